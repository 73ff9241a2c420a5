"""The OpenAI-compatible HTTP face of one engine: the FastAPI app and the state its handlers share.

The engine steps on its own thread; each engine request is pumped by its own asyncio task into a queue
that the HTTP handler reads (generation.py), so a slow client only ever delays itself. The process
around the app (flags, uvicorn, SIGTERM drain) is serve.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import re
from collections import OrderedDict

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagefleet.worker.core.sampling_params import StructuredOutputsParams
from pagefleet.worker.entrypoints.beam_api import beam_search_params, beam_search_response, check_length_penalty
from pagefleet.worker.entrypoints.chat_template import ChatTemplate
from pagefleet.worker.entrypoints.lora_api import add_lora_routes
from pagefleet.worker.entrypoints.metrics import CONTENT_TYPE, ServerMetrics
from pagefleet.worker.entrypoints.protocol import (
    ERROR_RESPONSES,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    chat_echo,
    check_grammar,
    check_tools,
    error_body,
    prompt_tools,
    sampling_params,
    structured_params,
    tool_choice,
)
from pagefleet.worker.entrypoints.reasoning import (
    END,
    REASONING_PARSERS,
    prompt_opens_reasoning,
    reasoning_ended,
    think_token_ids,
)
from pagefleet.worker.entrypoints.rl_api import add_rl_routes
from pagefleet.worker.entrypoints.streaming import ChatOutput, Generation, generate
from pagefleet.worker.entrypoints.tokenizing import AsyncTokenizer
from pagefleet.worker.entrypoints.tool_parsers import ToolParser, tool_parser

log = logging.getLogger("pagefleet.server")
REQUEST_TEMPLATES_KEPT = 16  # requests' own chat templates kept parsed (--trust-request-chat-template)

PROBE_PATHS = ("/health", "/ready", "/load", "/metrics")
OPEN_PATHS = PROBE_PATHS + ("/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|[a-z-]+\[.*\])$")


def _engine_facts(engine) -> tuple[int, int, str, int | None, str | None]:
    """(KV block size, KV blocks, KV cache dtype flag, model vocab size, architecture): an EngineProcess carries them
    itself, an AsyncLLMEngine wraps the LLMEngine that knows them."""
    if hasattr(engine, "block_size"):
        return engine.block_size, engine.num_blocks, engine.kv_cache_dtype, engine.vocab_size, engine.architecture
    core = getattr(engine, "engine", engine)
    model_config = getattr(core, "model_config", None)
    return (core.block_manager.block_size, core.block_manager.num_blocks, core.config.kv_cache_dtype,
            getattr(model_config, "vocab_size", None), getattr(model_config, "architecture", None))


class ServerState:
    """What the handlers share: the engine, the limits, and the counts that admission and drain read."""

    def __init__(self, engine, served_model_names: list[str], api_key: str | None, max_queue: int,
                 tool_call_parser: str | None = None, enable_auto_tool_choice: bool = False,
                 reasoning_parser: str | None = None, exclude_tools_when_tool_choice_none: bool = False,
                 chat_template: str | None = None, trust_request_chat_template: bool = False):
        self.engine = engine
        self.served_model_names = served_model_names
        self.model_name = served_model_names[0]
        self.api_key = api_key
        self.max_queue = max_queue
        self.draining = False
        self.num_in_flight = 0  # accepted generation requests, not yet finished
        self.num_queued = 0  # accepted and without a first token yet: what --max-queue bounds
        self.generations: set[Generation] = set()
        self.metrics = ServerMetrics(self.model_name, engine.stats)
        self.tokenizer = engine.tokenizer
        self.prompts = AsyncTokenizer(self.tokenizer)  # request prompts, encoded off the event loop
        self.max_model_len = engine.max_model_len
        self.max_num_seqs = engine.load()["max_num_seqs"]
        block_size, num_blocks, kv_cache_dtype, model_vocab, architecture = _engine_facts(engine)
        # On /load: the gateway's prefix index cuts prompts into this block size and bounds its LRU by these blocks.
        self.kv_blocks = {"block_size": block_size, "num_blocks": num_blocks}
        self.metrics.cache_config(block_size, num_blocks, kv_cache_dtype)
        self.vocab_size = min(len(self.tokenizer), model_vocab or len(self.tokenizer))
        self._token_text: dict[int, str] = {}
        # Tools: the format parser (--tool-call-parser, else the model family's), and whether "auto" is served.
        self.tool_parser: ToolParser = tool_parser(tool_call_parser, architecture)
        self.enable_auto_tool_choice = enable_auto_tool_choice
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {reasoning_parser!r}; choose one of "
                             + ", ".join(REASONING_PARSERS))
        self.reasoning_parser = reasoning_parser
        # Structured outputs of a reasoning model apply after its reasoning: from the token after `</think>`.
        self.think_start_id, self.think_end_id = None, None
        if reasoning_parser is not None:
            self.think_start_id, self.think_end_id = think_token_ids(self.tokenizer)
            if self.think_end_id is None:
                log.warning("--reasoning-parser %s: the tokenizer has no single %s token, so structured outputs "
                            "constrain the reply from its first token (no room to reason first)",
                            reasoning_parser, END)
        self.exclude_tools_when_tool_choice_none = exclude_tools_when_tool_choice_none
        # --chat-template: in place of the checkpoint's (the tokenizer itself is the engine's, left as it is)
        self.chat_template = ChatTemplate(self.tokenizer, self.tool_parser, chat_template)
        self.trust_request_chat_template = trust_request_chat_template
        self._request_templates: OrderedDict[str, ChatTemplate] = OrderedDict()  # requests' own, parsed once

    def template_for(self, chat_template: str | None) -> ChatTemplate:
        """The server's template, or a request's own chat_template where the server trusts them (a 400 else)."""
        if chat_template is None:
            return self.chat_template
        if not self.trust_request_chat_template:
            raise APIError(400, "chat_template was given with the request, but this server does not take templates "
                           "from requests; start it with --trust-request-chat-template to allow them.",
                           param="chat_template")
        template = self._request_templates.get(chat_template)
        if template is None:
            template = self._request_templates[chat_template] = ChatTemplate(self.tokenizer, self.tool_parser,
                                                                             chat_template)
            if len(self._request_templates) > REQUEST_TEMPLATES_KEPT:
                self._request_templates.popitem(last=False)
        self._request_templates.move_to_end(chat_template)
        return template

    def check_model(self, model: str | None) -> str:
        if model is None:
            return self.model_name
        if model not in self.served_model_names and model not in self.engine.lora_names():
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return model

    def lora_for(self, model: str) -> str | None:
        """The LoRA adapter a request's `model` names, as in vLLM (None: the base model)."""
        return None if model in self.served_model_names else model

    def admit(self) -> None:
        if self.draining:
            raise APIError(503, "The server is shutting down.", type="service_unavailable", code="draining")
        if self.engine.is_sleeping:  # its memory is handed back (POST /sleep); POST /wake_up serves again
            raise APIError(503, "The engine is asleep; retry after it wakes up.", type="service_unavailable",
                           code="sleeping", headers={"Retry-After": "1"})
        if self.num_queued >= self.max_queue:
            self.metrics.request_rejected("queue_full")
            raise APIError(429, f"Too many waiting requests ({self.num_queued} >= max_queue {self.max_queue}); "
                           "retry later.", type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})

    def decode_token(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def truncate(self, ids: list[int], body, max_tokens: int | None) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last k tokens (its first k with truncation_side "right");
        -1 keeps as many as fit beside max_tokens. A k that cannot fit is a 400 naming it."""
        k = body.truncate_prompt_tokens
        if k is None:
            if body.truncation_side is not None:
                raise APIError(400, "truncation_side needs truncate_prompt_tokens.", param="truncation_side")
            return ids
        room = self.max_model_len - (max_tokens or 1)
        if k > room:
            raise APIError(400, f"truncate_prompt_tokens={k} cannot be greater than max_model_len "
                           f"({self.max_model_len}) - max_tokens ({max_tokens or 1}) = {room}.",
                           param="truncate_prompt_tokens")
        k = room if k == -1 else k
        if k >= len(ids):
            return ids
        return ids[:k] if body.truncation_side == "right" else ids[len(ids) - k:]

    def check_prompt(self, ids: list[int], max_tokens: int | None, param: str) -> None:
        if not ids:
            raise APIError(400, "The prompt is empty.", param=param)
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise APIError(400, f"Prompt token ids must be in [0, {self.vocab_size}).", param=param)
        if len(ids) + (max_tokens or 1) > self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                           f"you requested {len(ids) + (max_tokens or 1)} tokens ({len(ids)} in the prompt, "
                           f"{max_tokens or 1} to generate).", param=param, code="context_length_exceeded")

    def chat_prompt(self, messages, add_generation_prompt: bool = True, continue_final_message: bool = False,
                    template_kwargs: dict | None = None, chat_template: str | None = None) -> list[int]:
        return self.template_for(chat_template).render(messages, add_generation_prompt,
                                                       continue_final_message=continue_final_message,
                                                       template_kwargs=template_kwargs)[1]

    def after_reasoning(self, structured: StructuredOutputsParams | None, reply_prompt_ids: list[int]):
        """The request's constraint, gated on the reasoning end token where the server has a reasoning parser
        and the reply starts before the end of a think block (reply_prompt_ids: what the prompt adds for the
        reply, or the whole prompt)."""
        if (structured is None or self.think_end_id is None
                or reasoning_ended(reply_prompt_ids, self.think_start_id, self.think_end_id)):
            return structured
        from pagefleet.worker.engine.structured_output import after_reasoning

        return after_reasoning(structured, self.think_end_id)


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class _Gate:
    """Pure ASGI middleware (no body buffering, so streams and disconnects pass through untouched):
    API key on everything but the probes and the schema, and 503 for new work while draining."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            error = None
            if self.state.api_key is not None:
                auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
                if not hmac.compare_digest(auth.encode(), f"Bearer {self.state.api_key}".encode()):
                    error = APIError(401, "Invalid or missing API key (Authorization: Bearer <key>).",
                                     code="invalid_api_key")
            if error is None and self.state.draining:
                error = APIError(503, "The server is shutting down.", type="service_unavailable", code="draining")
            if error is not None:
                await _error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _beam_answer(answer: dict | None) -> Response:
    # None: the client left mid-search (nobody reads this), as streaming.generate answers a non-streamed request.
    return Response(status_code=499) if answer is None else JSONResponse(answer)


def build_app(engine, served_model_name: str | list[str] | None = None, api_key: str | None = None,
              max_queue: int = 1024, enable_rl_endpoints: bool = False, tool_call_parser: str | None = None,
              enable_auto_tool_choice: bool = False, reasoning_parser: str | None = None,
              exclude_tools_when_tool_choice_none: bool = False, chat_template: str | None = None,
              trust_request_chat_template: bool = False) -> FastAPI:
    """The FastAPI app over a loaded AsyncLLMEngine; `app.state.server` is the shared ServerState.
    enable_rl_endpoints: the weight update, pause and sleep routes (rl_api.py); without it they do not exist.
    tool_call_parser / enable_auto_tool_choice / reasoning_parser / exclude_tools_when_tool_choice_none /
    trust_request_chat_template: as vLLM's flags of those names; chat_template: --chat-template's template text
    (chat_template.load_chat_template)."""
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    state = ServerState(engine, names or [engine.model_name], api_key, max_queue, tool_call_parser,
                        enable_auto_tool_choice, reasoning_parser, exclude_tools_when_tool_choice_none,
                        chat_template, trust_request_chat_template)
    app = FastAPI(title="pagefleet worker", version="0.1.0")
    app.state.server = state
    app.add_middleware(_Gate, state=state)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, e: APIError):
        return _error_response(e)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        # drop "body" and the union-member tags pydantic puts in loc ("str", "list[int]", ...)
        loc = [str(x) for x in first.get("loc", ()) if x != "body" and not _TYPE_TAG.match(str(x))]
        param = loc[0] if loc else None
        where = ".".join(loc)
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":  # its loc is a character position, not a param
            message, param = f"The body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip(), None
        return _error_response(APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(e.detail), type=kind), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def on_crash(request: Request, e: Exception):  # a bug of ours; still the OpenAI shape
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(f"internal error: {e}", type="internal_error"), status_code=500)

    @app.post("/v1/completions", responses=ERROR_RESPONSES)
    async def completions(body: CompletionRequest, request: Request):
        model = state.check_model(body.model)
        if body.echo and body.max_tokens == 0:  # vLLM's echo of the prompt alone; our engine samples at least one
            raise APIError(400, "max_tokens must be at least 1; echo with max_tokens 0 (the prompt alone) is not "
                           "supported.", param="max_tokens")
        if body.suffix:
            raise APIError(400, "suffix is not supported.", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, "best_of other than n is not supported.", param="best_of")
        p = body.prompt
        if isinstance(p, str):
            given = [p]
        elif p and all(isinstance(x, int) for x in p):
            given = [p]
        else:
            given = list(p)
        if not given:
            raise APIError(400, "The prompt is empty.", param="prompt")
        encoded = await asyncio.gather(*(state.prompts.encode(x) for x in given if isinstance(x, str)))
        texts = iter(encoded)
        prompts = [state.truncate(next(texts) if isinstance(x, str) else list(x), body, body.max_tokens)
                   for x in given]
        constraint = structured_params(body)
        params = sampling_params(body, body.max_tokens, body.logprobs, state.max_num_seqs, state.vocab_size,
                                 constraint[0] if constraint else None)
        for ids in prompts:
            state.check_prompt(ids, body.max_tokens, "prompt")
        if body.use_beam_search:
            if body.echo:
                raise APIError(400, "echo is not supported with use_beam_search.", param="echo")
            beams = beam_search_params(body, params, max(map(len, prompts)), state.max_model_len, body.stream)
            return _beam_answer(await beam_search_response(state, request, False, model, prompts, beams,
                                                           state.lora_for(model),
                                                           token_ids=bool(body.return_token_ids)))
        check_length_penalty(body)
        echo = None
        if body.echo:  # the prompt as given, token ids as their text
            echo = [x if isinstance(x, str) and body.truncate_prompt_tokens is None else state.tokenizer.decode(ids)
                    for x, ids in zip(given, prompts)]  # a truncated prompt echoes what the model saw
            if body.logprobs is not None:  # the echoed logprobs are the prompt tokens' first
                params.prompt_logprobs = max(body.prompt_logprobs or 0, body.logprobs)
        # a reasoning model's constraint waits for its reasoning, per prompt (a prompt may have closed it)
        prompt_params = [dataclasses.replace(params, structured=s) if s is not params.structured else params
                         for s in (state.after_reasoning(params.structured, ids) for ids in prompts)]
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await generate(state, request, False, model, prompts, params, body.stream, include_usage,
                              state.lora_for(model), prompt_params=prompt_params,
                              prompt_logprobs=body.prompt_logprobs, echo=echo, body=body)

    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        model = state.check_model(body.model)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true.", param="top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        constraint = structured_params(body)
        tools = check_tools(body.tools)
        mode, named = tool_choice(body, tools, state.enable_auto_tool_choice)
        parser = state.tool_parser if mode != "none" else None
        if mode in ("required", "named"):  # the calls are forced by a grammar: arguments valid for the schema
            if constraint is not None:
                raise APIError(400, f"tool_choice {mode if mode == 'required' else 'naming a function'} and "
                               f"{constraint[1]} both constrain the output; give one", param="tool_choice")
            tag = parser.constraint(tools, named, parallel=body.parallel_tool_calls is not False)
            constraint = (StructuredOutputsParams(structural_tag=tag), "tool_choice")
            check_grammar(constraint[0], "tool_choice")
        params = sampling_params(body, max_tokens, logprobs, state.max_num_seqs, state.vocab_size,
                                 constraint[0] if constraint else None)
        if parser is not None and not parser.skip_special_tokens:
            params.skip_special_tokens = False  # the format's marker is a special token
        shown = prompt_tools(tools, mode, state.exclude_tools_when_tool_choice_none)
        template = state.template_for(body.chat_template)
        text = template.render_text(body.messages, body.add_generation_prompt, shown, body.continue_final_message,
                                    body.chat_template_kwargs, body.documents)
        ids = await state.prompts.encode(text, add_special_tokens=False)
        ids = state.truncate(ids, body, max_tokens)
        state.check_prompt(ids, max_tokens, "messages")
        if params.structured is not None and state.think_end_id is not None:
            # the reply's own part of the prompt decides: a closed think block in an earlier turn does not count
            reply_prompt = template.generation_prompt(body.messages, shown, text, body.continue_final_message,
                                                      body.chat_template_kwargs, body.documents)
            params.structured = state.after_reasoning(
                params.structured, state.tokenizer.encode(reply_prompt, add_special_tokens=False))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        reasoning = None
        if state.reasoning_parser is not None:
            reasoning = prompt_opens_reasoning(text[-64:])
        if not body.include_reasoning and reasoning is not None:  # the token-level fields would show it
            for name, asks in (("logprobs", body.logprobs), ("prompt_logprobs", body.prompt_logprobs is not None),
                               ("return_token_ids", body.return_token_ids)):
                if asks:
                    raise APIError(400, f"{name} would show the reasoning that include_reasoning: false leaves out; "
                                   "ask for one of the two.", param=name)
        output = ChatOutput(parser, reasoning, chat_echo(body), show_reasoning=body.include_reasoning)
        if body.use_beam_search:
            if parser is not None:  # a beam's text is not parsed for calls
                raise APIError(400, "tools are not supported with use_beam_search unless tool_choice is none.",
                               param="tools")
            beams = beam_search_params(body, params, len(ids), state.max_model_len, body.stream)
            return _beam_answer(await beam_search_response(state, request, True, model, [ids], beams,
                                                           state.lora_for(model), output,
                                                           token_ids=bool(body.return_token_ids)))
        check_length_penalty(body)
        return await generate(state, request, True, model, [ids], params, body.stream, include_usage,
                              state.lora_for(model), output, prompt_logprobs=body.prompt_logprobs, body=body)

    @app.get("/v1/models")
    async def models():
        base = [{"id": name, "object": "model", "created": 0, "owned_by": "pagefleet", "root": engine.model_name,
                 "max_model_len": state.max_model_len, "vocab_size": state.vocab_size}
                for name in state.served_model_names]
        adapters = [{"id": name, "object": "model", "created": 0, "owned_by": "pagefleet", "root": name,
                     "parent": state.model_name, "max_model_len": state.max_model_len, "vocab_size": state.vocab_size}
                    for name in engine.lora_names()]
        return {"object": "list", "data": base + adapters}

    add_lora_routes(app, state)
    if enable_rl_endpoints:
        add_rl_routes(app, state)

    @app.post("/tokenize", responses=ERROR_RESPONSES)
    async def tokenize(body: TokenizeRequest):
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "Give exactly one of prompt or messages.", param="prompt")
        if body.prompt is not None:
            ids = state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            ids = state.chat_prompt(body.messages, body.add_generation_prompt, body.continue_final_message,
                                    body.chat_template_kwargs, body.chat_template)
        return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}

    @app.post("/detokenize", responses=ERROR_RESPONSES)
    async def detokenize(body: DetokenizeRequest):
        state.check_model(body.model)
        if any(not 0 <= t < state.vocab_size for t in body.tokens):
            raise APIError(400, f"Token ids must be in [0, {state.vocab_size}).", param="tokens")
        return {"prompt": state.tokenizer.decode(body.tokens)}

    @app.get("/health")
    async def health():
        alive = engine.is_alive()
        return JSONResponse({"status": "ok" if alive else "engine loop dead"}, status_code=200 if alive else 503)

    @app.get("/ready")
    async def ready():
        ok = engine.is_alive() and not state.draining and not engine.is_sleeping
        return JSONResponse({"ready": ok, "draining": state.draining, "sleeping": engine.is_sleeping},
                            status_code=200 if ok else 503)

    @app.get("/load")
    async def load():  # polled many times a second: skip FastAPI's response encoding
        # The gateway skips a draining worker.
        return JSONResponse({**engine.load(), **state.kv_blocks, "draining": state.draining})

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/debug/steps")
    async def debug_steps():
        """The engine's recent steps: how many sequences each one batched (the step trace)."""
        s = engine.stats()
        return {"steps_total": s.steps_total, "recent_steps": [dataclasses.asdict(r) for r in s.recent_steps]}

    return app
