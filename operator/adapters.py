"""LoRA adapters without restarts: bring each ready worker's loaded adapters in line with spec.lora.

The adapter list is not in the pod template (a change there would roll every pod). Workers start with
LoRA slots and the adapters' volume only; on each sweep the operator reads a worker's `/load`, which
names the loaded adapters with their folders, unloads those spec.lora no longer lists (or lists at
another path) and loads the missing ones through the worker's own `/v1/unload_lora_adapter` and
`/v1/load_lora_adapter`, as KubeAI's operator does. An adapter still serving requests refuses to
unload; the next sweep tries again. The gateway sends an adapter's requests only to workers whose
`/load` lists it, so a pod that has just become ready is not asked for an adapter it does not hold yet.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from pagefleet.operator import worker_pod


def desired_adapters(spec: Mapping[str, Any]) -> dict[str, str]:
    """Adapter name -> its folder as the worker sees it."""
    lora = spec.get("lora")
    if not lora:
        return {}
    root = worker_pod.lora_root(lora)
    return {a["name"]: f"{root}/{a['path']}" for a in lora["adapters"]}


@dataclass
class WorkerSync:
    url: str
    loaded: dict[str, str] = field(default_factory=dict)  # what the worker holds after this pass
    errors: list[str] = field(default_factory=list)

    @property
    def in_sync(self) -> bool:
        return not self.errors


async def sync_worker(client: httpx.AsyncClient, url: str, desired: Mapping[str, str]) -> WorkerSync:
    """One worker: unloads first, so that slots are free for the loads."""
    result = WorkerSync(url)
    try:
        resp = await client.get(f"{url}/load")
        resp.raise_for_status()
        loaded = dict(resp.json().get("lora_adapters") or {})
    except (httpx.HTTPError, ValueError) as exc:
        result.errors.append(f"{url}: /load failed: {exc}")
        return result
    for name, path in sorted(loaded.items()):
        if desired.get(name) != path:
            if await _post(client, url, "/v1/unload_lora_adapter", {"lora_name": name}, result):
                del loaded[name]
    for name, path in sorted(desired.items()):
        if name not in loaded:
            if await _post(client, url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}, result):
                loaded[name] = path
    result.loaded = loaded
    return result


async def _post(client: httpx.AsyncClient, url: str, path: str, body: dict, result: WorkerSync) -> bool:
    try:
        resp = await client.post(f"{url}{path}", json=body)
    except httpx.HTTPError as exc:
        result.errors.append(f"{url}{path} {body['lora_name']}: {exc}")
        return False
    if resp.status_code != 200:
        try:
            message = resp.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = resp.text[:200]
        result.errors.append(f"{body['lora_name']} on {url}: {message}")
        return False
    return True


async def sync_workers(urls: Sequence[str], desired: Mapping[str, str], timeout: float = 20.0,
                       headers: Mapping[str, str] | None = None) -> list[WorkerSync]:
    """All ready workers of one InferenceService, concurrently. Loading reads an adapter from disk, so
    the timeout is generous; a worker that does not answer is retried on the next sweep. headers: for
    workers started with an API key."""
    async with httpx.AsyncClient(timeout=timeout, headers=headers) as client:
        return list(await asyncio.gather(*(sync_worker(client, url, desired) for url in urls)))


def status_of(desired: Mapping[str, str], results: Sequence[WorkerSync]) -> dict[str, Any]:
    """status.lora: how many ready workers hold exactly spec.lora's adapters, and the first problem."""
    synced = sum(r.in_sync and r.loaded == dict(desired) for r in results)
    errors = [e for r in results for e in r.errors]
    return {
        "adapters": len(desired),
        "workersInSync": f"{synced}/{len(results)}",
        "message": errors[0] if errors else ("" if results else "no ready worker yet"),
    }
