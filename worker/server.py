"""`pagefleet serve`: the OpenAI-compatible HTTP face of one engine (FastAPI + uvicorn).

The engine steps on its own thread; each engine request is pumped by its own asyncio task into a queue
that the HTTP handler reads, so a slow client only ever delays itself. Only this module knows HTTP.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import re
import signal
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagefleet.worker.config import add_engine_arguments, engine_config_from_args
from pagefleet.worker.metrics import CONTENT_TYPE, ServerMetrics
from pagefleet.worker.protocol import (ERROR_RESPONSES, APIError, ChatCompletionRequest, CompletionRequest,
                                       DetokenizeRequest, TokenizeRequest, chat_logprobs, completion_logprobs,
                                       error_body, message_dicts, sampling_params, usage)

log = logging.getLogger("pagefleet.server")

PROBE_PATHS = ("/health", "/ready", "/load", "/metrics")
OPEN_PATHS = PROBE_PATHS + ("/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")
_CLOSED = object()
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|[a-z-]+\[.*\])$")


class ServerState:
    """What the handlers share: the engine, the limits, and the counts that admission and drain read."""

    def __init__(self, engine, served_model_names: list[str], api_key: str | None, max_queue: int):
        self.engine = engine
        self.served_model_names = served_model_names
        self.model_name = served_model_names[0]
        self.api_key = api_key
        self.max_queue = max_queue
        self.draining = False
        self.num_in_flight = 0  # accepted generation requests, not yet finished
        self.num_queued = 0  # accepted and without a first token yet: what --max-queue bounds
        self.generations: set[_Generation] = set()
        self.metrics = ServerMetrics(self.model_name, engine.stats)
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.max_num_seqs = engine.load()["max_num_seqs"]
        core = getattr(engine, "engine", engine)  # AsyncLLMEngine wraps the LLMEngine that knows the model
        model_vocab = getattr(getattr(core, "model_config", None), "vocab_size", None)
        self.vocab_size = min(len(self.tokenizer), model_vocab or len(self.tokenizer))
        self._token_text: dict[int, str] = {}

    def check_model(self, model: str | None) -> str:
        if model is None:
            return self.model_name
        if model not in self.served_model_names:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return model

    def admit(self) -> None:
        if self.draining:
            raise APIError(503, "The server is shutting down.", type="service_unavailable", code="draining")
        if self.num_queued >= self.max_queue:
            self.metrics.request_rejected("queue_full")
            raise APIError(429, f"Too many waiting requests ({self.num_queued} >= max_queue {self.max_queue}); "
                           "retry later.", type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})

    def decode_token(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def check_prompt(self, ids: list[int], max_tokens: int | None, param: str) -> None:
        if not ids:
            raise APIError(400, "The prompt is empty.", param=param)
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise APIError(400, f"Prompt token ids must be in [0, {self.vocab_size}).", param=param)
        if len(ids) + (max_tokens or 1) > self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                           f"you requested {len(ids) + (max_tokens or 1)} tokens ({len(ids)} in the prompt, "
                           f"{max_tokens or 1} to generate).", param=param, code="context_length_exceeded")

    def chat_prompt(self, messages, add_generation_prompt: bool = True) -> list[int]:
        if not messages:
            raise APIError(400, "messages must not be empty.", param="messages")
        try:
            text = self.tokenizer.apply_chat_template(message_dicts(messages), tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        except APIError:
            raise
        except Exception as e:  # a template may reject role orders etc. with any exception type
            raise APIError(400, f"The chat template rejected the messages: {e}", param="messages") from None
        # The template already holds the special tokens (as LLM.chat does).
        return self.tokenizer.encode(text, add_special_tokens=False)


class _Generation:
    """One API request: one engine request per prompt, each pumped by its own task into one queue."""

    def __init__(self, state: ServerState, request_id: str, prompts: list[list[int]], params):
        self.state, self.params = state, params
        self.engine_ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        self.done = [False] * len(prompts)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.arrival = time.perf_counter()
        self.last_token_at: float | None = None
        self.tokens_seen: dict[tuple[int, int], int] = {}
        self.queued = True
        self.closed = False
        state.num_in_flight += 1
        state.num_queued += 1
        state.generations.add(self)
        self.pumps = [asyncio.create_task(self._pump(i, ids)) for i, ids in enumerate(prompts)]

    async def _pump(self, i: int, ids: list[int]) -> None:
        try:
            async for out in self.state.engine.generate(ids, self.params, self.engine_ids[i]):
                self.queue.put_nowait((i, out))
            self.queue.put_nowait((i, None))
        except Exception as e:  # handed to the reader, which owns the HTTP answer
            self.queue.put_nowait((i, e))

    async def events(self):
        """(prompt index, RequestOutput) until every prompt finished, or nothing more once closed."""
        while not all(self.done):
            i, item = await self.queue.get()
            if item is _CLOSED:
                return
            if item is None:
                self.done[i] = True
                continue
            if isinstance(item, BaseException):
                raise item
            self._observe(i, item)
            yield i, item
        m = self.state.metrics
        m.e2e.observe(time.perf_counter() - self.arrival)

    def _observe(self, i: int, out) -> None:
        # Latencies as the client sees them; one step can bring several tokens (one per choice with n > 1).
        new = 0
        for o in out.outputs:
            key = (i, o.index)
            new = max(new, len(o.token_ids) - self.tokens_seen.get(key, 0))
            self.tokens_seen[key] = len(o.token_ids)
            if o.finish_reason is not None and out.finished:
                self.state.metrics.request_finished(o.finish_reason)
        if not new:
            return
        now = time.perf_counter()
        m = self.state.metrics
        if self.last_token_at is None:
            m.ttft.observe(now - self.arrival)
            self._leave_queue()
        else:
            gap = (now - self.last_token_at) / new
            for _ in range(new):
                m.itl.observe(gap)
        self.last_token_at = now

    def _leave_queue(self) -> None:
        if self.queued:
            self.queued = False
            self.state.num_queued -= 1

    def close(self) -> None:
        """Idempotent end: cancels the pumps (closing the engine's streams) and aborts unfinished requests,
        so their KV blocks are freed at the next step."""
        if self.closed:
            return
        self.closed = True
        self._leave_queue()
        for pump in self.pumps:
            pump.cancel()
        for engine_id, done in zip(self.engine_ids, self.done):
            if not done:
                self.state.engine.abort(engine_id)
                for _ in range(self.params.n):
                    self.state.metrics.request_finished("abort")
        self.state.num_in_flight -= 1
        self.state.generations.discard(self)
        self.queue.put_nowait((None, _CLOSED))


async def _close_on_disconnect(request: Request, gen: _Generation) -> None:
    # The body is read already, so the next ASGI message is the disconnect; a non-streaming request
    # has no other way to notice that its client left.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            gen.close()
            return


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _generate(state: ServerState, request: Request, chat: bool, model: str, prompts: list[list[int]],
                    params, stream: bool, include_usage: bool):
    """Run one completions / chat request; returns a JSON or a server-sent-events response."""
    if include_usage and not stream:
        raise APIError(400, "stream_options is only allowed with stream=true.", param="stream_options")
    state.admit()
    request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created, n = int(time.time()), params.n
    want_logprobs = params.logprobs is not None
    head = {"id": request_id, "object": ("chat.completion" if chat else "text_completion"),
            "created": created, "model": model}
    prompt_tokens = sum(len(p) for p in prompts)
    gen = _Generation(state, request_id, prompts, params)
    watcher = asyncio.create_task(_close_on_disconnect(request, gen))

    def logprobs_of(entries, text_offset):
        if not want_logprobs:
            return None
        if chat:
            return chat_logprobs(entries or [], state.decode_token)
        return completion_logprobs(entries or [], state.decode_token, text_offset)

    def completion_tokens():
        return sum(gen.tokens_seen.values())

    if not stream:
        try:
            final: dict[int, object] = {}
            async for i, out in gen.events():
                final[i] = out
            if not all(gen.done):  # the client left; nobody reads this
                return Response(status_code=499)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        finally:
            watcher.cancel()
            gen.close()
        choices = []
        for i in sorted(final):
            for o in sorted(final[i].outputs, key=lambda o: o.index):
                c = {"index": i * n + o.index, "logprobs": logprobs_of(o.logprobs, 0),
                     "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}
                if chat:
                    c["message"] = {"role": "assistant", "content": o.text}
                else:
                    c["text"] = o.text
                choices.append(c)
        return JSONResponse({**head, "choices": choices, "usage": usage(prompt_tokens, completion_tokens())})

    chunk_head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
    extra = {"usage": None} if include_usage else {}

    async def events():
        seen: dict[int, list[int]] = {}  # choice index -> [text length sent, logprobs sent]
        finished: set[int] = set()
        pending: list[str] = []  # events not yet written: several steps' worth go out in one write
        try:
            if chat:  # the role first, as OpenAI does; it also sends the headers before the first token
                for index in range(len(prompts) * n):
                    yield _sse({**chunk_head, "choices": [{"index": index, "delta": {"role": "assistant",
                                "content": ""}, "logprobs": None, "finish_reason": None}], **extra})
            async for i, out in gen.events():
                for o in out.outputs:
                    index = i * n + o.index
                    if index in finished:
                        continue
                    sent = seen.setdefault(index, [0, 0])
                    text, entries = o.text[sent[0]:], (o.logprobs or [])[sent[1]:]
                    if not text and not entries and o.finish_reason is None:
                        continue
                    offset, sent[0], sent[1] = sent[0], len(o.text), len(o.logprobs or [])
                    if o.finish_reason is not None:
                        finished.add(index)
                    c = {"index": index, "logprobs": logprobs_of(entries, offset),
                         "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}
                    if chat:
                        c["delta"] = {"content": text} if text else {}
                    else:
                        c["text"] = text
                    pending.append(_sse({**chunk_head, "choices": [c], **extra}))
                if pending and gen.queue.empty():  # caught up with the engine: write what we have
                    yield "".join(pending)
                    pending.clear()
            if include_usage:
                pending.append(_sse({**chunk_head, "choices": [], "usage": usage(prompt_tokens, completion_tokens())}))
        except APIError as e:
            pending.append(_sse(e.body()))
        except ValueError as e:
            pending.append(_sse(error_body(str(e))))
        except Exception as e:  # the status line is sent already: report in-band, as vLLM does
            log.exception("stream %s failed", request_id)
            pending.append(_sse(error_body(f"internal error: {e}", type="internal_error")))
        finally:
            watcher.cancel()
            gen.close()
        yield "".join(pending) + "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


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


def build_app(engine, served_model_name: str | list[str] | None = None, api_key: str | None = None,
              max_queue: int = 1024) -> FastAPI:
    """The FastAPI app over a loaded AsyncLLMEngine; `app.state.server` is the shared ServerState."""
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    state = ServerState(engine, names or [engine.model_name], api_key, max_queue)
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
        if body.echo:
            raise APIError(400, "echo is not supported.", param="echo")
        if body.suffix:
            raise APIError(400, "suffix is not supported.", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, "best_of other than n is not supported.", param="best_of")
        p = body.prompt
        if isinstance(p, str):
            prompts = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [p]
        else:
            prompts = list(p)
        if not prompts:
            raise APIError(400, "The prompt is empty.", param="prompt")
        prompts = [state.tokenizer.encode(x) if isinstance(x, str) else list(x) for x in prompts]
        params = sampling_params(body, body.max_tokens, body.logprobs, state.max_num_seqs, state.vocab_size)
        for ids in prompts:
            state.check_prompt(ids, body.max_tokens, "prompt")
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await _generate(state, request, False, model, prompts, params, body.stream, include_usage)

    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        model = state.check_model(body.model)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true.", param="top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = sampling_params(body, max_tokens, logprobs, state.max_num_seqs, state.vocab_size)
        ids = state.chat_prompt(body.messages)
        state.check_prompt(ids, max_tokens, "messages")
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await _generate(state, request, True, model, [ids], params, body.stream, include_usage)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "pagefleet", "root": engine.model_name,
             "max_model_len": state.max_model_len, "vocab_size": state.vocab_size} for name in state.served_model_names]}

    @app.post("/tokenize", responses=ERROR_RESPONSES)
    async def tokenize(body: TokenizeRequest):
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "Give exactly one of prompt or messages.", param="prompt")
        if body.prompt is not None:
            ids = state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            ids = state.chat_prompt(body.messages, body.add_generation_prompt)
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
        ok = engine.is_alive() and not state.draining
        return JSONResponse({"ready": ok, "draining": state.draining}, status_code=200 if ok else 503)

    @app.get("/load")
    async def load():  # polled many times a second: skip FastAPI's response encoding
        return JSONResponse({**engine.load(), "draining": state.draining})  # the gateway skips a draining worker

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/debug/steps")
    async def debug_steps():
        """The engine's recent steps: how many sequences each one batched (the step trace)."""
        s = engine.stats()
        return {"steps_total": s.steps_total, "recent_steps": [
            {"num_seqs": r.num_seqs, "num_prefill_tokens": r.num_prefill_tokens,
             "num_decode_tokens": r.num_decode_tokens, "duration_s": r.duration_s} for r in s.recent_steps]}

    return app


# ---- the process: flags, load, serve, drain ----

def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    add_engine_arguments(parser)  # --model, --max-model-len, --gpu-memory-fraction, ... as for generate and bench
    a("--served-model-name", nargs="+", default=None, help="name(s) clients use (default: the model folder name)")
    a("--host", default="0.0.0.0")
    a("--port", type=int, default=8000)
    a("--api-key", default=None,
      help="require Authorization: Bearer <key> on the API (default: $PAGEFLEET_API_KEY)")
    a("--max-queue", type=int, default=1024,
      help="requests accepted but without a first token yet (queued or in prefill) before new ones get 429")
    a("--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get after SIGTERM")
    a("--disable-access-log", action="store_true")
    a("--log-level", default="info")


class _DrainingServer:
    """uvicorn, except that SIGTERM drains: /ready turns false and new requests get 503 while the
    listener stays open, in-flight requests finish (up to the drain timeout), then the process exits 0."""

    def __init__(self, config, state: ServerState, drain_timeout: float):
        import uvicorn

        state_, timeout_ = state, drain_timeout

        class Server(uvicorn.Server):
            def handle_exit(self, sig, frame):
                if sig == signal.SIGTERM and not state_.draining:
                    state_.draining = True  # not re-raised afterwards: a drained exit is a clean exit
                    return
                super().handle_exit(sig, frame)

        self.server, self.state, self.drain_timeout = Server(config), state_, timeout_

    async def _drain_then_exit(self) -> None:
        while not self.state.draining:
            await asyncio.sleep(0.1)
        log.info("SIGTERM: draining %d in-flight requests (up to %.0f s)", self.state.num_in_flight,
                 self.drain_timeout)
        deadline = time.monotonic() + self.drain_timeout
        while self.state.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for gen in list(self.state.generations):  # past the deadline: abort what is left
            gen.close()
        await asyncio.sleep(0.1)  # let the last responses flush
        self.server.should_exit = True

    async def serve(self) -> None:
        drainer = asyncio.create_task(self._drain_then_exit())
        try:
            await self.server.serve()
        finally:
            drainer.cancel()


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from pagefleet.worker.async_engine import AsyncLLMEngine

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = engine_config_from_args(args)
    except ValueError as e:
        print(f"pagefleet serve: {e}")
        return 2
    if args.max_queue < 1:
        print("pagefleet serve: --max-queue must be at least 1")
        return 2
    try:
        engine = AsyncLLMEngine(config)
    except ValueError as e:  # a bad model folder or a setting the model cannot take: say so, no traceback
        print(f"pagefleet serve: {e}")
        return 2
    try:
        api_key = args.api_key or os.environ.get("PAGEFLEET_API_KEY")  # resolved here: never shown in --help
        app = build_app(engine, args.served_model_name, api_key, args.max_queue)
        uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                   access_log=not args.disable_access_log, timeout_graceful_shutdown=5)
        asyncio.run(_DrainingServer(uv_config, app.state.server, args.drain_timeout).serve())
    finally:
        engine.shutdown()
    return 0
