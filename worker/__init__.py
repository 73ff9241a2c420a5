"""pagefleet.worker: the inference engine (paged KV cache, continuous batching) and its server."""

from pagefleet.worker.core.config import EngineConfig
from pagefleet.worker.core.outputs import CompletionOutput, RequestOutput
from pagefleet.worker.core.sampling_params import SamplingParams


def __getattr__(name):  # LLM pulls in torch and transformers: import it only when asked for
    if name == "LLM":
        from pagefleet.worker.engine.llm import LLM

        return LLM
    if name == "BeamSearchParams":
        from pagefleet.worker.engine.beam_search import BeamSearchParams

        return BeamSearchParams
    raise AttributeError(name)


__all__ = ["LLM", "EngineConfig", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput"]
