#!/usr/bin/env bash
# pagefleet against vLLM 0.26 on one GPU, in one run, on one checkpoint, with one client: the peer scripts in
# .peer/ (a copy of the shared peer/ folder, see its README.md) run each engine, and this prints one table of
# their figures and the ratio pagefleet / vLLM. Machines differ by a few percent; only a run like this one
# compares the two engines.
# On the GPU machine, from the repository root, after `bash .peer/setup.sh` (vLLM in /tmp/site, the random
# Llama-3.1-8B-shape checkpoint with a word-level tokenizer in /root/llama8b):
#   bash benchmarks/side_by_side.sh OUT_DIR [offline] [serve] [grpo] [vbench] [sampled]  (default: offline serve)
#     offline  .peer/side_offline.py: batch 1 / 8 / 64 / 256 and the mixed 256 / 2048 draws (ONLY=static_1,...
#              picks some, TEMP=1.0 samples instead of greedy); about 5 min an engine
#     grpo     .peer/side_offline.py --grpo: 64 prompts x n=16, 256 in / 512 out, temperature 1, seeded
#     serve    .peer/side_serve.sh: the server, then the 564/128 streaming sweep (CONCS=1,8,16,32,64)
#     vbench   the same with VBENCH=1: vLLM's own `bench serve` client at concurrency 64, server-default sampling
#     sampled  benchmarks/serve_sampled.sh: one server, the greedy client at c = 64, then `vllm bench serve` at
#              c = 64 at the server's default sampling and at temperature 0.8 / top-p 0.95 / top-k 50
#   DTYPES="bf16 fp8" (default bf16) and ENGINES="pagefleet vllm" (the default) pick the runs. KV_CACHE_DTYPE=fp8
#   gives both engines an e4m3 KV cache in the sampled and grpo parts (their logs tagged -kvfp8); grpo then runs
#   benchmarks/grpo_side.py, the same workload as side_offline.py --grpo with the flag passed.
#   PF_FLAGS adds flags to pagefleet's server in the sampled part (say --mixed-prefill-tokens 512; its logs keep
#   their names, so give such a run an OUT_DIR of its own).
# Each run's output is kept in OUT_DIR/PART-ENGINE-DTYPE.log, and the table covers every log in OUT_DIR: parts run
# in separate calls (a persistent OUT_DIR such as /root/side) add up to one table. `side_by_side.sh DIR table`
# only prints it, on any machine.
set -uo pipefail
out=${1:?usage: benchmarks/side_by_side.sh OUT_DIR [offline] [serve] [grpo] [vbench] [sampled] [table]}
shift
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(offline serve)
for part in "${parts[@]}"; do
  case $part in offline | grpo | serve | vbench | sampled | table) ;; *) echo "unknown part $part"; exit 2 ;; esac
done
mkdir -p "$out"
out=$(realpath "$out")
if [ "${parts[*]}" != table ]; then
  [ -f .peer/side_offline.py ] || { echo "no .peer/ here: cp -r <shared>/peer .peer (see its README.md)"; exit 1; }
  [ -f /tmp/site/.done ] && [ -f /root/llama8b/tokenizer.json ] || { echo "run bash .peer/setup.sh first"; exit 1; }
  # shellcheck disable=SC1091
  source .peer/side_env.sh
  export OUT="$out"  # side_serve.sh copies each server's log there
  # pagefleet's HTTP side shares a process with its step loop, so it runs on its own web stack (uvicorn[standard]:
  # httptools, uvloop), not on the vLLM bundle's: .whl/ holds those wheels (docs/benchmarks.md, the commands)
  if [ -d .whl ] && [ ! -f /tmp/pfsite/.done ]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/pfsite .whl/*.whl && touch /tmp/pfsite/.done
  fi
  [ -f /tmp/pfsite/.done ] || echo "warning: no .whl/: pagefleet serves on the vLLM bundle's web stack"
fi
for part in "${parts[@]}"; do
  [ "$part" = table ] && continue
  for dt in ${DTYPES:-bf16}; do
    for eng in ${ENGINES:-pagefleet vllm}; do
      tag=$part
      [ "$part" = offline ] && tag=$part${TEMP:+-temp$TEMP}  # side_offline.py samples at TEMP; the servers ignore it
      case $part in sampled | grpo) tag=$tag${KV_CACHE_DTYPE:+-kv$KV_CACHE_DTYPE} ;; esac
      log="$out/$tag-$eng-$dt.log"
      echo "== $tag $eng $dt -> $log"
      pypath=/tmp/site
      [ "$eng" = pagefleet ] && [ -f /tmp/pfsite/.done ] && pypath=/tmp/pfsite:/tmp/site
      export PYTHONPATH=$pypath
      case $part in
        offline) python3 .peer/side_offline.py "$eng" "$dt" /root/llama8b ;;
        grpo)
          if [ -n "${KV_CACHE_DTYPE:-}" ]; then
            python3 benchmarks/grpo_side.py "$eng" "$dt" /root/llama8b --kv-cache-dtype "$KV_CACHE_DTYPE"
          else
            python3 .peer/side_offline.py "$eng" "$dt" /root/llama8b --grpo
          fi ;;
        serve) bash .peer/side_serve.sh "$eng" "$dt" ;;
        vbench) CONCS=${CONCS:-1} VBENCH=1 bash .peer/side_serve.sh "$eng" "$dt" ;;
        sampled) bash benchmarks/serve_sampled.sh "$eng" "$dt" ;;
      esac 2>&1 | tee "$log"
    done
  done
done
python3 - "$out" <<'EOF'
"""One table from the peer scripts' logs: RESULT lines (side_offline.py), READY and SERVE lines (side_serve.sh,
serve_bench.py), and `vllm bench serve`'s summary lines."""
import json
import re
import sys
from pathlib import Path

runs = {}  # (part, dtype) -> {engine: {metric: value}}
for log in sorted(Path(sys.argv[1]).glob("*.log")):
    m = re.fullmatch(r"(.+)-(pagefleet|vllm)-(bf16|fp8)", log.stem)
    if not m:
        continue
    part, engine, dtype = m.groups()
    figures = runs.setdefault((part, dtype), {}).setdefault(engine, {})
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[7:])
            for key, label in (("static_1", "batch 1, 512/128"), ("static_8", "batch 8, 512/128"),
                               ("static_64", "batch 64, 512/256"), ("static_256", "batch 256, 512/256"),
                               ("mixed256", "mixed 256 (seed 0)"), ("mixed2048", "mixed 2048 (seed 1)")):
                if key in r:
                    figures[f"{label}: output tok/s"] = r[key]
            if "grpo_64x16" in r:
                figures["GRPO 64 x n=16, 256/512: output tok/s"] = r["grpo_64x16"]["out_tok_s"]
            figures["engine start (s)"] = r["init_s"]
        elif line.startswith("READY "):
            figures["start to ready (s)"] = float(line.split()[-1].rstrip("s"))
        elif line.startswith("SERVE "):
            for c, r in json.loads(line[6:]).items():
                figures[f"c={c}: output tok/s"] = r["out_tok_s"]
                figures[f"c={c}: TTFT p50 / p99 (ms)"] = (r["ttft_p50_ms"], r["ttft_p99_ms"])
                figures[f"c={c}: inter-token p50 (ms)"] = r["itl_p50_ms"]
        elif line.startswith("-- same, --temperature 0"):  # side_serve.sh with VBENCH_T0=1
            figures["_at"] = "temperature 0"
        elif line.startswith("-- bench serve: "):  # serve_sampled.sh
            figures["_at"] = line[len("-- bench serve: "):].strip()
        else:
            m = re.match(r"(Output token throughput|Median TPOT|Median TTFT|P99 TTFT) \((tok/s|ms)\):\s+([\d.]+)", line)
            if m:
                at = f"bench serve c=64, {figures.get('_at', 'temperature 1')}"
                figures[f"{at}: {m[1]} ({m[2]})"] = float(m[3])
    figures.pop("_at", None)


def cell(v):
    if v is None:
        return "-"
    if isinstance(v, tuple):
        return " / ".join(cell(x) for x in v)
    return f"{v:.2f}" if abs(v) < 10 else f"{v:,.1f}"


def ratio(a, b):
    if a is None or b is None:
        return "-"
    if isinstance(a, tuple):
        return " / ".join(ratio(x, y) for x, y in zip(a, b, strict=True))
    return f"{a / b:.2f}x" if b else "-"


print("\n| run | dtype | figure | pagefleet | vLLM | pagefleet / vLLM |\n|---|---|---|---|---|---|")
for (part, dtype), engines in runs.items():
    ours, theirs = engines.get("pagefleet", {}), engines.get("vllm", {})
    for key in dict.fromkeys([*ours, *theirs]):
        a, b = ours.get(key), theirs.get(key)
        print(f"| {part} | {dtype} | {key} | {cell(a)} | {cell(b)} | {ratio(a, b)} |")
print("\nAbove 1 is pagefleet ahead for tok/s, behind for seconds and milliseconds.")
EOF
