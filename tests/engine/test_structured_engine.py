"""Structured outputs end to end through the engine: every constraint kind holds on the bundled model, with
greedy and sampled draws, n > 1, stop strings, max_tokens, preemption, and beside unconstrained requests."""

import json
import re
import threading

import jsonschema
import pytest
import xgrammar as xgr

from pagefleet.worker import LLM, SamplingParams
from pagefleet.worker.core.sampling_params import StructuredOutputsParams as Structured
from pagefleet.worker.core.sequence import SequenceStatus

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "color", "tags", "age"],
    "additionalProperties": False,
}
PROMPTS = ["Describe a person as JSON:", "Give me a JSON object for a cat:"]
DRAWS = [(0.0, None, 1), (1.0, 0, 4), (1.0, 1, 4)]  # (temperature, seed, n)


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(str(smollm2_path), max_model_len=512)


def completions(outputs):
    return [c for out in outputs for c in out.outputs]


def generate(llm, structured, temperature=0.0, seed=None, n=1, max_tokens=120, prompts=PROMPTS, **kw):
    params = SamplingParams(temperature=temperature, seed=seed, n=n, max_tokens=max_tokens, structured=structured,
                            **kw)
    got = completions(llm.generate(prompts, params))
    assert len(got) == len(prompts) * n
    return got


def test_unconstrained_output_is_not_json(llm):
    """The constraint is what makes the outputs below valid: without it the model writes prose and markdown."""
    for c in generate(llm, None, max_tokens=30):
        with pytest.raises(ValueError):
            json.loads(c.text)


@pytest.mark.parametrize("temperature,seed,n", DRAWS)
def test_json_schema_output_always_validates(llm, temperature, seed, n):
    for c in generate(llm, Structured(json=SCHEMA), temperature, seed, n):
        assert c.finish_reason == "stop", c.text
        value = json.loads(c.text)
        jsonschema.validate(value, SCHEMA)
        assert list(value) == list(SCHEMA["properties"])  # fields come in the schema's order


@pytest.mark.parametrize("temperature,seed,n", DRAWS[:2])
def test_json_object_parses_as_an_object(llm, temperature, seed, n):
    # Free-form JSON at temperature 1 may still be open at max_tokens; such an output must be a JSON prefix
    # (checked by a matcher of xgrammar's own JSON grammar, compiled apart from the engine's), greedy must close.
    # The closed objects here are 2-25 tokens, and seed 0 leaves one sample open: 60 tokens is that sample's
    # prefix check without 140 more single-row steps.
    outputs = generate(llm, Structured(json_object=True), temperature, seed, n, max_tokens=60)
    for c in outputs:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
            continue
        assert temperature > 0 and c.finish_reason == "length", (c.finish_reason, c.text)
        matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_builtin_json_grammar())
        assert c.text.lstrip().startswith("{") and matcher.accept_string(c.text), c.text
    assert any(c.finish_reason == "stop" for c in outputs)


@pytest.mark.parametrize("temperature,seed,n", DRAWS[:2])
def test_regex_choice_and_grammar_hold(llm, temperature, seed, n):
    regex = r"\d{3}-[a-z]{2,4}"
    for c in generate(llm, Structured(regex=regex), temperature, seed, n, max_tokens=40):
        assert c.finish_reason == "stop" and re.fullmatch(regex, c.text), c.text
    choices = ["yes", "no", "maybe"]
    for c in generate(llm, Structured(choice=choices), temperature, seed, n, max_tokens=40):
        assert c.finish_reason == "stop" and c.text in choices, c.text
    ebnf = 'root ::= count " " fruit\ncount ::= [1-9] [0-9]?\nfruit ::= "apples" | "pears"'
    for c in generate(llm, Structured(grammar=ebnf), temperature, seed, n, max_tokens=40):
        assert c.finish_reason == "stop" and re.fullmatch(r"[1-9][0-9]? (apples|pears)", c.text), c.text


def test_structural_tag_holds(llm):
    inner = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
             "additionalProperties": False}
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<call>", "end": "</call>",
                                                "content": {"type": "json_schema", "json_schema": inner}}}
    for c in generate(llm, Structured(structural_tag=tag), max_tokens=60):
        assert c.finish_reason == "stop", c.text
        body = re.fullmatch(r"<call>(.*)</call>", c.text, re.S)
        assert body, c.text
        jsonschema.validate(json.loads(body.group(1)), inner)


def test_logprobs_are_of_the_model_not_of_the_mask(llm):
    """A constrained row reports the model's own logprobs (vLLM's raw logprobs): its first token's top list is
    the unconstrained request's, finite, whatever the mask allowed."""
    free = generate(llm, None, max_tokens=1, logprobs=5)
    masked = generate(llm, Structured(choice=["yes", "no"]), max_tokens=5, logprobs=5)
    for f, m in zip(free, masked, strict=True):
        assert [t for t, _ in m.logprobs[0].top] == [t for t, _ in f.logprobs[0].top]
        assert [v for _, v in m.logprobs[0].top] == pytest.approx([v for _, v in f.logprobs[0].top], abs=1e-4)
        chosen = m.logprobs[0]
        assert chosen.token_id in m.token_ids[:1] and chosen.logprob < 0 and chosen.logprob > float("-inf")


def test_max_tokens_truncates_with_length_and_stop_strings_end_early(llm):
    structured = Structured(json=SCHEMA)
    full = generate(llm, structured)
    short = generate(llm, structured, max_tokens=5)
    for f, s in zip(full, short, strict=True):
        assert s.finish_reason == "length" and len(s.token_ids) == 5
        assert s.token_ids == f.token_ids[:5]  # the same draws, cut short
    stopped = generate(llm, structured, stop=['"tags"'])
    for f, s in zip(full, stopped, strict=True):
        assert s.finish_reason == "stop" and s.stop_reason == '"tags"'
        assert s.text == f.text[: f.text.index('"tags"')]


def test_bad_constraints_are_value_errors_naming_the_field(llm):
    bad = [(Structured(json={"type": "nonsense"}), "structured_outputs.json"),
           (Structured(regex="(unclosed"), "structured_outputs.regex"),
           (Structured(grammar="root ::= ("), "structured_outputs.grammar")]
    for structured, field in bad:
        with pytest.raises(ValueError) as e:
            llm.generate(PROMPTS, SamplingParams(structured=structured))
        assert e.value.param == field and field in str(e.value)
    assert not llm.engine.requests and not llm.engine.scheduler.waiting  # nothing was added


def test_preempted_requests_still_give_valid_output(smollm2_path):
    """8 blocks of 16 slots hold two of these samples at a time, not eight: sequences are preempted and
    recomputed mid-output, and their matchers carry on from the tokens they kept."""
    tight = LLM(str(smollm2_path), max_model_len=128, num_gpu_blocks_override=8)
    got = generate(tight, Structured(json=SCHEMA), 1.0, 3, 4, max_tokens=100)
    assert tight.engine.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    for c in got:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert tight.engine.block_manager.num_free_blocks == 8 and tight.engine.structured.live == 0


def test_unconstrained_requests_are_unchanged_beside_constrained_ones(tiny_models):
    """Token-exact greedy outputs of unconstrained requests, alone and in a batch with constrained ones (which
    switch the batch to synchronous steps while they sample)."""
    llm = LLM(str(tiny_models["llama"]), max_model_len=256)
    prompts = [list(range(100 + 9 * i, 120 + 13 * i)) for i in range(4)]
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = llm.generate(prompts, plain)
    constrained = [SamplingParams(temperature=t, seed=1, max_tokens=30, structured=s)
                   for t, s in [(0.0, Structured(regex=r"[a-z]{3,40}")), (1.0, Structured(json=SCHEMA))]]
    mixed = llm.generate(prompts[:2] + [[5, 6, 7, 8], [9, 10, 11]] + prompts[2:],
                         [plain, plain, *constrained, plain, plain])
    together = mixed[:2] + mixed[4:]
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]
    text = mixed[2].outputs[0].text
    assert re.fullmatch(r"[a-z]{3,40}", text) or (mixed[2].outputs[0].finish_reason == "length"
                                                  and re.fullmatch(r"[a-z]*", text)), text


def test_a_request_waiting_for_its_grammar_does_not_hold_the_batch(llm):
    engine = llm.engine
    structured = engine.structured_outputs()
    gate = threading.Event()
    real_compile = structured._compile

    def gated_compile(grammar):
        gate.wait(60)
        return real_compile(grammar)

    structured._compile = gated_compile
    try:
        schema = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}},
                  "required": ["id"], "additionalProperties": False}  # not compiled before: the gate holds it
        prompt = llm.encode(PROMPTS[0])
        engine.add_request("waits", prompt, SamplingParams(temperature=0.0, max_tokens=20,
                                                           structured=Structured(json=schema)))
        engine.add_request("runs", prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        waiting = engine.requests["waits"].seqs[0]
        finished = {}
        while "runs" not in finished:
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        assert waiting.status is SequenceStatus.WAITING and waiting.num_output_tokens == 0
        assert len(finished["runs"].outputs[0].token_ids) == 6
    finally:
        gate.set()
        structured._compile = real_compile
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    out = finished["waits"].outputs[0]
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), schema)


def test_abort_frees_the_matcher_and_a_failed_compile_ends_the_request(llm):
    engine = llm.engine
    structured = engine.structured_outputs()
    prompt = llm.encode(PROMPTS[1])
    engine.add_request("aborted", prompt, SamplingParams(n=3, temperature=1.0, max_tokens=50,
                                                         structured=Structured(json=SCHEMA)))
    seqs = engine.requests["aborted"].seqs
    while len(seqs) < 3 or seqs[0].num_output_tokens < 2:
        engine.step()
    assert structured.live == 3 and all(s.grammar is not None for s in seqs)
    engine.abort_request("aborted")
    assert structured.live == 0 and all(s.grammar is None for s in seqs)
    while engine.has_unfinished_requests() or engine.pending is not None:
        engine.step()

    real_compile = structured._compile

    def failing_compile(grammar):
        raise RuntimeError("out of memory while compiling")

    structured._compile = failing_compile
    try:
        params = SamplingParams(max_tokens=8, structured=Structured(regex=r"[0-9]{2,3}x"))  # a fresh compile
        (out,) = llm.generate([prompt], params)
    finally:
        structured._compile = real_compile
    assert out.outputs[0].finish_reason == "abort" and "out of memory" in out.outputs[0].stop_reason
    assert structured.live == 0
    (out,) = llm.generate([prompt], params)  # a failed compile is not cached: the next request compiles again
    assert out.outputs[0].finish_reason == "stop" and re.fullmatch(r"[0-9]{2,3}x", out.outputs[0].text)


def test_grammar_rows_overlap_and_give_the_synchronous_tokens(smollm2_path, llm):
    """Steps with grammar rows overlap: each reads the previous step's tokens after launching its forward and
    before filling its bitmask. Their outputs equal the synchronous engine's, greedy and seeded, token for token."""
    sync = LLM(str(smollm2_path), max_model_len=512, async_scheduling=False)
    engine = llm.engine
    overlapped = []
    real_launch = engine._launch

    def launch(batch, prev, overlap):
        if overlap and prev is not None and any(s.grammar is not None for s in batch.seqs):
            overlapped.append(len(batch.seqs))
        return real_launch(batch, prev, overlap)

    engine._launch = launch
    try:
        # the JSON rows close in 35-40 tokens; the regex and the unconstrained rows run to max_tokens, so theirs is
        # 40: past it they would be the only rows left, stepping alone in both engines
        params = [SamplingParams(temperature=t, seed=i, max_tokens=m, structured=s)
                  for i, (t, s, m) in enumerate([(0.0, Structured(json=SCHEMA), 80), (1.0, Structured(json=SCHEMA), 80),
                                                 (1.0, Structured(regex=r"[a-z]+( [a-z]+){0,6}"), 40),
                                                 (0.0, None, 40)])]
        prompts = PROMPTS + PROMPTS
        got = llm.generate(prompts, params)
    finally:
        engine._launch = real_launch
    assert len(overlapped) > 10, "steps with grammar rows were meant to overlap"
    want = sync.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for out in got[:2]:
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)


async def test_async_engine_streams_constrained_outputs(smollm2_path):
    import asyncio

    from pagefleet.worker.core.config import EngineConfig
    from pagefleet.worker.engine.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine(EngineConfig(model=str(smollm2_path), max_model_len=512))
    try:
        prompt = engine.tokenizer(PROMPTS[0]).input_ids

        async def final(params, request_id):
            last, seen = None, []
            async for out in engine.generate(prompt, params, request_id):
                seen.append(out.outputs[0].text)
                last = out
            assert all(b.startswith(a) for a, b in zip(seen, seen[1:], strict=False))  # streamed text only grows
            return last

        with pytest.raises(ValueError) as e:
            await final(SamplingParams(structured=Structured(json={"type": "nonsense"})), "bad")
        assert e.value.param == "structured_outputs.json"
        outs = await asyncio.gather(
            final(SamplingParams(temperature=0.0, max_tokens=100, structured=Structured(json=SCHEMA)), "json"),
            final(SamplingParams(temperature=1.0, seed=5, max_tokens=20, structured=Structured(choice=["up", "down"])),
                  "choice"),
            final(SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), "plain"))
        jsonschema.validate(json.loads(outs[0].outputs[0].text), SCHEMA)
        assert outs[1].outputs[0].text in ("up", "down") and outs[1].outputs[0].finish_reason == "stop"
        assert len(outs[2].outputs[0].token_ids) == 12
    finally:
        engine.shutdown()
