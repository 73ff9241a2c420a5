"""The KV block pool: reference counts, a free queue in eviction order, prefix hashes, copy-on-write.

A block is `block_size` token slots in every layer's cache. Blocks with reference count 0 sit in the
free queue; those holding a full, hashed prompt block stay findable by their hash until the queue
hands them out again (least recently freed first), which is what makes prefix caching free.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import chain

import numpy as np
import xxhash

from pagefleet.worker.core.sequence import Sequence
from pagefleet.worker.core.state_slots import StateSlots


class Block:
    """One block of the pool; `hash` and `token_ids` are set while it holds a full block the prefix cache finds."""

    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None  # kept to re-check a hash hit token by token


def block_hash(parent: int | None, token_ids: list[int], adapter_id: int = 0) -> int:
    h = xxhash.xxh64()
    h.update((0 if parent is None else parent).to_bytes(8, "little"))
    h.update(adapter_id.to_bytes(8, "little", signed=True))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


def chain_root(salt: str | None) -> int | None:
    """The parent of a sequence's first block hash: none, or its cache_salt's hash, so salted chains meet only
    chains of the same salt (the later blocks follow from the first)."""
    return None if salt is None else xxhash.xxh64(salt.encode()).intdigest()


class BlockTables:
    """The block tables of the last step, kept as int32 rows (vLLM's persistent batch): the next step copies the
    row of every sequence whose table is unchanged (same `table_version`) and converts only the others, so a
    decode step turns the blocks of the few sequences that crossed into a new block into int32, not every table
    (at 256 sequences of 12 blocks the full conversion was ~170 us a step; longer contexts cost more)."""

    def __init__(self):
        self.row_of: dict[int, int] = {}  # seq_id -> its row in `tables`
        self.seqs: list[Sequence] = []  # the last step's sequences, in their rows' order
        self.versions = np.zeros(0, dtype=np.int64)
        self.tables = np.zeros((0, 4), dtype=np.int32)

    def build(self, seqs: list[Sequence]) -> np.ndarray:
        """[n, width] int32, width a multiple of 4 (rows 16-byte aligned), zeros past each table. A new array each
        step: the one handed out before is never written again."""
        n = len(seqs)
        versions = np.fromiter((s.table_version for s in seqs), dtype=np.int64, count=n)
        same = seqs == self.seqs  # the steady decode step: the last step's sequences in their order (in C)
        if same:
            prev = np.arange(n)
            kept = self.versions == versions
        else:
            get = self.row_of.get
            prev = np.fromiter((get(s.seq_id, -1) for s in seqs), dtype=np.int64, count=n)
            kept = prev >= 0
            kept[kept] = self.versions[prev[kept]] == versions[kept]
        changed = np.flatnonzero(~kept).tolist()
        if len(changed) * 4 > n:  # mostly new rows (admissions, a fork, a preemption): one pass over them all
            tables = build_tables(seqs)
        else:
            width = -(-max(len(s.block_table) for s in seqs) // 4) * 4
            tables = np.zeros((n, width), dtype=np.int32)
            w = min(width, self.tables.shape[1])  # an unchanged row fits: its table is as long as it was
            tables[kept, :w] = self.tables[prev[kept], :w]
            for i in changed:
                table = seqs[i].block_table
                tables[i, : len(table)] = table
        if not same:
            self.row_of = {s.seq_id: i for i, s in enumerate(seqs)}
            self.seqs = list(seqs)
        self.versions, self.tables = versions, tables
        return tables


def build_tables(seqs: list[Sequence]) -> np.ndarray:
    """Every sequence's block table as an int32 row, zero-padded to a width that is a multiple of 4."""
    n = len(seqs)
    widths = np.fromiter((len(s.block_table) for s in seqs), dtype=np.int64, count=n)
    tables = np.zeros((n, -(-int(widths.max()) // 4) * 4), dtype=np.int32)  # rows 16-byte aligned
    tables[np.arange(tables.shape[1]) < widths[:, None]] = np.fromiter(
        chain.from_iterable(s.block_table for s in seqs), dtype=np.int32, count=int(widths.sum()))
    return tables


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 state: StateSlots | None = None):
        """state: the state slot pool of a model with recurrent layers (None: attention only)."""
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # first = evicted first
        self.hash_to_block: dict[int, int] = {}
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) for the next forward
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, found
        self.state = state
        # sequences whose K/V mixes two weight versions (held across an update): their blocks are never cached
        self.uncacheable: set[int] = set()
        self.tables = BlockTables()  # the step inputs' block table rows, kept across steps

    # ---- pool

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        """Share of blocks held by sequences (cached-but-free blocks count as free)."""
        return 1.0 - len(self.free) / self.num_blocks

    def _take(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict: the cached content is about to be overwritten
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
                if self.state is not None:
                    self.state.drop_snapshot(block.hash)
            block.hash, block.token_ids = None, None
        block.ref_count = 1
        return block_id

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count == 0:
            self.free[block_id] = None
            if block.hash is None:  # nothing worth keeping: hand it out before any cached block
                self.free.move_to_end(block_id, last=False)

    # ---- sequences

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        need = -(-total // self.block_size) - len(seq.block_table)
        return max(need, 0) + (1 if self._needs_copy(seq) else 0)

    def _needs_copy(self, seq: Sequence) -> bool:
        """The next token lands in a block another sequence also holds."""
        idx = seq.num_computed_tokens // self.block_size
        return idx < len(seq.block_table) and self.blocks[seq.block_table[idx]].ref_count > 1

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for the next `num_new_tokens` of `seq`; False (and nothing changed) if the pool is short.
        (blocks_needed and _needs_copy inlined: the scheduler calls this for every running sequence each step.)"""
        bs, table = self.block_size, seq.block_table
        idx = seq.num_computed_tokens // bs
        copy = idx < len(table) and self.blocks[table[idx]].ref_count > 1
        total = seq.num_computed_tokens + num_new_tokens
        grow = -(-total // bs) - len(table)
        if not copy and grow <= 0:  # a decode inside its own last block: nothing to do
            return True
        if max(grow, 0) + copy > len(self.free):
            return False
        seq.table_version += 1
        if copy:
            src = table[idx]
            dst = self._take()
            self._unref(src)
            table[idx] = dst
            self.pending_copies.append((src, dst))
        while len(table) * bs < total:
            table.append(self._take())
        return True

    def match_prefix(self, seq: Sequence) -> int:
        """Take the cached full blocks that start `seq` (a sequence holding no blocks); returns tokens hit.

        At least one token is always left to compute, since its logits are what the step samples from. With
        recurrent state the hit ends at the last block whose boundary has a state snapshot (or is none): the
        state there is restored, and the blocks past it would need a state nobody kept.
        """
        assert not seq.block_table
        if not self.enable_prefix_caching or seq.needs_prompt_logprobs:  # scoring the prompt needs its forward
            return 0
        bs = self.block_size
        num_full = (seq.num_tokens - 1) // bs
        self.prefix_queries += seq.num_prompt_tokens
        parent = chain_root(seq.params.cache_salt)
        hashes = []
        for i in range(num_full):
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            h = block_hash(parent, tokens, seq.lora_id)  # an adapter's K/V differ from the base model's
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tuple(tokens):
                break
            seq.block_table.append(block_id)
            hashes.append(h)
            parent = h
        if self.state is not None:
            keep = next((i for i in range(len(hashes), 0, -1) if self.state.has_snapshot(hashes[i - 1])), 0)
            del seq.block_table[keep:], hashes[keep:]
        for block_id in seq.block_table:
            self._ref(block_id)
        seq.table_version += 1
        seq.block_hashes = hashes
        hit = len(hashes) * bs
        seq.num_computed_tokens = seq.num_cached_tokens = hit
        self.prefix_hits += min(hit, seq.num_prompt_tokens)
        return hit

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Hash the blocks this step filled, so later requests can find them."""
        bs = self.block_size
        full = seq.num_computed_tokens // bs
        if full <= len(seq.block_hashes) and self.state is None:  # most calls: no block filled since the last
            return
        parent = seq.block_hashes[-1] if seq.block_hashes else chain_root(seq.params.cache_salt)
        for i in range(len(seq.block_hashes), full):
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            h = block_hash(parent, tokens, seq.lora_id)  # an adapter's K/V differ from the base model's
            seq.block_hashes.append(h)
            parent = h
            if not self.enable_prefix_caching or seq.seq_id in self.uncacheable:
                continue
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self.hash_to_block:
                block.hash, block.token_ids = h, tuple(tokens)
                self.hash_to_block[h] = block.block_id
        if self.state is not None and seq.seq_id in self.state.pending_snapshots:
            self.state.commit_snapshot(seq.seq_id, seq.num_computed_tokens, lambda at: self._cached_hash(seq, at))

    def _cached_hash(self, seq: Sequence, num_tokens: int) -> int | None:
        """The hash of seq's block ending at num_tokens, if the prefix cache holds that block."""
        h = seq.block_hashes[num_tokens // self.block_size - 1]
        return h if h in self.hash_to_block else None

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent, the partly filled last one too."""
        for block_id in parent.block_table:
            self._ref(block_id)
        child.block_table = list(parent.block_table)
        child.table_version += 1
        if parent.seq_id in self.uncacheable:
            self.uncacheable.add(child.seq_id)
        if self.state is not None:  # the child's own state slot starts as a copy of the parent's
            child.state_slot = self.state.fork(parent.state_slot)

    def free_sequence(self, seq: Sequence) -> None:
        # Tail first: the end of a sequence is the least likely to be shared, so it is evicted first.
        for block_id in reversed(seq.block_table):
            self._unref(block_id)
        if seq.state_slot is not None:
            self.state.release(seq.state_slot, seq.seq_id)
            seq.state_slot = None
        seq.block_table = []
        seq.table_version += 1
        seq.block_hashes = []
        seq.num_computed_tokens = 0
        self.uncacheable.discard(seq.seq_id)  # recomputed from here on, with one weight version

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (benchmarks: each workload starts cold, as on a fresh server)."""
        for block_id in self.free:
            block = self.blocks[block_id]
            if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
                if self.state is not None:
                    self.state.drop_snapshot(block.hash)
            block.hash, block.token_ids = None, None

    def drop_prefix_cache(self, held: list[Sequence]) -> None:
        """New weights: forget every cached block, those running sequences hold too (their K/V stays theirs);
        the held sequences that have K/V already never add blocks to the cache again."""
        if self.state is not None:
            for h in self.hash_to_block:
                self.state.drop_snapshot(h)
        for block in self.blocks:
            block.hash, block.token_ids = None, None
        self.hash_to_block.clear()
        self.uncacheable.update(seq.seq_id for seq in held if seq.block_table)

    # ---- state slots (models with recurrent layers)

    def can_take_state_slots(self, n: int) -> bool:
        return self.state is None or self.state.num_free >= n

    def take_state_slot(self, seq: Sequence) -> None:
        """At admission (after match_prefix and allocate): the sequence's slot, zeroed, or restored from the
        snapshot at the end of its prefix hit."""
        if self.state is None:
            return
        restore = self.state.snapshot(seq.block_hashes[-1]) if seq.num_computed_tokens else None
        assert restore is not None or not seq.num_computed_tokens, "a prefix hit without a state snapshot"
        seq.state_slot = self.state.take(restore)

    def snapshot_boundary(self, seq: Sequence) -> int | None:
        """Where seq's state is worth a snapshot: the end of the last full block a repeat of its tokens would hit,
        when that is still ahead of it (None: no snapshot to take)."""
        if self.state is None or not self.state.num_snapshots or not self.enable_prefix_caching:
            return None
        boundary = (seq.num_tokens - 1) // self.block_size * self.block_size
        return boundary if boundary > seq.num_computed_tokens else None

    def state_chunk(self, seq: Sequence, num_new_tokens: int) -> int:
        """A prompt chunk that would run past seq's snapshot boundary ends there, so the state there exists."""
        boundary = self.snapshot_boundary(seq)
        if boundary is not None and seq.num_computed_tokens + num_new_tokens > boundary:
            return boundary - seq.num_computed_tokens
        return num_new_tokens

    def plan_snapshot(self, seq: Sequence, num_new_tokens: int) -> None:
        """A scheduled chunk that ends at seq's snapshot boundary: its state is copied out after the forward."""
        boundary = self.snapshot_boundary(seq)
        if boundary is not None and seq.num_computed_tokens + num_new_tokens == boundary:
            self.state.plan_snapshot(seq.seq_id, seq.state_slot, boundary)

    def take_state_ops(self) -> tuple[list[tuple[int, int]], list[int], list[tuple[int, int]]]:
        return self.state.take_ops() if self.state is not None else ([], [], [])

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # ---- accounting

    def slot_usage(self, seqs: list[Sequence]) -> tuple[int, int]:
        """(slots holding tokens, slots allocated) over the blocks these sequences hold; a shared block counts once."""
        filled: dict[int, int] = {}
        for seq in seqs:
            n = seq.num_computed_tokens
            for i, block_id in enumerate(seq.block_table):
                filled[block_id] = max(filled.get(block_id, 0), min(self.block_size, max(n - i * self.block_size, 0)))
        return sum(filled.values()), len(filled) * self.block_size
