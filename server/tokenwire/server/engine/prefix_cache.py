"""Prompt prefixes whose KV cache is kept after their request ends, for later requests to reuse.

The cache works on full blocks of `block_tokens` prompt tokens, as vLLM's automatic prefix
caching does: a block is known by its parent block and its own tokens, so a block stands for
the whole prefix that ends with it, and a prompt's cached prefix is the longest chain of its
blocks found from the start. The key holds the tokens themselves (not a hash of them), so two
different prefixes can never share an entry. The chains form a tree of prefixes, like SGLang's
radix tree, at block granularity.

Each tenant has its own tree: the first block of a chain is keyed by the tenant instead of a
parent, so a lookup only ever walks chains its own tenant's requests cached. Otherwise a caller
could learn another's prompt, block by block, from how many of its prompt tokens came back
cached (or from how fast its first token came). The byte bound is shared: one tenant's blocks
may evict another's, but never serve it.

A prompt's last, partial block is cached too, as a tail that nothing extends: a chat's next turn
resends the whole previous prompt, so it finds that prompt to the last token, not just to its
last full block.

What a block holds is opaque here: the runner's KV rows for those positions, copied out of a
sequence's slot after its prefill and copied back into a new sequence's slot instead of a
prefill. Memory is bounded: when a new block does not fit, the least recently used block that
no running request holds and that no cached block extends is dropped. A block a running request
holds (a lease) is never dropped; when nothing can be dropped, the new block is not cached.

Used from the engine thread only.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(eq=False)
class _Block:
    key: tuple[int | str, tuple[int, ...]]
    """(the parent block's id, or the tenant at the start of a prompt; this block's tokens)."""
    id: int
    parent: _Block | None
    kv: np.ndarray
    leases: int = 0
    children: int = 0

    @property
    def tokens(self) -> int:
        return len(self.key[1])


@dataclass(eq=False)
class PrefixLease:
    """The cached blocks at the start of one request's prompt; they stay cached while it runs."""

    tenant: str
    """Whose tree the blocks are in, and the blocks the request caches go into."""
    blocks: list[_Block] = field(default_factory=list)
    """Full blocks, from the start of the prompt."""
    block_tokens: int = 0
    tail: _Block | None = None
    """A partial block after the full ones, when the lookup found one."""

    @property
    def tokens(self) -> int:
        return len(self.blocks) * self.block_tokens + (self.tail.tokens if self.tail is not None else 0)

    def kv(self) -> list[np.ndarray]:
        """The blocks' KV rows, in prompt order."""
        return [block.kv for block in self._held()]

    def _held(self) -> list[_Block]:
        return [*self.blocks, self.tail] if self.tail is not None else list(self.blocks)


@dataclass(frozen=True)
class PrefixCacheStats:
    lookups: int
    prompt_tokens: int
    """Prompt tokens of every lookup."""
    hit_tokens: int
    """Of those, tokens found in the cache."""
    blocks: int
    bytes: int
    capacity_bytes: int
    evicted_blocks: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class PrefixCache:
    """Full-block prompt prefixes and their KV rows, bounded in bytes, least recently used out."""

    def __init__(self, *, capacity_bytes: int, block_tokens: int) -> None:
        if block_tokens < 1:
            raise ValueError("block_tokens must be at least 1")
        self._capacity = capacity_bytes
        self._block_tokens = block_tokens
        self._by_key: dict[tuple[int | str, tuple[int, ...]], _Block] = {}
        # Least recently used first. A chain is touched leaf first, so a parent is always more
        # recent than its children and the front holds leaves: evicting from the front never
        # strands a cached child behind a dropped parent.
        self._recency: OrderedDict[int, _Block] = OrderedDict()
        self._ids = itertools.count(1)
        self._bytes = 0
        self._lookups = 0
        self._prompt_tokens = 0
        self._hit_tokens = 0
        self._evicted = 0

    @property
    def block_tokens(self) -> int:
        return self._block_tokens

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            lookups=self._lookups,
            prompt_tokens=self._prompt_tokens,
            hit_tokens=self._hit_tokens,
            blocks=len(self._by_key),
            bytes=self._bytes,
            capacity_bytes=self._capacity,
            evicted_blocks=self._evicted,
        )

    def lookup(self, prompt: Sequence[int], *, limit: int, tenant: str) -> PrefixLease:
        """Lease the longest prefix of `prompt`, at most `limit` tokens long, that requests of
        `tenant` cached; what the lease's request caches later is `tenant`'s too."""
        lease = PrefixLease(tenant=tenant, block_tokens=self._block_tokens)
        size = self._block_tokens
        usable = min(limit, len(prompt))
        parent: _Block | None = None
        for start in range(0, usable - size + 1, size):
            block = self._by_key.get((_parent_key(parent, tenant), tuple(prompt[start : start + size])))
            if block is None:
                break
            lease.blocks.append(block)
            parent = block
        start = len(lease.blocks) * size
        for length in range(min(size - 1, usable - start), 0, -1):
            lease.tail = self._by_key.get(
                (_parent_key(parent, tenant), tuple(prompt[start : start + length]))
            )
            if lease.tail is not None:
                break
        held = lease._held()
        for block in held:
            block.leases += 1
        self._touch(held)
        self._lookups += 1
        self._prompt_tokens += len(prompt)
        self._hit_tokens += lease.tokens
        return lease

    def extend(self, lease: PrefixLease, prompt: Sequence[int], kv_blocks: Sequence[np.ndarray]) -> int:
        """Cache the blocks that follow the lease's prefix; returns how many the lease now holds more.

        `kv_blocks[i]` holds the KV rows of the prompt's block `len(lease.blocks) + i`. A block
        already cached (another request cached the same prefix) is shared instead of stored twice.
        Stops at the first block that does not fit.
        """
        size = self._block_tokens
        added = 0
        if kv_blocks and lease.tail is not None:
            # Full blocks now cover the tail's tokens: the lease needs it no more.
            lease.tail.leases -= 1
            lease.tail = None
        for kv in kv_blocks:
            start = len(lease.blocks) * size
            tokens = tuple(prompt[start : start + size])
            if len(tokens) < size:
                break
            parent = lease.blocks[-1] if lease.blocks else None
            key = (_parent_key(parent, lease.tenant), tokens)
            block = self._by_key.get(key)
            if block is None:
                if not self._make_room(kv.nbytes):
                    break
                block = _Block(key=key, id=next(self._ids), parent=parent, kv=kv)
                self._by_key[block.key] = block
                self._bytes += kv.nbytes
                if parent is not None:
                    parent.children += 1
            block.leases += 1
            lease.blocks.append(block)
            added += 1
        self._touch(lease._held())
        return added

    def add_tail(self, lease: PrefixLease, prompt: Sequence[int], kv: np.ndarray) -> bool:
        """Cache the prompt's last, partial block, after the lease's full blocks (which must be all
        of the prompt's); False when it is already cached or does not fit."""
        start = len(lease.blocks) * self._block_tokens
        tokens = tuple(prompt[start:])
        if not 0 < len(tokens) < self._block_tokens:
            raise ValueError(f"a tail holds 1 to {self._block_tokens - 1} tokens, not {len(tokens)}")
        parent = lease.blocks[-1] if lease.blocks else None
        key = (_parent_key(parent, lease.tenant), tokens)
        if key in self._by_key or not self._make_room(kv.nbytes):
            return False
        block = _Block(key=key, id=next(self._ids), parent=parent, kv=kv)
        self._by_key[key] = block
        self._bytes += kv.nbytes
        if parent is not None:
            parent.children += 1
        self._touch([*lease._held(), block])
        return True

    def release(self, lease: PrefixLease) -> None:
        """The request is done with its prefix: its blocks may be evicted again."""
        for block in lease._held():
            block.leases -= 1
        lease.blocks = []
        lease.tail = None

    # -- internals -------------------------------------------------------------------------------

    def _touch(self, chain: list[_Block]) -> None:
        for block in reversed(chain):
            self._recency[block.id] = block
            self._recency.move_to_end(block.id)

    def _make_room(self, nbytes: int) -> bool:
        if nbytes > self._capacity:
            return False
        while self._bytes + nbytes > self._capacity:
            victim = next((b for b in self._recency.values() if b.leases == 0 and b.children == 0), None)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def _evict(self, block: _Block) -> None:
        del self._by_key[block.key]
        del self._recency[block.id]
        self._bytes -= block.kv.nbytes
        self._evicted += 1
        if block.parent is not None:
            block.parent.children -= 1


def _parent_key(parent: _Block | None, tenant: str) -> int | str:
    """A block's parent in its key: the parent's id, or at the root of a chain the tenant (block
    ids are numbers, so no tenant's root can be mistaken for a block)."""
    return tenant if parent is None else parent.id
