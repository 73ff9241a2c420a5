"""Our LiteLLM routing strategy: LiteLLM filters (cooldowns, retries' exclusions), we choose.

LiteLLM's `least-busy` counts only the proxy's own in-flight requests; this strategy asks the
workers (through the prober) how long their queues are and how full their KV caches are.
With a `PrefixAffinity` (--routing prefix-aware) it also scores the share of the prompt each worker
is expected to hold, and records the routed prompt under the chosen worker.
A failure callback marks a worker that refused a connection as down at once, so a retry that
follows within the same millisecond does not pick it again before the next probe.
"""

from __future__ import annotations

import logging
import random

from litellm.integrations.custom_logger import CustomLogger
from litellm.types.router import CustomRoutingStrategyBase

from pagefleet.gateway.config import WORKER_URL_KEY
from pagefleet.gateway.prefix import PrefixAffinity
from pagefleet.gateway.probe import Prober
from pagefleet.gateway.routing import RoutingPolicy, WorkerLoad, choose, holding

log = logging.getLogger("pagefleet.gateway.strategy")


def worker_url_of(deployment: dict) -> str:
    """The worker behind a LiteLLM deployment: our model_info key, else its api_base without /v1."""
    url = (deployment.get("model_info") or {}).get(WORKER_URL_KEY)
    if url:
        return url
    api_base = (deployment.get("litellm_params") or {}).get("api_base") or ""
    return api_base.rstrip("/").removesuffix("/v1")


def is_chat(request_kwargs: dict | None) -> bool:
    """A chat completion (the worker applies its chat template) unless the proxy's URL says /completions."""
    url = ((request_kwargs or {}).get("proxy_server_request") or {}).get("url") or ""
    return not (url.endswith("/completions") and not url.endswith("/chat/completions"))


def cache_salt_of(request_kwargs: dict | None) -> str | None:
    """The request's vLLM cache_salt (the workers share its prefix-cache entries only with the same salt)."""
    body = ((request_kwargs or {}).get("proxy_server_request") or {}).get("body") or {}
    salt = body.get("cache_salt") if isinstance(body, dict) else None
    return salt if isinstance(salt, str) and salt else None


class QueueDepthStrategy(CustomRoutingStrategyBase):
    def __init__(self, router, prober: Prober, policy: RoutingPolicy, rng: random.Random | None = None,
                 prefix: PrefixAffinity | None = None):
        self.router = router
        self.prober = prober
        self.policy = policy
        self.rng = rng or random.Random()
        self.prefix = prefix  # None: queue depth and KV only

    def pick(self, deployments: list[dict], model: str | None = None, messages: list[dict] | None = None,
             chat: bool = True, cache_salt: str | None = None) -> dict:
        by_url = {}
        for d in deployments:
            by_url.setdefault(worker_url_of(d), d)
        loads = [self.prober.snapshot(url) or WorkerLoad(url=url) for url in by_url]
        if model is not None:
            loads = holding(loads, model)
        lookup = None
        if self.prefix is not None:
            self.prefix.index.retain(self.prober.loads)  # workers that left take their entries with them
            lookup = self.prefix.lookup(loads, model or "", messages, chat, cache_salt)
        decision = choose(loads, self.policy, self.rng, lookup.hits if lookup else None,
                          lookup.held if lookup else None)
        self.prober.note_sent(decision.url)
        if lookup is not None:
            hit, blocks = self.prefix.record(decision.url, lookup)
            self.prober.metrics.prefix_queried.labels(decision.url).inc(blocks)
            self.prober.metrics.prefix_expected.labels(decision.url).inc(hit)
        self.prober.metrics.decisions.labels(decision.url, decision.reason).inc()
        log.debug("routed to %s (%s) scores=%s", decision.url, decision.reason, decision.scores)
        return by_url[decision.url]

    async def async_get_available_deployment(self, model, messages=None, input=None, specific_deployment=False,
                                             request_kwargs=None):
        # LiteLLM's own filters: model group, cooldowns, deployments a retry must skip.
        healthy = await self.router.async_get_healthy_deployments(
            model=model, request_kwargs=request_kwargs if request_kwargs is not None else {},
            messages=messages, input=input, specific_deployment=specific_deployment,
        )
        if isinstance(healthy, dict):  # the caller named one deployment
            return healthy
        return self.pick(healthy, model, messages, is_chat(request_kwargs), cache_salt_of(request_kwargs))

    def get_available_deployment(self, model, messages=None, input=None, specific_deployment=False,
                                 request_kwargs=None):
        # The proxy's request path is async; LiteLLM's sync helpers still get a sensible answer.
        model, healthy = self.router._common_checks_available_deployment(
            model=model, messages=messages, input=input, specific_deployment=specific_deployment,
            request_kwargs=request_kwargs or {},
        )
        if isinstance(healthy, dict):
            return healthy
        if not healthy:
            raise ValueError(f"no deployments for model {model!r}")
        return self.pick(healthy, model, messages, is_chat(request_kwargs), cache_salt_of(request_kwargs))


class WorkerFailureListener(CustomLogger):
    """Marks a worker down when a request to it could not connect (killed pod, closed port)."""

    def __init__(self, prober: Prober):
        super().__init__()
        self.prober = prober

    async def async_log_failure_event(self, kwargs, response_obj, start_time, end_time):
        exc = kwargs.get("exception")
        log.debug("failure event: %r", exc)
        if not _is_connection_failure(exc):
            return
        params = kwargs.get("litellm_params") or {}
        model_info = params.get("model_info") or {}
        url = model_info.get(WORKER_URL_KEY)
        if not url and params.get("api_base"):
            url = params["api_base"].rstrip("/").removesuffix("/v1")
        if url:
            log.warning("request to %s failed to connect (%s); out until its probe answers", url, type(exc).__name__)
            self.prober.note_failed(url)


def _is_connection_failure(exc) -> bool:
    import litellm

    if exc is None:
        return False
    if isinstance(exc, litellm.APIConnectionError):
        return True
    text = str(exc)
    return any(s in text for s in ("Connection error", "Connection refused", "ConnectError", "Connection reset",
                                   "Server disconnected"))
