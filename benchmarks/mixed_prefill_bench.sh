#!/usr/bin/env bash
# Prompt chunks beside decodes (--mixed-prefill-tokens) against vLLM's whole 8,192-token serving budget, pagefleet
# alone on one GPU, one server per setting in turn on one checkpoint: `pagefleet bench serve` at concurrency 64
# (256 requests of 564 / 128, ignore_eos) at temperature 1, the level where the closed loop runs in waves (a
# 36k-token prefill, then 128 decode steps of 64 rows that leave the GEMMs' arithmetic idle).
#   bash benchmarks/mixed_prefill_bench.sh OUT_DIR [MODEL (/root/llama8b)]
# SETTINGS="BUDGET[/MIXED[/fp8]] ..." (default "8192 8192/512 8192/384 8192/256 512 8192"): the step token budget,
# the prompt tokens a decoding step may take (- for none) and the weights' dtype; the first setting is run again
# last, so the table shows the drift between two runs of one setting. Needs the server's web packages (fastapi,
# uvicorn) on PYTHONPATH, as `source .peer/side_env.sh` or the .whl/ of docs/benchmarks.md give them.
# BENCH_ARGS adds `pagefleet bench serve` flags (say --concurrency 4 --num-requests 8 --input-len 32 --output-len 8
# --prompt-format ids for a smoke run on a CPU; a later --concurrency replaces the 64); MAX_MODEL_LEN (2048) the
# servers' max_model_len, PORT (8000) their port.
set -uo pipefail
out=${1:?usage: mixed_prefill_bench.sh OUT_DIR [MODEL]}; model=${2:-/root/llama8b}; port=${PORT:-8000}
mkdir -p "$out"
source "$(dirname "$0")/serve_common.sh"
trap 'kill "${SERVER_PID:-}" 2> /dev/null' EXIT  # a server that never answered goes with the script
[ -f "$model/tokenizer.json" ] || { echo "no checkpoint at $model (.peer/make_ckpt.py or make_checkpoint.py)"; exit 1; }
table="$out/mixed_prefill.md"
echo "| setting | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | TPOT p50 ms | errors | ready s |" > "$table"
echo "|---|---|---|---|---|---|---|" >> "$table"
for setting in ${SETTINGS:-8192 8192/512 8192/384 8192/256 512 8192}; do
  IFS=/ read -r budget mixed dtype <<< "$setting"
  flags=(--max-num-batched-tokens "$budget")
  [ -n "${mixed:-}" ] && [ "$mixed" != - ] && flags+=(--mixed-prefill-tokens "$mixed")
  [ "${dtype:-}" = fp8 ] && flags+=(--quantization fp8)
  tag=${setting//\//_}
  [ -n "${MAX_MODEL_LEN:-}" ] && flags+=(--max-model-len "$MAX_MODEL_LEN")
  t0=$(date +%s.%N)
  start_server pagefleet "$model" "$port" "$out/server-$tag.log" "${flags[@]}"
  wait_ready "$port" "$out/server-$tag.log"
  ready=$(python3 -c "print(f'{$(date +%s.%N) - $t0:.1f}')")
  echo "== $setting (${flags[*]}): ready in $ready s"
  timeout 300 python3 -m pagefleet bench serve --base-url http://127.0.0.1:$port --concurrency 64 --num-requests 256 \
    --temperature 1.0 --json-out "$out/bench-$tag.json" ${BENCH_ARGS:-} 2>&1 | tail -4
  kill "$SERVER_PID"; wait "$SERVER_PID" 2> /dev/null
  python3 - "$out/bench-$tag.json" "$setting" "$ready" >> "$table" <<'ROW'
import json, sys
row = json.load(open(sys.argv[1]))[-1]
print(f"| {sys.argv[2]} | {row['output_tok_s']:,.1f} | {row['ttft_p50_ms']:,.0f} / {row['ttft_p99_ms']:,.0f} | "
      f"{row['itl_p50_ms']:.2f} / {row['itl_p99_ms']:.2f} | {row['tpot_p50_ms']:.2f} | {row['errors']} | {sys.argv[3]} |")
ROW
done
cat "$table"
