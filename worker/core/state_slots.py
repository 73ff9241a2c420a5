"""The state slot pool: each running sequence's slot for its recurrent state, and the prefix cache's snapshots.

A model with recurrent layers (Gated DeltaNet) keeps, per sequence, a state that every step updates in place:
one slot of the executor's state cache. A sequence takes a slot at admission and gives it back at finish,
abort, retirement or preemption, in the same step, as it does its blocks. A slot's content is set by the
step that first runs it: zeroed (a fresh prompt), copied from a snapshot (a prefix hit) or copied from its
parent (a forked sample). The pool only decides and reports those operations; the executor runs them, copies
before zeroes, ahead of the forward (`take_ops`).

Snapshot slots (numbered after the sequence slots, in the same cache) hold the state at a block boundary,
keyed by the hash of the block that ends there: a later prompt whose prefix hit ends at that block restores
the snapshot instead of recomputing the prompt. They are kept least recently used first and dropped when
their block leaves the prefix cache.
"""

from __future__ import annotations

from collections import OrderedDict


class StateSlots:
    def __init__(self, num_slots: int, num_snapshots: int = 0):
        if num_slots < 1 or num_snapshots < 0:
            raise ValueError(f"need at least one state slot and no negative snapshot count, got {num_slots}, "
                             f"{num_snapshots}")
        self.num_slots = num_slots
        self.num_snapshots = num_snapshots
        self.free: list[int] = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self.free_snapshots: list[int] = list(range(num_slots + num_snapshots - 1, num_slots - 1, -1))
        self.snapshot_of: OrderedDict[int, int] = OrderedDict()  # block hash -> snapshot slot, least recent first
        # a snapshot being taken: sequence id -> (boundary in tokens, snapshot slot), kept once its step commits
        self.pending_snapshots: dict[int, tuple[int, int]] = {}
        # operations for the next forward, in the order the executor runs them
        self.copies: list[tuple[int, int]] = []  # (src, dst) before the forward: forks and snapshot restores
        self.zeros: list[int] = []  # fresh slots, zeroed before the forward (after the copies)
        self.snapshots: list[tuple[int, int]] = []  # (sequence slot, snapshot slot) after the forward

    @property
    def num_free(self) -> int:
        return len(self.free)

    def take(self, restore_from: int | None = None) -> int:
        """A slot for a sequence starting now: zeroed, or restored from snapshot slot `restore_from`."""
        if not self.free:
            raise RuntimeError("no free state slot: admission must check num_free first")
        slot = self.free.pop()
        if restore_from is None:
            self.zeros.append(slot)
        else:
            self.copies.append((restore_from, slot))
        return slot

    def fork(self, parent_slot: int) -> int:
        """A slot for a sample split off a parent: the parent's state is copied into it once."""
        if not self.free:
            raise RuntimeError("no free state slot for a forked sample: admission reserves one per sample")
        slot = self.free.pop()
        self.copies.append((parent_slot, slot))
        return slot

    def release(self, slot: int, seq_id: int) -> None:
        """Give a sequence's slot back. Operations still to run into it are dropped (a slot handed out again
        starts from its own zero or copy); copies out of it stay, as they run before anything is written there."""
        assert slot not in self.free, f"state slot {slot} freed twice"
        self.copies = [(s, d) for s, d in self.copies if d != slot]
        self.zeros = [z for z in self.zeros if z != slot]
        self.snapshots = [(s, d) for s, d in self.snapshots if s != slot]
        pending = self.pending_snapshots.pop(seq_id, None)
        if pending is not None:
            self.free_snapshots.append(pending[1])
        self.free.append(slot)

    # ---- snapshots

    def plan_snapshot(self, seq_id: int, slot: int, boundary: int) -> bool:
        """After this step's forward, copy the sequence's state (then at `boundary` tokens) into a snapshot slot;
        kept by `commit_snapshot` once the step's blocks are hashed. False: no snapshot slots at all."""
        if seq_id in self.pending_snapshots:
            return True
        if not self.free_snapshots:
            if not self.snapshot_of:
                return False
            _, evicted = self.snapshot_of.popitem(last=False)  # least recently used
            self.free_snapshots.append(evicted)
        snap = self.free_snapshots.pop()
        self.pending_snapshots[seq_id] = (boundary, snap)
        self.snapshots.append((slot, snap))
        return True

    def commit_snapshot(self, seq_id: int, num_computed_tokens: int, block_hash_at) -> None:
        """The sequence's step ran: a snapshot taken at its boundary becomes findable under the hash of the block
        ending there (block_hash_at(boundary) -> that hash, or None when the block is not in the prefix cache)."""
        pending = self.pending_snapshots.get(seq_id)
        if pending is None or num_computed_tokens < pending[0]:
            return
        del self.pending_snapshots[seq_id]
        boundary, snap = pending
        h = block_hash_at(boundary)
        if h is None or h in self.snapshot_of:
            self.free_snapshots.append(snap)
            return
        self.snapshot_of[h] = snap

    def snapshot(self, block_hash: int) -> int | None:
        """The snapshot slot for the state after the block with this hash (marked recently used), or None."""
        snap = self.snapshot_of.get(block_hash)
        if snap is not None:
            self.snapshot_of.move_to_end(block_hash)
        return snap

    def has_snapshot(self, block_hash: int) -> bool:
        return block_hash in self.snapshot_of

    def drop_snapshot(self, block_hash: int) -> None:
        """Its block left the prefix cache: the snapshot can no longer be reached."""
        snap = self.snapshot_of.pop(block_hash, None)
        if snap is not None:
            self.free_snapshots.append(snap)

    def take_ops(self) -> tuple[list[tuple[int, int]], list[int], list[tuple[int, int]]]:
        """(copies, zeros, snapshots) for the next forward, and the lists start over."""
        ops = (self.copies, self.zeros, self.snapshots)
        self.copies, self.zeros, self.snapshots = [], [], []
        return ops
