"""The queue of requests waiting for a slot: by priority, then fairly between callers by work.

A higher priority is always served first. Within a priority, callers share the engine in
proportion to their weights, counted in the work their requests ask for, not in turns
(weighted fair queueing kept as stride scheduling: each caller has a virtual pass that grows by
the request's work over the caller's weight when the request takes a slot, and the caller with
the lowest pass goes next). Work is `shares.work`: the prompt tokens still to prefill plus the
tokens it may still generate, so a caller sending 1,000-token prompts gets about a tenth of the
turns of one sending 100-token prompts, and the same part of the engine's time. A swapped-out
generation that resumes is charged the work it has left. A caller that starts queueing joins at
the current virtual time, so being idle earns no credit to flood with later. Within a caller,
requests keep their order, except that a request that is not ready yet (its response format
still compiling) lets the caller's next ready one go first.

Also answers what admission control asks: how many requests and prompt tokens a caller has
queued, the prompt tokens queued in all, and a caller's weighted share of a capacity among the
callers queueing now; and what preemption asks: who would go next, and which callers are
queueing at a priority.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from tokenwire.server.engine.shares import fair_share, held_per_share
from tokenwire.server.engine.types import Caller, Priority


class Queued(Protocol):
    @property
    def caller(self) -> Caller: ...

    @property
    def priority(self) -> Priority: ...

    @property
    def ready(self) -> bool: ...

    @property
    def work(self) -> int:
        """What its caller's pass is charged (over its weight) when it takes a slot."""
        ...

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens it counts toward the queue's token bound while it waits."""
        ...


E = TypeVar("E", bound=Queued)


@dataclass
class _Level(Generic[E]):
    """One priority's callers, each with its own queue and pass."""

    queues: dict[str, deque[E]] = field(default_factory=dict)
    passes: dict[str, float] = field(default_factory=dict)
    virtual_time: float = 0.0


class FairQueue(Generic[E]):
    def __init__(self) -> None:
        # Most urgent first: Priority values are ordered that way.
        self._levels: dict[Priority, _Level[E]] = {
            p: _Level() for p in sorted(Priority, key=lambda p: p.value)
        }
        self._weights: dict[str, float] = {}
        self._queued: dict[str, int] = {}
        self._tokens_by: dict[str, int] = {}
        self._counted_tokens: dict[int, int] = {}
        """Each queued entry's tokens as counted when it was queued (by id), so taking it out
        subtracts the same figure whatever it has become since."""
        self._tokens = 0
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator[E]:
        for level in self._levels.values():
            for queue in level.queues.values():
                yield from queue

    def push(self, entry: E) -> None:
        self._caller_queue(entry).append(entry)
        self._count(entry)

    def push_front(self, entry: E) -> None:
        """Queue `entry` ahead of its caller's other requests (work taken back from a slot, which
        was already its caller's next)."""
        self._caller_queue(entry).appendleft(entry)
        self._count(entry)

    def peek(self, allowed: Callable[[E], bool] = lambda _: True) -> E | None:
        """The entry `pop` would return, left in the queue."""
        found = self._next(allowed)
        return None if found is None else found[2]

    def pop(self, allowed: Callable[[E], bool] = lambda _: True) -> E | None:
        """The next ready entry that `allowed` accepts: most urgent priority first, then the
        caller with the lowest pass. None when no entry qualifies."""
        found = self._next(allowed)
        if found is None:
            return None
        self.take(found[2])
        return found[2]

    def take(self, entry: E) -> None:
        """Remove `entry` as if `pop` had returned it: its caller's turn is used up."""
        level = self._levels[entry.priority]
        name = entry.caller.name
        pass_ = level.passes[name]
        level.virtual_time = max(level.virtual_time, pass_)
        level.passes[name] = pass_ + held_per_share(entry.work, entry.caller.weight)
        self._discard(level, name, entry)

    def charge(self, caller: Caller, priority: Priority, work: int) -> None:
        """Charge `caller`'s pass at `priority` for work done beyond what its requests' turns
        paid for (drafts a verification rejected), as if a request of that much work had taken a
        turn. A caller with nothing queued there has no pass: it rejoins at the virtual time."""
        level = self._levels[priority]
        if caller.name in level.passes:
            level.passes[caller.name] += held_per_share(work, caller.weight)

    def remove(self, entry: E) -> None:
        level = self._levels[entry.priority]
        queue = level.queues.get(entry.caller.name)
        if queue is None or entry not in queue:
            raise ValueError("entry is not queued")
        self._discard(level, entry.caller.name, entry)

    def clear(self) -> list[E]:
        everything = list(self)
        for level in self._levels.values():
            level.queues.clear()
            level.passes.clear()
            level.virtual_time = 0.0
        self._weights.clear()
        self._queued.clear()
        self._tokens_by.clear()
        self._counted_tokens.clear()
        self._tokens = 0
        self._size = 0
        return everything

    def queued_by(self, caller: str) -> int:
        return self._queued.get(caller, 0)

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens waiting, all callers together."""
        return self._tokens

    def queued_tokens_by(self, caller: str) -> int:
        return self._tokens_by.get(caller, 0)

    def callers_at(self, priority: Priority) -> dict[str, float]:
        """The weight of each caller with a ready request queued at `priority`."""
        return {
            name: queue[0].caller.weight
            for name, queue in self._levels[priority].queues.items()
            if any(e.ready for e in queue)
        }

    def share(self, caller: Caller, capacity: int) -> float:
        """`caller`'s weighted part of `capacity` among the callers queueing now and itself."""
        weights = dict(self._weights)
        weights[caller.name] = caller.weight
        return fair_share(capacity, caller.weight, weights)

    def _next(self, allowed: Callable[[E], bool]) -> tuple[_Level[E], str, E] | None:
        for level in self._levels.values():
            best: tuple[float, str, E] | None = None
            for name, queue in level.queues.items():
                if best is not None and level.passes[name] >= best[0]:
                    continue
                entry = next((e for e in queue if e.ready and allowed(e)), None)
                if entry is not None:
                    best = (level.passes[name], name, entry)
            if best is not None:
                return level, best[1], best[2]
        return None

    def _caller_queue(self, entry: E) -> deque[E]:
        level = self._levels[entry.priority]
        name = entry.caller.name
        queue = level.queues.get(name)
        if queue is None:
            queue = level.queues[name] = deque()
            level.passes[name] = level.virtual_time
        return queue

    def _count(self, entry: E) -> None:
        name = entry.caller.name
        self._weights[name] = entry.caller.weight
        self._queued[name] = self._queued.get(name, 0) + 1
        tokens = self._counted_tokens[id(entry)] = entry.queued_tokens
        self._tokens_by[name] = self._tokens_by.get(name, 0) + tokens
        self._tokens += tokens
        self._size += 1

    def _discard(self, level: _Level[E], name: str, entry: E) -> None:
        queue = level.queues[name]
        queue.remove(entry)
        if not queue:
            # An idle caller keeps no pass: it rejoins at the virtual time of its return.
            del level.queues[name]
            del level.passes[name]
        tokens = self._counted_tokens.pop(id(entry))
        self._tokens -= tokens
        left = self._queued[name] - 1
        if left:
            self._queued[name] = left
            self._tokens_by[name] -= tokens
        else:
            del self._queued[name]
            del self._tokens_by[name]
            del self._weights[name]
        self._size -= 1
