"""One API request's generation: an engine request per prompt and sample group, pumped into one queue,
answered as one JSON body or as server-sent events, with usage and logprobs in the OpenAI shape, and a chat
choice's text read into reasoning_content, content and tool_calls (ChatOutput)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagefleet.worker.entrypoints.protocol import (
    APIError,
    chat_logprobs,
    completion_logprobs,
    echo_entries,
    error_body,
    usage,
    vllm_prompt_logprobs,
)
from pagefleet.worker.entrypoints.reasoning import ReasoningStreamer, split_reasoning

if TYPE_CHECKING:
    from pagefleet.worker.entrypoints.api_server import ServerState

log = logging.getLogger("pagefleet.server")

_CLOSED = object()


class ChatOutput:
    """How a chat choice's text becomes its message: the reasoning split off (--reasoning-parser), then the
    tool calls parsed out of the rest (the request's tools, with the server's --tool-call-parser)."""

    def __init__(self, parser=None, reasoning: bool | None = None, echo: str = "", show_reasoning: bool = True):
        self.parser = parser  # a ToolParser, or None when the request has no tools (or tool_choice none)
        self.reasoning = reasoning  # None: no reasoning parser; else whether the prompt opened the block
        self.echo = echo  # the content every choice starts with (vLLM's chat echo: protocol.chat_echo)
        self.show_reasoning = show_reasoning  # vLLM's include_reasoning: false splits the reasoning off and drops it

    @property
    def plain(self) -> bool:
        return self.parser is None and self.reasoning is None and not self.echo

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """A finished choice's message and its finish reason ("tool_calls" once it called a tool)."""
        message: dict = {"role": "assistant"}
        if self.reasoning is not None:
            reasoning, text = split_reasoning(text, self.reasoning, final=True)
            if self.show_reasoning:
                message["reasoning_content"] = reasoning
        content, calls = self.parser.extract(text) if self.parser is not None else (text, [])
        message["content"] = self.echo + (content or "") if self.echo else content
        if calls:
            message["tool_calls"] = [c.to_openai() for c in calls]
            if finish_reason == "stop":
                finish_reason = "tool_calls"
        return message, finish_reason

    def stream(self) -> _ChoiceStream:
        return _ChoiceStream(self)


class _ChoiceStream:
    """One streamed choice: text deltas in, OpenAI delta objects out (reasoning_content, content, tool_calls)."""

    def __init__(self, output: ChatOutput):
        self.reasoning = ReasoningStreamer(output.reasoning) if output.reasoning is not None else None
        self.show_reasoning = output.show_reasoning
        self.tools = output.parser.streamer() if output.parser is not None else None
        self.echo = output.echo  # sent ahead of the first delta's content

    def feed(self, text: str, final: bool) -> dict:
        delta: dict = {}
        if self.reasoning is not None:
            reasoning, text = self.reasoning.feed(text, final)
            if reasoning and self.show_reasoning:
                delta["reasoning_content"] = reasoning
        if self.tools is not None:
            text, items = self.tools.feed(text, final)
            if items:
                delta["tool_calls"] = items
        if self.echo:  # raw content, ahead of the model's: no reasoning or tool parser reads it
            text, self.echo = self.echo + text, ""
        if text:
            delta["content"] = text
        return delta

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.tools is not None and self.tools.called else reason


class Generation:
    """One API request: one engine request per prompt, each pumped by its own task into one queue."""

    def __init__(self, state: ServerState, request_id: str, prompts: list[list[int]], params,
                 lora_name: str | None = None, prompt_params: list | None = None):
        """prompt_params: each prompt's own params where they differ (a constraint gated on one prompt's reasoning
        and not on another's); otherwise params for all."""
        self.state, self.params, self.lora_name = state, params, lora_name
        self.prompt_params = prompt_params or [params] * len(prompts)
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
            async for out in self.state.engine.generate(ids, self.prompt_params[i], self.engine_ids[i],
                                                        self.lora_name):
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


async def client_left(request: Request) -> None:
    """Returns once the client disconnects. The body is read already, so the next ASGI message is the
    disconnect; a non-streamed answer has no other way to notice that its client left."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _close_on_disconnect(request: Request, gen: Generation) -> None:
    await client_left(request)
    gen.close()


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def generate(state: ServerState, request: Request, chat: bool, model: str, prompts: list[list[int]],
                    params, stream: bool, include_usage: bool, lora_name: str | None = None,
                    output: ChatOutput | None = None, prompt_params: list | None = None,
                    prompt_logprobs: int | None = None, echo: list[str] | None = None, *, body):
    """Run one completions / chat request; returns a JSON or a server-sent-events response (prompt_params: as
    Generation takes them). prompt_logprobs: the top k of vLLM's prompt_logprobs to answer with (not streamed);
    echo: each prompt's text, to lead its choices' text (and their logprobs, the prompt tokens'). body: the
    request, for vLLM's fields that shape the answer (return_token_ids, return_tokens_as_token_ids,
    stream_options.continuous_usage_stats)."""
    output = output or ChatOutput()
    if include_usage and not stream:
        raise APIError(400, "stream_options is only allowed with stream=true.", param="stream_options")
    token_ids = bool(body.return_token_ids)
    continuous = include_usage and body.stream_options.continuous_usage_stats
    decode_token = state.decode_token
    if body.return_tokens_as_token_ids:
        def decode_token(token_id: int) -> str:  # vLLM's spelling, for tokens that do not decode on their own
            return f"token_id:{token_id}"
    state.admit()
    request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created, n = int(time.time()), params.n
    want_logprobs = params.logprobs is not None
    head = {"id": request_id, "object": ("chat.completion" if chat else "text_completion"),
            "created": created, "model": model}
    prompt_tokens = sum(len(p) for p in prompts)
    gen = Generation(state, request_id, prompts, params, lora_name, prompt_params)
    watcher = asyncio.create_task(_close_on_disconnect(request, gen))

    def logprobs_of(entries, text_offset):
        if not want_logprobs:
            return None
        if chat:
            return chat_logprobs(entries or [], decode_token)
        return completion_logprobs(entries or [], decode_token, text_offset, params.logprobs)

    def echoed(i: int, out, text: str, entries):
        """A choice's text and logprob entries with prompt i in front."""
        if want_logprobs:
            entries = echo_entries(prompts[i], out.prompt_logprobs) + (entries or [])
        return echo[i] + text, entries

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
            scored = None
            if prompt_logprobs is not None:
                scored = vllm_prompt_logprobs(final[i].prompt_logprobs, prompt_logprobs, state.decode_token)
            for o in sorted(final[i].outputs, key=lambda o: o.index):
                text, entries = o.text, o.logprobs
                if echo is not None:
                    text, entries = echoed(i, final[i], text, entries)
                c = {"index": i * n + o.index, "logprobs": logprobs_of(entries, 0),
                     "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}
                if chat:
                    c["message"], c["finish_reason"] = output.message(text, o.finish_reason)
                else:
                    c["text"] = text
                    if prompt_logprobs is not None:  # vLLM's place: on each choice of the prompt
                        c["prompt_logprobs"] = scored
                    if token_ids:
                        c["prompt_token_ids"] = prompts[i]
                if token_ids:
                    c["token_ids"] = list(o.token_ids)
                choices.append(c)
        # the policy that produced the samples, for an RL trainer (SGLang reports it in its meta info)
        version = max(out.weight_version for out in final.values())
        body = {**head, "choices": choices, "usage": usage(prompt_tokens, completion_tokens()),
                "weight_version": version}
        if chat and prompt_logprobs is not None:  # vLLM's place: beside the choices (a chat has one prompt)
            body["prompt_logprobs"] = scored
        if chat and token_ids:
            body["prompt_token_ids"] = prompts[0]
        return JSONResponse(body)

    chunk_head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
    extra = {"usage": None} if include_usage else {}

    async def events():
        seen: dict[int, list[int]] = {}  # choice index -> [text length sent, logprobs sent, token ids sent]
        finished: set[int] = set()
        echoes: set[int] = set()  # choices whose prompt is sent
        pending: list[str] = []  # events not yet written: several steps' worth go out in one write
        streams: dict[int, _ChoiceStream] = {}
        # Each chunk carries the weight version of the policy that produced it, as non-streamed bodies do.
        version = state.engine.weight_version
        try:
            if chat:  # the role first, as OpenAI does; it also sends the headers before the first token
                ids = {"prompt_token_ids": prompts[0]} if token_ids else {}  # in the first chunk, as vLLM
                role_usage = {"usage": usage(len(prompts[0]), 0)} if continuous else extra
                for index in range(len(prompts) * n):
                    yield _sse({**chunk_head, "choices": [{"index": index, "delta": {"role": "assistant",
                                "content": ""}, "logprobs": None, "finish_reason": None}], **role_usage,
                                "weight_version": version, **(ids if index == 0 else {})})
            async for i, out in gen.events():
                version = out.weight_version
                for o in out.outputs:
                    index = i * n + o.index
                    if index in finished:
                        continue
                    sent = seen.setdefault(index, [0, 0, 0])
                    text, entries = o.text[sent[0]:], (o.logprobs or [])[sent[1]:]
                    if not text and not entries and o.finish_reason is None:
                        continue
                    offset, sent[0], sent[1] = sent[0], len(o.text), len(o.logprobs or [])
                    if echo is not None:  # the prompt leads the choice's first chunk, as in vLLM
                        if index in echoes:
                            offset += len(echo[i])
                        else:
                            echoes.add(index)
                            text, entries = echoed(i, out, text, entries)
                    if o.finish_reason is not None:
                        finished.add(index)
                    c = {"index": index, "logprobs": logprobs_of(entries, offset),
                         "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}
                    if chat and output.plain:
                        c["delta"] = {"content": text} if text else {}
                    elif chat:
                        s = streams.get(index) or streams.setdefault(index, output.stream())
                        c["delta"] = s.feed(text, final=o.finish_reason is not None)
                        c["finish_reason"] = s.finish_reason(o.finish_reason)
                        if not c["delta"] and not entries and c["finish_reason"] is None:
                            continue  # held back: it may be the start of a marker
                    else:
                        c["text"] = text
                        if token_ids and sent[2] == 0:  # no ids sent yet: the choice's first chunk, as vLLM
                            c["prompt_token_ids"] = prompts[i]
                    if token_ids:  # those a held-back chunk did not send go with the next one
                        c["token_ids"], sent[2] = list(o.token_ids[sent[2]:]), len(o.token_ids)
                    usage_now = extra
                    if continuous:  # vLLM's: this choice's prompt and its tokens so far
                        usage_now = {"usage": usage(len(prompts[i]), len(o.token_ids))}
                    pending.append(_sse({**chunk_head, "choices": [c], **usage_now, "weight_version": version}))
                if pending and gen.queue.empty():  # caught up with the engine: write what we have
                    yield "".join(pending)
                    pending.clear()
            if include_usage:
                pending.append(_sse({**chunk_head, "choices": [], "usage": usage(prompt_tokens, completion_tokens()),
                                     "weight_version": version}))
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
