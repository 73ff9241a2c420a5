"""`pagefleet gateway`: the real LiteLLM proxy, in our process, with our routing installed.

LiteLLM has no config key for a custom routing strategy, so we run its ASGI app under a
uvicorn.Server in our own asyncio loop, wait until the proxy has built its router from the
config we generated, and then install our strategy on that router. Membership (static or
Kubernetes EndpointSlices) and the prober start at the same moment.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

from pagefleet.gateway import cold_start
from pagefleet.gateway.config import ProxySettings, litellm_config, normalise_worker_url, write_config
from pagefleet.gateway.routing import RoutingPolicy

log = logging.getLogger("pagefleet.gateway")

ROUTINGS = ("prefix-aware", "queue-depth", "simple-shuffle", "least-busy")
OURS = ("prefix-aware", "queue-depth")
METRICS_PATH = "/pagefleet/metrics"

# Longer than the idle expiry of client pools (httpx and the openai SDK 5 s, aiohttp 15 s): at uvicorn's own 5 s
# both ends close at once, and a request written into a closing connection fails with "Server disconnected
# without sending a response" (the e2e prefix-routing bench met it between its two workloads).
KEEP_ALIVE_S = 75.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=4000)
    parser.add_argument("--master-key",
                        default=os.environ.get("PAGEFLEET_MASTER_KEY") or os.environ.get("LITELLM_MASTER_KEY"),
                        help="key clients must send on /v1/* (sk-...); "
                             "default $PAGEFLEET_MASTER_KEY or $LITELLM_MASTER_KEY")
    members = parser.add_argument_group("membership (one of)")
    members.add_argument("--worker", action="append", default=[], metavar="URL",
                         help="a static worker, http://host:port (repeat for more)")
    members.add_argument("--served-model-name", help="model name the static workers serve (the LiteLLM model group)")
    members.add_argument("--kubernetes", action="store_true",
                         help="follow the EndpointSlices of InferenceService Services in --namespace")
    members.add_argument("--namespace", default=os.environ.get("POD_NAMESPACE", "default"))
    routing = parser.add_argument_group("routing")
    routing.add_argument("--routing", choices=ROUTINGS, default="prefix-aware",
                         help="prefix-aware: ours, probed queues + expected prefix-cache hits; queue-depth: ours, "
                              "probed queues only; the others are LiteLLM's own, for comparison")
    routing.add_argument("--probe-interval-ms", type=float, default=200.0)
    routing.add_argument("--probe-timeout-ms", type=float, default=1000.0)
    routing.add_argument("--queue-threshold", type=int, default=5,
                         help="queued requests at which a worker is saturated")
    routing.add_argument("--kv-threshold", type=float, default=0.8,
                         help="KV cache usage at which a worker is saturated")
    routing.add_argument("--queue-weight", type=float, default=1.0, help="weight of the normalised queue term")
    routing.add_argument("--kv-weight", type=float, default=1.0, help="weight of the free-KV-cache term")
    routing.add_argument("--prefix-weight", type=float, default=2.0,
                         help="prefix-aware: weight of the expected prefix hit (share of the prompt a worker holds)")
    routing.add_argument("--load-factor", type=float, default=1.25,
                         help="prefix-aware: a worker earns its prefix term only while its load + 1 is within "
                              "this factor of the mean (bounded loads)")
    routing.add_argument("--prefix-tokenizer", metavar="DIR",
                         help="prefix-aware: the model's folder (tokenizer.json, chat template) to cut prompts into "
                              "the workers' own blocks; default: text chunks, no tokenizer")
    resilience = parser.add_argument_group("resilience")
    resilience.add_argument("--num-retries", type=int, default=3, help="tries on other workers after a failure")
    resilience.add_argument("--cooldown-s", type=float, default=5.0, help="how long a failing worker is skipped")
    resilience.add_argument("--allowed-fails", type=int, default=0,
                            help="failures per minute tolerated before a cooldown")
    resilience.add_argument("--request-timeout-s", type=float, default=600.0)
    parser.add_argument("--max-parallel-requests", type=int, default=None,
                        help="requests in flight through the gateway before it answers 429 (no database needed)")
    parser.add_argument("--worker-api-key", default=os.environ.get("PAGEFLEET_WORKER_API_KEY"),
                        help="key the gateway sends to workers started with --api-key")
    cold_start.add_arguments(parser)
    parser.add_argument("--timeout-keep-alive", type=float, default=KEEP_ALIVE_S,
                        help="seconds an idle client keep-alive connection stays open")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def _validate(args: argparse.Namespace) -> tuple[ProxySettings, RoutingPolicy, list[tuple[str, str]]]:
    if not args.master_key:
        raise SystemExit("pagefleet gateway: --master-key (or $PAGEFLEET_MASTER_KEY) is required")
    if bool(args.worker) == bool(args.kubernetes):
        raise SystemExit("pagefleet gateway: give either --worker URL (one or more) or --kubernetes")
    if args.worker and not args.served_model_name:
        raise SystemExit("pagefleet gateway: static workers need --served-model-name")
    if args.probe_interval_ms <= 0 or args.probe_timeout_ms <= 0:
        raise SystemExit("pagefleet gateway: probe interval and timeout must be > 0")
    try:
        workers = [(args.served_model_name, normalise_worker_url(u)) for u in args.worker]
        settings = ProxySettings(
            master_key=args.master_key,
            # Ours replaces LiteLLM's selection; simple-shuffle is the base it falls back on for sync paths.
            routing_strategy="simple-shuffle" if args.routing in OURS else args.routing,
            num_retries=args.num_retries, request_timeout_s=args.request_timeout_s,
            cooldown_time_s=args.cooldown_s, allowed_fails=args.allowed_fails, worker_api_key=args.worker_api_key,
        )
        policy = RoutingPolicy(queue_threshold=args.queue_threshold, kv_threshold=args.kv_threshold,
                               queue_weight=args.queue_weight, kv_weight=args.kv_weight,
                               prefix_weight=args.prefix_weight, load_factor=args.load_factor)
        if args.prefix_tokenizer and not os.path.isfile(os.path.join(args.prefix_tokenizer, "tokenizer.json")):
            raise ValueError(f"--prefix-tokenizer: no tokenizer.json in {args.prefix_tokenizer}")
        if args.max_parallel_requests is not None and args.max_parallel_requests < 1:
            raise ValueError("--max-parallel-requests must be >= 1")
    except ValueError as exc:
        raise SystemExit(f"pagefleet gateway: {exc}") from None
    return settings, policy, workers


def run(args: argparse.Namespace) -> int:
    settings, policy, workers = _validate(args)
    # Our loggers only: LiteLLM installs its own handlers, and a root handler would print its lines twice.
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    ours = logging.getLogger("pagefleet")
    ours.addHandler(handler)
    ours.setLevel(args.log_level.upper())
    ours.propagate = False
    # Both before litellm is imported: no cost-map download at import, and the proxy finds our config.
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    os.environ["CONFIG_FILE_PATH"] = write_config(litellm_config(settings, [] if args.kubernetes else workers))
    try:
        asyncio.run(serve(args, settings, policy))
    finally:
        os.unlink(os.environ["CONFIG_FILE_PATH"])
    return 0


async def serve(args: argparse.Namespace, settings: ProxySettings, policy: RoutingPolicy) -> None:
    import uvicorn
    from litellm.proxy import proxy_server

    from pagefleet.gateway.auth import MasterKeyOnly
    from pagefleet.gateway.limits import InFlightLimit
    from pagefleet.gateway.membership import Fleet, start_kubernetes_membership
    from pagefleet.gateway.probe import Prober

    prober = Prober(interval_s=args.probe_interval_ms / 1000, timeout_s=args.probe_timeout_ms / 1000,
                    headers={"Authorization": f"Bearer {settings.worker_api_key}"} if settings.worker_api_key else None)
    _mount_metrics(proxy_server.app, prober)
    # Outermost first: readiness gate, key check (a refused key never counts), in-flight cap, LiteLLM.
    app = proxy_server.app
    cold_starts = cold_start.ColdStarts.from_args(args, prober.metrics.registry) if args.kubernetes else None
    if cold_starts is not None:  # innermost: the key check and the in-flight cap apply before a hold
        app = cold_start.ColdStartHold(app, cold_starts)
    if args.max_parallel_requests:
        app = InFlightLimit(app, args.max_parallel_requests)
    # Without a database LiteLLM answers a wrong key with 400 "No connected db."; ours says 401.
    app = MasterKeyOnly(app, settings.master_key, database=bool(os.environ.get("DATABASE_URL")))
    app = NotReadyUntilRouting(app)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                           log_level="warning", timeout_graceful_shutdown=5,
                                           timeout_keep_alive=args.timeout_keep_alive))
    server_task = asyncio.create_task(server.serve(), name="litellm-proxy")
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))

    # The proxy builds llm_router in its lifespan; an on_event('startup') hook would never run here.
    while not (server.started and proxy_server.llm_router is not None):
        if server_task.done():
            await server_task  # start-up failed (port taken, bad config): raise its error
            raise SystemExit("pagefleet gateway: the LiteLLM proxy stopped during start-up")
        await asyncio.sleep(0.05)
    router = proxy_server.llm_router
    fleet = Fleet(router, prober, settings.worker_api_key, cold_starts)
    for model_name, url in ((args.served_model_name, u) for u in map(normalise_worker_url, args.worker)):
        fleet.members.add((model_name, url))  # already in the router from the config file
        prober.add(url)
    if args.routing in OURS:
        _install_strategy(router, prober, policy, _prefix_affinity(args))
    prober.start()
    stop_watch = start_kubernetes_membership(fleet, args.namespace) if args.kubernetes else None
    app.ready = True
    log.info("gateway on %s:%d, routing %s, %d static worker(s)%s", args.host, args.port, args.routing,
             len(args.worker), f", watching EndpointSlices in {args.namespace}" if args.kubernetes else "")
    try:
        await server_task
    finally:
        if stop_watch:
            stop_watch.set()
        await prober.stop()


class NotReadyUntilRouting:
    """/health/readiness answers 503 until our strategy is installed: LiteLLM's own readiness turns
    green as soon as uvicorn listens, and a request routed before that would bypass the strategy."""

    def __init__(self, app):
        self.app = app
        self.ready = False

    async def __call__(self, scope, receive, send):
        if not self.ready and scope["type"] == "http" and scope["path"] == "/health/readiness":
            await send({"type": "http.response.start", "status": 503, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"starting"})
            return
        await self.app(scope, receive, send)


def _prefix_affinity(args: argparse.Namespace):
    """The prefix index for --routing prefix-aware (None otherwise), keyed by tokens or by text chunks."""
    from pagefleet.gateway.prefix import PrefixAffinity
    from pagefleet.gateway.prefix_keys import TextKeys, TokenKeys

    if args.routing != "prefix-aware":
        return None
    return PrefixAffinity(TokenKeys(args.prefix_tokenizer) if args.prefix_tokenizer else TextKeys())


def _install_strategy(router, prober, policy: RoutingPolicy, prefix=None) -> None:
    import litellm

    from pagefleet.gateway.strategy import QueueDepthStrategy, WorkerFailureListener

    router.set_custom_routing_strategy(QueueDepthStrategy(router, prober, policy, prefix=prefix))
    listener = WorkerFailureListener(prober)
    litellm.logging_callback_manager.add_litellm_callback(listener)
    litellm.logging_callback_manager.add_litellm_async_failure_callback(listener)


def _mount_metrics(app, prober) -> None:
    """Our gauges on the proxy's own port, outside /v1 (no key), for Prometheus to scrape."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from starlette.responses import Response

    async def metrics(_request):
        return Response(generate_latest(prober.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.add_route(METRICS_PATH, metrics, methods=["GET"])
