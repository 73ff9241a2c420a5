"""The start-up warm-up (worker/executor/startup/warmup.py) on CPU, through the reference ops: every case runs
through the model and the attention metadata it builds, writes nothing to the KV cache, and the compile workers'
shares split the cases without gaps or overlaps. On the H200, tests/executor/test_engine_gpu.py checks that after
start-up no kernel compiles."""

import torch

from pagefleet.worker import LLM
from pagefleet.worker.executor.startup.warmup import warm_up, warmup_cases
from pagefleet.worker.models.layers import ops


def test_shares_cover_every_case_once(monkeypatch):
    monkeypatch.setattr(ops, "decode_warmup_batches", lambda max_num_seqs, kv_heads: [1, 4, 16, 64])
    cases = warmup_cases(256, 8, cascade=True)
    assert len(cases) == 4 + 2 * 4 + 1 and (64, [], False) in cases and (64, [3], False) in cases
    assert (64, [], True) in cases and (64, [], True) not in warmup_cases(256, 8)
    for n in (1, 3, 5, 16):
        shares = [warmup_cases(256, 8, (i, n), cascade=True) for i in range(n)]
        assert sorted(c for s in shares for c in s) == sorted(cases)


def test_warm_up_runs_every_case_and_writes_nothing(tiny_models, monkeypatch, capsys):
    llm = LLM(str(tiny_models["llama"]), max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8)
    runner = llm.engine.runner
    monkeypatch.setattr(ops, "decode_warmup_batches", lambda max_num_seqs, kv_heads: [1, 5])
    layers = runner.model.model.layers
    before = [(layer.self_attn.attn.k_cache.clone(), layer.self_attn.attn.v_cache.clone()) for layer in layers]
    assert warm_up(runner) == 8
    assert "warmed up 8 eager step shapes" in capsys.readouterr().out
    for (k, v), layer in zip(before, layers, strict=True):
        assert torch.equal(k, layer.self_attn.attn.k_cache) and torch.equal(v, layer.self_attn.attn.v_cache)
    assert warm_up(runner, (9, 10)) == 0  # a compile worker beyond the last case runs none
