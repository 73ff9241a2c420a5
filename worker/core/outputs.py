"""What the engine hands back: cumulative text and tokens per sample of a request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)  # one per sampled token with logprobs: a step of 256 rollouts makes 256
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely tokens at that step, best first
    rank: int | None = None  # 1 + how many tokens were more likely (prompt logprobs; None for sampled tokens)


@dataclass
class CompletionOutput:
    index: int
    text: str  # cumulative; never ends in a partial stop string; stop strings are cut
    token_ids: list[int]  # cumulative
    finish_reason: str | None = None  # None while running, then "stop" or "length" (or "abort")
    logprobs: list[TokenLogprobs] | None = None
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    # (weight version, index of the first output token it produced) per version that ran this sample, oldest
    # first: [(v, 0)] for one policy; [(0, 0), (1, 5)] when held by pause("keep") across an update after 5 tokens
    weight_versions: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    weight_version: int = 0  # the weight version that produced the last token
    # every weight version that ran this request, oldest first (two or more: held across an update)
    weight_versions: list[int] = field(default_factory=list)
    # SamplingParams.prompt_logprobs: per prompt token, its logprob given the tokens before it (None for the first
    # token), once the whole prompt is scored; None when not asked for or not scored yet
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)
