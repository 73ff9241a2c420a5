"""SamplingParams: what one request asks of the sampler, checked before it reaches the engine."""

from __future__ import annotations

import json as _json
from dataclasses import dataclass, field

GREEDY_EPS = 1e-5  # temperatures below this sample greedily
MAX_BAD_WORDS = 128  # vLLM sets no bound; each word is checked against the output every step
MAX_LOGIT_BIAS = 300  # entries per request, as OpenAI allows
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


def _bad(name: str, message: str) -> ValueError:
    err = ValueError(f"{name} {message}")
    err.param = name  # type: ignore[attr-defined]
    return err


def _canonical(value, ordered: bool = False):
    """JSON with its object keys sorted, except a schema's "properties", whose order is the order the fields are
    generated in (a pydantic model's field order)."""
    if isinstance(value, dict):
        items = value.items() if ordered else sorted(value.items())
        return {k: _canonical(v, not ordered and k == "properties") for k, v in items}
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    return value


@dataclass
class StructuredOutputsParams:
    """One constraint on a request's output, exactly one field set: a JSON schema (dict or JSON text), any JSON
    object, a regex, one of a list of strings, an EBNF grammar, or a structural tag (xgrammar's format)."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict | str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        set_fields = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(set_fields) != 1:
            raise _bad("structured_outputs", f"needs exactly one of {', '.join(STRUCTURED_KINDS)}, got "
                       + (", ".join(set_fields) if set_fields else "none"))
        kind = set_fields[0]
        name = f"structured_outputs.{kind}"
        if kind == "json":
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = _json.loads(schema)
                except ValueError as e:
                    raise _bad(name, f"is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise _bad(name, f"must be a JSON schema object, got {type(schema).__name__}")
        elif kind == "json_object":
            if self.json_object is not True:
                raise _bad(name, f"must be a boolean, got {self.json_object!r}")
        elif kind == "choice":
            if not isinstance(self.choice, list) or not self.choice:
                raise _bad(name, "must be a non-empty list of strings")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise _bad(name, "must hold non-empty strings")
        elif kind == "structural_tag":
            if not isinstance(self.structural_tag, (dict, str)):
                raise _bad(name, f"must be an object or JSON text, got {type(self.structural_tag).__name__}")
        elif not isinstance(getattr(self, kind), str) or not getattr(self, kind):
            raise _bad(name, f"must be a non-empty string, got {getattr(self, kind)!r}")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as canonical text: equal constraints give equal text, so the compiled grammar is
        cached by (kind, spec)."""
        value = getattr(self, self.kind)
        if self.kind in ("json", "structural_tag"):
            value = _json.loads(value) if isinstance(value, str) else value
            return _json.dumps(_canonical(value), separators=(",", ":"))
        if self.kind == "choice":
            return _json.dumps(value)
        if self.kind == "json_object":
            return ""
        return value

    def key(self) -> tuple[str, str]:
        return self.kind, self.spec


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's rule (SamplingParams.update_from_tokenizer): each word's tokens as it starts a text, and as it follows a
    space where that is a different word of as many tokens; the sampler bans a sequence's last token wherever the
    output ends with the tokens before it."""
    out: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        out.append(bare)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return out


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # sample i of a request uses seed + i, so it equals an n=1 request with that seed
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # top-k logprobs per generated token (0 = only the chosen token's)
    prompt_logprobs: int | None = None  # top-k logprobs per prompt token (0 = only the prompt token's own); vLLM's
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before penalties and sampling
    allowed_token_ids: list[int] | None = None  # only these may be drawn (vLLM's field); None: every token
    skip_special_tokens: bool = True
    # vLLM's: False writes an added token straight after the added token before it (no space the decoder puts
    # between them); only with skip_special_tokens False, as in vLLM
    spaces_between_special_tokens: bool = True
    # vLLM's: mixed into the first block's hash, so only requests with the same salt share prefix cache entries
    cache_salt: str | None = None
    include_stop_str_in_output: bool = False  # a stop string that ends the output stays in its text (vLLM's field)
    detokenize: bool = True  # False: token ids only (benchmarks); stop strings then need it on
    structured: StructuredOutputsParams | None = None  # output constrained by a grammar (json, regex, choice...)
    # vLLM's bad_words: none of these words is generated, at the output's start or after a space; the engine
    # fills bad_words_token_ids from them with the model's tokenizer (bad_words_token_ids below)
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias) if self.logit_bias else None
        self.allowed_token_ids = list(self.allowed_token_ids) if self.allowed_token_ids is not None else None
        self.bad_words = list(self.bad_words) if self.bad_words else None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def counts_outputs(self) -> bool:
        """The repetition, presence or frequency penalty reads this request's output counts (kept on the device
        by the sampler, from the tokens it draws)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self, vocab_size: int | None = None) -> SamplingParams:
        """Raise ValueError naming the bad field; the server maps it to HTTP 400 with that param. vocab_size:
        also check token ids (logit_bias) against the model's vocabulary."""

        def need(ok: bool, name: str, message: str) -> None:
            if not ok:
                err = ValueError(f"{name} {message}")
                err.param = name  # type: ignore[attr-defined]
                raise err

        need(isinstance(self.n, int) and 1 <= self.n <= 128, "n", f"must be an integer in [1, 128], got {self.n!r}")
        need(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        need(self.cache_salt is None or (isinstance(self.cache_salt, str) and self.cache_salt != ""), "cache_salt",
             f"must be a non-empty string if given, got {self.cache_salt!r}")
        need(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        need(self.top_k == -1 or self.top_k >= 0, "top_k", f"must be -1 (off), 0 (off) or positive, got {self.top_k}")
        need(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        need(self.repetition_penalty > 0.0, "repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        need(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
             f"must be in [-2, 2], got {self.presence_penalty}")
        need(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
             f"must be in [-2, 2], got {self.frequency_penalty}")
        need(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens > 0), "max_tokens",
             f"must be a positive integer, got {self.max_tokens!r}")
        need(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        need(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        need(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", f"must be in [0, 20], got {self.logprobs}")
        scored = self.prompt_logprobs
        need(scored is None or (isinstance(scored, int) and 0 <= scored <= 20), "prompt_logprobs",
             f"must be an integer in [0, 20], got {scored!r}")
        need(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        need(len(self.stop) <= 16, "stop", f"allows at most 16 strings, got {len(self.stop)}")
        need(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
             "must be non-negative integers")
        need(self.detokenize or not self.stop, "stop", "strings need detokenize=True")
        need(self.seed is None or isinstance(self.seed, int), "seed", f"must be an integer, got {self.seed!r}")
        bias = self.logit_bias or {}
        need(len(bias) <= MAX_LOGIT_BIAS, "logit_bias", f"allows at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
        need(all(isinstance(t, int) and t >= 0 and (vocab_size is None or t < vocab_size) for t in bias),
             "logit_bias", "keys must be token ids" + (f" in [0, {vocab_size})" if vocab_size else ""))
        need(all(isinstance(b, (int, float)) and -100.0 <= b <= 100.0 for b in bias.values()), "logit_bias",
             "values must be in [-100, 100]")
        allowed = self.allowed_token_ids
        in_vocab = f" in [0, {vocab_size})" if vocab_size else ""
        need(allowed is None or (len(allowed) > 0 and all(
            isinstance(t, int) and t >= 0 and (vocab_size is None or t < vocab_size) for t in allowed)),
             "allowed_token_ids", "must be a non-empty list of token ids" + in_vocab)
        words = self.bad_words or []
        need(all(isinstance(w, str) and w.strip() for w in words), "bad_words", "must be non-blank strings")
        need(len(words) <= MAX_BAD_WORDS, "bad_words", f"allows at most {MAX_BAD_WORDS} words, got {len(words)}")
        need(all(ids and all(isinstance(t, int) and 0 <= t and (vocab_size is None or t < vocab_size) for t in ids)
                 for ids in self.bad_words_token_ids or []), "bad_words", "must encode to token ids" + in_vocab)
        need(self.structured is None or isinstance(self.structured, StructuredOutputsParams), "structured",
             f"must be StructuredOutputsParams, got {type(self.structured).__name__}")
        return self
