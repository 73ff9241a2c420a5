"""The LoRA adapter endpoints, named as vLLM's: load and unload an adapter while the server runs.

POST /v1/load_lora_adapter {"lora_name", "lora_path"} and POST /v1/unload_lora_adapter {"lora_name"};
a loaded adapter is then a model: requests name it in `model`, and /v1/models lists it with its parent.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import Field

from pagefleet.worker.entrypoints.protocol import ERROR_RESPONSES, APIError, _Request


class LoadLoRARequest(_Request):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRARequest(_Request):
    lora_name: str = Field(min_length=1)


def add_lora_routes(app: FastAPI, state) -> None:
    @app.post("/v1/load_lora_adapter", responses=ERROR_RESPONSES, response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoRARequest):
        if body.lora_name in state.served_model_names:
            raise APIError(400, f"`{body.lora_name}` is the base model's name.", param="lora_name")
        try:
            await state.engine.load_lora(body.lora_name, body.lora_path)
        except ValueError as e:
            raise APIError(400, str(e), param="lora_path") from None
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    @app.post("/v1/unload_lora_adapter", responses=ERROR_RESPONSES, response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoRARequest):
        if body.lora_name not in state.engine.lora_names():
            raise APIError(404, f"The LoRA adapter `{body.lora_name}` is not loaded.", param="lora_name",
                           code="model_not_found")
        try:
            await state.engine.unload_lora(body.lora_name)
        except ValueError as e:
            raise APIError(400, str(e), param="lora_name") from None
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
