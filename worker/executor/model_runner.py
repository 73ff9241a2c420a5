"""One forward step on the device: the step's inputs, a CUDA graph or the eager forward, and sampling.

A step replays the graph its shape fits (graphs/manager.py: pure decodes, small prompt-only steps, a few
decodes beside small prompt chunks); larger, LoRA and --enforce-eager steps run eagerly, on kernel variants
compiled at start-up (startup/warmup.py). Bring-up (bringup.py) loads the model, sizes the KV cache and
captures the graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from pagefleet.worker.core.config import EngineConfig
from pagefleet.worker.core.outputs import TokenLogprobs
from pagefleet.worker.core.scheduler import ScheduledBatch
from pagefleet.worker.core.sequence import Sequence
from pagefleet.worker.executor.bringup import bring_up, resolve_device, resolve_dtype, resolve_kv_cache_dtype
from pagefleet.worker.executor.graphs.decode import DecodeGraphs
from pagefleet.worker.executor.graphs.manager import CUDAGraphs
from pagefleet.worker.executor.graphs.mixed import MixedGraphs
from pagefleet.worker.executor.graphs.prompt import PromptGraphs
from pagefleet.worker.executor.sampler import Sampled
from pagefleet.worker.executor.step_inputs import (
    CASCADE_MIN_ROWS,
    StepInputs,
    eager_metadata,
    feed_device_tokens,
    prepare,
    sampled_rows,
    shared_prefix_groups,
    upload_rows,
)
from pagefleet.worker.models.layers.context import forward_context
from pagefleet.worker.models.registry import ModelConfig


@dataclass
class PendingTokens:
    """One step's sampled tokens (and logprobs): on the device now, on the host once `event` has fired."""

    device: torch.Tensor
    host: Sampled  # host copies, filled behind the event
    event: object | None
    tokens: list[int] | None = None  # the host's list, once read

    def read(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()  # waits for this step only, not for the one launched after it
        self.tokens = self.host.tokens.tolist()
        return self.tokens

    def logprobs(self) -> list[TokenLogprobs | None]:
        """Per row, after read(): its logprobs, None for rows that asked for none."""
        return self.host.logprobs(self.tokens)


class StepWork(NamedTuple):
    """One step as every rank runs it: the block copies, the state slots' copies, zeroes and snapshots, the
    host arrays (the scheduler's Sequences stay on rank 0)."""

    copies: list[tuple[int, int]]
    state_copies: list[tuple[int, int]]
    state_zeros: list[int]
    state_snapshots: list[tuple[int, int]]
    step: StepInputs


PROMPT_LOGITS_ROWS = 256  # prompt positions scored at a time: 128 MB of fp32 logits at a 128k vocabulary


class ModelRunner:
    """Bring-up gives it model, start_seconds, lora, sampler, kv (and on CUDA profile and the graphs)."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_path, max_model_len: int,
                 compile_workers=None, compile_share: tuple[int, int] | None = None):
        """model_path None: random weights (a compile worker's twin, startup/compile_workers.py). compile_workers:
        the running CompileWorkers, waited for before the KV cache is sized. compile_share (i, n): a compile
        worker's slice of the warm-up steps and graph captures."""
        self.device = resolve_device(config.device)
        hopper = self.device.type == "cuda" and torch.cuda.get_device_capability(self.device)[0] == 9
        self.config = config = config.with_batch_defaults(hopper)  # LLMEngine schedules with these
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.dtype = resolve_dtype(config.dtype, model_config.dtype, self.device)
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.device)
        self.block_size = config.block_size
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.cuda_graphs = CUDAGraphs()  # no kind captured: every step eager (--enforce-eager, CPU)
        bring_up(self, model_path, compile_workers, compile_share)

    # each kind of graph, None when off (tests and benchmarks read them, and switch one off by setting None)

    @property
    def graphs(self) -> DecodeGraphs | None:
        return self.cuda_graphs.decode

    @graphs.setter
    def graphs(self, graphs: DecodeGraphs | None) -> None:
        self.cuda_graphs.decode = graphs

    @property
    def prompt_graphs(self) -> PromptGraphs | None:
        return self.cuda_graphs.prompt

    @prompt_graphs.setter
    def prompt_graphs(self, graphs: PromptGraphs | None) -> None:
        self.cuda_graphs.prompt = graphs

    @property
    def mixed_graphs(self) -> MixedGraphs | None:
        return self.cuda_graphs.mixed

    @mixed_graphs.setter
    def mixed_graphs(self, graphs: MixedGraphs | None) -> None:
        self.cuda_graphs.mixed = graphs

    # ---- step

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        """Host arrays for one step (step_inputs.prepare), with the shared-prefix groups of an eager decode step of
        CASCADE_MIN_ROWS rows or more (rows past the decode graphs: GRPO's 64 prompts x 16 samples)."""
        step = prepare(batch, self.block_size)
        if (self.cascade_samples and step.is_decode and step.num_seqs >= CASCADE_MIN_ROWS
                and not self.cuda_graphs.fits(step)):
            groups, prefix_lens = shared_prefix_groups(step.tables, step.seq_lens, self.block_size,
                                                       self.cascade_samples)
            if len(groups):
                step = step._replace(cascade=(groups, prefix_lens))
        return step

    def run(self, batch: ScheduledBatch, feed: tuple[np.ndarray, torch.Tensor] | None = None) -> torch.Tensor | None:
        """Forward the scheduled tokens; returns logits [rows, vocab] for the sequences that sample (None if none do).

        feed = (rows, tokens): sequences whose last token is still on the device (an overlapped step)
        take input id tokens[rows[i]] where rows[i] >= 0.
        """
        lora_mapping = self.lora.mapping(batch.seqs, batch.num_new_tokens) if self.lora is not None else None
        return self.execute(self.step_work(batch), feed, lora_mapping)

    def step_work(self, batch: ScheduledBatch) -> StepWork:
        """What every tensor-parallel rank runs of this batch: no Sequence in it, only arrays and slot numbers."""
        return StepWork(batch.copies, batch.state_copies, batch.state_zeros, batch.state_snapshots,
                        self.prepare(batch))

    @torch.inference_mode()
    def execute(self, work: StepWork, feed=None, lora_mapping=None) -> torch.Tensor | None:
        """One step from its StepWork (run's second half; a tensor-parallel worker's whole step)."""
        if work.copies:
            self.kv.copy_blocks(work.copies)
        if self.state is not None:  # fresh slots zeroed, forked and restored ones copied, before the forward
            self.state.before_forward(work.state_copies, work.state_zeros)
        step = work.step
        logits = None
        self.prompt_logprobs = None
        if lora_mapping is None and step.prompt_logprobs is None:  # graphs hold no adapter and no prompt's logits
            logits = self.cuda_graphs.replay(step, feed)
        if logits is None:
            logits = self._run_eager(step, feed, lora_mapping)
        if self.state is not None:
            self.state.after_forward(work.state_snapshots)  # states at a block boundary, for the prefix cache
        return logits if logits is not None and step.logits_rows else None

    def _run_eager(self, step: StepInputs, feed, lora_mapping) -> torch.Tensor | None:
        tokens_d = upload_rows(step.tokens, self.device)
        meta = eager_metadata(self.device, tokens_d[2], step.tables, step.seq_lens, step.cu, step.num_decodes,
                              step.is_decode, step.state_slots, step.cascade)
        if feed is not None:
            feed_device_tokens(tokens_d[0], feed)
        with forward_context(meta, lora_mapping):
            hidden = self.model(tokens_d[0], tokens_d[1])
        if step.prompt_logprobs is not None:
            self.prompt_logprobs = self._score_prompt(hidden, *step.prompt_logprobs)
        if not step.logits_rows:  # only unfinished prompt chunks ran
            return None
        return self.model.compute_logits(sampled_rows(hidden, step.logits_rows))

    def _score_prompt(self, hidden: torch.Tensor, rows: np.ndarray, targets: np.ndarray,
                      k: int) -> tuple[torch.Tensor, ...]:
        """Log-softmax of the logits at `rows` (PROMPT_LOGITS_ROWS at a time: a 128k vocabulary in fp32 is 0.5 MB
        a row) -> (each target's logprob, its rank, the top k ids, their logprobs), left on the device."""
        rows_d = torch.from_numpy(rows).to(self.device)
        targets_d = torch.from_numpy(targets).to(self.device)
        pieces = []
        for at in range(0, len(rows), PROMPT_LOGITS_ROWS):
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[rows_d[at : at + PROMPT_LOGITS_ROWS]])
                                         .float(), dim=-1)
            own = logprobs.gather(1, targets_d[at : at + PROMPT_LOGITS_ROWS, None])
            rank = (logprobs > own).sum(dim=1) + 1
            top = logprobs.topk(k, dim=1)  # k = 0: empty rows
            pieces.append((own[:, 0], rank, top.indices, top.values))
        return tuple(torch.cat(parts) for parts in zip(*pieces, strict=True))

    def take_prompt_logprobs(self) -> tuple[list, list, list, list]:
        """The last step's scored prompt tokens on the host, in prepare's order: their logprobs, ranks, top ids
        and top logprobs (one device-to-host wait)."""
        scored, self.prompt_logprobs = self.prompt_logprobs, None
        return tuple(t.tolist() for t in scored)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Sample and read back at once: the overlapped path's copies, waited for here."""
        pending = self.sample_async(logits, seqs)
        return pending.read(), pending.logprobs()

    def sample_async(self, logits: torch.Tensor, seqs: list[Sequence]) -> PendingTokens:
        """Sample without waiting: the tokens stay on the device for the next step and are copied, with the
        logprobs, to pinned host memory behind an event, so the host can prepare the next step meanwhile."""
        sampled = self.sampler.sample_step(logits, seqs)
        host = sampled.to_host(pin=self.device.type == "cuda")
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return PendingTokens(sampled.tokens, host, event)

    # ---- weights in place (engine/weight_updates.py): every rank runs the same calls on its shard

    def update_weights_from_disk(self, folder) -> None:
        from pagefleet.worker.models.loader import apply_weights, check_weights, checkpoint_shapes, checkpoint_tensors

        plan = check_weights(self.model, checkpoint_shapes(folder))
        apply_weights(self.model, checkpoint_tensors(folder, self.device), plan)

    def check_weights(self, shapes) -> dict:
        """(name, shape) pairs -> the update's plan (loader.check_weights); ValueError if any does not fit."""
        from pagefleet.worker.models.loader import check_weights

        return check_weights(self.model, shapes)

    def apply_weights(self, named_tensors, plan: dict) -> None:
        """Checkpoint-named (name, tensor) pairs, full-sized, into this rank's parameters."""
        from pagefleet.worker.models.loader import apply_weights

        apply_weights(self.model, named_tensors, plan)

    # ---- sleep mode (sleep.py, EngineConfig.enable_sleep_mode): the weights' and KV cache's memory handed back to
    # the driver and taken back at the same addresses, the captured graphs kept

    @property
    def is_sleeping(self) -> bool:
        return self.sleep_mode is not None and self.sleep_mode.is_sleeping

    @property
    def weights_asleep(self) -> bool:
        """The weights' memory is released: nothing may read or write the parameters (a weight update included)."""
        return self.sleep_mode is not None and "weights" in self.sleep_mode.asleep

    def check_sleep(self, level) -> int:
        """ValueError unless sleep(level) can run: sleep mode on, level 1 or 2, awake."""
        if self.sleep_mode is None:
            raise ValueError("sleep mode is off: start the engine with enable_sleep_mode=True (--enable-sleep-mode)")
        return self.sleep_mode.check_sleep(level)

    def sleep(self, level: int = 1) -> None:
        """level 1: the weights to pinned host memory, both regions released; level 2: both released."""
        self.check_sleep(level)
        self.sleep_mode.sleep(level)

    def wake_up(self, tags=None) -> tuple[str, ...]:
        """tags: "weights" and / or "kv_cache" (None: both) -> the tags woken."""
        if self.sleep_mode is None:
            raise ValueError("sleep mode is off: start the engine with enable_sleep_mode=True (--enable-sleep-mode)")
        return self.sleep_mode.wake_up(tags)
