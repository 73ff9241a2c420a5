"""Structured outputs: grammars compiled off the step loop and cached by constraint, one matcher per sequence,
and each step's packed token bitmask for the rows that have a grammar (xgrammar).

A request's constraint is parsed into a grammar when the request is checked (tokenizer-free and quick, so a
bad schema, regex or EBNF is a ValueError naming its field), then compiled against the vocabulary on a
thread pool; its sequence waits in the scheduler until the compile is done (GrammarState.ready) without
holding the batch. The vocabulary's tokenizer info is built once, on the pool, at the first request. A
sequence's matcher follows its output tokens: the sampler fills the bitmask from it before each step, the
step accepts the sampled token after it, and the matcher's terminated state ends the sequence. A preempted
sequence keeps its tokens and its matcher (recompute re-runs only the K/V), so nothing needs rebuilding;
`rebuild` replays the output tokens into a fresh matcher and lands in the same state. JSON is generated
without free whitespace (any_whitespace=False), so a small model cannot loop on blanks.

Jump-forward (--structured-outputs-jump-forward): where the grammar leaves only one text to come (a JSON key with
its quotes and colon, the rest of an enum value), `GrammarState.jump_forward` turns it into tokens by longest
match over the vocabulary (`ForcedText`), the matcher accepts them, and the engine appends them to the output at
once; the next step runs them through the model as one chunk. The last token is left to the model where a longer
vocabulary token starts with it, so the model's own token can merge it with the free text after it.

With a reasoning model (the server's --reasoning-parser) the constraint applies after the reasoning, as in
vLLM: a request's AfterReasoning constraint names the reasoning end token (`</think>`), and its sequence's grammar
stays inactive (no mask row, tokens not fed to the matcher) until that token is sampled; from the next token on
the grammar holds. The gate is part of the state, so forks, kept matchers and `rebuild` carry it the same way.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields

import numpy as np
import xgrammar as xgr

from pagefleet.worker.core.sampling_params import StructuredOutputsParams

CACHE_SIZE = 256  # compiled grammars kept (by kind and spec); a schema's compile is reused by every request
_XGR_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s*\S+?:\d+:\s*")  # "[08:06:48] /project/cpp/x.cc:94: "


def _reason(e: Exception) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return _XGR_PREFIX.sub("", text)


def parse(structured: StructuredOutputsParams) -> xgr.Grammar:
    """The constraint as a grammar (no tokenizer needed); ValueError naming the field when it is not one."""
    kind, spec = structured.kind, structured.spec
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(spec, any_whitespace=False)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(spec)
        if kind == "choice":
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                  for c in structured.choice))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(spec)
        return xgr.Grammar.from_structural_tag(spec)
    except (RuntimeError, ValueError, TypeError) as e:
        err = ValueError(f"structured_outputs.{kind} is not a valid {_NAMES[kind]}: {_reason(e)}")
        err.param = f"structured_outputs.{kind}"  # type: ignore[attr-defined]
        raise err from None


_NAMES = {"json": "JSON schema", "json_object": "JSON object", "regex": "regular expression",
          "choice": "list of choices", "grammar": "EBNF grammar", "structural_tag": "structural tag"}


@dataclass
class AfterReasoning(StructuredOutputsParams):
    """A constraint that applies once the reasoning is over: from the token after `reasoning_end_token_id`."""

    reasoning_end_token_id: int | None = None  # required: the default only follows the fields before it

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.reasoning_end_token_id, int) or self.reasoning_end_token_id < 0:
            raise ValueError(f"reasoning_end_token_id must be a token id, got {self.reasoning_end_token_id!r}")


def after_reasoning(structured: StructuredOutputsParams, end_token_id: int) -> AfterReasoning:
    """The same constraint, inactive until end_token_id is generated (its compile is shared: same key)."""
    base = {f.name: getattr(structured, f.name) for f in fields(StructuredOutputsParams)}
    return AfterReasoning(**base, reasoning_end_token_id=end_token_id)


class GrammarState:
    """One sequence's grammar: the compile's future, then (once it is done) its matcher; with a reasoning gate,
    inactive until the reasoning end token."""

    __slots__ = ("future", "stop_token_ids", "_matcher", "reasoning_end", "waiting")

    def __init__(self, future: Future, stop_token_ids: list[int], matcher: xgr.GrammarMatcher | None = None,
                 reasoning_end: int | None = None, waiting: bool | None = None):
        """reasoning_end: the token that ends the reasoning (None: no gate); waiting: the gate is still shut
        (default: shut when there is a gate)."""
        self.future = future
        self.stop_token_ids = stop_token_ids
        self._matcher = matcher
        self.reasoning_end = reasoning_end
        self.waiting = reasoning_end is not None if waiting is None else waiting

    @property
    def active(self) -> bool:
        """The grammar constrains the next token (its row gets a mask)."""
        return not self.waiting

    @property
    def ready(self) -> bool:
        """The compile is done (or failed: `error` says so); the scheduler admits the sequence from then on."""
        return self.future.done()

    @property
    def error(self) -> str | None:
        e = self.future.exception() if self.future.done() else None
        return None if e is None else _reason(e)

    @property
    def matcher(self) -> xgr.GrammarMatcher:
        if self._matcher is None:
            self._matcher = xgr.GrammarMatcher(self.future.result(), override_stop_tokens=self.stop_token_ids)
        return self._matcher

    def accept(self, token: int) -> bool:
        """The sampled token moves the matcher on; False when the grammar does not allow it. While the gate is
        shut every token is free, and the reasoning end token opens it (the grammar starts at the next one)."""
        if self.waiting:
            if token == self.reasoning_end:
                self.waiting = False
            return True
        return self.matcher.accept_token(token)

    @property
    def terminated(self) -> bool:
        return not self.waiting and self._matcher is not None and self._matcher.is_terminated()

    def jump_forward(self, forced: ForcedText, limit: int) -> list[int]:
        """The tokens the grammar forces next (at most `limit`), accepted by the matcher: [] where nothing is forced
        or the reasoning gate is shut."""
        if self.waiting or limit <= 0:
            return []
        matcher = self.matcher
        text = matcher.find_jump_forward_string()
        if not text:
            return []
        tokens = forced.split(text.encode(), limit)
        for i, token in enumerate(tokens):
            if not matcher.accept_token(token):  # a piece the grammar splits otherwise: the model goes on from here
                return tokens[:i]
        return tokens

    def fork(self) -> GrammarState:
        """A sibling sample's own state, where this one is now."""
        return GrammarState(self.future, self.stop_token_ids,
                            self._matcher.fork() if self._matcher is not None else None,
                            self.reasoning_end, self.waiting)

    def rebuild(self, output_token_ids: list[int]) -> GrammarState:
        """A fresh matcher fed the output tokens again, through the gate as they were: the state a kept matcher
        has after them."""
        state = GrammarState(self.future, self.stop_token_ids, reasoning_end=self.reasoning_end)
        for token in output_token_ids:
            if not state.accept(token):
                raise ValueError(f"token {token} is not allowed by the grammar at this point")
        return state


class ForcedText:
    """The vocabulary's ordinary tokens by their bytes, for splitting a grammar's forced text into tokens."""

    def __init__(self, info: xgr.TokenizerInfo):
        special = set(info.special_token_ids) | set(info.stop_token_ids)
        ids: dict[bytes, int] = {}
        for i, piece in enumerate(info.decoded_vocab):
            if piece and i not in special and piece not in ids:  # the lowest id of pieces spelt alike
                ids[piece] = i
        self.ids = ids
        self.longest = max(map(len, ids), default=0)
        pieces = sorted(ids)  # a piece is a strict prefix of another exactly when the one sorted after it is
        self.extendable = {a for a, b in zip(pieces, pieces[1:]) if b.startswith(a)}

    def split(self, text: bytes, limit: int) -> list[int]:
        """Up to `limit` tokens spelling text from its start, longest piece first. The token that ends the text
        is dropped where a longer piece extends it: what follows the text is the model's, and its own token there
        may take both."""
        tokens: list[int] = []
        at, end, ids = 0, len(text), self.ids
        while at < end and len(tokens) <= limit:
            for stop in range(min(end, at + self.longest), at, -1):
                token = ids.get(text[at:stop])
                if token is not None:
                    break
            else:
                break  # no piece spells the next byte
            tokens.append(token)
            last, at = text[at:stop], stop
        if tokens and at == end and last in self.extendable:
            tokens.pop()
        return tokens[:limit]


class StructuredOutputs:
    """The engine's grammar compiler (one pool, one cache) and the step's bitmask for the sampler."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], max_workers: int = 2,
                 fill_threads: int | None = None, jump_forward: bool = False):
        """vocab_size: the width of the model's logits rows, which may exceed the tokenizer's vocabulary; the
        ids past the tokenizer's are never allowed. jump_forward: build `forced` for GrammarState.jump_forward."""
        self.jump_forward = jump_forward
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.bitmask_width = -(-vocab_size // 32)
        self.pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar")
        self._compiler = self.pool.submit(self._make_compiler, tokenizer)
        self._lock = threading.Lock()  # requests are checked on the server's thread, added on the engine's
        self._parsed: OrderedDict[tuple[str, str], xgr.Grammar] = OrderedDict()
        self._compiled: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._batch = xgr.BatchGrammarMatcher(fill_threads or max(1, min(8, (os.cpu_count() or 2) // 2)))
        self._buffer = np.zeros((0, self.bitmask_width), dtype=np.int32)
        self.live = 0  # sequences holding a grammar state (the engine counts): 0 makes `bitmask` free
        self.forced: ForcedText | None = None  # the vocabulary for jump-forward, built with the compiler

    def _make_compiler(self, tokenizer) -> xgr.GrammarCompiler:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                  stop_token_ids=self.stop_token_ids)
        if self.jump_forward:
            self.forced = ForcedText(info)  # before any grammar compiles, so before any matcher exists
        return xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)  # cached here, by constraint

    def check(self, structured: StructuredOutputsParams) -> xgr.Grammar:
        """Parse (or find) the constraint's grammar; ValueError naming the field for a bad one."""
        key = structured.key()
        with self._lock:
            grammar = self._parsed.get(key)
            if grammar is not None:
                self._parsed.move_to_end(key)
                return grammar
        grammar = parse(structured)
        with self._lock:
            self._parsed[key] = grammar
            while len(self._parsed) > CACHE_SIZE:
                self._parsed.popitem(last=False)
        return grammar

    def state(self, structured: StructuredOutputsParams) -> GrammarState:
        """A new sequence's grammar state; its compile starts now on the pool unless cached."""
        key = structured.key()
        with self._lock:
            future = self._compiled.get(key)
            if future is not None and future.done() and future.exception() is not None:
                future = None  # a failed compile is not kept: the next request tries again
            if future is not None:
                self._compiled.move_to_end(key)
        if future is None:
            grammar = self.check(structured)
            future = self.pool.submit(self._compile, grammar)
            with self._lock:
                self._compiled[key] = future
                while len(self._compiled) > CACHE_SIZE:
                    self._compiled.popitem(last=False)
        return GrammarState(future, self.stop_token_ids,
                            reasoning_end=getattr(structured, "reasoning_end_token_id", None))

    def _compile(self, grammar: xgr.Grammar) -> xgr.CompiledGrammar:
        return self._compiler.result().compile_grammar(grammar)

    def bitmask(self, seqs: list) -> tuple[np.ndarray, np.ndarray] | None:
        """The step's constrained rows and their bitmasks (int32 [G, ceil(V/32)], bit t of a row set where
        token t is allowed), filled from the matchers in parallel; None when no row has an active grammar (one
        still behind its reasoning gate gets no row)."""
        if not self.live:  # no structured request in flight: unconstrained steps skip the scan
            return None
        rows = [i for i, seq in enumerate(seqs) if seq.grammar is not None and seq.grammar.active]
        if not rows:
            return None
        if len(self._buffer) < len(rows):
            self._buffer = np.zeros((max(len(rows), 2 * len(self._buffer)), self.bitmask_width), dtype=np.int32)
        bitmask = self._buffer[: len(rows)]
        self._batch.batch_fill_next_token_bitmask([seqs[i].grammar.matcher for i in rows], bitmask)
        return np.asarray(rows, dtype=np.int32), bitmask

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
