"""What each worker's prefix cache probably holds: the block-hash chains of the prompts the gateway sent it.

Pure bookkeeping, no servers. A prompt is cut into full blocks (tokens, or text chunks standing in for
them: `gateway/prefix_keys.py`); block i's hash covers blocks 0..i, as the worker's own prefix hashes do
(worker/core/block_manager.py), so two prompts share a hash exactly when they share everything up to
that block. The gateway records each routed prompt's chain under the worker it chose, in an LRU bounded
by that worker's reported KV capacity (`num_blocks` on `/load`, in the keys' units: `capacity`), and
estimates a newcomer's hit on each worker as the leading run of its chain found there.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

import xxhash

from pagefleet.gateway.routing import WorkerLoad

# Before a worker's first probe reports its KV capacity: large enough never to evict on a small fleet's
# first requests, small enough (8 bytes a block) that a worker which never reports costs little.
DEFAULT_CAPACITY_BLOCKS = 65536
DEFAULT_BLOCK_SIZE = 16  # the worker's own default (--block-size)


def chain_hashes(seed: str, blocks: Iterable[bytes]) -> list[int]:
    """Hash i covers the seed (model or adapter: their K/V differ) and blocks 0..i."""
    parent = xxhash.xxh64_intdigest(seed.encode())
    out = []
    for block in blocks:
        parent = xxhash.xxh64_intdigest(parent.to_bytes(8, "little") + block)
        out.append(parent)
    return out


def token_blocks(token_ids: list[int], block_size: int) -> list[bytes]:
    """The full blocks of a prompt, as the worker cuts them (a partial last block is never cached)."""
    raw, step = array("I", token_ids).tobytes(), 4 * block_size
    return [raw[i * step:(i + 1) * step] for i in range(len(token_ids) // block_size)]


def text_blocks(text: str, chunk_chars: int) -> list[bytes]:
    """Full chunks of `chunk_chars` characters: a block's worth of text, with no tokenizer."""
    full = len(text) // chunk_chars
    return [text[i * chunk_chars:(i + 1) * chunk_chars].encode() for i in range(full)]


class PrefixIndex:
    """Per worker, the block hashes its cache is expected to hold, least recently used first."""

    def __init__(self):
        self.blocks: dict[str, OrderedDict[int, None]] = {}

    def hit_blocks(self, url: str, hashes: list[int]) -> int:
        """How many leading blocks of `hashes` the worker is expected to hold."""
        held = self.blocks.get(url)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def record(self, url: str, hashes: list[int], capacity: int) -> None:
        """The worker computed (or reused) these blocks: they are now its most recently used.

        Tail first, so the first block ends most recent: the worker evicts a freed sequence's tail first
        too, and a chain without its first block is worth nothing.
        """
        held = self.blocks.setdefault(url, OrderedDict())
        for h in reversed(hashes):
            held[h] = None
            held.move_to_end(h)
        capacity = max(capacity, 1)
        while len(held) > capacity:
            held.popitem(last=False)

    def forget(self, url: str) -> None:
        """The worker left or restarted: whatever it held is gone."""
        self.blocks.pop(url, None)

    def retain(self, urls: Iterable[str]) -> None:
        keep = set(urls)
        for url in [u for u in self.blocks if u not in keep]:
            del self.blocks[url]


@dataclass
class Lookup:
    """One request's chain on each candidate worker, and the share of it each is expected to hold."""

    chains: dict[str, list[int]] = field(default_factory=dict)  # worker -> chain, in that worker's block size
    hits: dict[str, float] = field(default_factory=dict)  # worker -> expected hit blocks / chain blocks
    capacity: dict[str, int] = field(default_factory=dict)  # worker -> the LRU bound: its KV blocks, in keys
    held: dict[str, int] = field(default_factory=dict)  # worker -> blocks the index expects it to cache


class PrefixAffinity:
    """The index and the way requests become chains: what the prefix-aware strategy asks before it chooses."""

    def __init__(self, keys):
        self.keys = keys  # TextKeys or TokenKeys (gateway/prefix_keys.py)
        self.index = PrefixIndex()

    def lookup(self, loads: list[WorkerLoad], model: str, messages: list[dict] | None, chat: bool,
               cache_salt: str | None = None) -> Lookup:
        """cache_salt: the request's; its chains meet only those of the same salt, as the workers' do."""
        out, by_size = Lookup(), {}
        seed = model if cache_salt is None else f"{model}\0cache_salt\0{cache_salt}"
        for w in loads:
            if w.up is False:  # a worker that failed its probe may come back restarted, its cache empty
                self.index.forget(w.url)
            size = w.block_size or DEFAULT_BLOCK_SIZE
            if size not in by_size:
                by_size[size] = chain_hashes(seed, self.keys.blocks(messages, chat, size))
            chain = by_size[size]
            out.chains[w.url] = chain
            out.hits[w.url] = self.index.hit_blocks(w.url, chain) / len(chain) if chain else 0.0
            out.capacity[w.url] = self.keys.capacity(w.num_blocks) if w.num_blocks else DEFAULT_CAPACITY_BLOCKS
            out.held[w.url] = len(self.index.blocks.get(w.url, ()))
        return out

    def record(self, url: str, lookup: Lookup) -> tuple[int, int]:
        """The request went to `url`: its chain is now there. Returns (expected hit blocks, chain blocks)."""
        chain = lookup.chains.get(url, [])
        hit = round(lookup.hits.get(url, 0.0) * len(chain))
        self.index.record(url, chain, lookup.capacity.get(url, DEFAULT_CAPACITY_BLOCKS))
        return hit, len(chain)
