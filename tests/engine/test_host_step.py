"""The host shortcuts of the step path give what the long way gives: offline text built once at the end equals the
text built after each token, and the block table rows kept across steps equal rows built afresh."""

import numpy as np
import pytest

from pagefleet.worker import LLM, SamplingParams
from pagefleet.worker.core.block_manager import build_tables
from pagefleet.worker.core.detokenizer import text_decoder, update_text
from pagefleet.worker.core.sequence import Sequence
from pagefleet.worker.models.loader import load_tokenizer

TEXT = "Hello , world . Ünïcödé ✓ 日本語 🚀  two  spaces\nnew line"


@pytest.mark.parametrize("skip", [True, False])
def test_text_built_in_one_late_call_equals_the_text_built_after_each_token(smollm2_path, skip):
    tokenizer = load_tokenizer(smollm2_path)
    words = tokenizer.encode(TEXT, add_special_tokens=False)
    # multi-byte characters split over tokens, a run of skipped EOS, a prompt whose tail starts the window
    ids = words[:9] + [tokenizer.eos_token_id] * 5 + words[9:] + words
    decoder = text_decoder(tokenizer)
    params = SamplingParams(skip_special_tokens=skip)
    eager = Sequence("r", 0, ids[:4], 4, params, None)
    for token in ids[4:]:
        eager.token_ids.append(token)
        update_text(decoder, eager)
    late = Sequence("r", 0, list(ids), 4, params, None)
    half = len(ids) // 2
    pieces = update_text(decoder, late, half) + update_text(decoder, late)  # in two calls, the first one partial
    assert late.text == eager.text == pieces and eager.text
    assert (late.prefix_offset, late.read_offset, late.num_detokenized) == (
        eager.prefix_offset, eager.read_offset, len(ids))


def run(llm, prompts, params, emit_partial):
    """Step the engine by hand; emit_partial on detokenizes after each token, off only at each sequence's end."""
    engine = llm.engine
    engine.emit_partial = emit_partial
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{emit_partial}{i}", prompt, p)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [(o.text, o.token_ids, o.finish_reason) for o in out.outputs]
    return [done[f"r{emit_partial}{i}"] for i in range(len(prompts))]


def test_offline_text_equals_streamed_text(tiny_models):
    """Sampled (seeded, n=3) and greedy requests, some ended by EOS or a stop token, one by a stop string (which
    keeps the text built after each token offline too): the same texts, token ids and finish reasons."""
    llm = LLM(str(tiny_models["llama"]), max_model_len=256, num_gpu_blocks_override=200, device="cpu")
    prompts = [list(range(100 + 7 * i, 130 + 7 * i)) for i in range(6)]
    params = [SamplingParams(n=3, temperature=1.0, seed=5 + i, max_tokens=40) for i in range(3)]
    params += [SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[5000 + i]) for i in range(2)]
    params += [SamplingParams(temperature=1.0, seed=1, max_tokens=40, stop=["e"])]
    offline = run(llm, prompts, params, emit_partial=False)
    llm.engine.block_manager.reset_prefix_cache()
    streamed = run(llm, prompts, params, emit_partial=True)
    assert offline == streamed
    assert all(text for out in offline for text, _, _ in out)


def test_kept_block_table_rows_equal_rows_built_afresh(tiny_models):
    """Forks sharing blocks, copy-on-write, new blocks every 8 tokens, sequences ending, and preemptions (a pool
    too small for every sample at once): each step's rows as a fresh build gives them."""
    llm = LLM(str(tiny_models["llama"]), max_model_len=256, num_gpu_blocks_override=40, block_size=8, device="cpu")
    runner = llm.engine.runner
    original = runner.prepare
    kept_steps = []

    def checking_prepare(batch):
        step = original(batch)
        assert np.array_equal(step.tables, build_tables(batch.seqs))
        kept_steps.append(batch.block_tables is not None)
        return step

    runner.prepare = checking_prepare
    prompts = [list(range(200 + 11 * i, 200 + 11 * i + 20 + 3 * i)) for i in range(4)]
    params = [SamplingParams(n=4, temperature=1.0, seed=i, max_tokens=30 + 10 * i, ignore_eos=True) for i in range(4)]
    llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0 and len(kept_steps) > 50 and all(kept_steps)
