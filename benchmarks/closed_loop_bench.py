"""The serving benchmark's load on the engine alone, with where the GPU waited.

`pagefleet bench serve`'s shape (564-token prompts, 128 output tokens, ignore_eos; at concurrency c,
max(16, 4c) requests, each slot sending its next request as one finishes), driven straight into an
LLMEngine: no HTTP, no asyncio, no detokenising. Per concurrency it prints TTFT and inter-token p50 / p99 as
the engine hands tokens out, output tok/s, and the steps by kind (decode only, prompt only, mixed): how
many, and their host time p50.

Then, over a window of steps past the first wave of prompts, the torch profiler: the share of the window's
wall time the GPU spent running kernels. Where that is well under 100 %, the GPU waited on the host
(between overlapped steps, or inside an eager step's ~400 launches); near 100 %, the time is the kernels'
own. The profiler's own cost per launch makes the share a little pessimistic for eager steps. Over the
same window, the steady decode steps' GPU period (one sampling launch to the next): how much of it each op
took, and between which ops the GPU sat idle.

Requests that finish in one step are replaced before the next, so their prompts land together: the load
comes in waves, as it does through the server (its step traces at concurrency 16 show 14 prompts in a
step), only more sharply.

--alone 1,16 first times decode steps of those batch sizes by themselves (every sequence at context 640,
the load's middle, as gpu_bench's roofline does) with the same period breakdown, to set beside the loop's.

--budgets 8192,1024 runs every level under each token budget per step (--max-num-batched-tokens): a
smaller one spreads each wave of prompts over more steps, which carry the running decodes along.

Usage: python3 benchmarks/closed_loop_bench.py [--model PATH] [--fp8] [--concurrency 1,4,16,32,64]
       [--profile-steps 150] [--alone 1,16] [--budgets 8192,2048,1024]
Without --model: the random Llama-3.1-8B-shaped checkpoint (benchmarks/make_checkpoint.py). On CPU with a
tiny model it runs too (without the profiler window), which is how its test checks it.
"""
from __future__ import annotations

import argparse
import bisect
import os
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

sys.path.insert(0, os.path.dirname(__file__))

from pagefleet.worker import SamplingParams# noqa: E402
from pagefleet.worker.core.config import EngineConfig  # noqa: E402
from pagefleet.worker.engine.llm_engine import LLMEngine  # noqa: E402

PROMPT_TOKENS, OUTPUT_TOKENS = 564, 128


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def gpu_busy_share(prof, wall_s: float) -> float:
    """The union of the kernels' intervals over the profiled window, as a share of its wall time."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    busy, end = 0, None
    for a, b in spans:
        if end is None or a > end:
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    return busy / 1e6 / wall_s


def step_periods(prof, marker: str = "_argmax_kernel", top: int = 12) -> dict:
    """Where the GPU's time goes from one step to the next: periods run from one sampling launch (once a
    step) to the next, and only those within 10 % of the median period count (the steady decode steps, not
    the prompt waves). -> the mean period, its busy and idle µs, the µs per period of each op by name (graph
    kernels included), and the idle µs per period by the pair of ops on either side of a gap."""
    events = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                    if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    marks = [a for a, _, name in events if name == marker]
    if len(marks) < 3:
        return {}
    median = statistics.median(b - a for a, b in zip(marks, marks[1:]))
    steady = {i for i, (a, b) in enumerate(zip(marks, marks[1:])) if abs(b - a - median) < 0.1 * median}
    by_name, gaps = Counter(), Counter()
    busy = 0.0
    last = {}  # period -> (end of the busy span so far, name of the op that ended it)
    for start, end, name in events:
        i = bisect.bisect_right(marks, start) - 1
        if i not in steady:
            continue
        end = min(end, marks[i + 1])
        by_name[name[:60]] += end - start
        span_end, prev = last.get(i, (marks[i], "(period start)"))
        if start > span_end:
            gaps[f"{prev[:28]} -> {name[:28]}"] += start - span_end
        if end > span_end:  # the part of this op not already covered by one before it
            busy += end - max(start, span_end)
            last[i] = (end, name)
    for i in steady:  # the idle before the next period's sampling launch
        span_end, prev = last.get(i, (marks[i], "(period start)"))
        gaps[f"{prev[:28]} -> {marker[:28]}"] += marks[i + 1] - span_end
    n = len(steady)
    period = sum(marks[i + 1] - marks[i] for i in steady) / n
    return {"periods": n, "period_us": period, "busy_us": busy / n, "idle_us": period - busy / n,
            "ops_us": {k: v / n for k, v in by_name.most_common(top)},
            "gaps_us": {k: v / n for k, v in gaps.most_common(top // 2)}}


def print_periods(label: str, report: dict) -> None:
    if not report:
        return
    print(f"{label}: {report['periods']} steady steps of {report['period_us']:.1f} µs: busy {report['busy_us']:.1f}, "
          f"idle {report['idle_us']:.1f}", flush=True)
    for kind in ("ops_us", "gaps_us"):
        for name, us in report[kind].items():
            print(f"    {kind[:-3]:4s} {us:8.1f} µs  {name}", flush=True)


@dataclass
class Tally:
    """Each request's first token and the gaps between its tokens, timed as the engine hands them out."""

    arrived: dict[str, float] = field(default_factory=dict)  # request id -> time.perf_counter() it arrived
    seen: dict[str, int] = field(default_factory=dict)
    last: dict[str, float] = field(default_factory=dict)
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0

    def arrive(self, rid: str, at: float) -> None:
        self.arrived[rid], self.seen[rid] = at, 0

    def shift(self, seconds: float) -> None:
        """Move every clock on by seconds (time that was not serving: the profiler's start and teardown)."""
        for times in (self.arrived, self.last):
            for rid in times:
                times[rid] += seconds

    def record(self, outs, now: float) -> int:
        """Count a step's outputs; -> how many requests finished."""
        finished = 0
        for out in outs:
            rid, n = out.request_id, len(out.outputs[0].token_ids)
            if n > self.seen[rid]:
                if self.seen[rid] == 0:
                    self.ttft.append(now - self.arrived[rid])
                else:  # a step may hand over two tokens at once (an overlapped step read late): count each gap
                    self.itl += [(now - self.last[rid]) / (n - self.seen[rid])] * (n - self.seen[rid])
                self.output_tokens += n - self.seen[rid]
                self.seen[rid], self.last[rid] = n, now
            finished += out.finished
        return finished

    def summary(self, wall: float) -> dict:
        return {"output_tokens": self.output_tokens, "output_tok_s": self.output_tokens / wall,
                "ttft_p50_ms": pct(self.ttft, 0.5) * 1e3, "ttft_p99_ms": pct(self.ttft, 0.99) * 1e3,
                "itl_p50_ms": pct(self.itl, 0.5) * 1e3, "itl_p99_ms": pct(self.itl, 0.99) * 1e3}


def steps_by_kind(eng: LLMEngine, steps_before: int) -> dict:
    """The engine's steps since steps_before by kind (decode only, prompt only, mixed): count, host time p50, total."""
    kinds = {"decode": [], "prompt": [], "mixed": []}
    for s in list(eng.recent_steps)[-(eng.steps_total - steps_before):]:
        kind = "mixed" if s.num_prefill_tokens and s.num_decode_tokens else "prompt" if s.num_prefill_tokens else "decode"
        kinds[kind].append(s.duration_s)
    return {k: {"count": len(v), "host_ms_p50": pct(v, 0.5) * 1e3, "total_s": sum(v)} for k, v in kinds.items()}


def run_level(eng: LLMEngine, concurrency: int, vocab: int, profile_steps: int, seed: int) -> dict:
    rng = random.Random(seed)
    total = max(16, 4 * concurrency)
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True, detokenize=False)
    tally = Tally()
    sent = 0

    def send() -> None:
        nonlocal sent
        rid = f"c{concurrency}-{sent}"
        eng.add_request(rid, [rng.randrange(100, vocab) for _ in range(PROMPT_TOKENS)], params)
        tally.arrive(rid, time.perf_counter())
        sent += 1

    def hide(seconds: float) -> None:
        """The profiler's start and teardown (up to seconds of trace processing) are not serving time:
        move every clock past them."""
        nonlocal start
        start += seconds
        tally.shift(seconds)

    for _ in range(min(concurrency, total)):
        send()
    steps_before = eng.steps_total
    on_gpu = torch.cuda.is_available() and profile_steps > 0
    window = (steps_before + 40, steps_before + 40 + profile_steps)  # past the first wave of prompts
    prof, window_start, busy, periods = None, 0.0, None, {}
    start = time.perf_counter()
    while eng.has_unfinished_requests() or eng.pending is not None:
        if on_gpu and prof is None and busy is None and eng.steps_total >= window[0]:
            paused = time.perf_counter()
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
            window_start = time.perf_counter()
            hide(window_start - paused)
        outs = eng.step()
        if prof is not None and eng.steps_total >= window[1]:
            torch.cuda.synchronize()
            wall = time.perf_counter() - window_start
            paused = time.perf_counter()
            prof.__exit__(None, None, None)
            busy, periods, prof = gpu_busy_share(prof, wall), step_periods(prof), None
            hide(time.perf_counter() - paused)
        for _ in range(tally.record(outs, time.perf_counter())):
            if sent < total:
                send()
    wall = time.perf_counter() - start
    if prof is not None:  # the run ended inside the window
        prof.__exit__(None, None, None)
    return {"concurrency": concurrency, "requests": total, **tally.summary(wall),
            "steps": steps_by_kind(eng, steps_before), "gpu_busy_share": busy, "step_periods": periods}


def alone(eng: LLMEngine, batch: int, context: int = 640, steps: int = 30) -> dict:
    """Decode steps of `batch` sequences at `context` with nothing else running: ms a step, and the
    profiled period breakdown."""
    from gpu_bench import abort_all, fake_prefilled

    fake_prefilled(eng, batch, context)
    for _ in range(3):
        eng.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) / steps * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    abort_all(eng)
    return {"batch": batch, "context": context, "step_ms": ms, "step_periods": step_periods(prof)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="checkpoint folder (default: the 8B-shaped random checkpoint)")
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--concurrency", default="1,4,16,32,64")
    ap.add_argument("--profile-steps", type=int, default=150)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--alone", default="", help="batch sizes to time alone first, e.g. 1,16 (GPU only)")
    ap.add_argument("--budgets", default="8192", help="token budgets per step to run the levels under, e.g. 8192,2048 "
                    "(the engine is built with the largest; the scheduler's budget is lowered in place)")
    args = ap.parse_args()
    model = args.model
    if model is None:
        from gpu_bench import ROOT
        from make_checkpoint import make_checkpoint

        model = make_checkpoint("llama-3.1-8b", f"{ROOT}/llama-3.1-8b")
    # the serving benchmark's server flags (benchmarks/serve_bench.sh)
    budgets = [int(x) for x in args.budgets.split(",")]
    eng = LLMEngine(EngineConfig(model=str(model), quantization="fp8" if args.fp8 else None, max_model_len=args.max_model_len,
                                 max_num_seqs=256, max_num_batched_tokens=max(budgets)))
    vocab = eng.model_config.vocab_size
    for b in (int(x) for x in args.alone.split(",") if x):
        row = alone(eng, b)
        print(f"alone b={b} ctx={row['context']}: {row['step_ms']:.3f} ms a step", flush=True)
        print_periods(f"alone b={b}", row["step_periods"])
    rows = []
    levels = [int(x) for x in args.concurrency.split(",")]
    for j, budget in enumerate(budgets):
        eng.scheduler.max_num_batched_tokens = budget
        for i, c in enumerate(levels):  # fresh prompts for every run: no prefix-cache hits from an earlier one
            row = run_level(eng, c, vocab, args.profile_steps, seed=j * len(levels) + i)
            row["budget"] = budget
            rows.append(row)
            print_level(row)
    print("| budget | concurrency | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | tok/s | decode / prompt / mixed steps | GPU busy |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        busy = "-" if r["gpu_busy_share"] is None else f"{100 * r['gpu_busy_share']:.1f} %"
        counts = " / ".join(str(r["steps"][k]["count"]) for k in ("decode", "prompt", "mixed"))
        print(f"| {r['budget']} | {r['concurrency']} | {r['ttft_p50_ms']:.1f} / {r['ttft_p99_ms']:.1f} | {r['itl_p50_ms']:.2f} / "
              f"{r['itl_p99_ms']:.2f} | {r['output_tok_s']:,.1f} | {counts} | {busy} |")


def print_level(row: dict) -> None:
    c, st = row["concurrency"], row["steps"]
    busy = "-" if row["gpu_busy_share"] is None else f"{100 * row['gpu_busy_share']:.1f} %"
    print(f"budget {row['budget']} c={c}: TTFT p50/p99 {row['ttft_p50_ms']:.1f}/{row['ttft_p99_ms']:.1f} ms, ITL p50/p99 "
          f"{row['itl_p50_ms']:.2f}/{row['itl_p99_ms']:.2f} ms, {row['output_tok_s']:.1f} tok/s | steps "
          + ", ".join(f"{k} {v['count']} ({v['host_ms_p50']:.1f} ms, {v['total_s']:.2f} s)" for k, v in st.items())
          + f" | GPU busy {busy}", flush=True)
    print_periods(f"c={c}", row["step_periods"])


if __name__ == "__main__":
    main()
