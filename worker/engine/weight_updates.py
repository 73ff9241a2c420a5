"""The engine's weight updates in place (a checkpoint folder, a trainer's tensors, a trainer's broadcast) and
pause / resume around them, with the weight version that says which policy produced a sample.

An update runs between steps, never inside a sample: with requests in flight it is refused unless they are
held by pause("keep"), whose samples then say so in their weight_versions. Every update drops the prefix
cache (no K/V of the old weights serves a new request) and moves `weight_version`. A mixin of LLMEngine
(llm_engine.py), like step.py: it uses the engine's runner, scheduler, block manager and requests.
"""

from __future__ import annotations

from pathlib import Path

from pagefleet.worker.core.outputs import RequestOutput
from pagefleet.worker.core.sequence import Sequence
from pagefleet.worker.engine.step import EngineStep

PAUSE_MODES = ("abort", "wait", "keep")


class WeightUpdates(EngineStep):
    weight_version: int  # 0 at start, +1 per update
    paused: str | None  # the pause mode, None while running
    held: list[Sequence]  # sequences with nothing computed, kept out of the scheduler while paused
    weight_groups: dict  # group name -> executor/weight_transfer.WeightGroup

    # ---- pause and resume

    @property
    def is_paused(self) -> bool:
        return self.paused is not None

    def pause(self, mode: str = "abort", drain: bool = True) -> list[RequestOutput]:
        """Stop admitting requests (those that arrive, and those queued with nothing computed, wait for resume),
        then: abort: every request ends now, finish reason "abort"; wait: the requests that have started run to
        their end (stepped here, or by the caller's own step loop with drain=False, until in_flight() is 0);
        keep: they stay, with their KV cache, unstepped until resume. Returns the outputs this produced."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r}: one of {', '.join(PAUSE_MODES)}")
        if self.paused is not None:
            raise ValueError(f"the engine is paused already ({self.paused!r}); resume it first")
        outputs = self._resolve_pending()
        self.paused = mode
        waiting = list(self.scheduler.waiting)
        self.scheduler.waiting.clear()
        for seq in waiting:  # the ones that produced nothing yet can start over after the update
            (self.scheduler.waiting if seq.num_output_tokens else self.held).append(seq)
        if mode == "abort":
            for request_id in list(self.requests):
                request = self.requests[request_id]
                self.abort_request(request_id)
                outputs.append(self.make_output(request, True))
            self.held = []
        elif mode == "wait" and drain:
            while self.in_flight():
                outputs += super().step()
        return outputs

    def resume(self) -> None:
        if self.paused is None:
            raise ValueError("the engine is not paused")
        self.scheduler.waiting.extend(seq for seq in self.held if not seq.is_finished)
        self.held = []
        self.paused = None

    def step(self) -> list[RequestOutput]:
        if self.paused == "keep":  # held: nothing runs, their KV stays
            return []
        return super().step()

    def in_flight(self) -> int:
        """Sequences with work done under the current weights that is not finished: running, preempted after
        producing tokens, or with their last token still on the device (retired from the batch)."""
        s = self.scheduler
        seqs = {seq.seq_id for seq in s.running} | {seq.seq_id for seq in s.waiting if seq.num_output_tokens}
        if self.pending is not None:
            seqs.update(seq.seq_id for seq in self.pending.seqs if not seq.is_finished)
        return len(seqs)

    def _resolve_pending(self) -> list[RequestOutput]:
        """The overlapped step still on the device, read back: weights must not change under it."""
        if self.pending is None:
            return []
        prev, self.pending = self.pending, None
        return self._outputs(self._resolve(prev))

    # ---- weight updates

    def update_weights_from_disk(self, path: str) -> int:
        """All or some weights from a safetensors folder (HF names); returns the new weight version."""
        self._check_update()
        folder = Path(path)
        if not folder.is_dir() or not list(folder.glob("*.safetensors")):
            raise ValueError(f"{path} is not a folder of .safetensors files")
        self.runner.update_weights_from_disk(folder)  # every tensor-parallel rank reads its own shards
        return self._updated()

    def update_weights_from_tensor(self, named_tensors) -> int:
        """(name, tensor) pairs, a dict, or the string of weight_transfer.serialize_named_tensors (a trainer's
        CUDA IPC handles); names as in the HF checkpoint. Returns the new weight version."""
        from pagefleet.worker.executor.weight_transfer import deserialize_named_tensors, named_list

        self._check_update()
        if isinstance(named_tensors, str):
            named_tensors = deserialize_named_tensors(named_tensors)
        pairs = named_list(named_tensors)
        plan = self.runner.check_weights([(name, tuple(t.shape)) for name, t in pairs])
        self.runner.apply_weights(pairs, plan)
        return self._updated()

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str | None = None) -> None:
        """Join a trainer's broadcast group as rank rank_offset (the trainer is rank 0; weight_transfer.py)."""
        from pagefleet.worker.executor.weight_transfer import WeightGroup

        if group_name in self.weight_groups:
            raise ValueError(f"a weight update group named {group_name!r} exists already")
        if not 1 <= rank_offset < world_size:
            raise ValueError(f"rank_offset {rank_offset}: the trainer is rank 0, engines 1..{world_size - 1}")
        self.weight_groups[group_name] = WeightGroup(master_address, master_port, rank_offset, world_size,
                                                     group_name, backend, self.runner.device)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        group = self.weight_groups.pop(group_name, None)
        if group is None:
            raise ValueError(f"no weight update group named {group_name!r}")
        group.destroy()

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name: str | None = None) -> int:
        """Receive the trainer's broadcast of these tensors (WeightBroadcaster.broadcast, in packed buckets).
        A refusal (names, shapes, requests in flight) is agreed with the trainer before any bucket is sent,
        so both sides raise and no weight changes. Returns the new weight version."""
        from pagefleet.worker.executor.weight_transfer import receive_buckets

        group = self._weight_group(group_name)
        refuse, plan = None, {}
        try:
            self._check_update()
        except ValueError as e:
            refuse = str(e)

        def check(slots):
            plan.update(self.runner.check_weights([(s.name, s.shape) for s in slots]))

        self.runner.apply_weights(receive_buckets(group, names, dtypes, shapes, refuse, check), plan)
        return self._updated()

    def _weight_group(self, group_name: str | None):
        if group_name is None and len(self.weight_groups) == 1:
            return next(iter(self.weight_groups.values()))
        if group_name not in self.weight_groups:
            raise ValueError(f"no weight update group {group_name!r}: call init_weights_update_group first "
                             f"(groups: {', '.join(self.weight_groups) or 'none'})")
        return self.weight_groups[group_name]

    def _check_update(self) -> None:
        busy = self.in_flight()
        if busy and self.paused != "keep":
            raise ValueError(f"{busy} sequence(s) are running: new weights between their tokens would mix two "
                             f"policies in one sample; pause the engine first (pause('abort' | 'wait' | 'keep')) "
                             f"or let them finish")

    def _updated(self) -> int:
        if self.runner.device.type == "cuda":  # the copies are done before the next step reads the weights
            import torch

            torch.cuda.synchronize(self.runner.device)
        seqs = [seq for request in self.requests.values() for seq in request.seqs if not seq.is_finished]
        self.block_manager.drop_prefix_cache(seqs)
        self.weight_version += 1
        for seq in seqs:
            if seq.num_output_tokens or seq.num_computed_tokens:  # held across the update: both versions ran it
                seq.weight_versions.append((self.weight_version, seq.num_output_tokens))
            else:
                seq.weight_versions = [(self.weight_version, 0)]
        return self.weight_version


def output_versions(seqs: list[Sequence], num_tokens: list[int]) -> tuple[int, list[int]]:
    """(the version that produced the last token, every version that ran them in order) of a request's samples,
    each with num_tokens output tokens reported."""
    versions: list[int] = []
    last = 0
    for seq, n in zip(seqs, num_tokens, strict=True):
        spans = seq.weight_versions or [(0, 0)]
        versions += [v for v, _ in spans if v not in versions]
        last = max(last, max(v for v, start in spans if start < n) if n else spans[0][0])
    return last, versions
