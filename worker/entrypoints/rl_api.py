"""The RL endpoints, named as SGLang's and vLLM's: weight updates, pause and resume, sleep and wake, while serving.

They change what the server serves, so they exist only with --enable-rl-endpoints and sit behind the API key.
Every engine call runs on the engine's loop thread between two steps (AsyncLLMEngine); the handlers await it,
so a pause that drains, a rendezvous or a broadcast never blocks the event loop. Answers are JSON with
`success`, `message` and the engine's `weight_version`; a bad body or a refused update is a 400 in the OpenAI
error shape, and the engine keeps serving its old weights.

    POST /update_weights_from_disk        {"model_path"}
    POST /init_weights_update_group       {"master_address", "master_port", "rank_offset", "world_size",
                                           "group_name", "backend"}
    POST /update_weights_from_distributed {"names", "dtypes", "shapes", "group_name"}
    POST /update_weights_from_tensor      {"serialized_named_tensors"}
    POST /pause {"mode": "abort" | "wait" | "keep"} (or ?mode=, as vLLM),  POST /resume,  GET /is_paused
    POST /sleep?level=1|2,  POST /wake_up[?tags=weights&tags=kv_cache],  GET /is_sleeping
    POST /load_lora_adapter_from_tensors   {"lora_name", "config_dict", "serialized_tensors"} (also at
                                           /load_lora_adapter_from_tensor); needs --enable-lora as well
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import FastAPI, Query, Request
from pydantic import Field, ValidationError

from pagefleet.worker.entrypoints.protocol import ERROR_RESPONSES, APIError, _Request

PAUSE_MODES = ("abort", "wait", "keep")
WAKE_TAGS = ("weights", "kv_cache")


class _UpdateRequest(_Request):
    # SGLang's common fields. The prefix cache always goes with the old weights (its KV was computed by them),
    # and the version is the engine's own counter, so the two fields that would say otherwise are refused.
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | int | None = None
    load_format: str | None = None


class UpdateWeightsFromDiskRequest(_UpdateRequest):
    model_path: str = Field(min_length=1)


class InitWeightsUpdateGroupRequest(_Request):
    master_address: str = Field(min_length=1)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)  # rank 0 is the trainer
    world_size: int = Field(ge=2)
    group_name: str = Field(default="weight_update_group", min_length=1)
    backend: str | None = None  # None: nccl on a GPU, gloo on the CPU


class UpdateWeightsFromDistributedRequest(_UpdateRequest):
    names: list[str] = Field(min_length=1)
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = Field(default="weight_update_group", min_length=1)


class UpdateWeightsFromTensorRequest(_UpdateRequest):
    # SGLang sends one serialized string per tensor-parallel rank; one rank here, so one string (or the string)
    serialized_named_tensors: list[str] | str


class LoadLoRAFromTensorsRequest(_Request):
    # SGLang's fields: PEFT tensor names, adapter_config.json fields, the string of serialize_named_tensors
    lora_name: str = Field(min_length=1)
    config_dict: dict
    serialized_tensors: str = Field(min_length=1)
    pinned: bool = False  # an adapter here stays loaded until unloaded: every one is pinned
    load_format: str | None = None


class PauseRequest(_Request):
    mode: Literal["abort", "wait", "keep"] = "abort"


def _check_update(body: _UpdateRequest) -> None:
    if not body.flush_cache:
        raise APIError(400, "flush_cache=false is not supported: cached KV was computed by the old weights.",
                       param="flush_cache")
    if body.weight_version is not None:
        raise APIError(400, "weight_version is counted by the engine (+1 per update); leave it out.",
                       param="weight_version")
    if body.load_format not in (None, "auto"):
        raise APIError(400, f"load_format {body.load_format!r} is not supported; leave it out.", param="load_format")


def add_rl_routes(app: FastAPI, state) -> None:
    engine = state.engine

    def answer(message: str, **extra) -> dict:
        return {"success": True, "message": message, "weight_version": engine.weight_version, **extra}

    async def update(body: _UpdateRequest, param: str, call, *args):
        _check_update(body)
        try:
            version = await call(*args, abort_all_requests=body.abort_all_requests)
        except ValueError as e:
            raise APIError(400, str(e), param=param) from None
        return answer(f"Succeeded to update model weights (weight version {version}).")

    @app.post("/update_weights_from_disk", responses=ERROR_RESPONSES)
    async def update_weights_from_disk(body: UpdateWeightsFromDiskRequest):
        return await update(body, "model_path", engine.update_weights_from_disk, body.model_path)

    @app.post("/update_weights_from_tensor", responses=ERROR_RESPONSES)
    async def update_weights_from_tensor(body: UpdateWeightsFromTensorRequest):
        blobs = body.serialized_named_tensors
        blobs = [blobs] if isinstance(blobs, str) else blobs
        if len(blobs) != 1:
            raise APIError(400, f"serialized_named_tensors needs one entry (one tensor-parallel rank), got "
                           f"{len(blobs)}.", param="serialized_named_tensors")
        return await update(body, "serialized_named_tensors", engine.update_weights_from_tensor, blobs[0])

    @app.post("/init_weights_update_group", responses=ERROR_RESPONSES)
    async def init_weights_update_group(body: InitWeightsUpdateGroupRequest):
        if body.rank_offset >= body.world_size:
            raise APIError(400, f"rank_offset ({body.rank_offset}) must be below world_size ({body.world_size}).",
                           param="rank_offset")
        try:
            await engine.init_weights_update_group(body.master_address, body.master_port, body.rank_offset,
                                                   body.world_size, body.group_name, body.backend)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        return answer(f"Joined the weight update group {body.group_name!r} as rank {body.rank_offset}.")

    @app.post("/update_weights_from_distributed", responses=ERROR_RESPONSES)
    async def update_weights_from_distributed(body: UpdateWeightsFromDistributedRequest):
        if not len(body.names) == len(body.dtypes) == len(body.shapes):
            raise APIError(400, f"names, dtypes and shapes must have one entry per tensor, got {len(body.names)}, "
                           f"{len(body.dtypes)} and {len(body.shapes)}.", param="names")
        return await update(body, "names", engine.update_weights_from_distributed, body.names, body.dtypes,
                            [tuple(s) for s in body.shapes], body.group_name)

    async def load_lora_adapter_from_tensors(body: LoadLoRAFromTensorsRequest):
        if body.load_format not in (None, "auto"):
            raise APIError(400, f"load_format {body.load_format!r} is not supported: send the string of "
                           f"serialize_named_tensors.", param="load_format")
        if body.lora_name in state.served_model_names:
            raise APIError(400, f"`{body.lora_name}` is the base model's name.", param="lora_name")
        try:
            await engine.load_lora_from_tensors(body.lora_name, body.serialized_tensors, body.config_dict)
        except ValueError as e:
            raise APIError(400, str(e), param="serialized_tensors") from None
        return {"success": True, "message": f"Success: LoRA adapter '{body.lora_name}' added successfully."}

    for path in ("/load_lora_adapter_from_tensors", "/load_lora_adapter_from_tensor"):  # SGLang's name, and ours
        app.post(path, responses=ERROR_RESPONSES)(load_lora_adapter_from_tensors)

    @app.post("/pause", responses=ERROR_RESPONSES)
    async def pause(request: Request, mode: str | None = None):  # ?mode= as vLLM; else the body
        raw = await request.body()
        try:
            body = PauseRequest.model_validate_json(raw) if raw.strip() else PauseRequest()
        except ValidationError as e:
            first = e.errors()[0]
            raise APIError(400, f"mode: {first['msg']}" if first.get("loc") == ("mode",) else
                           f"The body is not a valid pause request: {first['msg']}", param="mode") from None
        mode = mode if mode is not None else body.mode
        if mode not in PAUSE_MODES:
            raise APIError(400, f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}.", param="mode")
        try:
            await engine.pause(mode)
        except ValueError as e:
            raise APIError(400, str(e), param="mode") from None
        return answer(f"Paused ({mode}).", is_paused=True)

    @app.post("/resume", responses=ERROR_RESPONSES)
    async def resume():
        try:
            await engine.resume()
        except ValueError as e:
            raise APIError(400, str(e)) from None
        return answer("Resumed.", is_paused=False)

    @app.get("/is_paused")
    async def is_paused():
        return {"is_paused": engine.is_paused}

    @app.post("/sleep", responses=ERROR_RESPONSES)
    async def sleep(level: int = 1):
        if level not in (1, 2):
            raise APIError(400, f"level must be 1 (weights to host memory) or 2 (weights dropped), got {level}.",
                           param="level")
        try:
            await engine.sleep(level)
        except ValueError as e:
            raise APIError(400, str(e), param="level") from None
        return answer(f"Asleep at level {level}.", is_sleeping=True)

    @app.post("/wake_up", responses=ERROR_RESPONSES)
    async def wake_up(tags: Annotated[list[str] | None, Query()] = None):
        bad = [t for t in tags or [] if t not in WAKE_TAGS]
        if bad:
            raise APIError(400, f"tags must be among {', '.join(WAKE_TAGS)}, got {', '.join(map(repr, bad))}.",
                           param="tags")
        try:
            await engine.wake_up(tags or None)
        except ValueError as e:
            raise APIError(400, str(e), param="tags") from None
        return answer("Awake." if not engine.is_sleeping else f"Restored {', '.join(tags)}.",
                      is_sleeping=engine.is_sleeping)

    @app.get("/is_sleeping")
    async def is_sleeping():
        return {"is_sleeping": engine.is_sleeping}
