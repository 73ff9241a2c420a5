"""The KV block pool: reference counts, a free queue in eviction order, prefix hashes, copy-on-write.

A block is `block_size` token slots in every layer's cache. Blocks with reference count 0 sit in the
free queue; those holding a full, hashed prompt block stay findable by their hash until the queue
hands them out again (least recently freed first), which is what makes prefix caching free.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import xxhash

from pagefleet.worker.core.sequence import Sequence


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


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # first = evicted first
        self.hash_to_block: dict[int, int] = {}
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) for the next forward
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, found

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
        """Make room for the next `num_new_tokens` of `seq`; False (and nothing changed) if the pool is short."""
        if self.blocks_needed(seq, num_new_tokens) > len(self.free):
            return False
        if self._needs_copy(seq):
            idx = seq.num_computed_tokens // self.block_size
            src = seq.block_table[idx]
            dst = self._take()
            self._unref(src)
            seq.block_table[idx] = dst
            self.pending_copies.append((src, dst))
        total = seq.num_computed_tokens + num_new_tokens
        while len(seq.block_table) * self.block_size < total:
            seq.block_table.append(self._take())
        return True

    def match_prefix(self, seq: Sequence) -> int:
        """Take the cached full blocks that start `seq` (a sequence holding no blocks); returns tokens hit.

        At least one token is always left to compute, since its logits are what the step samples from.
        """
        assert not seq.block_table
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        num_full = (seq.num_tokens - 1) // bs
        self.prefix_queries += seq.num_prompt_tokens
        parent = None
        hashes = []
        for i in range(num_full):
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            h = block_hash(parent, tokens, seq.lora_id)  # an adapter's K/V differ from the base model's
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tuple(tokens):
                break
            self._ref(block_id)
            seq.block_table.append(block_id)
            hashes.append(h)
            parent = h
        seq.block_hashes = hashes
        hit = len(hashes) * bs
        seq.num_computed_tokens = seq.num_cached_tokens = hit
        self.prefix_hits += min(hit, seq.num_prompt_tokens)
        return hit

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Hash the blocks this step filled, so later requests can find them."""
        bs = self.block_size
        full = seq.num_computed_tokens // bs
        parent = seq.block_hashes[-1] if seq.block_hashes else None
        for i in range(len(seq.block_hashes), full):
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            h = block_hash(parent, tokens, seq.lora_id)  # an adapter's K/V differ from the base model's
            seq.block_hashes.append(h)
            parent = h
            if not self.enable_prefix_caching:
                continue
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self.hash_to_block:
                block.hash, block.token_ids = h, tuple(tokens)
                self.hash_to_block[h] = block.block_id

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent, the partly filled last one too."""
        for block_id in parent.block_table:
            self._ref(block_id)
        child.block_table = list(parent.block_table)

    def free_sequence(self, seq: Sequence) -> None:
        # Tail first: the end of a sequence is the least likely to be shared, so it is evicted first.
        for block_id in reversed(seq.block_table):
            self._unref(block_id)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (benchmarks: each workload starts cold, as on a fresh server)."""
        for block_id in self.free:
            block = self.blocks[block_id]
            if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash, block.token_ids = None, None

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
