"""Structured outputs after the reasoning (a server with --reasoning-parser): the grammar of an AfterReasoning
constraint is inactive until `</think>` is generated and holds from the next token, through the real xgrammar
matcher over a tokenizer with `<think>` / `</think>` tokens, and through the engine on a tiny random model."""

import json

import jsonschema
import numpy as np
import pytest

from pagefleet.worker import LLM, SamplingParams
from pagefleet.worker.core.sampling_params import StructuredOutputsParams as Structured
from pagefleet.worker.core.sequence import Sequence
from pagefleet.worker.engine.structured_output import AfterReasoning, StructuredOutputs, after_reasoning
from think_models import VOCAB, think_model, think_tokenizer

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return think_tokenizer(tmp_path_factory.mktemp("think-tokenizer"))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    so = StructuredOutputs(tokenizer, VOCAB, [tokenizer.eos_token_id])
    yield so
    so.shutdown()


def ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def allowed(so, state, prompt=(1,)):
    """The token ids the state's mask allows next, or None where its row gets no mask."""
    seq = Sequence("r", 0, list(prompt), len(prompt), SamplingParams(), None)
    seq.grammar = state
    so.live = 1
    got = so.bitmask([seq])
    if got is None:
        return None
    rows, bitmask = got
    assert rows.tolist() == [0]
    bits = np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")[:VOCAB]
    return set(np.flatnonzero(bits).tolist())


def ready(state):
    state.future.result(timeout=60)
    return state


def test_the_grammar_is_free_until_think_ends_then_holds(tokenizer, compiler):
    end = tokenizer.convert_tokens_to_ids("</think>")
    state = ready(compiler.state(after_reasoning(Structured(json=SCHEMA), end)))
    thinking = ids(tokenizer, "<think>Let me count: five.")
    for token in thinking:  # tokens the JSON grammar refuses, taken while the gate is shut, the mask all-allowed
        assert allowed(compiler, state) is None and not state.active
        assert state.accept(token)
    assert not state.terminated
    assert state.accept(end) and state.active
    first = allowed(compiler, state)
    assert ids(tokenizer, "{")[0] in first and end not in first and thinking[1] not in first
    for token in ids(tokenizer, '{"n": 5}'):
        assert state.accept(token)
    assert not state.terminated
    assert allowed(compiler, state) == {tokenizer.eos_token_id}
    assert state.accept(tokenizer.eos_token_id) and state.terminated
    # without the gate the same constraint refuses the first thinking token
    plain = ready(compiler.state(Structured(json=SCHEMA)))
    assert thinking[1] not in allowed(compiler, plain) and not plain.accept(thinking[1])


def test_fork_and_rebuild_pass_through_the_gate_the_same_way(tokenizer, compiler):
    end = tokenizer.convert_tokens_to_ids("</think>")
    state = ready(compiler.state(after_reasoning(Structured(json=SCHEMA), end)))
    before = ids(tokenizer, "<think>hmm")
    for token in before:
        state.accept(token)
    shut = state.fork()
    assert shut.waiting and state.rebuild(before).waiting
    after = [end, *ids(tokenizer, '{"n": ')]
    for token in after:
        state.accept(token)
    assert shut.waiting  # a fork is its own state: the gate opened in the parent only
    rebuilt = state.rebuild(before + after)  # recompute replays the kept tokens: the same state
    assert rebuilt.active and allowed(compiler, rebuilt) == allowed(compiler, state)
    sibling = state.fork()
    for token in ids(tokenizer, "7"):
        sibling.accept(token)
    assert allowed(compiler, sibling) != allowed(compiler, state)  # each sample moves on alone
    with pytest.raises(ValueError, match="not allowed"):  # tokens after the gate are checked on replay
        state.rebuild(before + [end, *ids(tokenizer, "no")])


def test_after_reasoning_keeps_the_constraint_and_its_compile(tokenizer):
    base = Structured(json=SCHEMA)
    gated = after_reasoning(base, 7)
    assert isinstance(gated, AfterReasoning) and gated.key() == base.key()
    assert SamplingParams(structured=gated).validate().structured.reasoning_end_token_id == 7
    with pytest.raises(ValueError, match="reasoning_end_token_id"):
        AfterReasoning(json=SCHEMA)


# ---- through the engine: a tiny random Qwen3 over the think vocabulary ----

@pytest.fixture(scope="module")
def think_llm(tmp_path_factory):
    return LLM(str(think_model(tmp_path_factory.mktemp("think-model"))), max_model_len=256)


PROMPT = list(range(300, 316))


def test_engine_outputs_are_unconstrained_before_think_ends(think_llm):
    end = think_llm.tokenizer.convert_tokens_to_ids("</think>")
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    free = think_llm.generate([PROMPT], plain)[0].outputs[0]
    assert end not in free.token_ids
    with pytest.raises(ValueError):
        json.loads(free.text)
    gated = after_reasoning(Structured(json=SCHEMA), end)
    waiting = think_llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                          structured=gated))[0].outputs[0]
    assert waiting.token_ids == free.token_ids  # no mask while the reasoning goes on
    assert think_llm.engine.structured.live == 0


@pytest.mark.parametrize("temperature,seed,n", [(0.0, None, 1), (1.0, 4, 3)])
def test_engine_constrains_from_the_token_after_think_ends(think_llm, temperature, seed, n):
    end = think_llm.tokenizer.convert_tokens_to_ids("</think>")
    bias = {end: 100.0}  # the model ends its reasoning at once; the mask then rules `</think>` out again
    params = SamplingParams(temperature=temperature, seed=seed, n=n, max_tokens=40, logit_bias=bias,
                            structured=after_reasoning(Structured(json=SCHEMA), end))
    for c in think_llm.generate([PROMPT], params)[0].outputs:
        assert c.token_ids[0] == end and end not in c.token_ids[1:] and c.finish_reason == "stop", c.text
        reasoning, _, answer = c.text.partition("</think>")
        assert reasoning == ""
        jsonschema.validate(json.loads(answer), SCHEMA)
    # the same constraint without the gate holds from the first token: `</think>` is never allowed
    params.structured = Structured(json=SCHEMA)
    for c in think_llm.generate([PROMPT], params)[0].outputs:
        assert end not in c.token_ids
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_preempted_gated_samples_still_validate(tmp_path_factory):
    """Few KV blocks: samples are preempted and recomputed mid-output; their gates and matchers carry on."""
    tight = LLM(str(think_model(tmp_path_factory.mktemp("think-model-tight"))), max_model_len=128,
                num_gpu_blocks_override=8)
    end = tight.tokenizer.convert_tokens_to_ids("</think>")
    wide = {"type": "object", "properties": {"xs": {"type": "array", "items": SCHEMA["properties"]["n"],
                                                    "minItems": 12, "maxItems": 12}},
            "required": ["xs"], "additionalProperties": False}
    params = SamplingParams(temperature=1.0, seed=3, n=4, max_tokens=100, logit_bias={end: 100.0},
                            structured=after_reasoning(Structured(json=wide), end))
    outs = tight.generate([PROMPT], params)[0].outputs
    assert tight.engine.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    for c in outs:
        assert c.token_ids[0] == end and c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text.partition("</think>")[2]), wide)
    assert tight.engine.block_manager.num_free_blocks == 8 and tight.engine.structured.live == 0
