"""benchmarks/poisson_bench.py on CPU with a tiny model: requests arrive at their drawn times, every one
completes with every token counted, and the engine idles between arrivals instead of spinning."""

import itertools
import random
import sys
from pathlib import Path

from pagefleet.worker.core.config import EngineConfig
from pagefleet.worker.engine.llm_engine import LLMEngine

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from poisson_bench import run_rate  # noqa: E402


def test_open_loop_arrivals_and_counts(tiny_models):
    eng = LLMEngine(EngineConfig(model=str(tiny_models["llama"]), max_model_len=256, max_num_seqs=16,
                                 max_num_batched_tokens=256))
    slow = run_rate(eng, 10.0, 6, 1000, seed=0, prompt_tokens=24, output_tokens=5)
    assert slow["output_tokens"] == 6 * 5 and slow["requests"] == 6
    gaps = random.Random(0 + 1)
    last_arrival = list(itertools.accumulate(gaps.expovariate(10.0) for _ in range(5)))[-1]
    assert slow["output_tok_s"] <= 6 * 5 / last_arrival  # the level lasts at least until the last arrival
    assert 0 < slow["ttft_p50_ms"] <= slow["ttft_p99_ms"] and 0 < slow["itl_p50_ms"] <= slow["itl_p99_ms"]
    burst = run_rate(eng, 1e6, 6, 1000, seed=1, prompt_tokens=24, output_tokens=5)
    assert burst["output_tokens"] == 6 * 5 and burst["most_in_flight"] == 6  # all six arrive before the first step
    steps = burst["steps"]
    assert steps["decode"]["count"] + steps["mixed"]["count"] >= 4  # each of the 5 tokens after the first
    assert not eng.has_unfinished_requests()
