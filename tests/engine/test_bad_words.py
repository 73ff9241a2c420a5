"""vLLM's bad_words on the bundled SmolLM2 (CPU): each word's tokens, bare and after a space, never appear in the
output. A one-token word is banned in the sampler's slot like a token allowed_token_ids leaves out; a word of
several tokens has its last token banned in a step whose output ends with the others. Greedy and seeded samples,
overlapped steps (the engine's default) and forks alike."""

import pytest

from pagefleet.worker import LLM, SamplingParams
from pagefleet.worker.core.sampling_params import bad_words_token_ids

SEA = "Write a short poem about the sea."
FRANCE = "The capital of France is"


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(str(smollm2_path), device="cpu", max_model_len=256)


def contains(output: list[int], ids: list[int]) -> bool:
    return any(output[i:i + len(ids)] == ids for i in range(len(output) - len(ids) + 1))


def test_words_become_token_sequences_as_vllm_makes_them(llm):
    tok = llm.engine.tokenizer
    paris = bad_words_token_ids(tok, ["Paris"])
    assert paris == [tok.encode("Paris", add_special_tokens=False), tok.encode(" Paris", add_special_tokens=False)]
    assert all(len(ids) == 1 for ids in paris) and paris[0] != paris[1]
    # "is a" is two tokens bare and two after a space, with another first token: both forms are kept
    assert len(bad_words_token_ids(tok, ["is a"])) == 2
    # " beautiful" is one token where "beautiful" is two: a different word, so only the bare form is kept
    assert [len(ids) for ids in bad_words_token_ids(tok, ["beautiful"])] == [2]


def test_banned_words_never_appear_greedy_or_sampled(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    free = [o.outputs[0].token_ids for o in llm.generate([FRANCE, SEA], greedy)]
    words = ["Paris", "is a"]
    banned = bad_words_token_ids(llm.engine.tokenizer, words)
    # without the ban the greedy answers hold them: " Paris" first, then " is a" twice in the poem
    assert free[0][0] == banned[1][0] and contains(free[1], banned[3])
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, bad_words=words)
    got = [o.outputs[0].token_ids for o in llm.generate([FRANCE, SEA], params)]
    for out, before in zip(got, free, strict=True):
        assert out != before and not any(contains(out, ids) for ids in banned)
    # the poem runs as before up to the first " is", then takes another token than " a"
    cut = next(i for i in range(len(free[1])) if free[1][i:i + 2] == banned[3]) + 1
    assert got[1][:cut] == free[1][:cut] and got[1][cut] != banned[3][1]
    # seeded samples at temperature 1, four forks of one prompt and a second prompt in the same steps
    sampled = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=24, ignore_eos=True, bad_words=["is", "the sea"])
    banned = bad_words_token_ids(llm.engine.tokenizer, ["is", "the sea"])
    unbanned = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=24, ignore_eos=True)
    assert any(contains(s.token_ids, ids) for r in llm.generate([SEA, FRANCE], unbanned) for s in r.outputs
               for ids in banned)  # the same draws without the ban say "is" somewhere
    for request in llm.generate([SEA, FRANCE], sampled):
        for sample in request.outputs:
            assert not any(contains(sample.token_ids, ids) for ids in banned), sample.text
    assert llm.engine.runner.sampler.state.bad_words == {}  # every sequence left the sampler when it finished


def test_blank_words_are_refused(llm):
    with pytest.raises(ValueError, match="bad_words must be non-blank strings"):
        llm.generate([FRANCE], SamplingParams(max_tokens=2, bad_words=["  "]))
    with pytest.raises(ValueError, match="bad_words allows at most 128 words"):
        llm.generate([FRANCE], SamplingParams(max_tokens=2, bad_words=[f"w{i}" for i in range(129)]))
