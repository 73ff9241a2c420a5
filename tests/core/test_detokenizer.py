"""Incremental detokenisation (worker/core/detokenizer.py): the Rust tokenizer's decode, taken where it gives what
tokenizer.decode gives, and the text built token by token equal to one decode of the whole."""

import pytest

from pagefleet.worker.core.detokenizer import text_decoder, update_text
from pagefleet.worker.core.sampling_params import SamplingParams
from pagefleet.worker.core.sequence import Sequence
from pagefleet.worker.models.loader import load_tokenizer

TEXT = "Hello , world . Ünïcödé ✓ 日本語 🚀  two  spaces\nnew line"


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return load_tokenizer(smollm2_path)


def chat_ids(tokenizer):
    chat = [{"role": "user", "content": TEXT}, {"role": "assistant", "content": TEXT}]
    return tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]


@pytest.mark.parametrize("skip", [True, False])
def test_the_fast_decoder_gives_what_tokenizer_decode_gives(tokenizer, skip):
    decode = text_decoder(tokenizer).decode
    ids = chat_ids(tokenizer)  # special tokens included
    for a in range(0, len(ids), 7):
        for b in range(a, len(ids) + 1, 5):
            assert decode(ids[a:b], skip) == tokenizer.decode(ids[a:b], skip_special_tokens=skip)


def test_tokenizers_that_clean_up_spaces_or_are_not_fast_keep_their_own_decode(tokenizer, monkeypatch):
    calls = []
    real = tokenizer.decode
    monkeypatch.setattr(tokenizer, "decode", lambda ids, **kw: calls.append(ids) or real(ids, **kw))
    assert text_decoder(tokenizer).decode([1, 2], True) == real([1, 2], skip_special_tokens=True) and calls == []
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    decoder = text_decoder(tokenizer)
    calls.clear()  # building it decoded each special token once
    assert decoder.decode([1, 2], True) == real([1, 2], skip_special_tokens=True) and calls == [[1, 2]]

    class Slow:  # a tokenizer without a Rust backend
        def decode(self, ids, skip_special_tokens):
            return "|".join(map(str, ids))

    assert text_decoder(Slow()).decode([3, 4], True) == "3|4"


def build_text(decoder, ids, skip=True):
    seq = Sequence("r", 0, [], 0, SamplingParams(skip_special_tokens=skip), None)
    for token in ids:  # multi-byte characters span tokens: a piece waits until they are whole
        seq.token_ids.append(token)
        update_text(decoder, seq)
    return seq.text


def test_text_built_token_by_token_equals_one_decode(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert build_text(text_decoder(tokenizer), ids) == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("skip", [True, False])
def test_a_run_of_skipped_special_tokens_is_not_decoded(tokenizer, skip):
    """EOS after EOS under ignore_eos: with skip_special_tokens each adds nothing and is not decoded (the
    windows would otherwise grow by one token a step); without, each shows as text. Text is as one decode."""
    words = tokenizer.encode(TEXT, add_special_tokens=False)
    eos = tokenizer.eos_token_id
    ids = words[:9] + [eos] * 300 + words[9:]
    decoder = text_decoder(tokenizer)
    assert eos in decoder.skipped
    lengths = []

    def decode(window, skip_special):
        lengths.append(len(window))
        return decoder.decode(window, skip_special)

    text = build_text(type(decoder)(decode, decoder.skipped), ids, skip)
    assert text == tokenizer.decode(ids, skip_special_tokens=skip)
    if skip:  # no decode during the run; the windows hold it for the two tokens after (3 decodes), then move past
        assert len(lengths) == 2 * len(words) and max(lengths) <= 300 + 12
        assert sorted(lengths)[-4] < 20
    else:
        assert max(lengths) < 20


def windows_only(decoder):
    """The same decoder without its Rust stream: the windows' rule in Python."""
    return type(decoder)(decoder.decode, decoder.skipped)


def random_stream(rng, vocab, specials, prompt_len, out_len):
    """Random ids, as a random-weight model draws them: stray byte tokens (ids < 200 hold SmolLM2's bytes) split
    and break characters; special tokens among them."""
    def draw():
        r = rng.random()
        return rng.choice(specials) if r < 0.05 else rng.randrange(200) if r < 0.35 else rng.randrange(vocab)
    return [rng.randrange(vocab) for _ in range(prompt_len)], [draw() for _ in range(out_len)]


def test_the_stream_gives_the_windows_text_token_by_token_and_late(tokenizer):
    """The Rust DecodeStream against the windows' rule on 300 random streams, after each token and in one call at
    the end; each starts at the first output token, or stays with the windows where the prompt's tail ends inside
    a character."""
    import random

    decoder = text_decoder(tokenizer)
    assert decoder.backend is not None  # SmolLM2's fast tokenizer, no space clean-up
    rng = random.Random(7)
    specials = sorted(tokenizer.all_special_ids)
    kinds = set()
    for trial in range(300):
        skip = trial % 2 == 0
        prompt, out = random_stream(rng, len(tokenizer), specials, rng.randrange(1, 24), rng.randrange(1, 48))
        params = SamplingParams(skip_special_tokens=skip)
        texts = []
        for d in (decoder, windows_only(decoder)):
            eager = Sequence("r", 0, list(prompt), len(prompt), params, None)
            for token in out:
                eager.token_ids.append(token)
                update_text(d, eager)
            late = Sequence("r", 0, prompt + out, len(prompt), params, None)
            assert update_text(d, late) == late.text == eager.text
            texts.append(eager.text)
            if d is decoder:
                kinds.add(type(eager.decode_stream).__name__)
        assert texts[0] == texts[1], (prompt, out, skip)
    assert kinds == {"DecodeStream", "bool"}  # both ways were taken


def test_a_stream_that_fails_goes_on_with_the_windows(tokenizer):
    decoder = text_decoder(tokenizer)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    want = Sequence("r", 0, list(ids), 3, SamplingParams(), None)
    update_text(windows_only(decoder), want)

    class Breaks:
        def __init__(self):
            self.inner, self.steps = None, 0

        def step(self, backend, token):
            self.steps += 1
            if self.steps == 6:
                raise Exception("Invalid prefix encountered")
            return self.inner.step(backend, token)

    seq = Sequence("r", 0, list(ids[:3]), 3, SamplingParams(), None)
    seq.token_ids.append(ids[3])
    update_text(decoder, seq)  # the stream starts
    breaks = Breaks()
    breaks.inner, seq.decode_stream = seq.decode_stream, breaks
    for token in ids[4:]:
        seq.token_ids.append(token)
        update_text(decoder, seq)
    assert seq.decode_stream is False and breaks.steps == 6
    assert seq.text == want.text  # plain words: the windows restart on a character boundary


@pytest.mark.parametrize("clean_up", [False, True])  # the Rust stream, and the windows over tokenizer.decode
def test_spaces_between_special_tokens_false_joins_added_tokens(clean_up):
    """vLLM's rule: with special tokens kept, an added token right after another output added token is written as
    its own text, without the space a word-joining decoder puts before it; other tokens keep their spaces."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"t0": 0, "hello": 1, "world": 2}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken("<a>", special=True), AddedToken("<b>", special=True)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=clean_up)
    a, b = tokenizer.convert_tokens_to_ids(["<a>", "<b>"])
    decoder = text_decoder(tokenizer)
    assert (decoder.backend is None) == clean_up

    def text(ids, **params):
        seq = Sequence("r", 0, [1], 1, SamplingParams(**params), None)  # the prompt: "hello"
        for token in ids:
            seq.token_ids.append(token)
            update_text(decoder, seq)
        late = Sequence("r", 0, [1] + ids, 1, SamplingParams(**params), None)
        update_text(decoder, late)  # built at the end, as offline runs do
        assert late.text == seq.text
        return seq.text

    ids = [a, b, 2, b, a]
    assert text(ids, skip_special_tokens=False) == " <a> <b> world <b> <a>"
    assert text(ids, skip_special_tokens=False, spaces_between_special_tokens=False) == " <a><b> world <b><a>"
    assert text(ids, spaces_between_special_tokens=False) == " world"  # skipped: the flag has nothing to join
    assert text([b], skip_special_tokens=False, spaces_between_special_tokens=False) == " <b>"  # after the prompt
