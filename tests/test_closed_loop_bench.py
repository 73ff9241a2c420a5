"""benchmarks/closed_loop_bench.py on CPU with a tiny model: its closed loop keeps the slots full and its
counts add up (every request, token, first token and gap counted once; steps sorted by kind)."""

import sys
from pathlib import Path

from pagefleet.worker.core.config import EngineConfig
from pagefleet.worker.engine.llm_engine import LLMEngine

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from closed_loop_bench import OUTPUT_TOKENS, gpu_busy_share, run_level, step_periods  # noqa: E402


def test_closed_loop_counts(tiny_models):
    eng = LLMEngine(EngineConfig(model=str(tiny_models["llama"]), max_model_len=1024, max_num_seqs=256,
                                 max_num_batched_tokens=8192))
    lone = run_level(eng, 1, 49152, profile_steps=0, seed=0)
    assert lone["requests"] == 16 and lone["output_tokens"] == 16 * OUTPUT_TOKENS
    steps = lone["steps"]
    # one request at a time: each prompt alone, then its decodes alone
    assert (steps["prompt"]["count"], steps["mixed"]["count"]) == (16, 0)
    assert steps["decode"]["count"] == 16 * (OUTPUT_TOKENS - 1)
    assert lone["gpu_busy_share"] is None and lone["output_tok_s"] > 0
    assert 0 < lone["ttft_p50_ms"] <= lone["ttft_p99_ms"] and 0 < lone["itl_p50_ms"] <= lone["itl_p99_ms"]
    four = run_level(eng, 4, 49152, profile_steps=0, seed=1)
    assert four["output_tokens"] == 16 * OUTPUT_TOKENS
    # four slots in lockstep: their prompts land in one step each wave, and nothing is left running
    assert four["steps"]["decode"]["count"] >= 4 * (OUTPUT_TOKENS - 1) and four["steps"]["decode"]["count"] < 16 * OUTPUT_TOKENS
    assert not eng.has_unfinished_requests()


class Event:
    def __init__(self, start, end, cuda=True, name="k"):
        import torch

        self.name = name
        self.device_type = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
        self.time_range = type("Range", (), {"start": start, "end": end})()


class Profile:
    def __init__(self, events):
        self._events = events

    def events(self):
        return self._events


def test_gpu_busy_share_counts_overlaps_once():
    # kernels at 0-10, 5-20 and 12-18 us cover 0-20; with 30-40, 30 us busy in a 50 us window; CPU events ignored
    prof = Profile([Event(30, 40), Event(0, 10), Event(5, 20), Event(0, 50, cuda=False), Event(12, 18)])
    assert abs(gpu_busy_share(prof, 50e-6) - 0.6) < 1e-9


def test_step_periods_splits_each_step_into_ops_and_idle():
    def step(t0, graph_us):  # one decode step: an input copy, the graph's kernel, the sampling launch
        return [Event(t0, t0 + 5, name="copy"), Event(t0 + 7, t0 + 7 + graph_us, name="graph"),
                Event(t0 + 9 + graph_us, t0 + 12 + graph_us, name="_argmax_kernel")]

    events = []
    for i in range(5):  # steady 100 us periods: 5 copy, 2 idle, 86 graph, 2 idle, 3 argmax, 2 idle
        events += step(100 * i, 86)
    events += step(500, 986)  # a long (prompt) step, left out of the steady periods
    events.append(Event(0, 2000, cuda=False, name="cpu"))
    r = step_periods(Profile(events))
    # marks at 95, 195, 295, 395, 495 and 1495: four steady periods of 100 us, the 1000 us one dropped
    assert r["periods"] == 4 and r["period_us"] == 100
    assert r["busy_us"] == 94 and r["idle_us"] == 6
    assert r["ops_us"] == {"graph": 86, "copy": 5, "_argmax_kernel": 3}
    assert r["gaps_us"] == {"copy -> graph": 2, "graph -> _argmax_kernel": 2, "_argmax_kernel -> copy": 2}
