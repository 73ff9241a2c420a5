"""Incremental detokenisation and stop strings, across token boundaries.

Decoding a window of a few tokens before the new ones keeps leading spaces and multi-byte characters
right (the same trick vLLM and TGI use); a stop string is searched only where new text could complete it.
With a fast tokenizer the windows move inside the Rust tokenizer (tokenizers' DecodeStream, one call a token
instead of two decodes and their slices in Python), started where the windows start: the same text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tokenizers.decoders import DecodeStream

from pagefleet.worker.core.sequence import Sequence

Decode = Callable[[list[int], bool], str]  # (token ids, skip special tokens) -> text


@dataclass(frozen=True)
class TextDecoder:
    decode: Decode
    # special tokens that decode to nothing when skipped: update_text does not decode them at all. A model
    # that keeps emitting EOS under ignore_eos would otherwise lengthen both decode windows by a token a
    # step, since no text comes to move them on.
    skipped: frozenset[int] = frozenset()
    backend: object | None = None  # the Rust tokenizer where decode is its decode: sequences step a DecodeStream
    # added tokens (special or not) by id -> their text: spaces_between_special_tokens=False writes one straight
    # after an added token before it, as vLLM's fast detokenizer does
    added: dict[int, str] = field(default_factory=dict)


def text_decoder(tokenizer) -> TextDecoder:
    """tokenizer.decode, or straight the Rust tokenizer's decode where that is all tokenizer.decode would run
    (a fast tokenizer that cleans up no spaces). update_text took 1.7 against 5.4 us a token on the CPU machine
    (SmolLM2's tokenizer; 1.3 against 4.7 with the benchmarks' word-level one), paid for every sequence in
    every step, in the engine's thread: at 64 streams 0.35 ms of each step before, 0.11 ms after."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        backend = None

        def decode(ids, skip):
            return tokenizer.decode(ids, skip_special_tokens=skip)
    else:
        def decode(ids, skip):
            return backend.decode(ids, skip_special_tokens=skip)
    specials = getattr(tokenizer, "all_special_ids", None) or []
    skipped = frozenset(i for i in specials if decode([i], True) == "")
    added = {i: t.content for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()}
    return TextDecoder(decode, skipped, backend, added)


def _joined_added(decoder: TextDecoder, seq: Sequence, k: int) -> str | None:
    """Token k's own text where it is an added token right after an output token that is one too and the request
    asks for no spaces between them (spaces_between_special_tokens False, special tokens kept); else None."""
    params, ids = seq.params, seq.token_ids
    if params.spaces_between_special_tokens or params.skip_special_tokens or k <= seq.num_prompt_tokens:
        return None
    if ids[k - 1] in decoder.added:
        return decoder.added.get(ids[k])
    return None


def update_text(decoder: TextDecoder, seq: Sequence, end: int | None = None) -> str:
    """Append the text of the tokens before `end` (default: all) that have none yet to seq.text, one token at a
    time as they came, so a late call gives the text the calls after each token would have; returns the new text.
    (The engine calls this after each token, or, where nothing reads the text before the end, once at the end.)"""
    ids = seq.token_ids
    end = len(ids) if end is None else end
    if decoder.backend is not None and seq.decode_stream is not False:
        return _stream(decoder, seq, ids, end)
    if seq.num_detokenized + 1 == end:  # one new token: the call after each
        seq.num_detokenized = end
        return _advance(decoder, seq, ids, end)
    pieces = []
    for k in range(seq.num_detokenized + 1, end + 1):
        seq.num_detokenized = k
        pieces.append(_advance(decoder, seq, ids, k))
    return "".join(pieces)


def _stream(decoder: TextDecoder, seq: Sequence, ids: list[int], end: int) -> str:
    """update_text through the sequence's DecodeStream: the windows' rule, stepped in Rust. On the CPU machine
    (SmolLM2's tokenizer, 256 streams of 128 random tokens) 1.27 against 2.81 us a token built at the end
    (offline), 2.18 against 3.29 after each token (a server); identical text over 3,000 random streams with
    special and byte tokens (tests/core/test_detokenizer.py holds 300 of them)."""
    skip = seq.params.skip_special_tokens
    stream = seq.decode_stream
    if stream is None:  # its first output token: the stream starts where the windows start
        stream = seq.decode_stream = _new_stream(decoder, ids[seq.prefix_offset : seq.read_offset], skip)
        if stream is False:
            return update_text(decoder, seq, end)
    backend, skipped = decoder.backend, decoder.skipped
    k = seq.num_detokenized
    if k + 1 == end:  # one new token: the call after each (a server's every step), kept short
        token = ids[k]
        if skip and token in skipped:
            seq.num_detokenized = end
            return ""
        try:
            piece = stream.step(backend, token)
        except Exception:  # as below
            return _windows_from(decoder, seq, k, end, "")
        seq.num_detokenized = end
        if (joined := _joined_added(decoder, seq, k)) is not None:
            piece = joined
        if piece:
            seq.text += piece
            return piece
        return ""
    pieces = []
    for k in range(seq.num_detokenized, end):
        token = ids[k]
        if skip and token in skipped:
            continue  # decodes to nothing (TextDecoder.skipped)
        try:
            piece = stream.step(backend, token)
        except Exception:  # the new window's text does not extend the last one's (invalid UTF-8)
            return _windows_from(decoder, seq, k, end, "".join(pieces))
        if (joined := _joined_added(decoder, seq, k)) is not None:
            piece = joined
        if piece:
            pieces.append(piece)
    seq.num_detokenized = max(seq.num_detokenized, end)
    text = "".join(pieces)
    seq.text += text
    return text


def _windows_from(decoder: TextDecoder, seq: Sequence, k: int, end: int, done: str) -> str:
    """The stream failed at token k (its text before k is `done`): go on with the windows' rule from there, as
    vLLM resets its stream."""
    seq.decode_stream = False
    seq.prefix_offset, seq.read_offset, seq.num_detokenized = max(k - 5, 0), k, k
    seq.text += done
    return done + update_text(decoder, seq, end)


def _new_stream(decoder: TextDecoder, tail: list[int], skip: bool):
    """A DecodeStream that has read `tail` (the prompt's last tokens), or False where the windows' rule must
    stay in Python: a tail whose text ends inside a character (the stream would emit the tail's text again),
    or a tokenizers release whose DecodeStream takes no ids."""
    if decoder.backend.decode(tail, skip_special_tokens=skip).endswith("\ufffd"):
        return False
    try:
        return DecodeStream(ids=tail, skip_special_tokens=skip)
    except TypeError:
        return False


def _advance(decoder: TextDecoder, seq: Sequence, ids: list[int], end: int) -> str:
    """The text that token end - 1 completes, appended to seq.text; the decode windows move past it."""
    skip = seq.params.skip_special_tokens
    if skip and ids[end - 1] in decoder.skipped:
        return ""  # what decoding would conclude, without the decodes
    prefix_text = decoder.decode(ids[seq.prefix_offset : seq.read_offset], skip)
    new_text = decoder.decode(ids[seq.prefix_offset : end], skip)
    if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
        return ""  # an incomplete UTF-8 character: wait for the next token
    piece = new_text[len(prefix_text) :]
    if (joined := _joined_added(decoder, seq, end - 1)) is not None:
        piece = joined
    seq.prefix_offset, seq.read_offset = seq.read_offset, end
    seq.text += piece
    return piece


def find_stop(seq: Sequence, piece: str) -> str | None:
    """If a stop string now appears, cut the text before it (after it with include_stop_str_in_output) and
    return it."""
    if not piece:
        return None
    for stop in seq.params.stop:
        # only where the new piece could have completed it
        start = max(len(seq.text) - len(piece) - len(stop) + 1, 0)
        at = seq.text.find(stop, start)
        if at != -1:
            seq.text = seq.text[: at + len(stop) if seq.params.include_stop_str_in_output else at]
            return stop
    return None


def visible_text(seq: Sequence) -> str:
    """What may be shown while running: hold back a tail that could still become a stop string."""
    if seq.is_finished or not seq.params.stop:
        return seq.text
    text, hold = seq.text, 0
    for stop in seq.params.stop:
        for k in range(min(len(stop) - 1, len(text)), hold, -1):  # the longest tail that starts a stop string
            if text.endswith(stop[:k]):
                hold = k
                break
    return text[: len(text) - hold]
