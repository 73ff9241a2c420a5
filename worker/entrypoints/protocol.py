"""OpenAI wire format: request models (pydantic, so FastAPI publishes an OpenAPI schema), the error body,
and the mapping from a request onto the engine's SamplingParams.

Pydantic checks types only; value ranges are checked by SamplingParams.validate() and by
`sampling_params()` here, so every rule lives in one place and comes back as a 400 naming its param.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from pagefleet.worker.core.sampling_params import STRUCTURED_KINDS, SamplingParams, StructuredOutputsParams

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
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, each chunk's choice's usage so far


def _off(*values):
    """A refused field's values that ask for nothing (None always does)."""
    return lambda v, req: v in values


# Fields of OpenAI's chat / completions requests (and vLLM's extensions) that change what is generated and that
# we do not implement: refused with a 400 naming them unless they ask for nothing. Fields that change nothing
# generated (user, metadata, store, service_tier, parallel_tool_calls, prompt_cache_key ...) stay accepted.
UNSUPPORTED: dict[str, Any] = {
    "best_of": lambda v, req: v == req.n,  # chat only: completions declare it (and the route checks it)
    "functions": _off([]), "function_call": _off("none"),
    "prediction": _off(), "audio": _off(), "modalities": _off(["text"]), "reasoning_effort": _off(),
    "web_search_options": _off(), "verbosity": _off(),
    # vLLM's extensions
    "logits_processors": _off([]),
    "continue_final_message": _off(False), "add_generation_prompt": _off(True),
    "chat_template": _off(), "chat_template_kwargs": _off({}), "documents": _off(),  # chat's prompt (a chat field)
    "prompt_embeds": _off(), "priority": _off(0), "logprob_token_ids": _off([]), "return_token_offsets": _off(False),
    "return_prompt_text": _off(False), "kv_transfer_params": _off({}), "ec_transfer_params": _off({}),
    "vllm_xargs": _off({}), "repetition_detection": _off(), "thinking_token_budget": _off(),
    "return_assistant_tokens_mask": _off(False),  # chat's
    "mm_processor_kwargs": _off({}), "media_io_kwargs": _off({}),  # a text-only server
}


class _SamplingRequest(_Request):
    _unsupported: dict[str, Any] = PrivateAttr(default_factory=dict)  # the UNSUPPORTED fields the body set

    @model_validator(mode="wrap")
    @classmethod
    def _keep_unsupported(cls, data: Any, handler):
        """Extra fields stay out of the model (and of its schema); those in UNSUPPORTED are kept aside."""
        request = handler(data)
        if isinstance(data, dict):  # a field the request type declares is its route's to honour or refuse
            request._unsupported = {k: data[k] for k in data.keys() & UNSUPPORTED.keys() if k not in cls.model_fields}
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
    bad_words: list[str] | None = None  # vLLM's: never generated, at the output's start or after a space
    stop_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None  # token id (a JSON key, so a string) -> bias in [-100, 100]
    allowed_token_ids: list[int] | None = None  # vLLM's: only these may be generated
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and the top k there (not streamed)
    # vLLM's: keep this many prompt tokens (-1: as many as fit beside max_tokens), the last ones unless
    # truncation_side is "right"
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # vLLM's (SamplingParams)
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's: the choices' token ids and the prompt's beside the text (streamed: each chunk's new ones, the prompt's
    # in a choice's first chunk); logprobs' tokens written "token_id:N"; a salt that keeps this request's prefix
    # cache entries apart from everyone else's (tenants that must not time each other's prompts)
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    cache_salt: str | None = None
    # vLLM's beam search (entrypoints/beam_api.py): n beams, finished ones ranked by logprob / length ** penalty
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # Output constraints (structured_params below): OpenAI's response_format, vLLM's structured_outputs and the
    # older guided_* fields; loosely typed here so that every rule's 400 names its exact field.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


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
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn's answer to one of them


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat fields for the prompt: the template's generation prompt, continuing the final message instead,
    # and the template's own switches (chat_template.py)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # used with --trust-request-chat-template, a 400 otherwise
    # vLLM's: false leaves the reasoning (--reasoning-parser) out of the answer; generation is the same
    include_reasoning: bool = True
    # vLLM's: retrieval documents (title / text dicts) for a template that reads them, a 400 for one that does not
    documents: list[dict[str, str]] | None = None
    # vLLM's: the reply's content starts with the last message's where that message has the reply's role (the
    # assistant's, or with add_generation_prompt false the last message's own): a continued turn comes back whole
    echo: bool = False


def chat_echo(body: ChatCompletionRequest) -> str:
    """The text a chat reply's content starts with under `echo` (vLLM's rule): the last message's content where
    its role is the reply's, else nothing."""
    if not body.echo or not body.messages:
        return ""
    role = "assistant" if body.add_generation_prompt else body.messages[-1].role
    last = message_dicts(body.messages[-1:])[0]
    return last["content"] if last["role"] == role else ""


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # used with --trust-request-chat-template, a 400 otherwise


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
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            d["tool_calls"] = [_message_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(m.tool_calls)]
        out.append(d)
    return out


def _message_call(call: dict, where: str) -> dict:
    """An earlier turn's call, its arguments as an object: chat templates write them with `tojson`."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise APIError(400, f"{where}.function.name must be a string", param="messages")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except ValueError:
            raise APIError(400, f"{where}.function.arguments is not JSON", param="messages") from None
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}


# ---- output constraints and tools ----

# vLLM's structured_outputs options that tune a constraint without being one: accepted, the defaults kept.
_STRUCTURED_OPTIONS = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                       "whitespace_pattern", "backend")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _constraint(kwargs: dict, field: str, param_of) -> StructuredOutputsParams:
    """StructuredOutputsParams, or a 400 naming the request field (param_of maps the kind to it)."""
    try:
        structured = StructuredOutputsParams(**kwargs)
    except ValueError as e:
        param = getattr(e, "param", "structured_outputs")
        kind = param.partition(".")[2] or None
        raise APIError(400, str(e).replace(param, param_of(kind) if kind else field, 1),
                       param=param_of(kind) if kind else field) from None
    check_grammar(structured, param_of(structured.kind))
    return structured


_CHECKED: dict[tuple[str, str], str | None] = {}  # constraint key -> why it is bad (None: good), bounded
_CHECKED_SIZE = 256


def check_grammar(structured: StructuredOutputsParams, param: str) -> None:
    """Parse the constraint now (no tokenizer, under a millisecond for common schemas), so a bad schema, regex or
    grammar is a 400 before a stream's status line is sent; verdicts are kept, so a benchmark's one schema is
    parsed once here."""
    from pagefleet.worker.engine.structured_output import parse

    key = structured.key()
    if key not in _CHECKED:
        try:
            parse(structured)
            _CHECKED[key] = None
        except ValueError as e:
            _CHECKED[key] = str(e).split(" is not a valid ", 1)[-1]
        if len(_CHECKED) > _CHECKED_SIZE:
            del _CHECKED[next(iter(_CHECKED))]
    reason = _CHECKED[key]
    if reason is not None:
        raise APIError(400, f"{param} is not a valid {reason}", param=param)


def _response_format(rf: dict) -> StructuredOutputsParams | None:
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _constraint({"json_object": True}, "response_format", lambda k: "response_format")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise APIError(400, "response_format.json_schema must be an object with name and schema",
                           param="response_format.json_schema")
        schema = js.get("schema", js.get("json_schema"))  # some clients nest the schema once more
        if schema is None:
            schema = {"type": "object"}  # OpenAI's default: any object
        if not isinstance(schema, dict):
            raise APIError(400, "response_format.json_schema.schema must be a JSON schema object",
                           param="response_format.json_schema.schema")
        return _constraint({"json": schema}, "response_format.json_schema.schema",
                           lambda k: "response_format.json_schema.schema")
    raise APIError(400, f"response_format.type must be one of text, json_object, json_schema; got {kind!r}",
                   param="response_format.type")


def structured_params(req: _SamplingRequest) -> tuple[StructuredOutputsParams, str] | None:
    """The request's one output constraint and the field that set it; 400 for a bad one or for two."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    if req.response_format is not None:
        c = _response_format(req.response_format)
        if c is not None:
            found.append((c, "response_format"))
    so = req.structured_outputs
    if so is not None:
        unknown = sorted(set(so) - set(STRUCTURED_KINDS) - set(_STRUCTURED_OPTIONS))
        if unknown:
            raise APIError(400, f"structured_outputs.{unknown[0]} is not a known field; use one of "
                           + ", ".join(STRUCTURED_KINDS), param=f"structured_outputs.{unknown[0]}")
        kwargs = {k: v for k, v in so.items() if k in STRUCTURED_KINDS and v is not None}
        found.append((_constraint(kwargs, "structured_outputs", lambda k: f"structured_outputs.{k}" if k
                                  else "structured_outputs"), "structured_outputs"))
    for field, kind in _GUIDED.items():
        value = getattr(req, field)
        if value is not None:
            found.append((_constraint({kind: value}, field, lambda k, f=field: f), field))
    if len(found) > 1:
        raise APIError(400, f"{found[1][1]} and {found[0][1]} both constrain the output; give one",
                       param=found[1][1])
    return found[0] if found else None


def check_tools(tools: list[dict] | None) -> list[dict]:
    """The request's tools in the OpenAI shape, parameters defaulted and each schema parsed."""
    out = []
    names: set[str] = set()
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise APIError(400, f"{where}.type must be \"function\"", param=f"{where}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(400, f"{where}.function.name must be a non-empty string", param=f"{where}.function.name")
        if fn["name"] in names:
            raise APIError(400, f"{where}.function.name {fn['name']!r} is given twice", param=f"{where}.function.name")
        names.add(fn["name"])
        parameters = fn.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise APIError(400, f"{where}.function.parameters must be a JSON schema object",
                           param=f"{where}.function.parameters")
        check_grammar(StructuredOutputsParams(json=parameters), f"{where}.function.parameters")
        out.append({"type": "function", "function": {**fn, "parameters": parameters}})
    return out


def tool_choice(req: ChatCompletionRequest, tools: list[dict], auto_enabled: bool) -> tuple[str, str | None]:
    """(mode, function name): mode none, auto, required or named; vLLM's defaults (auto once tools are given)."""
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise APIError(400, 'tool_choice must be none, auto, required or {"type": "function", "function": '
                           '{"name": ...}}', param="tool_choice")
        if name not in {t["function"]["name"] for t in tools}:
            raise APIError(400, f"tool_choice names the function {name!r}, which is not in tools",
                           param="tool_choice")
        return "named", name
    if choice not in ("none", "auto", "required"):
        raise APIError(400, f"tool_choice must be none, auto, required or a function; got {choice!r}",
                       param="tool_choice")
    if choice != "none" and not tools:
        raise APIError(400, f"tool_choice {choice!r} needs tools", param="tool_choice")
    if choice == "auto" and not auto_enabled:
        raise APIError(400, '"auto" tool choice needs the server started with --enable-auto-tool-choice '
                       '(and --tool-call-parser); pass tool_choice "required", "none" or a named function',
                       param="tool_choice")
    return choice, None


def prompt_tools(tools: list[dict], mode: str, exclude_when_none: bool) -> list[dict] | None:
    """The tools the prompt shows the model. As in vLLM, tool_choice "none" still shows them (the model knows the
    tools exist but its reply is not read for calls), unless the server runs with
    --exclude-tools-when-tool-choice-none."""
    if not tools or (mode == "none" and exclude_when_none):
        return None
    return tools


_PARAM_RE = re.compile(r"^([a-z_]+)\b")


def sampling_params(req: _SamplingRequest, max_tokens: int | None, logprobs: int | None,
                    max_num_seqs: int, vocab_size: int,
                    structured: StructuredOutputsParams | None = None) -> SamplingParams:
    """Build and validate the engine's SamplingParams; every rejection is a 400 with its param."""
    for name, value in sorted(req._unsupported.items()):
        if value is not None and not UNSUPPORTED[name](value, req):
            raise APIError(400, f"{name} is not supported by this server; leave it out", param=name)
    if req.stream and req.prompt_logprobs:  # vLLM's rule: a stream has no place for them (0 passes there too)
        raise APIError(400, "`prompt_logprobs` are not available when `stream=true`.", param="prompt_logprobs")
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
        prompt_logprobs=None if req.stream else req.prompt_logprobs,  # a stream never shows them: nothing to score
        logit_bias=logit_bias,
        allowed_token_ids=req.allowed_token_ids,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        structured=structured,
        bad_words=req.bad_words,
        cache_salt=req.cache_salt,
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


def completion_logprobs(entries: list, decode, text_offset: int, k: int | None = None) -> dict:
    """The legacy completions shape: parallel lists, top_logprobs as {token text: logprob}. An entry that is a bare
    token id (an echoed prompt token with no logprob: the first) is null in token_logprobs and top_logprobs;
    k: at most this many of an entry's top tokens (an echoed prompt's may be scored for more)."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for e in entries:
        if isinstance(e, int):
            text = decode(e)
            token_logprobs.append(None)
            tops.append(None)
        else:
            text = decode(e.token_id)
            token_logprobs.append(_lp(e.logprob))
            top = {decode(t): _lp(lp) for t, lp in e.top[:k]}
            top.setdefault(text, _lp(e.logprob))
            tops.append(top)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def echo_entries(prompt_token_ids: list[int], prompt_logprobs: list | None) -> list:
    """An echoed prompt's completion_logprobs entries: each token's TokenLogprobs, or its id where it has none."""
    scored = prompt_logprobs or [None] * len(prompt_token_ids)
    return [t if e is None else e for t, e in zip(prompt_token_ids, scored)]


def vllm_prompt_logprobs(prompt_logprobs: list | None, k: int, decode) -> list | None:
    """vLLM's prompt_logprobs: per prompt token null (the first) or {token id: {logprob, rank, decoded_token}}, the
    prompt token first with its own rank, then the top k not already there, best first (ranks 1..k)."""
    if prompt_logprobs is None:
        return None
    out: list[dict | None] = []
    for e in prompt_logprobs:
        if e is None:
            out.append(None)
            continue
        entry = {str(e.token_id): {"logprob": _lp(e.logprob), "rank": e.rank, "decoded_token": decode(e.token_id)}}
        for rank, (t, lp) in enumerate(e.top[:k], 1):
            entry.setdefault(str(t), {"logprob": _lp(lp), "rank": rank, "decoded_token": decode(t)})
        out.append(entry)
    return out


def chat_logprobs(entries: list, decode) -> dict:
    def item(token_id, logprob):
        text = decode(token_id)
        return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries]}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
