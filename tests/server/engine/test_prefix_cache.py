"""The prefix cache's bookkeeping: longest full-block prefixes, LRU eviction, leases, the byte bound,
and one tree of prefixes per tenant."""

from __future__ import annotations

import numpy as np

from tokenwire.server.engine.prefix_cache import PrefixCache

BLOCK = 4
BLOCK_BYTES = 32
ALICE = "caller:alice"
BOB = "caller:bob"


def kv(marker: int) -> np.ndarray:
    """Stand-in KV rows for one block: 32 bytes carrying a marker to tell blocks apart."""
    return np.full(8, marker, dtype=np.float32)


def cache_with(capacity_blocks: int) -> PrefixCache:
    return PrefixCache(capacity_bytes=capacity_blocks * BLOCK_BYTES, block_tokens=BLOCK)


def store(cache: PrefixCache, prompt: list[int], *, keep: bool = False, tenant: str = ALICE) -> int:
    """Run a request's bookkeeping: look up, cache the rest of its full blocks, release (unless kept)."""
    lease = cache.lookup(prompt, limit=len(prompt), tenant=tenant)
    missing = len(prompt) // BLOCK - len(lease.blocks)
    added = cache.extend(lease, prompt, [kv(100 + i) for i in range(missing)])
    if not keep:
        cache.release(lease)
    return added


def test_lookup_finds_the_longest_cached_full_block_prefix() -> None:
    cache = cache_with(16)
    prompt = list(range(1, 11))  # two full blocks and two loose tokens
    assert store(cache, prompt) == 2
    longer = cache.lookup([*prompt[:8], 50, 51, 52, 53, 54], limit=100, tenant=ALICE)
    assert longer.tokens == 8
    assert [int(b[0]) for b in longer.kv()] == [100, 101]
    diverging = cache.lookup([1, 2, 3, 4, 5, 6, 7, 99], limit=100, tenant=ALICE)
    assert diverging.tokens == 4
    assert cache.lookup([9, 2, 3, 4, 5, 6, 7, 8], limit=100, tenant=ALICE).tokens == 0


def test_lookup_never_returns_more_than_the_limit() -> None:
    cache = cache_with(16)
    prompt = list(range(1, 13))
    store(cache, prompt)
    assert cache.lookup(prompt, limit=10, tenant=ALICE).tokens == 8
    assert cache.lookup(prompt, limit=3, tenant=ALICE).tokens == 0


def test_a_block_is_known_by_its_whole_prefix_not_its_own_tokens() -> None:
    cache = cache_with(16)
    store(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    # The same second block after a different first block is a different prefix.
    assert cache.lookup([9, 9, 9, 9, 5, 6, 7, 8], limit=100, tenant=ALICE).tokens == 0


def test_the_least_recently_used_prefix_is_evicted_first() -> None:
    cache = cache_with(4)
    store(cache, [1] * 8)  # blocks A1 A2
    store(cache, [2] * 8)  # blocks B1 B2
    cache.release(cache.lookup([1] * 8, limit=100, tenant=ALICE))  # A is now more recent than B
    store(cache, [3] * 8)  # needs two blocks: B's go
    assert cache.lookup([2] * 8, limit=100, tenant=ALICE).tokens == 0
    assert cache.lookup([1] * 8, limit=100, tenant=ALICE).tokens == 8
    assert cache.stats().evicted_blocks == 2


def test_eviction_takes_a_prefix_s_last_block_before_its_first() -> None:
    cache = cache_with(3)
    store(cache, [1] * 12)  # three blocks of one chain fill the cache
    store(cache, [7] * 4)  # one block must go: the chain's tail, so its head stays usable
    assert cache.lookup([1] * 12, limit=100, tenant=ALICE).tokens == 8


def test_blocks_a_running_request_holds_are_never_evicted() -> None:
    cache = cache_with(2)
    lease = cache.lookup([1] * 8, limit=100, tenant=ALICE)
    assert cache.extend(lease, [1] * 8, [kv(1), kv(2)]) == 2
    # The cache is full of leased blocks: a new prefix is simply not cached.
    assert store(cache, [2] * 8) == 0
    again = cache.lookup([1] * 8, limit=100, tenant=ALICE)
    assert again.tokens == 8
    cache.release(again)
    cache.release(lease)
    assert store(cache, [2] * 8) == 2


def test_memory_never_exceeds_the_capacity() -> None:
    cache = cache_with(5)
    for start in range(20):
        store(cache, [start] * 8 + [start + 1] * 4)
        stats = cache.stats()
        assert stats.bytes <= stats.capacity_bytes
        assert stats.bytes == stats.blocks * BLOCK_BYTES


def test_a_prefix_cached_twice_is_stored_once() -> None:
    cache = cache_with(16)
    first = cache.lookup([1] * 8, limit=100, tenant=ALICE)
    second = cache.lookup([1] * 8, limit=100, tenant=ALICE)  # both looked up before either cached anything
    cache.extend(first, [1] * 8, [kv(1), kv(2)])
    cache.extend(second, [1] * 8, [kv(3), kv(4)])
    assert cache.stats().blocks == 2
    assert [int(b[0]) for b in second.kv()] == [1, 2]


def test_hit_rate_counts_prompt_tokens_found_in_the_cache() -> None:
    cache = cache_with(16)
    store(cache, [1] * 8)  # lookup of 8 tokens, none cached
    cache.release(cache.lookup([1] * 8 + [2] * 8, limit=100, tenant=ALICE))  # 8 of 16 cached
    stats = cache.stats()
    assert (stats.lookups, stats.prompt_tokens, stats.hit_tokens) == (2, 24, 8)
    assert stats.hit_rate == 8 / 24


def store_with_tail(cache: PrefixCache, prompt: list[int]) -> None:
    """A whole prompt's bookkeeping: its full blocks, then its partial last block."""
    lease = cache.lookup(prompt, limit=len(prompt), tenant=ALICE)
    missing = len(prompt) // BLOCK - len(lease.blocks)
    cache.extend(lease, prompt, [kv(100 + i) for i in range(missing)])
    if len(prompt) % BLOCK:
        cache.add_tail(lease, prompt, kv(900))
    cache.release(lease)


def test_a_prompt_that_continues_a_cached_one_finds_it_to_the_last_token() -> None:
    cache = cache_with(16)
    store_with_tail(cache, [1, 2, 3, 4, 5, 6])  # one block and a two-token tail
    turn = cache.lookup([1, 2, 3, 4, 5, 6, 7, 8, 9], limit=100, tenant=ALICE)
    assert turn.tokens == 6
    assert [int(b[0]) for b in turn.kv()] == [100, 900]


def test_a_tail_is_found_only_when_the_prompt_has_all_its_tokens() -> None:
    cache = cache_with(16)
    store_with_tail(cache, [1, 2, 3, 4, 5, 6, 7])
    assert cache.lookup([1, 2, 3, 4, 5, 6, 0, 0], limit=100, tenant=ALICE).tokens == 4
    # The limit cuts the tail.
    assert cache.lookup([1, 2, 3, 4, 5, 6, 7, 0], limit=6, tenant=ALICE).tokens == 4


def test_full_blocks_cached_after_a_tail_take_its_place_in_the_lease() -> None:
    cache = cache_with(16)
    store_with_tail(cache, [1, 2, 3, 4, 5, 6])
    lease = cache.lookup([1, 2, 3, 4, 5, 6, 7, 8, 9], limit=100, tenant=ALICE)
    assert cache.extend(lease, [1, 2, 3, 4, 5, 6, 7, 8, 9], [kv(2)]) == 1
    assert lease.tail is None and lease.tokens == 8
    cache.release(lease)
    # Nothing is held now: every block, the tail included, makes way for new prefixes.
    for start in range(16):
        assert store(cache, [start + 50] * 4) == 1
    assert cache.lookup([1, 2, 3, 4, 5, 6], limit=100, tenant=ALICE).tokens == 0


def test_a_held_tail_is_never_evicted() -> None:
    cache = cache_with(2)
    store_with_tail(cache, [1, 2, 3, 4, 5])
    held = cache.lookup([1, 2, 3, 4, 5, 6, 7], limit=100, tenant=ALICE)
    assert held.tokens == 5
    assert store(cache, [9] * 8) == 0  # both places hold the leased block and tail
    cache.release(held)
    assert store(cache, [9] * 8) == 2


def test_a_tenant_never_finds_the_prefixes_another_tenant_cached() -> None:
    cache = cache_with(16)
    store_with_tail(cache, [1, 2, 3, 4, 5, 6])
    theirs = cache.lookup([1, 2, 3, 4, 5, 6, 7], limit=100, tenant=BOB)
    assert theirs.tokens == 0 and theirs.kv() == []
    assert cache.stats().hit_tokens == 0
    # Bob caches the same prompt for himself: his own copy, which alice's lookups never see either.
    assert cache.extend(theirs, [1, 2, 3, 4, 5, 6, 7], [kv(7)]) == 1
    cache.release(theirs)
    assert cache.stats().blocks == 3
    assert [int(b[0]) for b in cache.lookup([1, 2, 3, 4, 9], limit=100, tenant=BOB).kv()] == [7]
    assert [int(b[0]) for b in cache.lookup([1, 2, 3, 4, 9], limit=100, tenant=ALICE).kv()] == [100]


def test_one_tenant_s_blocks_may_evict_another_s() -> None:
    cache = cache_with(2)
    store(cache, [1] * 8, tenant=ALICE)
    assert store(cache, [2] * 8, tenant=BOB) == 2  # the bound is shared: alice's blocks made room
    assert cache.stats().evicted_blocks == 2
    assert cache.lookup([1] * 8, limit=100, tenant=ALICE).tokens == 0
