# Sourced by the serving benchmarks (hybrid_serve.sh, structured_serve.sh): either engine's server, and the wait
# for it, with the settings both engines share there.

# start_server ENG CHECKPOINT PORT LOG [FLAGS...]: vLLM's or pagefleet's OpenAI server in the background on
# CHECKPOINT, served as "m", max_model_len 2048, GPU share 0.85, plus FLAGS (the engine's own); SERVER_PID is its pid.
start_server() {
  local eng=$1 ck=$2 port=$3 log=$4
  shift 4
  if [ "$eng" = vllm ]; then
    python3 -m vllm.entrypoints.cli.main serve "$ck" --served-model-name m --port "$port" --host 127.0.0.1 \
      --max-model-len 2048 --gpu-memory-utilization 0.85 "$@" > "$log" 2>&1 &
  else
    python3 -m pagefleet serve --model "$ck" --served-model-name m --port "$port" --host 127.0.0.1 \
      --max-model-len 2048 --gpu-memory-fraction 0.85 --disable-access-log "$@" > "$log" 2>&1 &
  fi
  SERVER_PID=$!
}

# wait_ready PORT LOG: until the server answers /v1/models (at most 450 s); exit 1 with its log's tail if it ends.
# Python asks, not curl, so the scripts run where only Python is (their CPU tests).
wait_ready() {
  local port=$1 log=$2
  for _ in $(seq 1 900); do
    python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" \
      "http://127.0.0.1:$port/v1/models" 2> /dev/null && return 0
    kill -0 "$SERVER_PID" 2> /dev/null || { tail -40 "$log"; exit 1; }
    sleep 0.5
  done
  echo "the server on port $port did not answer in 450 s"; tail -40 "$log"; exit 1
}
