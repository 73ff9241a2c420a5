"""pagefleet.worker: the inference engine (paged KV cache, continuous batching) and its server."""

from pagefleet.worker.config import EngineConfig
from pagefleet.worker.outputs import CompletionOutput, RequestOutput
from pagefleet.worker.sampling import SamplingParams


def __getattr__(name):  # LLM pulls in torch and transformers: import it only when asked for
    if name == "LLM":
        from pagefleet.worker.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput"]
