#!/usr/bin/env bash
# Two checkouts of pagefleet on one GPU in one run: gpu_bench.py's static and mixed sections, then the serving
# sweep at concurrency 1 and 64 twice each, alternating (A, B, A, B), on one checkpoint. It is how a change that
# must not move the step path (a restructuring, a refactor) is held to its figures before the change.
# Usage (on the GPU machine): benchmarks/ab_bench.sh OUT_DIR TREE_A TREE_B [MODEL_DIR]
#   TREE_A, TREE_B: checkout folders (e.g. `git worktree add /tmp/a REV`); neither needs installing: each runs
#   from a PYTHONPATH folder mapping `pagefleet` onto it, as the editable install does.
# Env: SERVE_RUNS (default 2) serving runs per tree; SKIP_BENCH=1 or SKIP_SERVE=1 to leave a half out.
set -uo pipefail
export PYTHONUNBUFFERED=1
out=${1:?OUT_DIR}; a=$(cd "${2:?TREE_A}" && pwd); b=$(cd "${3:?TREE_B}" && pwd)
model=${4:-/dev/shm/pagefleet/llama-3.1-8b}
mkdir -p "$out"
declare -A TREE=([a]="$a" [b]="$b")
for arm in a b; do  # pagefleet.worker etc. live in top-level folders: link them under one package
  farm="$out/.path_$arm"; rm -rf "$farm"; mkdir -p "$farm/pagefleet"; cp "${TREE[$arm]}"/pagefleet/*.py "$farm/pagefleet/"
  for p in worker kernels operator gateway; do ln -s "${TREE[$arm]}/$p" "$farm/pagefleet/$p"; done
done
start=$(date +%s)
[ -f "$model/config.json" ] || (cd "$b" && PYTHONPATH="$out/.path_b${PYTHONPATH:+:$PYTHONPATH}" \
  python3 benchmarks/make_checkpoint.py llama-3.1-8b "$model")
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader | tee "$out/gpu.txt"
if [ -z "${SKIP_BENCH:-}" ]; then
  for arm in a b; do
    mkdir -p "$out/bench_$arm"
    (cd "${TREE[$arm]}" && PYTHONPATH="$out/.path_$arm${PYTHONPATH:+:$PYTHONPATH}" \
      python3 benchmarks/gpu_bench.py "$out/bench_$arm" static mixed) > "$out/bench_$arm/gpu_bench.log" 2>&1
    echo "== $arm (${TREE[$arm]}) gpu_bench rc=$? at $(( $(date +%s) - start ))s"
    grep -E "^batch |^mixed " "$out/bench_$arm/gpu_bench.log"
  done
fi
if [ -z "${SKIP_SERVE:-}" ]; then
  for i in $(seq "${SERVE_RUNS:-2}"); do
    for arm in a b; do
      d="$out/serve_$arm$i"; mkdir -p "$d"
      # from a neutral folder: `python3 -m pagefleet` would find the checkout's own pagefleet/ folder first
      (cd /tmp && PYTHONPATH="$out/.path_$arm${PYTHONPATH:+:$PYTHONPATH}" CONCURRENCY="1 64" \
        bash "${TREE[$arm]}/benchmarks/serve_bench.sh" "$d" "$model") > "$d/serve.log" 2>&1
      echo "== $arm serve run $i rc=$? at $(( $(date +%s) - start ))s"; grep -E "^\||/ready" "$d/serve.log"
    done
  done
fi
