#!/usr/bin/env bash
# Serving the Qwen3.6-27B-shaped hybrid checkpoint (hybrid_bench.py make DIR): one engine's server, then the
# peer's greedy 564 / 128 streaming client at concurrency 1, 8 and 64 (.peer/serve_bench.py), then vLLM's own
# `bench serve` at the server's default sampling (temperature 1) at the same levels. The issue's serving rows,
# for pagefleet and vLLM 0.26 one after the other on one GPU (.peer/ set up as its README says):
#   source .peer/side_env.sh && bash benchmarks/hybrid_serve.sh {pagefleet|vllm} OUT_DIR [DIR (/dev/shm/q36)]
# CONCS=8,64 picks the levels; SAMPLED=0 skips vLLM's client (the sampled rows); PF_FLAGS adds flags to
# pagefleet's server (say --mixed-prefill-tokens 512).
# Both servers: max_model_len 2048, GPU share 0.85, each engine's serving defaults for the GPU. vLLM gets the
# Triton GDN prefill (no FlashInfer in the bundle) and no image or video inputs.
set -uo pipefail
concs=${CONCS:-1,8,64}; sampled=${SAMPLED:-1}
eng=${1:?usage: hybrid_serve.sh pagefleet-or-vllm OUT_DIR [CHECKPOINT]}; out=${2:?OUT_DIR}; ck=${3:-/dev/shm/q36}
port=8000; log=$out/hybrid-serve-$eng.log
mkdir -p "$out"
source "$(dirname "$0")/serve_common.sh"
t0=$(date +%s.%N)
if [ "$eng" = vllm ]; then
  start_server vllm "$ck" $port "$log" --limit-mm-per-prompt '{"image": 0, "video": 0}' \
    --additional-config '{"gdn_prefill_backend": "triton"}'
else
  # shellcheck disable=SC2086
  start_server pagefleet "$ck" $port "$log" ${PF_FLAGS:-}
fi
wait_ready $port "$log"
echo "READY $eng $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s"
timeout 400 python3 .peer/serve_bench.py http://127.0.0.1:$port m "$concs" 2>&1 | tail -4
for c in $([ "$sampled" = 0 ] || echo "${concs//,/ }"); do
  echo "-- vllm bench serve, server-default sampling, concurrency $c"
  timeout 300 python3 -m vllm.entrypoints.cli.main bench serve --backend vllm --base-url http://127.0.0.1:$port \
    --model m --tokenizer "$ck" --dataset-name random --random-input-len 564 --random-output-len 128 \
    --num-prompts $((c < 4 ? 16 : 4 * c)) --max-concurrency $c --ignore-eos --seed 5 2>&1 \
    | grep -E "Successful|Total input tokens|Output token throughput|Median TTFT|P99 TTFT|Median TPOT|rror" | head -9
done
kill $SERVER_PID; wait $SERVER_PID 2> /dev/null
true
