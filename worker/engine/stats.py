"""What the engine reports about itself: per-step records and the counters behind /load and /metrics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepRecord:
    num_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    duration_s: float
    start_s: float = 0.0  # time.perf_counter() when the step began (monotonic: comparable across processes)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    steps_total: int
    recent_steps: list[StepRecord] = field(default_factory=list)
    jump_forward_tokens_total: int = 0  # of the generation tokens, those a grammar forced (no draw)
    max_loras: int = 0  # 0: LoRA off
    running_loras: list[str] = field(default_factory=list)  # adapters of running / waiting requests
    waiting_loras: list[str] = field(default_factory=list)


def collect(engine) -> EngineStats:
    """A snapshot of an LLMEngine's scheduler, block pool, counters and LoRA slots."""
    scheduler, blocks = engine.scheduler, engine.block_manager
    return EngineStats(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        kv_cache_usage=blocks.usage(),
        num_preemptions_total=scheduler.num_preemptions,
        prompt_tokens_total=engine.prompt_tokens_total,
        generation_tokens_total=engine.generation_tokens_total,
        prefix_cache_queries_total=blocks.prefix_queries,
        prefix_cache_hits_total=blocks.prefix_hits,
        steps_total=engine.steps_total,
        recent_steps=list(engine.recent_steps),
        jump_forward_tokens_total=engine.jump_forward_tokens_total,
        **_lora_stats(engine),
    )


def _lora_stats(engine) -> dict:
    """vLLM's lora_requests_info: the slots, and the adapters of running and of waiting requests."""
    lora = engine.runner.lora
    if lora is None:
        return {}
    name_of = {i: name for name, i in lora.id_of.items()}

    def names(seqs) -> list[str]:
        return sorted({name_of[s.lora_id] for s in seqs if s.lora_id in name_of})

    return {"max_loras": lora.max_loras, "running_loras": names(engine.scheduler.running),
            "waiting_loras": names(engine.scheduler.waiting)}
