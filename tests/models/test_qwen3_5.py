"""Qwen3.5 (Gated DeltaNet + gated full attention) against transformers on tiny random checkpoints, CPU fp32.

The model runs over a paged KV cache and state slots allocated here (a small harness standing in for the
engine): a whole prompt, the same prompt in 16-token chunks continuing from the state, sequences of different
lengths in one step, mixed decode + prompt steps, and greedy decoding, each against transformers' logits.
"""

from __future__ import annotations

import json

import pytest
import torch

from engine_models import tiny_qwen3_5
from pagefleet.worker.models.layers import ops
from pagefleet.worker.models.layers.context import forward_context
from pagefleet.worker.models.layers.paged_attention import AttentionMetadata
from pagefleet.worker.models.loader import build_model, load_model_config

BLOCK = 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5") / "tiny")


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


def hf_logits(hf, ids):
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


class Harness:
    """Paged KV blocks and state slots for a few sequences, and one forward per step."""

    def __init__(self, model, num_slots=4, blocks_per_seq=8):
        self.model = model
        c = model.config
        self.blocks_per_seq = blocks_per_seq
        for attn in model.attention_layers():
            attn.k_cache = torch.zeros(num_slots * blocks_per_seq, BLOCK, c.num_key_value_heads, c.head_dim)
            attn.v_cache = torch.zeros_like(attn.k_cache)
        shapes = model.state_shapes()
        (conv_shape, conv_dtype), (ssm_shape, ssm_dtype) = shapes["conv"], shapes["ssm"]
        self.conv = torch.zeros(conv_shape[0], num_slots, *conv_shape[1:], dtype=conv_dtype)
        self.ssm = torch.zeros(ssm_shape[0], num_slots, *ssm_shape[1:], dtype=ssm_dtype)
        model.bind_state_cache(self.conv, self.ssm)
        self.lens = [0] * num_slots  # tokens cached per slot (sequence s lives in slot s, blocks s * blocks_per_seq..)

    def step(self, chunks: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """chunks: (slot, new token ids), decodes (one token) first -> each chunk's logits [n, vocab]."""
        ids, positions, slot_mapping, cu = [], [], [], [0]
        for slot, new in chunks:
            start = self.lens[slot]
            for i, t in enumerate(new):
                p = start + i
                ids.append(t)
                positions.append(p)
                slot_mapping.append((slot * self.blocks_per_seq + p // BLOCK) * BLOCK + p % BLOCK)
            self.lens[slot] += len(new)
            cu.append(cu[-1] + len(new))
        slots = [s for s, _ in chunks]
        tables = torch.tensor([[s * self.blocks_per_seq + b for b in range(self.blocks_per_seq)] for s in slots],
                              dtype=torch.int32)
        seq_lens = torch.tensor([self.lens[s] for s in slots], dtype=torch.int32)
        cu_t = torch.tensor(cu, dtype=torch.int32)
        is_decode = all(len(new) == 1 for _, new in chunks)
        nd = 0 if is_decode else next((i for i, (_, new) in enumerate(chunks) if len(new) != 1), len(chunks))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping), block_tables=tables, seq_lens=seq_lens, cu_seqlens_q=cu_t,
            max_seq_len=int(seq_lens.max()), is_decode=is_decode, num_decodes=nd,
            prefill_block_tables=tables[nd:] if nd else None, prefill_seq_lens=seq_lens[nd:] if nd else None,
            prefill_cu_seqlens_q=(cu_t[nd:] - cu_t[nd]) if nd else None)
        meta.state_slots = torch.tensor(slots, dtype=torch.int32)
        with torch.inference_mode(), forward_context(meta):
            logits = self.model.compute_logits(self.model(torch.tensor(ids), torch.tensor(positions)))
        return [logits[cu[i]:cu[i + 1]] for i in range(len(chunks))]


@pytest.fixture(scope="module")
def ours(ckpt):
    ops.use_triton(False)
    return build_model(load_model_config(ckpt), ckpt, torch.float32, torch.device("cpu"))


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


def close(a, b):
    torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4)


def test_config_fields(ckpt):
    c = load_model_config(ckpt)
    assert c.architecture == "Qwen3_5ForCausalLM"
    assert c.layer_types == ["linear_attention", "full_attention", "linear_attention", "full_attention"]
    assert (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
            c.linear_conv_kernel_dim) == (2, 4, 16, 16, 4)
    assert c.partial_rotary_factor == 0.25 and c.attn_output_gate and c.rope_scaling is None


def test_state_shapes(ours):
    shapes = ours.state_shapes()
    conv_dim = 2 * 2 * 16 + 4 * 16
    assert shapes == {"conv": ((2, conv_dim, 3), torch.float32), "ssm": ((2, 4, 16, 16), torch.float32)}
    assert len(ours.attention_layers()) == 2


def test_whole_prompt(ours, hf):
    ids = _prompt(70, 1)  # past one 64-token chunk of the rule
    (logits,) = Harness(ours).step([(0, ids)])
    close(logits, hf_logits(hf, ids))


def test_prompt_in_chunks_of_16(ours, hf):
    ids = _prompt(53, 2)
    h = Harness(ours)
    got = torch.cat([h.step([(1, ids[i:i + 16])])[0] for i in range(0, len(ids), 16)])
    close(got, hf_logits(hf, ids))


def test_sequences_of_different_lengths_in_one_step(ours, hf):
    prompts = [_prompt(n, 10 + n) for n in (5, 33, 1, 18)]
    outs = Harness(ours).step(list(enumerate(prompts)))
    for ids, logits in zip(prompts, outs):
        close(logits, hf_logits(hf, ids))


def test_greedy_decode_and_mixed_steps(ours, hf):
    """Two sequences prefill then decode greedily; a third arrives mid-way, its prompt in two chunks beside
    their decodes (mixed steps). Every sequence's logits match transformers on its own tokens."""
    h = Harness(ours)
    seqs = {0: _prompt(20, 3), 1: _prompt(9, 4)}
    late = _prompt(24, 5)
    logits = dict(zip(seqs, h.step(list(seqs.items()))))
    for step in range(6):
        for s in seqs:
            seqs[s].append(int(logits[s][-1].argmax()))
        chunks = [(s, seqs[s][-1:]) for s in seqs]
        if step in (2, 3):
            chunks.append((2, late[:12] if step == 2 else late[12:]))
        outs = h.step(chunks)
        logits = {s: outs[i] for i, (s, _) in enumerate(chunks) if s in seqs}
        if step == 3:
            close(outs[-1], hf_logits(hf, late)[12:])
    for s, ids in seqs.items():
        close(logits[s][-1], hf_logits(hf, ids)[-1])
    with torch.inference_mode():
        for s in seqs:  # and the greedy tokens are transformers' own
            prompt = seqs[s][: (20, 9)[s]]
            out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=6, min_new_tokens=6,
                              pad_token_id=0)
            assert out[0, len(prompt):].tolist() == seqs[s][len(prompt):]


def test_profiling_run_without_caches(ckpt, hf):
    """No KV cache or state bound (the engine's memory-profiling pass): the step still runs, with fresh states."""
    model = build_model(load_model_config(ckpt), ckpt, torch.float32, torch.device("cpu"))
    prompts = [_prompt(n, 20 + n) for n in (7, 30)]
    cu = torch.tensor([0, 7, 37], dtype=torch.int32)
    meta = AttentionMetadata(slot_mapping=torch.full((37,), -1), block_tables=torch.zeros(2, 1, dtype=torch.int32),
                             seq_lens=torch.tensor([7, 30], dtype=torch.int32), cu_seqlens_q=cu, max_seq_len=30,
                             is_decode=False)
    meta.state_slots = torch.tensor([5, 9], dtype=torch.int32)  # slots of a cache that is not there yet
    with torch.inference_mode(), forward_context(meta):
        logits = model.compute_logits(model(torch.tensor(prompts[0] + prompts[1]), torch.tensor(
            list(range(7)) + list(range(30)))))
    close(logits[:7], hf_logits(hf, prompts[0]))
    close(logits[7:], hf_logits(hf, prompts[1]))


def test_multimodal_checkpoint_skips_the_vision_tower(ckpt, tmp_path, capsys, ours):
    """Qwen3_5ForConditionalGeneration's layout: text weights under model.language_model., a vision tower
    under model.visual. and MTP heads: the text model loads (same logits), the rest is skipped with a line."""
    from safetensors.torch import load_file, save_file

    tensors = {(k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
               for k, v in load_file(str(ckpt / "model.safetensors")).items()}
    tensors["model.visual.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 2, 2)
    tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.randn(24, 8)
    tensors["mtp.fc.weight"] = torch.randn(64, 128)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    text = json.loads((ckpt / "config.json").read_text())
    text.pop("architectures", None)
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text,
              "vision_config": {"depth": 1, "hidden_size": 8}, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (ckpt / name).exists():
            (tmp_path / name).write_text((ckpt / name).read_text())
    mc = load_model_config(tmp_path)
    assert mc.architecture == "Qwen3_5ForConditionalGeneration" and mc.layer_types == ours.config.layer_types
    model = build_model(mc, tmp_path, torch.float32, torch.device("cpu"))
    out = capsys.readouterr().out
    assert "skipping the checkpoint's vision tower (model.visual.*)" in out and out.count("vision tower") == 1
    assert "multi-token-prediction" in out
    ids = _prompt(12, 7)
    close(Harness(model).step([(0, ids)])[0], Harness(ours).step([(0, ids)])[0])


def test_bad_layer_types_refused(ckpt, tmp_path):
    raw = json.loads((ckpt / "config.json").read_text())
    raw["layer_types"] = ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]
    from pagefleet.worker.models.registry import ModelConfig

    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_dict(raw, {})
