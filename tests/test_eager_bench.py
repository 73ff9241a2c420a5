"""benchmarks/eager_bench.py on CPU with a tiny model: every arm runs every batch to its last token, and the
enforce_eager engine it starts has no graphs of any kind."""

import sys
from pathlib import Path

from pagefleet.worker.engine.llm_engine import LLMEngine

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import eager_bench  # noqa: E402


def test_every_arm_at_every_batch(tiny_models, monkeypatch):
    engines = []

    class Recorded(LLMEngine):
        def __init__(self, config):
            super().__init__(config)
            engines.append(self)

    monkeypatch.setattr(eager_bench, "LLMEngine", Recorded)
    monkeypatch.setattr(eager_bench, "PROMPT", 40)
    monkeypatch.setattr(eager_bench, "OUTPUT", 6)
    rows = eager_bench.measure(dict(model=str(tiny_models["llama"]), max_model_len=256, max_num_seqs=16,
                                    max_num_batched_tokens=512))
    assert set(rows) == set(eager_bench.BATCHES)
    for r in rows.values():
        assert set(r) == {"graphs", "decode_graphs_off", "enforce_eager"} and all(v > 0 for v in r.values())
    graphed, eager = engines
    assert eager.config.enforce_eager and not graphed.config.enforce_eager
    assert (eager.runner.graphs, eager.runner.prompt_graphs, eager.runner.mixed_graphs) == (None, None, None)
    assert not graphed.has_unfinished_requests() and not eager.has_unfinished_requests()



def test_gpu_bench_settings_take_overrides():
    """decode_graphs_ab.py, lone_prompt_bench.py, eager_bench.py and mixed_bench.py all override some of them."""
    import gpu_bench

    settings = gpu_bench.engine_settings("/m", max_num_seqs=64, gpu_memory_fraction=0.8, quantization="fp8")
    assert settings == {"model": "/m", "max_model_len": 4224, "max_num_seqs": 64, "max_num_batched_tokens": 16384,
                        "gpu_memory_fraction": 0.8, "quantization": "fp8"}
