"""Sampled against greedy decoding: the sampling kernel alone, and offline through one engine.

--kernel: kernels/sampling.py alone on bf16 logits of the 8B shape's vocabulary (128,256) at batch 1, 4, 16, 64
and 256, per setting, against greedy's argmax kernel: median of CUDA-event-timed launches, in us.
"per-row" is the one-program-per-row kernel (split=False); at batch <= 64 "split" is the row split across
programs (split=True, sampling_split.py), timed as launched and as one CUDA graph replay (its launches without the
host's gaps between them), its tokens checked against the per-row kernel's (they may differ only at a top-p edge
within rounding). --fold F ... also times the per-row kernel with its count passes reading F search blocks a step,
each column checked to draw the same tokens as the default.
--baseline REV: the per-row kernel and the split path of commit REV (read with `git show`, so the old kernels live
only here) beside today's, the split path launched and as a graph, their tokens against today's.
MODEL_DIR: the same 64 prompts (512 in / 128 out) under five sampling settings, one engine on one GPU, prefix
cache reset before each run, each setting run twice and the second run printed (the first compiles nothing after
start-up, but warms the allocator): what the device-side sampler costs per setting beside greedy.
Usage: python3 benchmarks/sampling_bench.py [MODEL_DIR] [--kernel [--baseline REV] [--fold 2 4]]
       (MODEL_DIR e.g. from make_checkpoint.py llama-3.1-8b DIR)
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import time
import types
from pathlib import Path

SETTINGS = {
    "greedy": dict(temperature=0),
    "temperature 1": dict(temperature=1.0),
    "temperature 1, top-p 0.95": dict(temperature=1.0, top_p=0.95),
    "temperature 0.8, top-p 0.95, top-k 50": dict(temperature=0.8, top_p=0.95, top_k=50),
    "temperature 1, seeded": dict(temperature=1.0, seed=7),
}
KERNEL_SETTINGS = {  # temperature, top_k, top_p, min_p
    "temperature 1": (1.0, 0, 1.0, 0.0),
    "top-p 0.95": (1.0, 0, 0.95, 0.0),
    "top-k 50": (1.0, 50, 1.0, 0.0),
    "t 0.8, top-k 50, top-p 0.95": (0.8, 50, 0.95, 0.0),
    "min-p 0.05": (1.0, 0, 1.0, 0.05),
}
VOCAB = 128256
ROOT = Path(__file__).resolve().parents[1]


def baseline_kernel(rev: str):
    """kernels/sampling.py and kernels/sampling_split.py as of commit `rev`, loaded as modules beside today's (the
    old per-row kernel calls the old split path)."""
    def show(name):
        return subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:kernels/{name}.py"], check=True,
                              capture_output=True, text=True).stdout

    tag = rev.replace("/", "_").replace("~", "_").replace("^", "_")
    sources = {  # each old module imports the other old one, not today's
        f"_sampling_{tag}": show("sampling").replace("from . import sampling_split",
                                                     f"from . import _sampling_split_{tag} as sampling_split"),
        f"_sampling_split_{tag}": show("sampling_split").replace("from .sampling import",
                                                                 f"from ._sampling_{tag} import"),
    }
    modules = []
    for name, src in sources.items():
        path = ROOT / "kernels" / f"{name}.py"  # Triton reads a kernel's source from its file; relative imports
        # resolve inside the package
        path.write_text(src)
        try:
            module = types.ModuleType(f"pagefleet.kernels.{name}")
            module.__file__, module.__package__ = str(path), "pagefleet.kernels"
            sys.modules[module.__name__] = module
            import pagefleet.kernels
            setattr(pagefleet.kernels, name, module)
            exec(compile(src, str(path), "exec"), module.__dict__)
        finally:
            path.unlink()
        modules.append(module)
    return modules[0]


def kernel_table(baseline: str | None, scale: float, folds: list[int]) -> None:
    import numpy as np
    import torch

    from pagefleet.kernels import greedy, sampling
    from pagefleet.kernels import reference as ref
    from pagefleet.worker.executor.sampler import split_class

    old = baseline_kernel(baseline) if baseline else None

    def records(n, temperature, top_k, top_p, min_p):
        rec = np.zeros((n, ref.SAMPLE_FIELDS), dtype=np.int32)
        f = rec.view(np.float32)
        f[:, ref.INV_TEMPERATURE], f[:, ref.TOP_P] = 1.0 / temperature, top_p
        f[:, ref.LOG_MIN_P] = np.log(min_p) if min_p > 0 else -np.inf
        rec[:, ref.TOP_K], rec[:, ref.SEED_LO] = top_k, np.arange(n)
        return torch.from_numpy(rec).cuda()

    from gemv_bench import median_us  # benchmarks/ is on sys.path: it holds this script

    def time_us(fn, reps=50):
        for _ in range(3):  # compiles and warms up outside the timed runs
            fn()
        return median_us(fn, reps, cuda=True)

    print(f"sampling kernel alone, bf16 logits N(0, {scale}^2) x {VOCAB:,}, median us per launch"
          + (f"; old = kernels/sampling.py at {baseline}" if old else ""), flush=True)
    print(f"{'setting':30s} {'batch':>5s} {'per-row us':>10s} {'split us':>9s} {'graph us':>9s} {'same':>5s}"
          + (f" {'old per-row':>11s} {'old/new':>7s} {'same':>5s} {'old split':>9s} {'old graph':>9s}"
             f" {'old/new graph':>13s} {'same':>5s}" if old else "")
          + "".join(f" {f'fold {f} us':>10s} {'same':>5s}" for f in folds), flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    for batch in (1, 4, 16, 64, 256):
        logits = (torch.randn(batch, VOCAB, generator=g, device="cuda") * scale).to(torch.bfloat16)
        us = time_us(lambda logits=logits: greedy.argmax(logits))
        print(f"{'greedy (argmax kernel)':30s} {batch:5d} {us:10.1f}", flush=True)
        for name, setting in KERNEL_SETTINGS.items():
            rec = records(batch, *setting)
            host = rec.cpu().numpy()  # the sampler's launch class for these rows
            cls = split_class(host, host.view(np.float32)[:, ref.INV_TEMPERATURE] == 0)
            new = sampling.sample(logits, rec, split=False)
            new_us = time_us(lambda rec=rec, x=logits: sampling.sample(x, rec, split=False))
            line = f"{name:30s} {batch:5d} {new_us:10.1f}"
            if old:  # the old per-row kernel, its tokens against today's
                old_us = time_us(lambda rec=rec, x=logits: old.sample(x, rec, split=False))
                same = int((old.sample(logits, rec, split=False) == new).sum())
                old_cols = f" {old_us:11.1f} {old_us / new_us:7.2f} {same:>5d}"
            if batch <= 64:
                split_us = time_us(lambda rec=rec, x=logits, c=cls: sampling.sample(x, rec, split=True, filters=c))
                out = torch.empty(batch, dtype=torch.int64, device="cuda")
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    sampling.sample(logits, rec, out, split=True, filters=cls)
                graph_us = time_us(graph.replay)
                line += f" {split_us:9.1f} {graph_us:9.1f} {int((out == new).sum()):>5d}"
                if old:  # the old split path, launched and as a graph, its tokens against today's split path
                    old_split_us = time_us(lambda rec=rec, x=logits: old.sample(x, rec, split=True))
                    old_out = torch.empty(batch, dtype=torch.int64, device="cuda")
                    old_graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(old_graph):
                        old.sample(logits, rec, old_out, split=True)
                    old_graph_us = time_us(old_graph.replay)
                    line += old_cols + (f" {old_split_us:9.1f} {old_graph_us:9.1f} {old_graph_us / graph_us:13.2f}"
                                        f" {int((old_out == out).sum()):>5d}")
            else:
                line += f" {'':9s} {'':9s} {'':5s}" + (old_cols if old else "")
            for f in folds:
                fold_us = time_us(lambda rec=rec, x=logits, f=f: sampling.sample(x, rec, fold=f, split=False))
                line += f" {fold_us:10.1f} {int((sampling.sample(logits, rec, fold=f, split=False) == new).sum()):>5d}"
            print(line, flush=True)


def engine_table(model: str, prompts_n: int) -> None:
    from pagefleet.worker import LLM, SamplingParams

    llm = LLM(model, max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=8192, gpu_memory_fraction=0.85)
    random.seed(0)
    prompts = [[random.randrange(100, 120000) for _ in range(512)] for _ in range(prompts_n)]
    greedy_rate = None
    for rep in range(2):
        for name, settings in SETTINGS.items():
            params = SamplingParams(max_tokens=128, ignore_eos=True, detokenize=False, **settings)
            llm.engine.block_manager.reset_prefix_cache()
            start = time.perf_counter()
            outputs = llm.generate(prompts, params)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            if rep:
                rate = tokens / seconds
                greedy_rate = greedy_rate or rate
                print(f"{name:40s} {rate:9.1f} output tok/s ({seconds:.2f} s) {rate / greedy_rate:.2f}x greedy",
                      flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", help="checkpoint folder (the offline table)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--kernel", action="store_true", help="time the sampling kernel alone")
    parser.add_argument("--baseline", help="a commit (or file) whose kernels/sampling.py the kernel table times beside")
    parser.add_argument("--scale", type=float, default=2.0, help="the kernel table's logit standard deviation")
    parser.add_argument("--fold", type=int, nargs="*", default=[], help="count-pass folds to time beside the default")
    args = parser.parse_args()
    if args.prompts < 1:
        parser.error(f"--prompts must be >= 1, got {args.prompts}")
    if not args.model and not args.kernel:
        parser.error("give MODEL_DIR, --kernel, or both")
    if args.kernel:
        bad = [f for f in args.fold if f < 1 or f & (f - 1)]
        if bad:
            parser.error(f"--fold takes powers of two, got {bad[0]}")
        kernel_table(args.baseline, args.scale, args.fold)
    if args.model:
        engine_table(args.model, args.prompts)


if __name__ == "__main__":
    main()
