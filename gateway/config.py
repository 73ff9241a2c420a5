"""The LiteLLM proxy config we generate: one deployment per worker, retries, cooldowns, the master key.

LiteLLM reads it from the file named by CONFIG_FILE_PATH when its app starts; deployments that
join later go through `Router.add_deployment` with the same `deployment()` entry.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from urllib.parse import urlsplit

import yaml

# Where our strategy finds a deployment's worker (LiteLLM keeps unknown model_info keys).
WORKER_URL_KEY = "pagefleet_worker_url"


def normalise_worker_url(url: str) -> str:
    """`http://host:port` with no path or trailing slash; rejects anything else with a clear message."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
        raise ValueError(f"worker URL must look like http://host:port, got {url!r}")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"worker URL must not have a path (the gateway adds /v1 and /load), got {url!r}")
    return f"{parts.scheme}://{parts.netloc}"


def deployment_id(served_model_name: str, worker_url: str) -> str:
    return f"{served_model_name}@{worker_url}"


def deployment(served_model_name: str, worker_url: str, worker_api_key: str | None = None) -> dict:
    """One LiteLLM model_list entry: the model group is the served model name, the backend one worker."""
    worker_url = normalise_worker_url(worker_url)
    return {
        "model_name": served_model_name,
        "litellm_params": {
            # openai/: the worker speaks the OpenAI API; LiteLLM passes chat and text completions through.
            "model": f"openai/{served_model_name}",
            "api_base": f"{worker_url}/v1",
            # The OpenAI client insists on a key; the worker ignores it unless started with --api-key.
            "api_key": worker_api_key or "none",
        },
        "model_info": {"id": deployment_id(served_model_name, worker_url), WORKER_URL_KEY: worker_url},
    }


@dataclass(frozen=True)
class ProxySettings:
    master_key: str
    routing_strategy: str = "simple-shuffle"  # LiteLLM's base strategy; ours replaces it unless --routing litellm
    num_retries: int = 3
    request_timeout_s: float = 600.0
    cooldown_time_s: float = 5.0
    allowed_fails: int = 0  # a worker that fails is cooled down at once: in a fleet, another can take the request
    worker_api_key: str | None = None

    def __post_init__(self):
        if not self.master_key.startswith("sk-"):
            raise ValueError("the LiteLLM master key must start with 'sk-'")
        if self.num_retries < 0 or self.cooldown_time_s < 0 or self.allowed_fails < 0:
            raise ValueError("num_retries, cooldown_time_s and allowed_fails must be >= 0")


def litellm_config(settings: ProxySettings, workers: list[tuple[str, str]]) -> dict:
    """The whole proxy config for `workers`, a list of (served model name, worker URL)."""
    config = {
        "model_list": [deployment(name, url, settings.worker_api_key) for name, url in workers],
        "router_settings": {
            "routing_strategy": settings.routing_strategy,
            "num_retries": settings.num_retries,
            "timeout": settings.request_timeout_s,
            "cooldown_time": settings.cooldown_time_s,
            "allowed_fails": settings.allowed_fails,
            # A retry goes to another worker at once: waiting helps a single overloaded backend, not a fleet.
            "retry_after": 0,
        },
        "litellm_settings": {
            "num_retries": settings.num_retries,
            "request_timeout": settings.request_timeout_s,
            # No telemetry: the gateway may run without outside network.
            "telemetry": False,
            "drop_params": True,
        },
        "general_settings": {"master_key": settings.master_key},
    }
    return config


def write_config(config: dict, directory: str | None = None) -> str:
    """Writes `config` as YAML to a private temporary file and returns its path."""
    fd, path = tempfile.mkstemp(prefix="pagefleet-litellm-", suffix=".yaml", dir=directory)
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(config, f, sort_keys=False)
    return path
