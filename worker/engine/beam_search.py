"""Beam search as vLLM runs it: every step asks the engine for one token of each live beam with its top 2 x width
logprobs, and the host keeps the `width` best extensions. A beam that ends in an end-of-sequence token is done;
the finished ones are ranked by cumulative logprob over length ** length_penalty. Each step's requests share
their prompt's blocks through the prefix cache, so a step recomputes little beyond its new token.

`BeamSearch` is one prompt's search and knows nothing of the engine: the offline LLM (llm.py) and the server
(entrypoints/api_server.py) drive it with their own generate calls, `step_params` asking for the logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagefleet.worker.core.sampling_params import SamplingParams

MAX_BEAM_WIDTH = 10  # 2 x width logprobs a step, and the engine returns at most 20


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams: beam_width beams, at most max_tokens generated tokens each."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # of the step's draw; the beams follow the model's logprobs whatever it is
    length_penalty: float = 1.0
    skip_special_tokens: bool = True  # in the beams' text (a final end-of-sequence token never is)

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be in [1, {MAX_BEAM_WIDTH}], got {self.beam_width}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")

    def step_params(self) -> SamplingParams:
        """One token with the top 2 x width logprobs; the search, not the engine, ends a beam at its eos."""
        return SamplingParams(max_tokens=1, logprobs=2 * self.beam_width, temperature=self.temperature,
                              ignore_eos=True, detokenize=False)


@dataclass
class BeamSearchSequence:
    """A beam: its tokens (prompt and generated), their summed logprob, and, once searched, its generated text."""

    tokens: list[int]
    cum_logprob: float = 0.0
    text: str = ""
    finish_reason: str | None = None  # "stop" (ended in an eos token) or "length"
    num_prompt_tokens: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence] = field(default_factory=list)  # best first


def beam_score(beam: BeamSearchSequence, eos_token_ids, length_penalty: float) -> float:
    """vLLM's ranking: cumulative logprob over (tokens, prompt included, less a final eos) ** length_penalty."""
    length = len(beam.tokens) - (1 if beam.tokens and beam.tokens[-1] in eos_token_ids else 0)
    return beam.cum_logprob / (length ** length_penalty)


class BeamSearch:
    """One prompt's search: `requests()` gives the live beams' tokens, `advance` takes each one's top logprobs;
    `results()` once `done`."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids, max_model_len: int):
        self.params = params
        self.eos = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.num_prompt_tokens = len(prompt_token_ids)
        self.live = [BeamSearchSequence(list(prompt_token_ids), num_prompt_tokens=len(prompt_token_ids))]
        self.completed: list[BeamSearchSequence] = []
        self.steps = 0

    @property
    def done(self) -> bool:
        return not self.live or self.steps >= self.params.max_tokens

    def requests(self) -> list[list[int]]:
        return [beam.tokens for beam in self.live]

    def advance(self, tops: list[list[tuple[int, float]]]) -> None:
        """tops: for each live beam (requests()' order), its next token's top (token id, logprob) pairs."""
        width = self.params.beam_width
        candidates: list[BeamSearchSequence] = []
        for beam, top in zip(self.live, tops, strict=True):
            for token, logprob in top[: 2 * width]:
                extended = BeamSearchSequence(beam.tokens + [token], beam.cum_logprob + logprob,
                                              num_prompt_tokens=self.num_prompt_tokens)
                if token in self.eos and not self.params.ignore_eos:
                    extended.finish_reason = "stop"
                    self.completed.append(extended)
                else:
                    candidates.append(extended)
        candidates.sort(key=lambda b: b.cum_logprob, reverse=True)  # one length a step: the score's order
        self.live = candidates[:width]
        self.steps += 1
        if self.live and len(self.live[0].tokens) >= self.max_model_len:  # no room for another token
            for beam in self.live:
                beam.finish_reason = "length"
            self.completed.extend(self.live)
            self.live = []

    def results(self, decode=None) -> list[BeamSearchSequence]:
        """The `beam_width` best beams, finished and live, best first; decode(token ids) -> their text (of the
        generated tokens less a final eos)."""
        beams = self.completed + self.live
        for beam in self.live:
            beam.finish_reason = "length"
        beams.sort(key=lambda b: beam_score(b, self.eos, self.params.length_penalty), reverse=True)
        best = beams[: self.params.beam_width]
        if decode is not None:
            for beam in best:
                ids = beam.output_token_ids
                beam.text = decode(ids[:-1] if beam.finish_reason == "stop" else ids)  # less its eos, as vLLM
        return best
