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
