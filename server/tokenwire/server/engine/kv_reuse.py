"""KV rows kept beyond a slot: cached prompt prefixes, preempted generations and forked prompts.

The one user of the runners' KV row access (`KvRowAccess`): it looks prompts up in the prefix
cache (for the scheduler, when a prompt is first planned), copies a cached prefix into a new
request's slot instead of prefilling it, and copies a prompt's blocks into the cache as they are
prefilled; it copies a preempted generation's rows aside and back into a slot; and it keeps a
prompt's rows and last logits for the other completions of a request that asked for n > 1, which
copy them into their own slots: straight from the source's slot while the source holds it (the
copy stays where the cache lives, on its device), else from the kept host copy. What a request
holds of all this lives in its record (`Request.kv`, and its group's `kept` prompt); nothing here
is keyed by request.

Rows set aside (cached prefix blocks, swapped-out generations, kept prompts) are host arrays
wherever the runner's cache lives: each is copied out of its slot once and back in on a hit, a
resumption or a fork. A runner that cannot copy rows at all leaves all of this off, said once at
start (each completion then prefills its prompt).

Used from the engine thread only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from tokenwire.server.engine.pacing import MIN_CHUNK
from tokenwire.server.engine.prefix_cache import PrefixCache, PrefixCacheStats
from tokenwire.server.engine.request import Request
from tokenwire.server.models.runner import KvRowAccess, ModelRunner

log = logging.getLogger(__name__)

KvRows = np.ndarray
"""A copy of some positions of a sequence's KV cache, as `KvRowAccess.read_kv` returns it."""


@dataclass
class KeptPrompt:
    """A group's prompt, kept until every follower has copied it or ended."""

    rows: KvRows
    logits: np.ndarray
    """The model's logits after the prompt's last token: each follower samples its first token."""
    waiting: set[int]
    source: int
    """The request that prefilled the prompt."""
    source_in_slot: bool = True
    """Whether the source still holds the prompt's rows in a slot, for a follower to copy slot
    to slot; once it is swapped out or has ended, followers copy `rows` instead."""


class KvReuse:
    """Prefix-cache lookups, hits and inserts, swapping generations out and in, and forks."""

    def __init__(
        self,
        runner: ModelRunner,
        *,
        prefix_cache_bytes: int,
        prefix_block_tokens: int,
        swapping: bool,
    ) -> None:
        info = runner.info
        name = info.name
        rows = runner if isinstance(runner, KvRowAccess) and runner.kv_bytes_per_token() > 0 else None
        self._rows = rows
        self._cache: PrefixCache | None = None
        self.notes: list[str] = []
        """What was set up and what could not be, for the engine's start-up log."""
        cache_at = info.kv_cache_placement or "the runner's KV cache"
        if rows is None and (prefix_cache_bytes > 0 or swapping):
            self.notes.append(
                f"prefix cache, preemption and prompt copies off for {name}: its runner cannot copy KV rows"
            )
        elif rows is not None:
            per_token = rows.kv_bytes_per_token()
            if prefix_cache_bytes > 0:
                self.notes.append(
                    f"prefix cache for {name}: up to {prefix_cache_bytes / 2**20:.0f} MiB in host memory, "
                    f"room for about {prefix_cache_bytes // per_token} prompt tokens in blocks of "
                    f"{prefix_block_tokens}, each block copied once out of the KV cache ({cache_at}) "
                    "and back into a slot on a hit"
                )
                self._cache = PrefixCache(capacity_bytes=prefix_cache_bytes, block_tokens=prefix_block_tokens)
            slots = runner.capacity()
            most = slots * info.context_length * per_token
            if swapping:
                self.notes.append(
                    f"preemption for {name}: a swapped-out generation's rows wait in host memory, "
                    f"at most {slots} at once (up to {most / 2**20:.1f} MiB), copied back into a slot "
                    f"of the KV cache ({cache_at}) when it resumes"
                )
            self.notes.append(
                f"n completions for {name}: one prefill a prompt, the others copy its rows slot to "
                f"slot in the KV cache ({cache_at}), or from a host copy kept until each has copied "
                f"it (at most {max(1, slots)} prompts kept at once)"
            )
        self._swapping = swapping and rows is not None
        self._kept_prompts = 0
        self.max_kept_prompts = max(1, runner.capacity())
        """Most groups' prompts kept at once (each holds a prompt's rows): beyond it, the followers
        of a group prefill the prompt themselves."""

    @property
    def can_swap(self) -> bool:
        return self._swapping

    @property
    def can_fork(self) -> bool:
        """Whether a prompt's rows can be copied into other slots (n completions, one prefill)."""
        return self._rows is not None

    @property
    def block_tokens(self) -> int:
        """The prefix cache's block size; 0 when it is off."""
        return self._cache.block_tokens if self._cache is not None else 0

    def prefix_stats(self) -> PrefixCacheStats | None:
        return self._cache.stats() if self._cache is not None else None

    # -- prefix cache ----------------------------------------------------------------------------

    def look_up(self, request: Request) -> int:
        """Lease the longest prefix of the request's prompt that its tenant's requests cached
        under the same adapter (a tenant never finds another tenant's blocks, nor a request the
        KV another adapter computed); the tokens found (0: none)."""
        if self._cache is None:
            return 0
        # At least MIN_CHUNK prompt tokens are left to prefill: the last one's logits are needed,
        # and a shorter chunk would compute them differently from a prefill without the cache.
        prompt = request.prompt_ids
        # An adapter changes every position's KV, so each adapter's prefixes are a tree of their
        # own: the cache's tenant is the caller's tenant and the adapter (NUL never is in a name).
        tenant = (
            request.caller.tenant if not request.adapter else f"{request.caller.tenant}\0{request.adapter}"
        )
        lease = self._cache.lookup(prompt, limit=len(prompt) - MIN_CHUNK, tenant=tenant)
        request.kv.prefix = lease
        request.kv.prefix_tokens = lease.tokens
        return lease.tokens

    def load_prefix(self, request: Request) -> bool:
        """Copy the request's looked-up prefix into its slot; False if that failed (the lease is
        let go: the request prefills its prompt from the start)."""
        holding = request.kv
        assert self._cache is not None and self._rows is not None and holding.prefix is not None
        try:
            loaded = self._rows.start_from_kv(request.key, holding.prefix.kv())
        except Exception:
            log.exception("copying a cached prefix failed for request %s", request.submitted.request_id)
            loaded = -1
        if loaded == holding.prefix_tokens:
            return True
        self._cache.release(holding.prefix)
        holding.prefix_tokens = 0
        holding.caching_stopped = True
        return False

    @property
    def caches_prefixes(self) -> bool:
        return self._cache is not None

    def cache_prompt(self, request: Request, prefilled: int) -> None:
        """Copy the prompt's newly completed full blocks into the prefix cache, and once the whole
        prompt is in, its last partial block too (a chat's next turn resends the whole prompt)."""
        holding = request.kv
        lease = holding.prefix
        if self._cache is None or self._rows is None or lease is None or holding.caching_stopped:
            return
        cache, rows, key, prompt = self._cache, self._rows, request.key, request.prompt_ids
        size = cache.block_tokens
        have, full = len(lease.blocks), prefilled // size
        if full > have:
            try:
                # One read per block: each block is its own array, freed on its own when evicted.
                blocks = [rows.read_kv(key, i * size, (i + 1) * size) for i in range(have, full)]
            except Exception:
                log.exception("caching the prompt of request %s failed", request.submitted.request_id)
                holding.caching_stopped = True
                return
            if cache.extend(lease, prompt, blocks) < len(blocks):
                holding.caching_stopped = True  # the rest would not fit either
                return
        length = len(prompt)
        if prefilled < length or length % size == 0 or len(lease.blocks) != length // size:
            return
        try:
            tail = rows.read_kv(key, length // size * size, length)
        except Exception:
            log.exception("caching the prompt of request %s failed", request.submitted.request_id)
            return
        cache.add_tail(lease, prompt, tail)

    # -- preemption ------------------------------------------------------------------------------

    def swap_out(self, request: Request, positions: int) -> bool:
        """Copy a request's first `positions` KV rows aside; False (it keeps its slot) on failure."""
        assert self._rows is not None, "swapping needs a runner that copies KV rows"
        if positions == 0:  # a prompt not yet begun: nothing to keep
            request.kv.swapped = None
            return True
        try:
            request.kv.swapped = self._rows.read_kv(request.key, 0, positions)
        except Exception:
            log.exception("swapping out request %s failed; it keeps its slot", request.submitted.request_id)
            return False
        self._source_holds_slot(request, False)
        return True

    def swap_in(self, request: Request) -> None:
        """Copy a swapped-out request's rows back into its (new) slot. Raises on failure. A prompt
        set aside before its first chunk has none: its prefill starts the sequence afresh."""
        assert self._rows is not None, "swapping needs a runner that copies KV rows"
        rows, request.kv.swapped = request.kv.swapped, None
        if rows is not None:
            self._rows.start_from_kv(request.key, [rows])
            self._source_holds_slot(request, True)

    # -- forks (n completions) -------------------------------------------------------------------

    def keep_prompt(self, request: Request, logits: np.ndarray) -> bool:
        """Keep the request's prompt rows (just prefilled) and the logits after it, for its
        group's other completions to copy; False when they cannot be kept (the followers then
        prefill the prompt themselves)."""
        group = request.group
        assert group is not None, "a prompt kept for a request without a group"
        followers = group.live_followers()
        if self._rows is None or not followers or self._kept_prompts >= self.max_kept_prompts:
            return False
        try:
            rows = self._rows.read_kv(request.key, 0, request.prompt_length)
        except Exception:
            log.exception(
                "keeping the prompt of request %s for its other completions failed",
                request.submitted.request_id,
            )
            return False
        group.kept = KeptPrompt(rows, logits.copy(), set(followers), source=request.key)
        self._kept_prompts += 1
        return True

    def fork_prompt(self, request: Request) -> np.ndarray:
        """Start follower `request` from its group's prompt, slot to slot while the source holds
        it, else from the kept host copy; the logits its first token is sampled from (its own
        copy: sampling may rewrite them). Raises on failure."""
        assert self._rows is not None, "forks need a runner that copies KV rows"
        group = request.group
        assert group is not None and group.kept is not None, "a fork without a kept prompt"
        kept = group.kept
        if not kept.source_in_slot or not self._copy_from_source(request, kept):
            self._rows.start_from_kv(request.key, [kept.rows])
        logits = kept.logits.copy()
        self._done_waiting(request)
        return logits

    def _copy_from_source(self, request: Request, kept: KeptPrompt) -> bool:
        assert self._rows is not None
        try:
            self._rows.start_from_sequence(request.key, kept.source, request.prompt_length)
        except Exception:
            log.exception(
                "copying the prompt of request %s slot to slot failed; copying its kept rows instead",
                request.submitted.request_id,
            )
            return False
        return True

    def _source_holds_slot(self, request: Request, holds: bool) -> None:
        """Note whether a group's source holds its prompt's rows in a slot (swapped out or back
        in, or ended)."""
        group = request.group
        kept = group.kept if group is not None else None
        if kept is not None and kept.source == request.key:
            kept.source_in_slot = holds

    def _done_waiting(self, request: Request) -> None:
        group = request.group
        kept = group.kept if group is not None else None
        if kept is None or request.key not in kept.waiting:
            return
        kept.waiting.discard(request.key)
        if not kept.waiting:
            group.kept = None  # type: ignore[union-attr]
            self._kept_prompts -= 1

    # -- ending ----------------------------------------------------------------------------------

    def release(self, request: Request) -> None:
        """A request ended: its cached blocks may be evicted again, and set-aside rows are dropped."""
        holding = request.kv
        if holding.prefix is not None and self._cache is not None:
            self._cache.release(holding.prefix)
        holding.swapped = None
        self._source_holds_slot(request, False)
        self._done_waiting(request)  # a follower that ended before it copied its prompt
