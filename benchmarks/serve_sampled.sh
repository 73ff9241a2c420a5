#!/usr/bin/env bash
# One server, the sampled and greedy loads at concurrency 64, for benchmarks/side_by_side.sh's `sampled` part:
# ENGINE (pagefleet|vllm) DTYPE (bf16|fp8) on /root/llama8b, as .peer/side_serve.sh starts it. Then the peer's
# greedy client (564/128, c = 64) and `vllm bench serve` (random 564/128, 256 prompts, c = 64, ignore_eos) at
# the server's default sampling and at temperature 0.8 / top-p 0.95 / top-k 50, each with prompts of its own
# (--seed 5, 6): a level that re-sent the last one's prompts would be served from the prefix cache.
# Prints READY, SERVE and the bench's summary lines after a "-- bench serve: LABEL" line each. KV_CACHE_DTYPE=fp8
# serves both with an e4m3 KV cache; PF_FLAGS adds flags to pagefleet's server.
set -uo pipefail
eng=${1:?ENGINE}; dt=${2:?DTYPE}; ck=/root/llama8b; port=8000; q=()
[ "$dt" = fp8 ] && q=(--quantization fp8)
# KV_CACHE_DTYPE=fp8: both engines keep their KV cache in e4m3 (vLLM's flag of the same name)
[ -n "${KV_CACHE_DTYPE:-}" ] && q+=(--kv-cache-dtype "$KV_CACHE_DTYPE")
# PF_FLAGS: more flags for pagefleet's server alone (say --mixed-prefill-tokens 512)
# shellcheck disable=SC2206
[ "$eng" = pagefleet ] && q+=(${PF_FLAGS:-})
out=${OUT:-/tmp}
t0=$(date +%s.%N)
if [ "$eng" = vllm ]; then
  python3 -m vllm.entrypoints.cli.main serve $ck --served-model-name llama8b --port $port --host 127.0.0.1 \
    --max-model-len 2048 --gpu-memory-utilization 0.85 "${q[@]}" >"$out/server-$eng-$dt.log" 2>&1 &
else
  python3 -m pagefleet serve --model $ck --served-model-name llama8b --port $port --host 127.0.0.1 \
    --max-model-len 2048 --gpu-memory-fraction 0.85 --disable-access-log "${q[@]}" >"$out/server-$eng-$dt.log" 2>&1 &
fi
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null' EXIT  # the next run needs its GPU memory
until curl -sf http://127.0.0.1:$port/health >/dev/null && curl -sf http://127.0.0.1:$port/v1/models >/dev/null; do
  kill -0 $server 2>/dev/null || { tail -40 "$out/server-$eng-$dt.log"; exit 1; }
  sleep 0.5
done
echo "READY $eng $dt $(python3 -c "print(round($(date +%s.%N) - $t0, 1))")s"
timeout 200 python3 .peer/serve_bench.py http://127.0.0.1:$port llama8b 64 2>&1 | grep "^SERVE "
bench() {
  echo "-- bench serve: $1"
  shift
  timeout 200 python3 -m vllm.entrypoints.cli.main bench serve --backend vllm --base-url http://127.0.0.1:$port \
    --model llama8b --tokenizer $ck --dataset-name random --random-input-len 564 --random-output-len 128 \
    --num-prompts 256 --max-concurrency 64 --ignore-eos "$@" 2>&1 |
    grep -E "Successful|Failed|Output token throughput|Median TTFT|P99 TTFT|Median TPOT|rror" | head -12
}
bench "temperature 1" --seed 5
bench "t 0.8, top-p 0.95, top-k 50" --seed 6 --temperature 0.8 --top-p 0.95 --top-k 50
