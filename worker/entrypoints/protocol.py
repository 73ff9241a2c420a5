"""OpenAI wire format: request models (pydantic, so FastAPI publishes an OpenAPI schema), the error body,
and the mapping from a request onto the engine's SamplingParams.

Pydantic checks types only; value ranges are checked by SamplingParams.validate() and by
`sampling_params()` here, so every rule lives in one place and comes back as a 400 naming its param.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from pagefleet.worker.core.sampling_params import SamplingParams

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_LOGPROBS = 20


class APIError(Exception):
    """An error that becomes an OpenAI error body; raised anywhere below the route handlers."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 429, 503)
}


class _Request(BaseModel):
    # Unknown fields that change nothing generated (user, metadata, ...) are accepted and ignored, as vLLM
    # does; NaN / Infinity (which Python's json parser accepts) never reach the sampler.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False


def _off(*values):
    """A refused field's values that ask for nothing (None always does)."""
    return lambda v, req: v in values


# Fields of OpenAI's chat / completions requests (and vLLM's extensions) that change what is generated and that
# we do not implement: refused with a 400 naming them unless they ask for nothing. Fields that change nothing
# generated (user, metadata, store, service_tier, parallel_tool_calls, prompt_cache_key ...) stay accepted.
UNSUPPORTED: dict[str, Any] = {
    "response_format": lambda v, req: isinstance(v, dict) and v.get("type") == "text" and len(v) == 1,
    "best_of": lambda v, req: v == req.n,  # chat only: completions declare it (and the route checks it)
    "tools": _off([]), "tool_choice": _off("none"), "functions": _off([]), "function_call": _off("none"),
    "prediction": _off(), "audio": _off(), "modalities": _off(["text"]), "reasoning_effort": _off(),
    "web_search_options": _off(), "verbosity": _off(),
    # vLLM's extensions
    "use_beam_search": _off(False), "length_penalty": _off(1.0), "bad_words": _off([]),
    "allowed_token_ids": _off(), "prompt_logprobs": _off(), "logits_processors": _off([]),
    "guided_json": _off(), "guided_regex": _off(), "guided_choice": _off(), "guided_grammar": _off(),
    "structured_outputs": _off(), "include_stop_str_in_output": _off(False),
    "spaces_between_special_tokens": _off(True), "truncate_prompt_tokens": _off(),
    "echo": _off(False), "continue_final_message": _off(False), "add_generation_prompt": _off(True),
    "chat_template": _off(), "chat_template_kwargs": _off({}), "documents": _off(),  # chat's prompt
}


class _SamplingRequest(_Request):
    _unsupported: dict[str, Any] = PrivateAttr(default_factory=dict)  # the UNSUPPORTED fields the body set

    @model_validator(mode="wrap")
    @classmethod
    def _keep_unsupported(cls, data: Any, handler):
        """Extra fields stay out of the model (and of its schema); those in UNSUPPORTED are kept aside."""
        request = handler(data)
        if isinstance(data, dict):
            request._unsupported = {k: data[k] for k in data.keys() & UNSUPPORTED.keys()}
        return request

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None  # token id (a JSON key, so a string) -> bias in [-100, 100]
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Chat messages as the tokenizer's chat template wants them: content flattened to text."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"messages[{i}].content: only text parts are supported",
                                   param="messages")
                texts.append(part["text"])
            content = "".join(texts)
        d: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


_PARAM_RE = re.compile(r"^([a-z_]+)\b")


def sampling_params(req: _SamplingRequest, max_tokens: int | None, logprobs: int | None,
                    max_num_seqs: int, vocab_size: int) -> SamplingParams:
    """Build and validate the engine's SamplingParams; every rejection is a 400 with its param."""
    for name, value in sorted(req._unsupported.items()):
        if value is not None and not UNSUPPORTED[name](value, req):
            raise APIError(400, f"{name} is not supported by this server; leave it out", param=name)
    logit_bias = None
    if req.logit_bias:
        try:
            logit_bias = {int(t): b for t, b in req.logit_bias.items()}
        except ValueError:
            raise APIError(400, "logit_bias keys must be token ids", param="logit_bias") from None
    if not 1 <= req.n <= max_num_seqs:
        raise APIError(400, f"n must be between 1 and max_num_seqs ({max_num_seqs}), got {req.n}", param="n")
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise APIError(400, f"logprobs must be between 0 and {MAX_LOGPROBS}, got {logprobs}", param="logprobs")
    stop_token_ids = req.stop_token_ids or []
    if any(not 0 <= t < vocab_size for t in stop_token_ids):
        raise APIError(400, f"stop_token_ids must be token ids in [0, {vocab_size})", param="stop_token_ids")
    if req.min_tokens < 0 or (max_tokens is not None and req.min_tokens > max_tokens):
        raise APIError(400, f"min_tokens must be in [0, max_tokens], got {req.min_tokens}", param="min_tokens")
    top_k = req.top_k if req.top_k is not None else -1
    if top_k == 0 or top_k >= vocab_size:  # vLLM's convention: 0 and "all of the vocabulary" both mean off
        top_k = -1
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(s == "" for s in stop):
        raise APIError(400, "stop strings must not be empty", param="stop")
    params = SamplingParams(
        n=req.n,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=top_k,
        min_p=0.0 if req.min_p is None else req.min_p,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        presence_penalty=0.0 if req.presence_penalty is None else req.presence_penalty,
        frequency_penalty=0.0 if req.frequency_penalty is None else req.frequency_penalty,
        seed=req.seed,
        stop=stop,
        stop_token_ids=stop_token_ids,
        ignore_eos=req.ignore_eos,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        logprobs=logprobs,
        logit_bias=logit_bias,
        skip_special_tokens=req.skip_special_tokens,
    )
    try:
        params.validate(vocab_size)
    except ValueError as e:
        m = _PARAM_RE.match(str(e))
        param = getattr(e, "param", None) or (m.group(1) if m else None)
        raise APIError(400, str(e), param=param) from None
    return params


# ---- responses: plain dicts (cheaper than models on the per-token path) ----

def _lp(x: float) -> float:
    # JSON has no -inf / NaN; vLLM clamps the same way.
    return -9999.0 if x != x or x < -9999.0 else float(x)


def completion_logprobs(entries: list, decode, text_offset: int) -> dict:
    """The legacy completions shape: parallel lists, top_logprobs as {token text: logprob}."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for e in entries:
        text = decode(e.token_id)
        tokens.append(text)
        token_logprobs.append(_lp(e.logprob))
        top = {decode(t): _lp(lp) for t, lp in e.top}
        top.setdefault(text, _lp(e.logprob))
        tops.append(top)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(entries: list, decode) -> dict:
    def item(token_id, logprob):
        text = decode(token_id)
        return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries]}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
