"""The serving benchmark's requests arriving at Poisson times, on the engine alone, with the mixed graphs and
without them.

closed_loop_bench.py's closed loop sends prompts in waves: requests that start together finish together,
and their replacements arrive together. Under open-loop arrivals (`pagefleet bench serve --request-rate`)
prompts land one or two at a time beside running decodes, in steps that mix them: the steps
worker/executor/graphs/mixed.py replays as graphs. At each rate, 564-token prompts and 128 output tokens
(ignore_eos) arrive at exponential gaps (seeded; the same prompts and times in both arms), driven straight
into an LLMEngine. Per rate and arm: TTFT and inter-token p50 / p99 from the arrival time, output tok/s,
and the steps by kind with their host time p50.

Usage: python3 benchmarks/poisson_bench.py [--model PATH] [--fp8] [--rates 2,4,8,16] [--requests 64]
       [--budget 2048] [--eager-too]
Without --model: the random Llama-3.1-8B-shaped checkpoint (benchmarks/make_checkpoint.py). On CPU with a
tiny model it runs too, which is how its test checks it.
"""
from __future__ import annotations

import argparse
import itertools
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from pagefleet.worker import SamplingParams# noqa: E402
from pagefleet.worker.core.config import EngineConfig  # noqa: E402
from pagefleet.worker.engine.llm_engine import LLMEngine  # noqa: E402

from closed_loop_bench import OUTPUT_TOKENS, PROMPT_TOKENS, Tally, steps_by_kind  # noqa: E402


def run_rate(eng: LLMEngine, rate: float, requests: int, vocab: int, seed: int,
             prompt_tokens: int = PROMPT_TOKENS, output_tokens: int = OUTPUT_TOKENS) -> dict:
    rng, gaps = random.Random(seed), random.Random(seed + 1)
    arrivals = [0.0] + list(itertools.accumulate(gaps.expovariate(rate) for _ in range(requests - 1)))
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True, detokenize=False)
    tally = Tally()
    steps_before, sent, most = eng.steps_total, 0, 0
    start = time.perf_counter()
    while sent < requests or eng.has_unfinished_requests() or eng.pending is not None:
        now = time.perf_counter() - start
        while sent < requests and arrivals[sent] <= now:  # each request timed from its arrival, not its add
            rid = f"r{rate:g}-{sent}"
            eng.add_request(rid, [rng.randrange(100, vocab) for _ in range(prompt_tokens)], params)
            tally.arrive(rid, start + arrivals[sent])
            sent += 1
        if not eng.has_unfinished_requests() and eng.pending is None:
            time.sleep(max(0.0, arrivals[sent] - (time.perf_counter() - start)))  # idle until the next arrival
            continue
        most = max(most, len(eng.scheduler.running) + len(eng.scheduler.waiting))
        outs = eng.step()
        tally.record(outs, time.perf_counter())
    wall = time.perf_counter() - start
    return {"rate": rate, "requests": requests, "most_in_flight": most, **tally.summary(wall),
            "steps": steps_by_kind(eng, steps_before)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="checkpoint folder (default: the 8B-shaped random checkpoint)")
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--rates", default="2,4,8,16", help="requests a second")
    ap.add_argument("--requests", type=int, default=64, help="per rate")
    ap.add_argument("--budget", type=int, default=2048, help="--max-num-batched-tokens (the server's default)")
    ap.add_argument("--eager-too", action="store_true", help="each rate again with the mixed graphs off")
    args = ap.parse_args()
    model = args.model
    if model is None:
        from gpu_bench import ROOT
        from make_checkpoint import make_checkpoint

        model = make_checkpoint("llama-3.1-8b", f"{ROOT}/llama-3.1-8b")
    eng = LLMEngine(EngineConfig(model=str(model), quantization="fp8" if args.fp8 else None, max_model_len=2048,
                                 max_num_seqs=256, max_num_batched_tokens=args.budget))
    graphs = eng.runner.mixed_graphs
    arms = ["graphs", "eager"] if args.eager_too and graphs is not None else ["graphs" if graphs else "eager"]
    rows = []
    for i, rate in enumerate(float(x) for x in args.rates.split(",")):
        for arm in arms:  # the same prompts and arrival times in both arms
            eng.runner.mixed_graphs = graphs if arm == "graphs" else None
            row = {"mixed": arm, **run_rate(eng, rate, args.requests, eng.model_config.vocab_size, seed=100 * i)}
            rows.append(row)
            print(row, flush=True)
    eng.runner.mixed_graphs = graphs
    print("| rate (/s) | mixed steps | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | tok/s | most in flight | decode / prompt / mixed steps (host ms p50) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        steps = " / ".join(f"{v['count']} ({v['host_ms_p50']:.1f})" for v in r["steps"].values())
        print(f"| {r['rate']:g} | {r['mixed']} | {r['ttft_p50_ms']:.1f} / {r['ttft_p99_ms']:.1f} | {r['itl_p50_ms']:.2f} / "
              f"{r['itl_p99_ms']:.2f} | {r['output_tok_s']:,.1f} | {r['most_in_flight']} | {steps} |")


if __name__ == "__main__":
    main()
