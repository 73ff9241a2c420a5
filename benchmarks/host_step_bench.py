"""The engine's host time per step, by phase, on the CPU: where a step's time goes besides the forward.

On a GPU a small model's decode step is host-bound (SmolLM2-135M at 256 sequences: the forward is far shorter
than the step), so this measures the host part alone: an engine on the CPU with a tiny random-weight Llama
(transformers' own classes, the bundled tokenizer where installed), its methods wrapped with perf_counter
from the outside. Phases per step (microseconds):
  schedule   Scheduler.schedule
  launch     EngineStep._launch less the runner's run and the sampling below (token bookkeeping, forks)
  prepare    ModelRunner.prepare: the step's host arrays (step_inputs.prepare)
  run-other  ModelRunner.run less prepare and forward: uploads, attention metadata (device copies on a GPU)
  forward    the model's forward and logits: the CPU stand-in for device time, reported apart from the host
  sample     SamplingState.rows / .processed: the sampler's per-row records (host)
  sample-dev the rest of sampling: the sampling kernel (device time on a GPU) and the token copy
  resolve    EngineStep._resolve: tokens into sequences, finish rules, incremental detokenisation, hashing
  outputs    LLMEngine._outputs: RequestOutputs (offline: finished requests only)
  wait       CUDA only: the host waiting for a step's tokens (PendingTokens.read's event); resolve (overlapped
             steps) or sample-dev (synchronous ones) holds it too
  host       the step less forward and sample-dev on the CPU; on CUDA the step less wait (forward and sampling
             are launches there, host work)
  host, run  the host time of all the run's steps, ms: offline the text is built as each sequence ends, in a step
             the medians leave out
Workloads: grpo (32 prompts x n=8 samples, 128 tokens, temperature 1, a seed per request) and greedy (256
prompts, 128 tokens, temperature 0), both offline at 256 sequences at once; rollouts (examples/grpo.py's and
rl_bench.py grpo's settings: grpo's shape with the sampled token's logprob, logprobs=0); serve64 (64 prompts of
~800 tokens, 128 tokens at temperature 0.7, seeded) with every step's outputs, as a server's engine makes them.
schema64 (64 prompts, benchmarks/structured_schema.json as a json grammar on each, up to 256 tokens at
temperature 1, seeded): the grammar's host work (bitmask fills, matcher advances) in every step.
Phases are medians over the steps that run at least 80 % of the workload's sequences.
--device cuda --model DIR measures one engine on the GPU instead (CUDA graphs, overlapped steps, the real
uploads): whether a step is bound by the host (wait near 0) or by the device, and where the host's part goes.
Usage: python3 benchmarks/host_step_bench.py [--compare REV] [--workloads grpo,greedy] [--repeats 2] [--rounds 2]
       python3 benchmarks/host_step_bench.py --device cuda --model DIR [--workloads rollouts,greedy]
  --compare REV: the same run on REV's tree (git archive into /tmp) and on this one, side by side, and the ratio;
  with two cores the trees run at once, one per core, swapping cores each round (else they alternate), and the
  run with the least host time counts, as this machine's speed drifts by 20 % between minutes. The outputs'
  digests are compared too: they must be identical.
  Run it from /tmp or the repo root with python3 benchmarks/host_step_bench.py (not python -m).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PHASES = ("schedule", "launch", "prepare", "run-other", "forward", "sample", "sample-dev", "resolve", "outputs",
          "wait", "host", "step")
# package name -> folder, as pyproject.toml's package-dir maps them
PACKAGE_DIRS = {"pagefleet": "pagefleet", "pagefleet.worker": "worker", "pagefleet.kernels": "kernels",
                "pagefleet.operator": "operator", "pagefleet.gateway": "gateway"}
START = time.time()
# glibc keeps freed memory instead of handing every large tensor back to the kernel: on the CPU a step frees its
# logits (MBs), and munmap plus the page faults of the next step's allocation cost milliseconds the GPU's caching
# allocator never pays; they would land on whichever phase dropped the last reference
MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 36),
          "MALLOC_TOP_PAD_": str(1 << 30)}


def log(text: str) -> None:
    print(f"[{time.time() - START:6.1f}s] {text}", file=sys.stderr, flush=True)


def use_tree(tree: Path) -> None:
    """Import pagefleet from another tree (an older commit's) instead of the installed one."""
    from importlib.machinery import PathFinder
    from importlib.util import spec_from_file_location

    class TreeFinder:
        @classmethod
        def find_spec(cls, fullname, path=None, target=None):
            if fullname in PACKAGE_DIRS:
                return spec_from_file_location(fullname, tree / PACKAGE_DIRS[fullname] / "__init__.py")
            parent = fullname.rpartition(".")[0]
            if parent in PACKAGE_DIRS:
                return PathFinder.find_spec(fullname, [str(tree / PACKAGE_DIRS[parent])])
            return None

    sys.meta_path.insert(0, TreeFinder)


def tiny_llama(folder: Path) -> Path:
    """A 2-layer random-weight Llama, vocabulary 8192 (ids any tokenizer decodes), written with save_pretrained."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from pagefleet.worker.entrypoints.cli.bench_serve import write_word_tokenizer
    from pagefleet.worker.models.loader import ModelFolderError, bundled_model_path

    if (folder / "config.json").exists():
        return folder
    config = LlamaConfig(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, eos_token_id=2,
                         bos_token_id=1, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    try:
        AutoTokenizer.from_pretrained(bundled_model_path()).save_pretrained(folder)
    except ModelFolderError:
        write_word_tokenizer(str(folder))
    return folder


class PhaseTimer:
    """Wraps engine methods on their instances and sums each one's time within the current step."""

    def __init__(self):
        self.now: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []

    def wrap(self, obj, name: str, phase: str) -> None:
        inner = getattr(obj, name)
        now = self.now

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                now[phase] += time.perf_counter() - t

        setattr(obj, name, timed)

    def end_step(self, running: int) -> None:
        record = dict(self.now)
        record["running"] = running
        self.steps.append(record)
        self.now.clear()


def instrument(engine) -> PhaseTimer:
    timer = PhaseTimer()
    if engine.runner.device.type == "cuda":  # the host idle until a step's tokens are there
        import torch

        timer.wrap(torch.cuda.Event, "synchronize", "wait")
    runner = engine.runner
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine, "_launch", "launch")
    timer.wrap(runner, "run", "run")
    timer.wrap(runner, "prepare", "prepare")
    timer.wrap(runner.model, "forward", "forward")
    timer.wrap(runner.model, "compute_logits", "forward")
    timer.wrap(runner, "sample_async", "sample-all")
    timer.wrap(runner.sampler.state, "rows", "sample")
    timer.wrap(runner.sampler.state, "processed", "sample")
    timer.wrap(engine, "_resolve", "resolve")
    timer.wrap(engine, "_outputs", "outputs")
    step = engine.step

    def timed_step():
        t = time.perf_counter()
        try:
            return step()
        finally:
            timer.now["step"] += time.perf_counter() - t
            timer.end_step(len(engine.scheduler.running))

    engine.step = timed_step
    return timer


def phases(record: dict[str, float], cuda: bool = False) -> dict[str, float]:
    """One step's exclusive phase times from the wrapped (nested) ones. cuda: forward and sampling are launches,
    host work; the device's time shows as wait."""
    g = defaultdict(float, record)
    out = {
        "schedule": g["schedule"], "prepare": g["prepare"], "forward": g["forward"], "sample": g["sample"],
        "sample-dev": g["sample-all"] - g["sample"], "run-other": g["run"] - g["prepare"] - g["forward"],
        "launch": g["launch"] - g["run"] - g["sample-all"], "resolve": g["resolve"],
        "outputs": g["outputs"], "wait": g["wait"], "step": g["step"],
    }
    out["host"] = out["step"] - (out["wait"] if cuda else out["forward"] + out["sample-dev"])
    return out


def workload(name: str):
    from pagefleet.worker.core.sampling_params import SamplingParams

    if name == "grpo":
        prompts = [[(p * 131 + i * 7) % 8000 + 100 for i in range(48 + p % 17)] for p in range(32)]
        params = [SamplingParams(n=8, temperature=1.0, max_tokens=128, seed=1000 + p, ignore_eos=True)
                  for p in range(32)]
        return prompts, params
    if name == "rollouts":
        prompts = [[(p * 131 + i * 7) % 8000 + 100 for i in range(32)] for p in range(32)]
        params = [SamplingParams(n=8, temperature=1.0, max_tokens=128, seed=1000 + p, ignore_eos=True, logprobs=0)
                  for p in range(32)]
        return prompts, params
    if name == "greedy":
        prompts = [[(p * 37 + i * 11) % 8000 + 100 for i in range(24 + p % 9)] for p in range(256)]
        return prompts, [SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)] * 256
    if name == "serve64":
        prompts = [[(p * 53 + i * 13) % 8000 + 100 for i in range(800 + p)] for p in range(64)]
        return prompts, [SamplingParams(temperature=0.7, max_tokens=128, seed=p, ignore_eos=True) for p in range(64)]
    if name == "schema64":
        from pagefleet.worker.core.sampling_params import StructuredOutputsParams

        schema = json.loads((REPO / "benchmarks" / "structured_schema.json").read_text())
        prompts = [[(p * 53 + i * 13) % 8000 + 100 for i in range(64 + p)] for p in range(64)]
        return prompts, [SamplingParams(temperature=1.0, max_tokens=256, seed=p,
                                        structured=StructuredOutputsParams(json=schema)) for p in range(64)]
    raise SystemExit(f"unknown workload {name!r}: grpo, rollouts, greedy, serve64 or schema64")


def measure(workloads: list[str], repeats: int, device: str = "cpu", model: str | None = None) -> dict:
    """Per workload: the median microseconds per step of each phase over the steps running a full batch (the
    best of `repeats` runs by host time; medians, as this machine's speed wavers by 2x from one step to the next),
    the step count, and a digest of the outputs (equal across trees)."""
    import hashlib

    from pagefleet.worker.engine.llm import LLM

    cuda = device == "cuda"
    if cuda:  # the example's engine (examples/grpo.py, rl_bench.py grpo) on a real model
        llm = LLM(model, max_model_len=1024, gpu_memory_fraction=0.35, seed=0)
    else:
        folder = tiny_llama(Path(tempfile.gettempdir()) / "pagefleet-host-step-llama")
        llm = LLM(str(folder), device="cpu", max_model_len=1024, max_num_seqs=256, max_num_batched_tokens=4096,
                  num_gpu_blocks_override=8192, cpu_threads=1)
    timer = instrument(llm.engine)
    results = {}
    for name in workloads:
        prompts, params = workload(name)
        full_batch = sum(p.n for p in params)
        # a server's engine: every step's outputs, text after each token
        llm.engine.emit_partial = name in ("serve64", "schema64")
        best = None
        for r in range(repeats):
            llm.engine.block_manager.reset_prefix_cache()
            timer.steps.clear()
            outs = llm.generate(prompts, params)
            digest = hashlib.sha256(json.dumps([[(o.token_ids, o.text) for o in out.outputs] for out in outs])
                                    .encode()).hexdigest()[:16]
            full = [phases(s, cuda) for s in timer.steps if s["running"] >= 0.8 * full_batch]
            med = {p: 1e6 * statistics.median(s[p] for s in full) for p in PHASES}
            log(f"{name} run {r + 1}/{repeats}: {len(timer.steps)} steps, {len(full)} at a full batch, "
                f"host {med['host']:.0f} us/step, forward {med['forward']:.0f} us/step, outputs {digest}")
            host_total = 1e3 * sum(phases(s, cuda)["host"] for s in timer.steps)  # the steps' medians hide the last one
            if best is None or med["host"] < best["us"]["host"]:
                best = {"us": med, "steps": len(timer.steps), "full_steps": len(full), "digest": digest,
                        "host_total_ms": host_total}
        results[name] = best
    return results


def table(columns: dict[str, dict], workloads: list[str]) -> str:
    """Rows: phases; a column of us/step per tree and workload, and the ratio new / old where there are two."""
    names = list(columns)
    lines = []
    for w in workloads:
        head = f"{w + ' (us/step)':<18}" + "".join(f"{n:>12}" for n in names)
        if len(names) == 2:
            head += f"{'new/old':>10}"
        lines.append(head)
        for p in PHASES:
            vals = [columns[n][w]["us"][p] for n in names]
            row = f"{p:<18}" + "".join(f"{v:>12.0f}" for v in vals)
            if len(names) == 2:
                row += f"{vals[1] / vals[0]:>10.2f}" if vals[0] > 0.5 else f"{'':>10}"
            lines.append(row)
        totals = [columns[n][w]["host_total_ms"] for n in names]
        row = f"{'host, run (ms)':<18}" + "".join(f"{v:>12.1f}" for v in totals)
        lines.append(row + (f"{totals[1] / totals[0]:>10.2f}" if len(names) == 2 else ""))
        lines.append(f"{'steps':<18}" + "".join(f"{columns[n][w]['steps']:>12}" for n in names))
        digests = {columns[n][w]["digest"] for n in names}
        lines.append(f"{'outputs':<18}" + ("identical" if len(digests) == 1 else "DIFFER: " + " ".join(digests)))
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compare", metavar="REV", help="also measure this git revision's tree, side by side")
    ap.add_argument("--workloads", default="grpo,greedy")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each workload per engine (the best counts)")
    ap.add_argument("--rounds", type=int, default=2, help="engines per tree, alternating between the trees")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cuda: one engine on the GPU over --model (no --compare)")
    ap.add_argument("--model", help="with --device cuda: the model folder (e.g. rl_bench.py grpo's 135M)")
    ap.add_argument("--tree", help=argparse.SUPPRESS)  # child: import pagefleet from this tree
    ap.add_argument("--json", help=argparse.SUPPRESS)  # child: write the results here
    args = ap.parse_args()
    workloads = args.workloads.split(",")
    if args.device == "cuda":
        if args.compare or not args.model:
            ap.error("--device cuda takes --model DIR and no --compare")
        print(table({"cuda": measure(workloads, args.repeats, "cuda", args.model)}, workloads))
        return 0
    if args.tree:
        use_tree(Path(args.tree))
    if args.json:
        Path(args.json).write_text(json.dumps(measure(workloads, args.repeats)))
        return 0
    columns = {}
    with tempfile.TemporaryDirectory() as tmp:
        trees = [("this tree", REPO)]
        if args.compare:
            old = Path(tmp) / "old"
            old.mkdir()
            archive = subprocess.run(["git", "-C", str(REPO), "archive", args.compare, *PACKAGE_DIRS.values()],
                                     check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
            label = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", args.compare], check=True,
                                   capture_output=True, text=True).stdout.strip()
            trees.insert(0, (label, old))
        cores = sorted(os.sched_getaffinity(0))
        together = len(trees) == 2 and len(cores) >= 2  # one core each, at once: the same minute of the machine
        for r in range(args.rounds):
            runs = []
            for k, (name, tree) in enumerate(trees):
                core = cores[(k + r) % len(cores)]  # the trees swap cores from one round to the next
                log(f"round {r + 1}/{args.rounds}: {name} ({tree})" + (f" on core {core}" if together else ""))
                out = Path(tmp) / f"result-{k}.json"
                cmd = [sys.executable, __file__, "--tree", str(tree), "--json", str(out), "--workloads",
                       args.workloads, "--repeats", str(args.repeats)]
                if together:
                    cmd = ["taskset", "-c", str(core), *cmd]
                runs.append((name, out, subprocess.Popen(cmd, cwd=tmp, env={**os.environ, **MALLOC})))
                if not together:
                    runs[-1][2].wait()
            for name, out, proc in runs:
                if proc.wait() != 0:
                    raise SystemExit(f"the run of {name} failed")
                for w, best in json.loads(out.read_text()).items():
                    column = columns.setdefault(name, {})
                    if w not in column or best["us"]["host"] < column[w]["us"]["host"]:
                        column[w] = best
    print(table(columns, workloads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
