"""One sample of a request: its tokens, status, block table, and the output built so far."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum

from pagefleet.worker.core.outputs import TokenLogprobs
from pagefleet.worker.core.sampling_params import SamplingParams

_seq_ids = itertools.count()


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    index: int  # which of the request's n samples
    token_ids: list[int]  # prompt + output
    num_prompt_tokens: int
    params: SamplingParams
    seed: int | None  # this sample's seed (request seed + index)
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    table_version: int = 0  # +1 whenever the block manager changes block_table (BlockTables keeps rows by it)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of the full blocks, in order
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # of those, served by the prefix cache at (re)admission
    pending_forks: int = 0  # samples still to split off once the prompt is done (n > 1 parents)
    lora_id: int = 0  # the LoRA adapter this sample runs with (0: the base model)
    # (weight version, output tokens before it) for each version that ran this sample, oldest first:
    # more than one only when it was held across a weight update (LLMEngine.pause("keep"))
    weight_versions: list[tuple[int, int]] = field(default_factory=list)
    grammar: object | None = None  # its output's grammar state (engine/structured_output.py): admitted once ready
    jumping: bool = False  # forced tokens of its grammar wait to run (jump-forward): its chunk may be held back
    state_slot: int | None = None  # its slot of recurrent state (hybrid models) while it holds one
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] | None = None
    # params.prompt_logprobs: entry j scores prompt token j + 1 (the first token has nothing before it); filled as
    # prompt chunks run, kept across preemption, shared by the samples forked from it
    prompt_logprobs: list[TokenLogprobs] | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    # incremental detokenisation state
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    num_detokenized: int = 0  # tokens whose text step has run (detokenizer.update_text)
    decode_stream: object | None = None  # its tokenizers DecodeStream once text starts; False: the windows' rule

    def __post_init__(self) -> None:
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = []
        # start the detokeniser a few tokens back into the prompt so the first word gets its leading space
        self.read_offset = self.num_detokenized = self.num_prompt_tokens
        self.prefix_offset = max(self.num_prompt_tokens - 5, 0)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt tokens are still to be scored: its prompt must run in full, not from the prefix cache."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def fork(self, index: int, seed: int | None) -> Sequence:
        """A sibling sample that shares everything computed so far (the block manager shares the blocks)."""
        child = Sequence(self.request_id, index, list(self.token_ids), self.num_prompt_tokens, self.params, seed)
        child.status = self.status
        child.block_hashes = list(self.block_hashes)
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.arrival_time = self.arrival_time
        child.lora_id = self.lora_id
        child.weight_versions = list(self.weight_versions)
        child.prompt_logprobs = self.prompt_logprobs  # scored once, by the parent, before the fork
        child.grammar = self.grammar.fork() if self.grammar is not None else None  # its own matcher
        return child
