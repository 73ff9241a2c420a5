#!/usr/bin/env bash
# Serving benchmark on one GPU: `pagefleet serve` on a random-weight Llama-3.1-8B-shape checkpoint with a
# word-level tokenizer (a prompt of N words is N tokens), then `pagefleet bench serve` against it.
# Usage: benchmarks/serve_bench.sh OUT_DIR [MODEL_DIR [extra `pagefleet serve` flags, e.g. --quantization fp8]]
# CONCURRENCY="1 4 8 16 32 64" sets the closed-loop levels; RATES="4 8 12" adds open-loop levels after them
# (Poisson arrivals, `pagefleet bench serve --request-rate`, 64 requests each, in serve_rates.json).
set -euo pipefail
out=${1:?OUT_DIR}; model=${2:-/dev/shm/pagefleet/llama-3.1-8b}
mkdir -p "$out"
[ -f "$model/config.json" ] || python3 benchmarks/make_checkpoint.py llama-3.1-8b "$model"
port=8765
start=$(date +%s.%N)
python3 -m pagefleet serve --model "$model" --served-model-name llama-8b --host 127.0.0.1 --port $port \
  --max-model-len 2048 --max-num-seqs 256 --max-num-batched-tokens 8192 --disable-access-log "${@:3}" >"$out/serve_server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT  # the next run needs its GPU memory
until curl -sf http://127.0.0.1:$port/ready >/dev/null; do
  kill -0 $server 2>/dev/null || { tail -50 "$out/serve_server.log"; exit 1; }
  sleep 0.5
done
ready=$(python3 -c "print(f'{$(date +%s.%N) - $start:.1f}')")
echo "process start to /ready: ${ready}s" | tee "$out/serve_ready.txt"
python3 -m pagefleet bench serve --base-url http://127.0.0.1:$port --input-len 564 --output-len 128 \
  --concurrency ${CONCURRENCY:-1 4 8 16 32 64} --json-out "$out/serve_bench.json" --trace-out "$out/serve_trace.json" \
  2>&1 | tee "$out/serve_bench.txt"
if [ -n "${RATES:-}" ]; then
  python3 -m pagefleet bench serve --base-url http://127.0.0.1:$port --input-len 564 --output-len 128 \
    --request-rate $RATES --seed 1 --json-out "$out/serve_rates.json" 2>&1 | tee "$out/serve_rates.txt"
fi
