"""Overlapped steps: step N+1 is launched before step N's sampled tokens are read back.

A token still on the device stands in a sequence as PLACEHOLDER; the next step's decodes read it from
the device, and resolving the step puts the real ids in. A mixin of LLMEngine (engine.py), which decides
in `step` whether a batch may overlap.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from pagefleet.worker.engine.stats import StepRecord
from pagefleet.worker.core.outputs import RequestOutput
from pagefleet.worker.core.sequence import Sequence

if TYPE_CHECKING:
    from pagefleet.worker.engine.llm_engine import Request

PLACEHOLDER = -1  # an output token still on the device (overlapped decode)


@dataclass
class PendingStep:
    seqs: list[Sequence]
    tokens: object  # model_runner.PendingTokens
    seq_ids: set[int] = field(default_factory=set)


class OverlappedSteps:
    """LLMEngine's overlapped-step methods. They use the engine's runner, scheduler, block manager,
    requests and `pending` step, and its _append_token / _outputs bookkeeping."""

    def _can_overlap(self, batch) -> bool:
        """True when no sequence that samples in this step needs its token on the host before the next
        step: no logprobs, no penalties (they read the output so far), no samples to fork. Prompt chunks
        that sample nothing never stand in the way; a preemption does (its victim may hold a pending token)."""
        if batch.preempted:
            return False
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.num_computed_tokens + n < seq.num_tokens:
                continue
            p = seq.params
            if seq.pending_forks or p.logprobs is not None or p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
                return False
        return True

    def _drop_finished(self, batch) -> None:
        keep = [i for i, seq in enumerate(batch.seqs) if not seq.is_finished]
        if len(keep) != len(batch.seqs):
            batch.seqs = [batch.seqs[i] for i in keep]
            batch.num_new_tokens = [batch.num_new_tokens[i] for i in keep]

    def _launch_overlapped(self, batch, start: float) -> list[RequestOutput]:
        prev = self.pending
        feed = None
        if prev is not None:  # decodes over a token still on the device read it from there
            row_of = {seq.seq_id: i for i, seq in enumerate(prev.seqs)}
            rows = np.full(sum(batch.num_new_tokens), -1, dtype=np.int64)
            offset = 0
            for seq, n in zip(batch.seqs, batch.num_new_tokens):
                if seq.token_ids[-1] == PLACEHOLDER:
                    rows[offset] = row_of[seq.seq_id]
                offset += n
            feed = (rows, prev.tokens.device)
        logits = self.runner.run(batch, feed)
        sampling: list[Sequence] = []
        num_prefill = num_decode = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            fed = seq.token_ids[-1] == PLACEHOLDER
            if seq.num_computed_tokens + 1 == seq.num_tokens and n == 1:
                num_decode += 1
            else:
                num_prefill += n
            seq.num_computed_tokens += n
            if not fed:  # a block holding a pending token is hashed when the token is known
                self.block_manager.commit_full_blocks(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                sampling.append(seq)
        tokens = self.runner.sample_async(logits, sampling) if sampling else None
        for seq in sampling:
            seq.token_ids.append(PLACEHOLDER)  # the real id arrives when this step is resolved
            p = seq.params
            if (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens) or seq.num_tokens >= self.max_model_len:
                # Its last token is on its way: leave the batch now so the next step does not run it and
                # its blocks serve the queue (stream order keeps this step's writes ahead of their reuse).
                self.scheduler.retire(seq)
        self.pending = PendingStep(sampling, tokens, {s.seq_id for s in sampling}) if sampling else None
        self.steps_total += 1
        self.recent_steps.append(StepRecord(len(batch.seqs), num_prefill, num_decode, time.perf_counter() - start, start))
        return self._resolve(prev) if prev is not None else []

    def _resolve_pending(self) -> list[RequestOutput]:
        prev, self.pending = self.pending, None
        return self._resolve(prev) if prev is not None else []

    def _resolve(self, step: "PendingStep") -> list[RequestOutput]:
        """Read a launched step's tokens back and do what a synchronous step does after sampling."""
        touched: dict[str, Request] = {}
        relaunched = self.pending.seq_ids if self.pending is not None else set()
        for seq, token in zip(step.seqs, step.tokens.read()):
            if seq.is_finished:  # finished (or aborted) while this step ran: its token is dropped
                continue
            again = seq.seq_id in relaunched  # a later step is already running over this token
            at = seq.num_tokens - (2 if again else 1)
            assert seq.token_ids[at] == PLACEHOLDER
            del seq.token_ids[at:]
            self._append_token(seq, token, None)  # stop checks and text see only real tokens
            if again and not seq.is_finished:
                seq.token_ids.append(PLACEHOLDER)
            if not seq.is_finished:
                self.block_manager.commit_full_blocks(seq)
            touched[seq.request_id] = self.requests[seq.request_id]
        return self._outputs(touched)

