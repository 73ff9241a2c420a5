"""Concurrency 1 without the server: the time to first token of a lone 564-token prompt (the serving
benchmark's prompt), from the engine alone, under the idle gaps a real client leaves between requests.

A short prompt step is bound by the host's kernel launches unless it replays a prompt graph
(worker/executor/graphs/prompt.py); how fast the host launches drifts after idle gaps (docs/benchmarks.md, run Q).
Each variant runs 16 prompts and reports the last 15: the prompt step's host time (the engine's own step
record) and the first token, p50 and max, in ms.

Usage: python3 benchmarks/lone_prompt_bench.py [fp8] [--enforce-eager]
"""
import random
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
from gpu_bench import ROOT, engine  # noqa: E402
from make_checkpoint import make_checkpoint  # noqa: E402

from pagefleet.worker import SamplingParams# noqa: E402

QUANT = "fp8" if "fp8" in sys.argv[1:] else None
EAGER = "--enforce-eager" in sys.argv[1:]
VARIANTS = (  # label, output tokens, seconds between prompts, spin (True) or sleep while waiting
    ("prompts back to back", 1, 0, False),
    ("prompts, 3 ms asleep between", 1, 0.003, False),
    ("prompts, 3 ms spinning between", 1, 0.003, True),
    ("prompts, 20 ms spinning between", 1, 0.02, True),
    ("prompts, 20 ms asleep between", 1, 0.02, False),
    ("prompt + 128 decodes", 128, 0, False),
    ("prompts back to back, at the end", 1, 0, False),
)


def one(eng, rng, request_id: str, max_tokens: int, pause: float, spin: bool) -> tuple[float, float]:
    """-> (the prompt step's host ms, first token ms)."""
    if pause:
        torch.cuda.synchronize()
        if spin:  # the host thread stays busy, so its core keeps its clock
            end = time.perf_counter() + pause
            while time.perf_counter() < end:
                pass
        else:
            time.sleep(pause)
    steps_before = eng.steps_total
    start = time.perf_counter()
    eng.add_request(request_id, [rng.randint(100, 119999) for _ in range(564)],
                    SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False))
    first = None
    while eng.has_unfinished_requests() or eng.pending is not None:
        for out in eng.step():
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter() - start
    steps = list(eng.recent_steps)[-(eng.steps_total - steps_before):]
    return next(s.duration_s for s in steps if s.num_prefill_tokens) * 1e3, first * 1e3


def main() -> None:
    eng = engine(make_checkpoint("llama-3.1-8b", f"{ROOT}/llama-3.1-8b"), quantization=QUANT, enforce_eager=EAGER,
                 max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=8192)
    rng = random.Random(0)
    graphs = eng.runner.prompt_graphs
    print(f"prompt graphs: {graphs.buckets if graphs else 'none'}", flush=True)
    for v, (label, max_tokens, pause, spin) in enumerate(VARIANTS):
        rows = [one(eng, rng, f"{v}-{i}", max_tokens, pause, spin) for i in range(16)][1:]
        host = sorted(r[0] for r in rows)
        first = sorted(r[1] for r in rows)
        print(f"{QUANT or 'bf16'} {label:34s} prompt step host ms p50 {host[len(host) // 2]:.1f} max {host[-1]:.1f} | "
              f"first token ms p50 {first[len(first) // 2]:.1f} max {first[-1]:.1f}", flush=True)


if __name__ == "__main__":
    main()
