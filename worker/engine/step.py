"""The engine's one step path: schedule, launch (forward and sampling), resolve the sampled tokens.

Every step launches; the launched step is resolved at once (depth 0: tokens and logprobs read back with
`runner.sample`), or, when nothing in it needs the host to see a token first, on the next step
(depth 1: `runner.sample_async`), after that step is already running on the device. A token still on the
device stands in its sequence as PLACEHOLDER; the next step's decodes read it from the device, and
resolving puts the real id in. Overlapped, the host's scheduling and bookkeeping hide behind the forward
and outputs lag one step. A step that samples rows with a grammar (structured outputs) overlaps too: after
queuing its forward it reads the previous step's tokens, which its matchers accept, and fills its bitmask while
the forward runs. With jump-forward on, a grammar row's forced tokens join it when its token is resolved,
and the next step runs them as a chunk: a sequence whose token brought forced ones samples nothing in the
step already launched over that token. A mixin of LLMEngine (llm_engine.py): it uses the engine's runner,
scheduler, block manager, requests and counters, and its `_outputs`.
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from pagefleet.worker.core.detokenizer import find_stop, update_text
from pagefleet.worker.core.outputs import RequestOutput, TokenLogprobs
from pagefleet.worker.core.scheduler import ScheduledBatch
from pagefleet.worker.core.sequence import Sequence, SequenceStatus
from pagefleet.worker.engine.stats import StepRecord

if TYPE_CHECKING:
    from pagefleet.worker.engine.llm_engine import Request

PLACEHOLDER = -1  # an output token still on the device (overlapped step)
FINISHED = SequenceStatus.FINISHED
GRAMMAR_WAIT_S = 0.01  # an empty step with grammars compiling waits this long for one, instead of spinning


def token_finish(p, token: int, num_output: int, length: int, eos_token_ids, max_model_len: int):
    """The finish rules a sampled token meets after stop strings and grammars: (finish_reason, stop_reason) for
    an end of sequence, a stop token or a length limit (num_output tokens out, length in all), else None."""
    if num_output >= p.min_tokens and not p.ignore_eos and token in eos_token_ids:
        return "stop", None
    if token in p.stop_token_ids and num_output >= p.min_tokens:
        return "stop", token
    if (p.max_tokens is not None and num_output >= p.max_tokens) or length >= max_model_len:
        return "length", None
    return None


@dataclass
class PendingStep:
    """A launched step's sampling sequences and their tokens: `tokens` is model_runner.PendingTokens while
    they are on the device (overlapped), the host list with `logprobs` beside it once read back."""

    seqs: list[Sequence]
    tokens: object
    logprobs: list | None = None
    seq_ids: set[int] = field(default_factory=set)  # overlapped: whose token a later step may read on the device


class EngineStep:
    """LLMEngine's step: `step` and the bookkeeping every launched step shares."""

    pending: PendingStep | None  # an overlapped step not yet read back
    _resolved_early: dict | None = None  # the previous step, resolved inside this one's launch (grammar rows)

    def step(self) -> list[RequestOutput]:
        """Schedule, launch, resolve. Steps overlap when nothing in them needs the host to see a token first:
        step N+1 (decodes and prompt chunks alike) is launched before step N's tokens are read back (depth 1);
        any other step is resolved in the call that launched it (depth 0)."""
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        overlap = self.config.async_scheduling and bool(batch.seqs) and self._can_overlap(batch)
        outputs: list[RequestOutput] = self._fail_grammars(batch.failed) if batch.failed else []
        if self.pending is not None and not overlap:
            prev, self.pending = self.pending, None
            outputs += self._outputs(self._resolve(prev))
            self._drop_finished(batch)  # a token read just now may have ended one of them
        if not batch.seqs:
            if self.structured is not None and self.structured.live and not outputs:
                self._wait_for_grammars()
            return outputs
        prev = self.pending  # a step still on the device when this one overlaps it
        launched, num_prefill, num_decode = self._launch(batch, prev, overlap)
        if overlap:
            self.pending = launched
            self._record(batch, num_prefill, num_decode, start)
            early, self._resolved_early = self._resolved_early, None
            if early is not None:  # read at launch, for the grammars' bitmask
                return self._outputs(early)
            return self._outputs(self._resolve(prev)) if prev is not None else []
        touched = self._resolve(launched) if launched is not None else {}
        self._record(batch, num_prefill, num_decode, start)  # a synchronous step's time includes its tokens
        return outputs + self._outputs(touched)

    def _can_overlap(self, batch: ScheduledBatch) -> bool:
        """True unless a sequence that samples in this step has samples to fork (the forks split off on the
        host before sampling) or the step preempts (its victim may hold a pending token). Penalties count
        tokens on the device and logprobs come back with the tokens, so neither needs a synchronous step;
        prompt chunks that sample nothing never stand in the way. Grammar rows overlap too: their step reads
        the previous one's tokens after its forward is launched and before it samples (_launch). Rows with bad
        words of several tokens do not: the sampler compares their output's last tokens on the host."""
        if batch.preempted or batch.prompt_logprob_spans() or self.runner.sampler.needs_outputs(batch.seqs):
            return False
        return not any(seq.pending_forks and seq.num_computed_tokens + n >= seq.num_tokens
                       for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True))

    def _wait_for_grammars(self) -> None:
        """Nothing to run but grammars still compiling: wait a moment for one (the compile pool gets the CPU)."""
        futures = [s.grammar.future for s in self.scheduler.waiting if s.grammar is not None and not s.grammar.ready]
        if futures:
            wait_futures(futures, timeout=GRAMMAR_WAIT_S, return_when=FIRST_COMPLETED)

    def _fail_grammars(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """Sequences whose grammar failed to compile end now: finish reason "abort", the reason in stop_reason."""
        touched: dict[str, Request] = {}
        for seq in seqs:
            seq.finish_reason, seq.stop_reason = "abort", f"the grammar failed to compile: {seq.grammar.error}"
            self._finish(seq)
            if seq.request_id in self.requests:
                touched[seq.request_id] = self.requests[seq.request_id]
        return self._outputs(touched)

    def _drop_finished(self, batch: ScheduledBatch) -> None:
        """Take the sequences that finished since the batch was scheduled out of it."""
        keep = [i for i, seq in enumerate(batch.seqs) if not seq.is_finished]
        if len(keep) != len(batch.seqs):
            batch.seqs = [batch.seqs[i] for i in keep]
            batch.num_new_tokens = [batch.num_new_tokens[i] for i in keep]
            batch.scoring = None  # its rows moved

    def _launch(self, batch: ScheduledBatch, prev: PendingStep | None,
                overlap: bool) -> tuple[PendingStep | None, int, int]:
        """Run the batch and sample its sequences whose prompt is done: (the launched step, None when none
        samples; prefill tokens; decode tokens)."""
        feed = self._feed(batch, prev) if prev is not None else None
        spans = batch.prompt_logprob_spans()  # before the loop below moves num_computed_tokens
        logits = self.runner.run(batch, feed)
        if spans:
            self._add_prompt_logprobs(batch.seqs, spans)
        sampling: list[Sequence] = []
        num_prefill = num_decode = 0
        commit = self.block_manager.commit_full_blocks
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):  # every running sequence: kept to reads
            ids = seq.token_ids
            computed, total = seq.num_computed_tokens, len(ids)
            if computed + 1 == total and n == 1:
                num_decode += 1
            else:
                num_prefill += n
            seq.num_computed_tokens = computed = computed + n
            if ids[-1] != PLACEHOLDER:  # a block holding a pending token is hashed when the token is known
                commit(seq)
            if computed == total:  # a prompt chunk that is not the last samples nothing
                sampling.append(seq)
                seq.jumping = False  # its forced tokens, if any, have run
        if not sampling:
            return None, num_prefill, num_decode
        if not overlap:
            if any(seq.pending_forks for seq in sampling):
                sampling, rows = self._fork_samples(sampling)
                logits = logits[rows]
            tokens, logprobs = self.runner.sample(logits, sampling)
            return PendingStep(sampling, tokens, logprobs), num_prefill, num_decode
        if (prev is not None and self.structured is not None and self.structured.live
                and any(seq.grammar is not None for seq in sampling)):
            # The matchers need the previous step's tokens before this step's bitmask: read them now, with this
            # step's forward already queued behind them, so the device keeps running while the host fills it.
            self._resolved_early = self._resolve(prev, relaunched=set())
            # ended by the token just read, or given forced tokens after it: nothing to sample now
            if any(seq.is_finished or seq.num_computed_tokens < len(seq.token_ids) for seq in sampling):
                keep = [i for i, seq in enumerate(sampling)
                        if not seq.is_finished and seq.num_computed_tokens == len(seq.token_ids)]
                if not keep:
                    return None, num_prefill, num_decode
                sampling, logits = [sampling[i] for i in keep], logits[keep]
        tokens = self.runner.sample_async(logits, sampling)
        max_model_len = self.max_model_len
        for seq in sampling:
            ids = seq.token_ids
            ids.append(PLACEHOLDER)  # the real id arrives when this step is resolved
            max_tokens = seq.params.max_tokens
            if ((max_tokens is not None and len(ids) - seq.num_prompt_tokens >= max_tokens)
                    or len(ids) >= max_model_len):
                # Its last token is on its way: leave the batch now so the next step does not run it and
                # its blocks serve the queue (stream order keeps this step's writes ahead of their reuse).
                self.scheduler.retire(seq)
        return PendingStep(sampling, tokens, None, {s.seq_id for s in sampling}), num_prefill, num_decode

    def _add_prompt_logprobs(self, seqs: list[Sequence], spans: list[tuple[int, int, int]]) -> None:
        """The prompt tokens this step scored, appended to their sequences (spans: batch.prompt_logprob_spans())."""
        own, rank, top_ids, top_lps = self.runner.take_prompt_logprobs()
        step_k = len(top_ids[0]) if top_ids else 0  # the most any sequence of the step asked for
        at = 0
        for i, start, end in spans:  # one comprehension a sequence: a 2,048-token chunk makes 2,048 entries
            seq, rows = seqs[i], slice(at, at + end - start)
            at = rows.stop
            k = seq.params.prompt_logprobs
            ids, lps = top_ids[rows], top_lps[rows]
            if k < step_k:
                ids, lps = [t[:k] for t in ids], [t[:k] for t in lps]
            seq.prompt_logprobs.extend(TokenLogprobs(token, lp, list(zip(t, tl)), r) for token, lp, r, t, tl in zip(
                seq.token_ids[start + 1 : end + 1], own[rows], rank[rows], ids, lps))

    @staticmethod
    def _feed(batch: ScheduledBatch, prev: PendingStep) -> tuple[np.ndarray, object]:
        """Decodes over a token still on the device read it from there: (row in prev's tokens or -1 per
        scheduled token, prev's tokens on the device)."""
        seqs = batch.seqs
        if batch.num_new_tokens.count(1) == len(seqs) and seqs == prev.seqs:
            # the steady decode step: the same sequences in the same order (a list compare by identity, in C),
            # one token each, and each fed where its last token is the one prev sampled for it
            fed = np.fromiter((s.token_ids[-1] == PLACEHOLDER for s in seqs), dtype=bool, count=len(seqs))
            return np.where(fed, np.arange(len(seqs)), -1), prev.tokens.device
        row_of = {seq.seq_id: i for i, seq in enumerate(prev.seqs)}
        rows = np.full(sum(batch.num_new_tokens), -1, dtype=np.int64)
        offset = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            if seq.token_ids[-1] == PLACEHOLDER:
                rows[offset] = row_of[seq.seq_id]
            offset += n
        return rows, prev.tokens.device

    def _fork_samples(self, sampling: list[Sequence]) -> tuple[list[Sequence], list[int]]:
        """n > 1: a prompt is done; its other samples split off here, sharing every block and the prompt's
        logits row. Returns the sampling sequences, each sample right behind its parent, and their rows."""
        forked: list[Sequence] = []
        rows: list[int] = []
        for row, parent in enumerate(sampling):
            forked.append(parent)
            rows.append(row)
            if not parent.pending_forks:
                continue
            request = self.requests[parent.request_id]
            for _ in range(parent.pending_forks):
                index = len(request.seqs)
                child = parent.fork(index, None if parent.seed is None else parent.seed + index)
                if child.grammar is not None:  # its own matcher, forked from the parent's
                    self.structured.live += 1
                self.block_manager.fork(parent, child)
                self.scheduler.add_forked(parent, child)
                request.seqs.append(child)
                forked.append(child)
                rows.append(row)
            parent.pending_forks = 0
        return forked, rows

    def _resolve(self, step: PendingStep, relaunched: set[int] | None = None) -> dict[str, Request]:
        """Put a launched step's tokens into its sequences and check their finish rules; the requests touched.
        relaunched: the sequences a later step is already running over this step's token (default: the pending
        step's)."""
        touched: dict[str, Request] = {}
        requests = self.requests
        if step.logprobs is not None:  # read back at launch: nothing ran since
            jump = self.structured is not None and self.structured.jump_forward
            for seq, token, logprob in zip(step.seqs, step.tokens, step.logprobs, strict=True):
                touched[seq.request_id] = requests[seq.request_id]
                self._append_token(seq, token, logprob)
                if jump and seq.grammar is not None and seq.status is not FINISHED:
                    self._jump_forward(seq)
            return touched
        if relaunched is None:
            relaunched = self.pending.seq_ids if self.pending is not None else set()
        ended: set[str] = set()  # requests a sequence of which ends now
        skipped: list[int] = []  # rows finished (or aborted) while this step ran
        emit = self.emit_partial
        commit = self.block_manager.commit_full_blocks
        bs = self.block_manager.block_size
        hash_always = self.block_manager.state is not None  # commit_full_blocks has snapshots to take
        eos, max_model_len = self.eos_token_ids, self.max_model_len
        plain_tokens = 0
        tokens = step.tokens.read()
        for i, (seq, token, logprob) in enumerate(zip(step.seqs, tokens, step.tokens.logprobs(), strict=True)):
            if seq.status is FINISHED:  # finished (or aborted) while this step ran: its token is dropped
                skipped.append(i)
                continue
            again = seq.seq_id in relaunched  # a later step is already running over this token
            ids = seq.token_ids
            at = len(ids) - (2 if again else 1)
            assert ids[at] == PLACEHOLDER
            p = seq.params
            if seq.grammar is not None or (p.detokenize and (p.stop or emit)):
                del ids[at:]
                self._append_token(seq, token, logprob)  # stop checks and text see only real tokens
                finished = seq.status is FINISHED
                if not finished and again:
                    ids.append(PLACEHOLDER)
                elif not finished and seq.grammar is not None and self.structured.jump_forward:
                    self._jump_forward(seq)
                    finished = seq.status is FINISHED
            else:
                # No text and no grammar this step (_append_token's rules without them): the token takes its
                # placeholder's place, and a later step's placeholder behind it stays
                ids[at] = token
                plain_tokens += 1
                if logprob is not None:
                    seq.logprobs.append(logprob)
                rule = token_finish(p, token, at + 1 - seq.num_prompt_tokens, at + 1, eos, max_model_len)
                finished = rule is not None
                if finished:
                    seq.finish_reason, seq.stop_reason = rule
                    del ids[at + 1:]
                    self._finish(seq)
            if finished:
                ended.add(seq.request_id)
            elif hash_always or seq.num_computed_tokens // bs > len(seq.block_hashes):  # a block filled: hash it
                commit(seq)
            if emit:
                touched[seq.request_id] = requests[seq.request_id]
        self.generation_tokens_total += plain_tokens
        if not emit:  # offline: only a request a sequence of which ended now can be done
            if not ended:
                return {}
            rows = (i for i in range(len(step.seqs)) if i not in skipped) if skipped else range(len(step.seqs))
            seqs = step.seqs
            return {seqs[i].request_id: requests[seqs[i].request_id] for i in rows if seqs[i].request_id in ended}
        return touched

    def _jump_forward(self, seq: Sequence) -> None:
        """Jump-forward (--structured-outputs-jump-forward): the tokens seq's grammar forces after its last one
        join it now, through the same text, stop-string and length rules as drawn ones, and the next step runs
        them as one chunk and samples after them (the scheduler runs a token a step of it while a step's chunks
        are full). At most max_tokens - 1 outputs (one is left to draw) and max_model_len - 1 tokens. Rows
        whose logprobs or penalties need every token drawn on the device draw them."""
        p = seq.params
        if p.logprobs is not None or p.counts_outputs:
            return
        ids = seq.token_ids
        limit = self.max_model_len - len(ids) - 1
        if p.max_tokens is not None:
            limit = min(limit, p.max_tokens - (len(ids) - seq.num_prompt_tokens) - 1)
        forced = seq.grammar.jump_forward(self.structured.forced, limit)
        if not forced:
            return
        seq.jumping = True  # the scheduler may run its chunk a token at a time while the graphs are full
        self.jump_forward_tokens_total += len(forced)
        for token in forced:
            self._append_token(seq, token, None, accepted=True)
            if seq.status is FINISHED:
                return

    def _append_token(self, seq: Sequence, token: int, logprob, accepted: bool = False) -> None:
        """A sampled token joins its sequence; the finish rules (stop string, grammar, eos, stop token, length)
        apply. A grammar's matcher accepts the token first (unless `accepted`: a forced token it took already); it
        refuses one only when the mask left nothing allowed (min_tokens banning the end of a complete output),
        and the output then ends as it is."""
        grammar = seq.grammar
        if grammar is not None and not accepted and not grammar.accept(token):
            seq.finish_reason = "stop"
            self._finish(seq)
            return
        ids = seq.token_ids
        ids.append(token)
        self.generation_tokens_total += 1
        if logprob is not None:
            seq.logprobs.append(logprob)
        p = seq.params
        if p.detokenize and (p.stop or self.emit_partial):
            piece = update_text(self.text_decoder, seq)
            stop = find_stop(seq, piece) if p.stop else None
        else:  # offline without stop strings the text is read only at the end: _finish builds it then
            stop = None
        num_output = len(ids) - seq.num_prompt_tokens
        if stop is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop
        elif grammar is not None and grammar.terminated:  # the grammar is complete and took its end token
            seq.finish_reason = "stop"
        elif (rule := token_finish(p, token, num_output, len(ids), self.eos_token_ids, self.max_model_len)) is not None:
            seq.finish_reason, seq.stop_reason = rule
        if seq.finish_reason is not None:
            self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        if seq.params.detokenize:  # the text of tokens left undecoded (offline), token by token as they came
            ids = seq.token_ids
            end = len(ids)
            while end and ids[end - 1] == PLACEHOLDER:  # still on the device: dropped
                end -= 1
            if seq.num_detokenized < end:
                update_text(self.text_decoder, seq, end)
        self.scheduler.finish(seq)  # its blocks go back to the pool now, before the next step
        self.runner.sampler.forget(seq)
        if seq.grammar is not None:  # its matcher goes with it
            seq.grammar = None
            self.structured.live -= 1

    def _record(self, batch: ScheduledBatch, num_prefill: int, num_decode: int, start: float) -> None:
        self.steps_total += 1
        self.recent_steps.append(StepRecord(len(batch.seqs), num_prefill, num_decode, time.perf_counter() - start,
                                            start))
