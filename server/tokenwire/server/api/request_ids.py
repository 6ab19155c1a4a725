"""Idempotency keys: one generation per caller and idempotency_key, however often it is asked for.

A request that carries an idempotency_key is registered under (caller, key) with a fingerprint
of its body. While it runs, a retry with the same caller, key and body attaches to it instead of
starting a second generation: it hears what happened so far (started, then the tokens so far as
one chunk per completion, under the completion's index) and then every event as it comes.
After a generation ends by itself (EOS, length or a stop string) its result stays retrievable
for `retention` seconds, within `max_bytes` of results in all. A result's size is what it holds
in memory, every field counted (text, ids, each position's log-probability and its alternatives,
each completion's own). When a new result would pass the bound, the results that go first are
those of the caller holding the most (its oldest first), so a caller keeping many results only
ever evicts its own while another holds less than it. A retry with the same key and another
body is ALREADY_EXISTS. Keys are scoped per caller, so no caller can reach another's generations.

Only the key makes a request idempotent: a request_id is a handle (a stream's label for events
and cancels) and is never looked up here, so two clients numbering their requests 1, 2, 3 never
meet each other's generations.

A generation that is cancelled, fails, or loses its last listener (every call that asked for it
went away) is forgotten: nothing of it is kept, and a later retry starts afresh. Everything here
runs on the event loop (engine events are delivered there), so no lock is needed.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tokenwire.server.engine.engine import Engine
from tokenwire.server.engine.errors import ErrorKind, FieldViolation, GenerationError
from tokenwire.server.engine.types import (
    AbortReason,
    Completed,
    EngineEvent,
    EventSink,
    Failed,
    FinishReason,
    GenerationResult,
    Started,
    TimingReport,
    TokenLogprobs,
    TokensGenerated,
)

_NATURAL_ENDS = (FinishReason.EOS, FinishReason.LENGTH, FinishReason.STOP)


@dataclass
class _Output:
    """What one completion of a live generation produced so far."""

    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass
class _Generation:
    caller: str
    idempotency_key: str
    fingerprint: bytes
    engine: Engine | None = None
    engine_key: int = 0
    """The engine's handle of the request, for aborting it."""
    listeners: dict[int, EventSink] = field(default_factory=dict)
    started: Started | None = None
    outputs: dict[int, _Output] = field(default_factory=dict)
    """Per completion index (0 alone unless the request asked for n > 1), its output so far."""
    completed: Completed | None = None
    """Its result, when kept (a natural end, with retention)."""
    ending: Completed | Failed | None = None
    """How it ended, kept or not: for a listener that attached just before the end."""
    finished_at: float = 0.0
    size: int = 0

    def so_far(self) -> list[EngineEvent]:
        """What a listener that joins now has missed, as few events as possible: one chunk per
        completion, under that completion's index."""
        events: list[EngineEvent] = []
        if self.started is not None:
            events.append(self.started)
        if self.completed is not None:
            result = self.completed.result
            if result.choices:
                events.extend(
                    TokensGenerated(choice.token_ids, choice.text, choice.logprobs, index=choice.index)
                    for choice in result.choices
                    if choice.token_ids or choice.text
                )
            elif result.token_ids or result.text:
                events.append(TokensGenerated(result.token_ids, result.text, result.logprobs))
            events.append(self.completed)
            return events
        for index in sorted(self.outputs):
            output = self.outputs[index]
            if output.token_ids or output.text:
                events.append(
                    TokensGenerated(
                        tuple(output.token_ids), "".join(output.text), tuple(output.logprobs), index=index
                    )
                )
        return events


class Subscription:
    """One call's interest in a generation; `stop` is how that call ends it or lets go of it."""

    def __init__(self, registry: GenerationRegistry, generation: _Generation, listener: int) -> None:
        self._registry = registry
        self._generation = generation
        self._listener = listener

    def stop(self, reason: AbortReason) -> None:
        self._registry.stop(self._generation, self._listener, reason)


class GenerationRegistry:
    def __init__(self, *, retention: float, max_bytes: int, clock: Callable[[], float]) -> None:
        self._retention = retention
        self._max_bytes = max_bytes
        self._clock = clock
        self._live: dict[tuple[str, str], _Generation] = {}
        self._kept: OrderedDict[tuple[str, str], _Generation] = OrderedDict()
        """Every kept result, oldest first (for expiry)."""
        self._kept_by_caller: dict[str, OrderedDict[str, _Generation]] = {}
        """Each caller's kept results by key, oldest first (for eviction)."""
        self._caller_bytes: dict[str, int] = {}
        self._kept_bytes = 0
        self._listeners = itertools.count(1)

    @property
    def live_count(self) -> int:
        return len(self._live)

    @property
    def kept_count(self) -> int:
        return len(self._kept)

    @property
    def kept_bytes(self) -> int:
        """What the kept results hold in memory, as counted against `max_bytes`."""
        return self._kept_bytes

    def listeners(self, caller: str, idempotency_key: str) -> int:
        """Calls listening to the caller's live generation with this key (0 when none runs)."""
        found = self._live.get((caller, idempotency_key))
        return 0 if found is None else len(found.listeners)

    def find(self, caller: str, idempotency_key: str, fingerprint: bytes) -> _Generation | None:
        """The caller's generation with this key, live or kept; None when there is none.
        Raises ALREADY_EXISTS when it was asked for with another body."""
        self._expire()
        key = (caller, idempotency_key)
        found = self._live.get(key) or self._kept.get(key)
        if found is not None and found.fingerprint != fingerprint:
            raise GenerationError(
                ErrorKind.ALREADY_EXISTS,
                f"idempotency_key {idempotency_key!r} was already used for a different request",
                violations=(
                    FieldViolation(
                        "idempotency_key",
                        "already used for a different request; choose a new key for a new request",
                    ),
                ),
                reason="IDEMPOTENCY_KEY_REUSED",
            )
        return found

    def begin(
        self, caller: str, idempotency_key: str, fingerprint: bytes, listener: EventSink
    ) -> tuple[_Generation, Subscription]:
        """Register a new generation, heard by `listener`; bind it to its engine with `bind`."""
        generation = _Generation(caller, idempotency_key, fingerprint)
        self._live[(caller, idempotency_key)] = generation
        number = next(self._listeners)
        generation.listeners[number] = listener
        return generation, Subscription(self, generation, number)

    def deliver_to(self, generation: _Generation) -> EventSink:
        """The sink to submit the generation's request with."""
        return lambda event: self._deliver(generation, event)

    def bind(self, generation: _Generation, engine: Engine, key: int) -> None:
        """The engine's handle, for stopping the generation once it is queued."""
        generation.engine, generation.engine_key = engine, key

    def discard(self, generation: _Generation) -> None:
        """The generation never reached the engine (it was refused)."""
        self._live.pop((generation.caller, generation.idempotency_key), None)

    def attach(self, generation: _Generation, listener: EventSink) -> Subscription:
        """Let `listener` hear `generation`: what happened so far, then the rest as it comes. The
        catch-up is delivered on the next turn of the event loop, after the caller's own reply to
        the request (a stream's `queued` event) has gone out."""
        number = next(self._listeners)

        def join() -> None:
            for event in generation.so_far():
                listener(event)
            if generation.completed is not None:
                return  # so_far ended with the kept result
            if generation.ending is not None:
                # It ended, unkept, between the attach and now: the listener still hears how.
                listener(generation.ending)
            elif (generation.caller, generation.idempotency_key) in self._live:
                generation.listeners[number] = listener

        asyncio.get_running_loop().call_soon(join)
        return Subscription(self, generation, number)

    def stop(self, generation: _Generation, listener: int, reason: AbortReason) -> None:
        # A cancel ends the generation for everyone, the canceller included (it hears the
        # cancelled completion); a call that went away only lets go of it, and the generation
        # stops when nobody is left listening.
        if reason is not AbortReason.CANCELLED:
            generation.listeners.pop(listener, None)
        if generation.engine is None or generation.completed is not None:
            return
        if reason is AbortReason.CANCELLED or not generation.listeners:
            generation.engine.abort(generation.engine_key, reason)

    def _deliver(self, generation: _Generation, event: EngineEvent) -> None:
        if isinstance(event, Started):
            generation.started = event
        elif isinstance(event, TokensGenerated):
            output = generation.outputs.setdefault(event.index, _Output())
            output.token_ids.extend(event.token_ids)
            output.text.append(event.text)
            output.logprobs.extend(event.logprobs)
        for listener in list(generation.listeners.values()):
            listener(event)
        if isinstance(event, Completed | Failed):
            generation.ending = event
            self._live.pop((generation.caller, generation.idempotency_key), None)
            generation.listeners.clear()
            if isinstance(event, Completed) and event.result.finish_reason in _NATURAL_ENDS:
                self._keep(generation, event)

    def _keep(self, generation: _Generation, completed: Completed) -> None:
        if self._retention <= 0:
            return
        result = completed.result
        generation.completed = completed
        generation.outputs = {}
        generation.started = Started(result.timing.queued, result.prompt_tokens)
        generation.size = result_bytes(result)
        if generation.size > self._max_bytes:
            return
        generation.finished_at = self._clock()
        caller, key = generation.caller, generation.idempotency_key
        self._kept[(caller, key)] = generation
        self._kept_by_caller.setdefault(caller, OrderedDict())[key] = generation
        self._caller_bytes[caller] = self._caller_bytes.get(caller, 0) + generation.size
        self._kept_bytes += generation.size
        while self._kept_bytes > self._max_bytes:
            # The caller holding the most gives up its oldest: memory is shared between callers.
            largest = max(self._caller_bytes, key=self._caller_bytes.__getitem__)
            oldest_key = next(iter(self._kept_by_caller[largest]))
            self._forget(self._kept[(largest, oldest_key)])

    def _forget(self, generation: _Generation) -> None:
        caller, key = generation.caller, generation.idempotency_key
        del self._kept[(caller, key)]
        mine = self._kept_by_caller[caller]
        del mine[key]
        self._caller_bytes[caller] -= generation.size
        if not mine:
            del self._kept_by_caller[caller], self._caller_bytes[caller]
        self._kept_bytes -= generation.size

    def _expire(self) -> None:
        cutoff = self._clock() - self._retention
        while self._kept:
            oldest = next(iter(self._kept.values()))
            if oldest.finished_at > cutoff:
                return
            self._forget(oldest)


# What kept objects weigh in memory (CPython, 64-bit), measured once from real instances: a
# result is counted by its parts, without walking every object of it.
_INT = sys.getsizeof(1 << 40)
_FLOAT = sys.getsizeof(1.0)
_ALTERNATIVE = sys.getsizeof((0, "", 0.0))
_RECORD = sys.getsizeof(_Generation("", "", b"")) + sys.getsizeof(_Generation("", "", b"").__dict__)
_LOGPROB = sys.getsizeof(TokenLogprobs(0, "", 0.0)) + sys.getsizeof(TokenLogprobs(0, "", 0.0).__dict__)
_TIMING = sys.getsizeof(TimingReport(0.0, 0.0)) + sys.getsizeof(TimingReport(0.0, 0.0).__dict__) + 7 * _FLOAT
_KEEPING = 4 * 104
"""The record's entries in the registry's three maps, their keys and the fingerprint."""


def result_bytes(result: GenerationResult) -> int:
    """What keeping `result` costs in memory: its record, texts, ids, timing, and for every
    position its log-probability with each alternative (id, text, value), for every completion.
    Strings are counted by their own size, so text in any script weighs what it does."""
    total = _RECORD + _KEEPING + _TIMING + sys.getsizeof(result) + sys.getsizeof(result.__dict__)
    total += sys.getsizeof(result.request_id) + sys.getsizeof(result.model)
    outputs: list[tuple[str, Sequence[int], Sequence[TokenLogprobs]]] = [
        (result.text, result.token_ids, result.logprobs)
    ]
    outputs += [(choice.text, choice.token_ids, choice.logprobs) for choice in result.choices]
    total += sum(sys.getsizeof(choice) + sys.getsizeof(choice.__dict__) for choice in result.choices)
    for text, ids, logprobs in outputs:
        total += sys.getsizeof(text) + sys.getsizeof(ids) + _INT * len(ids) + sys.getsizeof(logprobs)
        for position in logprobs:
            total += _LOGPROB + _INT + _FLOAT + sys.getsizeof(position.token) + sys.getsizeof(position.top)
            total += len(position.top) * (_ALTERNATIVE + _INT + _FLOAT)
            total += sum(sys.getsizeof(alternative) for _, alternative, _ in position.top)
    return total
