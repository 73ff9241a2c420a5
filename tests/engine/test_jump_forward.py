"""Jump-forward for structured outputs (--structured-outputs-jump-forward): the text a grammar forces joins the
output as tokens at once and runs through the model as one chunk. Outputs still validate, in fewer steps;
overlapped and synchronous steps agree; length, stop strings, n > 1 and preemption keep their rules; rows whose
logprobs or penalties need every token drawn do not jump. The mixed CUDA graphs' side: tests/executor/
test_mixed_graphs.py."""

import json

import jsonschema
import pytest
import xgrammar as xgr

from pagefleet.worker import LLM, SamplingParams
from pagefleet.worker.core.sampling_params import StructuredOutputsParams as Structured
from pagefleet.worker.engine.stats import collect
from pagefleet.worker.engine.structured_output import ForcedText

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["alpha", "beta"]}, "maxItems": 3},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "color", "tags", "age"],
    "additionalProperties": False,
}
PROMPTS = ["Describe a person as JSON:", "Give me a JSON object for a cat:"]


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(str(smollm2_path), max_model_len=512, structured_outputs_jump_forward=True)


@pytest.fixture(scope="module")
def plain(smollm2_path):
    return LLM(str(smollm2_path), max_model_len=512)


def run(llm, params, prompts=PROMPTS):
    """(completions, steps taken, tokens jumped)."""
    engine = llm.engine
    steps, jumped = engine.steps_total, engine.jump_forward_tokens_total
    outputs = [c for out in llm.generate(prompts, params) for c in out.outputs]
    return outputs, engine.steps_total - steps, engine.jump_forward_tokens_total - jumped


def test_forced_text_takes_the_longest_pieces_and_leaves_an_extendable_last_one():
    info = xgr.TokenizerInfo(["a", "ab", "abc", "b", "c", '"', ":", '":', "<s>"], stop_token_ids=[8])
    forced = ForcedText(info)
    assert forced.split(b'abc":', 10) == [2, 7]  # "abc" then '":', which no longer piece extends
    assert forced.split(b"abcab", 10) == [2]  # "ab" ends the text and "abc" extends it: left to the model
    assert forced.split(b"abcabc", 1) == [2]  # at most `limit`
    assert forced.split(b"abx", 10) == [1]  # no piece spells "x": the jump stops before it
    assert forced.split(b"<s>", 10) == []  # stop tokens are never forced


@pytest.mark.parametrize("temperature,seed,n", [(0.0, None, 1), (1.0, 3, 4)])
def test_outputs_validate_in_fewer_steps(llm, plain, temperature, seed, n):
    params = SamplingParams(temperature=temperature, seed=seed, n=n, max_tokens=120, structured=Structured(json=SCHEMA))
    got, steps, jumped = run(llm, params)
    want, plain_steps, _ = run(plain, params)
    assert len(got) == len(PROMPTS) * n
    tokenizer = llm.engine.tokenizer
    for c in got:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
        assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)  # the same detokenizer
    # each output's keys, quotes and colons are forced: a third or more of its tokens
    assert jumped >= sum(len(c.token_ids) for c in got) // 3, (jumped, [len(c.token_ids) for c in got])
    assert steps < 0.8 * plain_steps, (steps, plain_steps)
    assert collect(llm.engine).jump_forward_tokens_total == llm.engine.jump_forward_tokens_total  # for /metrics


def test_overlapped_and_synchronous_steps_agree(smollm2_path, llm):
    """Whether a jump happens while the next step is on the device (its token then samples nothing) or between
    synchronous steps, the same tokens come out, greedy and seeded."""
    sync = LLM(str(smollm2_path), max_model_len=512, async_scheduling=False, structured_outputs_jump_forward=True)
    params = [SamplingParams(temperature=t, seed=i, max_tokens=100, structured=Structured(json=SCHEMA))
              for i, t in enumerate([0.0, 1.0, 1.0])]
    prompts = PROMPTS + PROMPTS[:1]
    got, _, jumped = run(llm, params, prompts)
    want, _, sync_jumped = run(sync, params, prompts)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert jumped == sync_jumped > 0


def test_length_and_stop_strings_hold_inside_forced_text(llm):
    structured = Structured(json=SCHEMA)
    # a budget that ends inside the forced '{"name": "': never more tokens than max_tokens
    for max_tokens in (1, 2, 3, 5):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured=structured)
        (c,), _, _ = run(llm, params, PROMPTS[:1])
        assert c.finish_reason == "length" and len(c.token_ids) == max_tokens, (max_tokens, c.token_ids)
    # the stop string is part of a forced key: the output ends before it
    (c,), _, jumped = run(llm, SamplingParams(temperature=0.0, max_tokens=100, stop=['"color"'],
                                              structured=structured), PROMPTS[:1])
    assert c.finish_reason == "stop" and c.stop_reason == '"color"' and jumped
    assert c.text.startswith('{"name": "') and '"color"' not in c.text and c.text.endswith('", ')


def test_rows_that_need_every_token_drawn_do_not_jump(llm):
    structured = Structured(json=SCHEMA)
    for extra in (dict(logprobs=1), dict(presence_penalty=0.5), dict(repetition_penalty=1.2)):
        got, _, jumped = run(llm, SamplingParams(temperature=0.0, max_tokens=120, structured=structured, **extra))
        assert jumped == 0, extra
        for c in got:
            jsonschema.validate(json.loads(c.text), SCHEMA)
    got, _, _ = run(llm, SamplingParams(temperature=0.0, max_tokens=120, logprobs=1, structured=structured))
    assert all(len(c.logprobs) == len(c.token_ids) for c in got)


def test_preempted_requests_still_validate(smollm2_path):
    """8 blocks of 16 slots hold two of these samples at a time, not eight: sequences are preempted, some with
    forced tokens not yet run, and recompute them with the rest."""
    tight = LLM(str(smollm2_path), max_model_len=128, num_gpu_blocks_override=8, structured_outputs_jump_forward=True)
    params = SamplingParams(temperature=1.0, seed=3, n=4, max_tokens=100, structured=Structured(json=SCHEMA))
    got, _, jumped = run(tight, params)
    assert tight.engine.scheduler.num_preemptions > 0 and jumped > 0
    for c in got:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert tight.engine.block_manager.num_free_blocks == 8 and tight.engine.structured.live == 0
