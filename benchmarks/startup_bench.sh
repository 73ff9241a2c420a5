#!/usr/bin/env bash
# Start to /ready of `pagefleet serve`, with Triton's kernel cache empty (cold) and then filled (warm).
# Each server line is prefixed with the seconds since the process started; the pagefleet: lines tell where
# the time went (compile workers, the engine's phases). The cache folder is this script's own.
# Usage: benchmarks/startup_bench.sh OUT_DIR [MODEL_DIR [extra `pagefleet serve` flags, e.g. --quantization fp8]]
set -euo pipefail
out=${1:?OUT_DIR}; model=${2:-/dev/shm/pagefleet/llama-3.1-8b}
mkdir -p "$out"
[ -f "$model/config.json" ] || python3 benchmarks/make_checkpoint.py llama-3.1-8b "$model"
out=$(realpath "$out"); model=$(realpath "$model")
export TRITON_CACHE_DIR="$out/triton-cache"
rm -rf "$TRITON_CACHE_DIR"
port=8766
stamp='import sys, time; t0 = float(sys.argv[1])
for line in sys.stdin: print(f"{time.time() - t0:7.2f} {line}", end="", flush=True)'
for run in cold warm; do
  start=$(date +%s.%N)
  # from $out: `-m` puts the working folder on sys.path, and the checkout's operator/ would shadow the stdlib's
  (cd "$out" && python3 -u -m pagefleet serve --model "$model" --host 127.0.0.1 --port $port --max-model-len 2048 \
    --max-num-seqs 256 --max-num-batched-tokens 8192 --disable-access-log "${@:3}") 2>&1 \
    | python3 -u -c "$stamp" "$start" >"$out/startup_$run.log" &
  pid=$!
  up=0
  for _ in $(seq 1200); do
    curl -sf http://127.0.0.1:$port/ready >/dev/null && { up=1; break; }
    kill -0 $pid 2>/dev/null || break  # the server exited
    sleep 0.2
  done
  ready=$(python3 -c "print(f'{$(date +%s.%N) - $start:.1f}')")
  [ $up = 1 ] || { echo "$run: the server did not get ready"; tail -30 "$out/startup_$run.log"; pkill -f "pagefleet serve .*--port $port"; exit 1; }
  pkill -f "pagefleet serve .*--port $port" || true
  wait || true
  echo "$run: process start to /ready ${ready}s" | tee -a "$out/startup.txt"
  { grep "pagefleet:" "$out/startup_$run.log" || true; } | tee -a "$out/startup.txt"
done
