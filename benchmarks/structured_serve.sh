#!/usr/bin/env bash
# Structured outputs under load: one engine's server on an 8B-shape checkpoint whose word-level tokenizer also
# spells JSON (`pagefleet bench serve --write-word-tokenizer DIR --json-chars`: the top 95 ids are the printable
# ASCII characters), then `pagefleet bench serve` at concurrency 64, unconstrained and with
# benchmarks/structured_schema.json on every request (response_format json_schema; outputs validated). The same
# client and checkpoint for both engines, one after the other on one GPU (.peer/ set up as its README says):
#   source .peer/side_env.sh && bash benchmarks/structured_serve.sh {pagefleet|vllm} OUT_DIR [DIR (/root/llama8b)]
# Random weights under a grammar: strings run to their maxLength and the document closes after ~190 tokens, one
# character a token outside the strings (tests/entrypoints/test_structured_bench.py, a tiny random model), so
# max_tokens is 384 and an output cut there counts as cut off. Prompts are 564 words below the characters' ids.
# JUMP_FORWARD=1 (pagefleet): the server runs with --structured-outputs-jump-forward, its results tagged -jf.
set -uo pipefail
eng=${1:?usage: structured_serve.sh pagefleet-or-vllm OUT_DIR [CHECKPOINT]}; out=${2:?OUT_DIR}; ck=${3:-/root/llama8b}
port=8000; schema=$(dirname "$0")/structured_schema.json
flags=(); tag=$eng
if [ "${JUMP_FORWARD:-0}" = 1 ]; then flags=(--structured-outputs-jump-forward); tag=$eng-jf; fi
log=$out/structured-serve-$tag.log
mkdir -p "$out"
vocab=$(python3 -c "import json; print(json.load(open('$ck/config.json'))['vocab_size'])")
python3 -c "from transformers import AutoTokenizer; import sys; t = AutoTokenizer.from_pretrained('$ck'); \
sys.exit(0 if t.convert_tokens_to_ids('{') == $vocab - 95 + 91 else 1)" \
  || python3 -m pagefleet bench serve --write-word-tokenizer "$ck" --json-chars
source "$(dirname "$0")/serve_common.sh"
start_server "$eng" "$ck" $port "$log" "${flags[@]}"
wait_ready $port "$log"
common=(--base-url http://127.0.0.1:$port --model m --input-len 564 --concurrency 64 --num-requests 256
        --vocab-high $((vocab - 95)) --temperature 1.0)
echo "-- $tag, concurrency 64, unconstrained, 564 / 128, ignore_eos"  # also fills the prefix cache, as for the others
timeout 400 python3 -m pagefleet bench serve "${common[@]}" --output-len 128 --json-out "$out/$tag-free.json" \
  2>&1 | tail -3
echo "-- $tag, concurrency 64, json_schema on every request, max_tokens 384"
timeout 400 python3 -m pagefleet bench serve "${common[@]}" --output-len 384 --json-schema "$schema" \
  --json-out "$out/$tag-schema.json" 2>&1 | tail -3
[ "$eng" = pagefleet ] && curl -s http://127.0.0.1:$port/metrics \
  | grep -E '^(vllm:generation_tokens_total|pagefleet:jump_forward_tokens_total|pagefleet:engine_steps_total)'
kill $SERVER_PID; wait $SERVER_PID 2> /dev/null
true
