"""KV rows kept beyond a slot: cached prompt prefixes and preempted generations.

The one user of the runners' KV row access (`KvRowAccess`): it copies a prompt's blocks into the
prefix cache as they are prefilled and copies a cached prefix into a new request's slot instead
of prefilling it; it copies a preempted generation's rows aside and back into a slot; and it
keeps a prompt's rows and last logits for the other completions of a request that asked for
n > 1, which copy them into their own slots. A runner whose cache lives on a device cannot copy
rows: all of these are then off, said once at start (each completion prefills its prompt).

Used from the engine thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tokenwire.server.engine.pacing import MIN_CHUNK
from tokenwire.server.engine.prefix_cache import PrefixCache, PrefixCacheStats, PrefixLease
from tokenwire.server.models.runner import KvRowAccess, ModelRunner

log = logging.getLogger(__name__)

_NO_ROW_COPIES = "its runner cannot copy KV rows (a KV cache on a device)"


@dataclass
class _KeptPrompt:
    """A fork's prompt, kept until every follower has copied it or ended."""

    rows: np.ndarray
    logits: np.ndarray
    """The model's logits after the prompt's last token: each follower samples its first token."""
    waiting: set[int]


@dataclass
class _PromptCaching:
    """One request's part in the prefix cache: the blocks it holds, and whether to offer more."""

    lease: PrefixLease
    full: bool = False
    """The cache took no more of this prompt's blocks; stop offering them."""


class KvReuse:
    """Prefix-cache hits and inserts, and swapping preempted generations out and in."""

    def __init__(
        self,
        runner: ModelRunner,
        *,
        prefix_cache_bytes: int,
        prefix_block_tokens: int,
        swapping: bool,
    ) -> None:
        name = runner.info.name
        rows = runner if isinstance(runner, KvRowAccess) and runner.kv_bytes_per_token() > 0 else None
        self._rows = rows
        self._cache: PrefixCache | None = None
        self.notes: list[str] = []
        """What was set up and what could not be, for the engine's start-up log."""
        if prefix_cache_bytes > 0:
            if rows is None:
                self.notes.append(
                    f"prefix cache off for {name}: its runner cannot copy KV rows (a KV cache on a device)"
                )
            else:
                room = prefix_cache_bytes // rows.kv_bytes_per_token()
                self.notes.append(
                    f"prefix cache for {name}: {prefix_cache_bytes / 2**20:.0f} MiB, room for about "
                    f"{room} prompt tokens in blocks of {prefix_block_tokens}"
                )
                self._cache = PrefixCache(capacity_bytes=prefix_cache_bytes, block_tokens=prefix_block_tokens)
        if swapping and rows is None:
            self.notes.append(
                f"preemption off for {name}: its runner cannot copy KV rows (a KV cache on a device)"
            )
        self._swapping = swapping and rows is not None
        self._caching: dict[int, _PromptCaching] = {}
        self._swapped: dict[int, np.ndarray | None] = {}
        """Set-aside rows by request key; None for a prompt preempted before its first chunk."""
        self._kept: dict[int, _KeptPrompt] = {}
        """Forks' prompts by the key of the request that prefilled them."""
        self._kept_for: dict[int, int] = {}
        """Each waiting follower's fork source."""
        self.max_kept_prompts = max(1, runner.capacity())
        """Most forks' prompts kept at once (each holds a prompt's rows): beyond it, the followers
        of a fork prefill the prompt themselves."""

    @property
    def can_swap(self) -> bool:
        return self._swapping

    @property
    def can_fork(self) -> bool:
        """Whether a prompt's rows can be copied into other slots (n completions, one prefill)."""
        return self._rows is not None

    @property
    def caches_prefixes(self) -> bool:
        return self._cache is not None

    def prefix_stats(self) -> PrefixCacheStats | None:
        return self._cache.stats() if self._cache is not None else None

    # -- prefix cache ----------------------------------------------------------------------------

    def looked_up(self, key: int) -> bool:
        return key in self._caching

    def load_prefix(self, key: int, prompt: Sequence[int], *, tenant: str) -> int:
        """Start a request from the longest prefix of its prompt that `tenant`'s requests cached;
        the tokens loaded (0: none). A tenant never finds another tenant's blocks."""
        if self._cache is None or self._rows is None:
            return 0
        # At least MIN_CHUNK prompt tokens are left to prefill: the last one's logits are needed,
        # and a shorter chunk would compute them differently from a prefill without the cache.
        lease = self._cache.lookup(prompt, limit=len(prompt) - MIN_CHUNK, tenant=tenant)
        self._caching[key] = _PromptCaching(lease)
        if not lease.tokens:
            return 0
        try:
            return self._rows.start_from_kv(key, lease.kv())
        except Exception:
            log.exception("copying a cached prefix failed for request key %d", key)
            self._cache.release(lease)  # it prefills from the start instead
            self._caching[key] = _PromptCaching(lease, full=True)
            return 0

    def cache_prompt(self, key: int, prompt: Sequence[int], prefilled: int) -> None:
        """Copy the prompt's newly completed full blocks into the prefix cache, and once the whole
        prompt is in, its last partial block too (a chat's next turn resends the whole prompt)."""
        caching = self._caching.get(key)
        if self._cache is None or self._rows is None or caching is None or caching.full:
            return
        cache, rows, lease = self._cache, self._rows, caching.lease
        size = cache.block_tokens
        have, full = len(lease.blocks), prefilled // size
        if full > have:
            try:
                # One read per block: each block is its own array, freed on its own when evicted.
                blocks = [rows.read_kv(key, i * size, (i + 1) * size) for i in range(have, full)]
            except Exception:
                log.exception("caching the prompt of request key %d failed", key)
                caching.full = True
                return
            if cache.extend(lease, prompt, blocks) < len(blocks):
                caching.full = True  # the rest would not fit either
                return
        length = len(prompt)
        if prefilled < length or length % size == 0 or len(lease.blocks) != length // size:
            return
        try:
            tail = rows.read_kv(key, length // size * size, length)
        except Exception:
            log.exception("caching the prompt of request key %d failed", key)
            return
        cache.add_tail(lease, prompt, tail)

    # -- preemption ------------------------------------------------------------------------------

    def swap_out(self, key: int, positions: int) -> bool:
        """Copy a request's first `positions` KV rows aside; False (it keeps its slot) on failure."""
        assert self._rows is not None, "swapping needs a runner that copies KV rows"
        if positions == 0:  # a prompt not yet begun: nothing to keep
            self._swapped[key] = None
            return True
        try:
            self._swapped[key] = self._rows.read_kv(key, 0, positions)
        except Exception:
            log.exception("swapping out request key %d failed; it keeps its slot", key)
            return False
        return True

    def swap_in(self, key: int) -> None:
        """Copy a swapped-out request's rows back into its (new) slot. Raises on failure. A prompt
        set aside before its first chunk has none: its prefill starts the sequence afresh."""
        assert self._rows is not None, "swapping needs a runner that copies KV rows"
        rows = self._swapped.pop(key)
        if rows is not None:
            self._rows.start_from_kv(key, [rows])

    # -- forks (n completions) -------------------------------------------------------------------

    def keep_prompt(self, source: int, length: int, logits: np.ndarray, followers: Sequence[int]) -> bool:
        """Keep the first `length` rows of `source`'s cache (its whole prompt, just prefilled) and
        the logits after it, for `followers` to copy; False when they cannot be kept (the
        followers then prefill the prompt themselves)."""
        if self._rows is None or not followers or len(self._kept) >= self.max_kept_prompts:
            return False
        try:
            rows = self._rows.read_kv(source, 0, length)
        except Exception:
            log.exception("keeping the prompt of request key %d for its other completions failed", source)
            return False
        self._kept[source] = _KeptPrompt(rows, logits.copy(), set(followers))
        self._kept_for.update((follower, source) for follower in followers)
        return True

    def fork_prompt(self, key: int) -> np.ndarray:
        """Start follower `key` from its fork's kept prompt; the logits its first token is sampled
        from (its own copy: sampling may rewrite them). Raises on failure."""
        assert self._rows is not None, "forks need a runner that copies KV rows"
        source = self._kept_for[key]
        kept = self._kept[source]
        self._rows.start_from_kv(key, [kept.rows])
        logits = kept.logits.copy()
        self._done_waiting(key)
        return logits

    def _done_waiting(self, key: int) -> None:
        source = self._kept_for.pop(key, None)
        if source is None:
            return
        kept = self._kept[source]
        kept.waiting.discard(key)
        if not kept.waiting:
            del self._kept[source]

    # -- ending ----------------------------------------------------------------------------------

    def release(self, key: int) -> None:
        """A request ended: its cached blocks may be evicted again, and set-aside rows are dropped."""
        caching = self._caching.pop(key, None)
        if caching is not None and self._cache is not None:
            self._cache.release(caching.lease)
        self._swapped.pop(key, None)
        self._done_waiting(key)  # a follower that ended before it copied its prompt
