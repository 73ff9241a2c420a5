"""StateCache slot copies: chunked gathers give what one gather gives, and a slot both read and written in one call
still reads its old state."""

import pytest
import torch

from pagefleet.worker.executor import state_cache
from pagefleet.worker.executor.state_cache import StateCache

SHAPES = {"conv": ((3, 4, 5), torch.bfloat16), "ssm": ((3, 2, 4, 4), torch.float32)}


def filled(slots: int = 10) -> StateCache:
    cache = StateCache(SHAPES, slots - 2, 2, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    cache.conv.copy_(torch.randn(cache.conv.shape, generator=g))
    cache.ssm.copy_(torch.randn(cache.ssm.shape, generator=g))
    return cache


def one_gather(cache: StateCache, pairs) -> tuple[torch.Tensor, torch.Tensor]:
    conv, ssm = cache.conv.clone(), cache.ssm.clone()
    src, dst = torch.tensor([s for s, _ in pairs]), torch.tensor([d for _, d in pairs])
    conv[:, dst], ssm[:, dst] = conv[:, src].clone(), ssm[:, src].clone()
    return conv, ssm


def test_forks_copied_in_chunks_equal_one_gather(monkeypatch):
    monkeypatch.setattr(state_cache, "COPY_CHUNK_BYTES", 1)  # one slot a gather
    cache = filled()
    pairs = [(0, 3), (0, 4), (0, 5), (1, 6), (2, 7)]  # a parent's forks and two other sources
    want = one_gather(cache, pairs)
    gathers = []
    index = torch.Tensor.__getitem__

    def counting(t, key):
        if isinstance(key, tuple) and len(key) == 2 and isinstance(key[1], torch.Tensor):
            gathers.append(len(key[1]))
        return index(t, key)

    monkeypatch.setattr(torch.Tensor, "__getitem__", counting)
    cache.before_forward(pairs, [])
    monkeypatch.undo()
    assert gathers == [1] * 10  # conv and ssm, a slot at a time: never the whole set of sources at once
    assert torch.equal(cache.conv, want[0]) and torch.equal(cache.ssm, want[1])


def test_a_slot_read_and_written_in_one_call_reads_its_old_state(monkeypatch):
    monkeypatch.setattr(state_cache, "COPY_CHUNK_BYTES", 1)
    cache = filled()
    pairs = [(1, 2), (2, 3)]  # slot 2 is written and read: 3 must get 2's state from before the call
    want = one_gather(cache, pairs)
    cache.after_forward(pairs)
    assert torch.equal(cache.conv, want[0]) and torch.equal(cache.ssm, want[1])


def test_ssm_state_dtype_rule_and_flag():
    """vLLM's rule for the recurrent state's storage: the flag, then the checkpoint's mamba_ssm_dtype, then the
    model dtype; `pagefleet serve --mamba-ssm-cache-dtype` reaches the engine config; bad values are refused."""
    import argparse

    from pagefleet.worker.entrypoints.engine_args import add_engine_arguments, engine_config_from_args
    from pagefleet.worker.executor.bringup import ssm_state_dtype

    assert ssm_state_dtype("auto", None, torch.bfloat16)[0] == torch.bfloat16
    assert ssm_state_dtype("auto", "float32", torch.bfloat16)[0] == torch.float32
    assert ssm_state_dtype("auto", "torch.float32", torch.bfloat16)[0] == torch.float32
    assert ssm_state_dtype("bfloat16", "float32", torch.float32) == (torch.bfloat16, "--mamba-ssm-cache-dtype")
    with pytest.raises(ValueError, match="mamba_ssm_dtype 'int8'"):
        ssm_state_dtype("auto", "int8", torch.bfloat16)
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_config_from_args(parser.parse_args([])).mamba_ssm_cache_dtype == "auto"
    args = parser.parse_args(["--mamba-ssm-cache-dtype", "bfloat16"])
    assert engine_config_from_args(args).mamba_ssm_cache_dtype == "bfloat16"
    with pytest.raises(SystemExit):
        parser.parse_args(["--mamba-ssm-cache-dtype", "int4"])
