"""The `pagefleet serve` process: its flags, the engine and adapters at start-up, uvicorn, and a SIGTERM
that drains (/ready false, new requests 503, in-flight requests finish, exit 0)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import time

from pagefleet.worker.entrypoints.api_server import ServerState, build_app
from pagefleet.worker.entrypoints.chat_template import load_chat_template
from pagefleet.worker.entrypoints.engine_args import add_engine_arguments, engine_config_from_args
from pagefleet.worker.entrypoints.reasoning import REASONING_PARSERS
from pagefleet.worker.entrypoints.tool_parsers import TOOL_PARSERS

log = logging.getLogger("pagefleet.server")
# Longer than the idle expiry of the pools that call us (httpx and the openai SDK 5 s, aiohttp 15 s): with
# uvicorn's own 5 s both ends close at the same instant, and a request written into a connection the server is
# closing fails with "Server disconnected without sending a response". The client has to expire first.
KEEP_ALIVE_S = 75.0

def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    add_engine_arguments(parser)  # --model, --max-model-len, --gpu-memory-fraction, ... as for generate and bench
    a("--served-model-name", nargs="+", default=None, help="name(s) clients use (default: the model folder name)")
    a("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
      help="LoRA adapters (PEFT folders) to load at start-up; requests name them as their model (needs --enable-lora)")
    a("--host", default="0.0.0.0")
    a("--port", type=int, default=8000)
    a("--api-key", default=None,
      help="require Authorization: Bearer <key> on the API (default: $PAGEFLEET_API_KEY)")
    a("--max-queue", type=int, default=1024,
      help="requests accepted but without a first token yet (queued or in prefill) before new ones get 429")
    a("--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get after SIGTERM")
    a("--enable-rl-endpoints", action="store_true",
      help="the RL routes: weight updates (disk, tensors, broadcast), pause / resume, sleep / wake_up")
    a("--enable-auto-tool-choice", action="store_true",
      help='serve tool_choice "auto": the reply is parsed for calls ("required" and named functions need no flag)')
    a("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
      help="the model's tool-call format (default: from the model family; hermes for Qwen and others)")
    a("--exclude-tools-when-tool-choice-none", action="store_true",
      help='leave the tools out of the prompt when tool_choice is "none" (default: rendered, as vLLM does)')
    a("--reasoning-parser", choices=REASONING_PARSERS, default=None,
      help="split a reply's <think> block into reasoning_content")
    a("--chat-template", default=None,
      help="a chat template (a Jinja file, or the template inline) in place of the checkpoint's")
    a("--trust-request-chat-template", action="store_true",
      help="let requests bring their own chat_template (a 400 without this flag, as in vLLM)")
    a("--timeout-keep-alive", type=float, default=KEEP_ALIVE_S,
      help="seconds an idle HTTP keep-alive connection stays open")
    a("--engine-process", action=argparse.BooleanOptionalAction,
      default=os.environ.get("PAGEFLEET_ENGINE_PROCESS") == "1",
      help="run the engine's step loop in a process of its own, apart from the HTTP server's GIL "
           "(default: $PAGEFLEET_ENGINE_PROCESS=1, else one process)")
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

    from pagefleet.worker.engine.async_engine import AsyncLLMEngine
    from pagefleet.worker.executor.startup.gc_freeze import freeze_startup_heap

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = engine_config_from_args(args)
        config.serving = True  # vLLM's API-server batch defaults
    except ValueError as e:
        print(f"pagefleet serve: {e}")
        return 2
    if args.max_queue < 1:
        print("pagefleet serve: --max-queue must be at least 1")
        return 2
    chat_template = None
    if args.chat_template is not None:
        try:
            chat_template = load_chat_template(args.chat_template)
        except ValueError as e:
            print(f"pagefleet serve: {e}")
            return 2
    modules = [m.split("=", 1) for m in args.lora_modules]
    if any(len(m) != 2 or not all(m) for m in modules) or (modules and not config.enable_lora):
        print("pagefleet serve: --lora-modules takes NAME=PATH pairs and needs --enable-lora")
        return 2
    try:
        if args.engine_process:
            from pagefleet.worker.engine.engine_process import EngineProcess

            engine = EngineProcess(config)
        else:
            engine = AsyncLLMEngine(config)

        async def load_adapters():  # through the loop thread, as every later load goes
            for name, path in modules:
                await engine.load_lora(name, path)

        asyncio.run(load_adapters())
    except ValueError as e:  # a bad model folder or a setting the model cannot take: say so, no traceback
        print(f"pagefleet serve: {e}")
        return 2
    try:
        api_key = args.api_key or os.environ.get("PAGEFLEET_API_KEY")  # resolved here: never shown in --help
        app = build_app(engine, args.served_model_name, api_key, args.max_queue, args.enable_rl_endpoints,
                        args.tool_call_parser, args.enable_auto_tool_choice, args.reasoning_parser,
                        args.exclude_tools_when_tool_choice_none, chat_template,
                        args.trust_request_chat_template)
        uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                   access_log=not args.disable_access_log, timeout_graceful_shutdown=5,
                                   timeout_keep_alive=args.timeout_keep_alive)
        freeze_startup_heap()  # full GC passes over the start-up heap paused the engine for ~250 ms each
        asyncio.run(_DrainingServer(uv_config, app.state.server, args.drain_timeout).serve())
    finally:
        engine.shutdown()
    return 0
