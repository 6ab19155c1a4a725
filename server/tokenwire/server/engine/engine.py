"""Continuous batching in a thread of its own.

The event loop hands requests and aborts to the engine through a lock-protected inbox; the
engine thread alone owns the model and the running sequences. Its loop is
schedule -> execute -> update: apply aborts and deadlines, admit queued requests into free
slots, run prompt chunks, run one batched decode step, then deliver the step's events to the
event loop in a single `call_soon_threadsafe`. Aborts (cancel, disconnect, deadline, shutdown)
therefore take effect at the next step boundary, within one decode step, and free the
sequence's KV cache at once.

Prompt work is stall-free: a free slot is taken at once, but while streams decode a round
runs only as many prompt tokens as its step-time budget allows (pacing.py), so a long prompt
spreads over several rounds instead of holding every stream's next token. And a prompt that
starts with a prefix an earlier prompt had, in full blocks, starts from a copy of that
prefix's KV rows (prefix_cache.py) and prefills only the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

import numpy as np

from tokenwire.server.engine.errors import ErrorKind, GenerationError
from tokenwire.server.engine.fair_queue import FairQueue
from tokenwire.server.engine.format_cache import FormatCache, invalid_format
from tokenwire.server.engine.observer import EngineObserver, NullObserver
from tokenwire.server.engine.pacing import PrefillPacer, chunk_length
from tokenwire.server.engine.prefix_cache import PrefixCache, PrefixCacheStats
from tokenwire.server.engine.sequence import Sequence, timing_report
from tokenwire.server.engine.types import (
    AbortReason,
    Caller,
    Completed,
    EngineEvent,
    EventSink,
    Failed,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    Priority,
    RequestTicket,
    Started,
    TerminalEvent,
    TimingReport,
    TokenLogprobs,
    TokensGenerated,
)
from tokenwire.server.models.runner import KvRowAccess, ModelRunner
from tokenwire.server.sampling.constraint import CompiledFormat, MaskWorkspace
from tokenwire.server.sampling.logprobs import token_logprob
from tokenwire.server.sampling.sampler import pick_tokens
from tokenwire.server.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

Clock = Callable[[], float]
AdmissionCheck = Callable[[], None]
"""Raises GenerationError while the server takes no new work (loading, draining)."""


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 8
    """Most sequences decoded together."""
    max_queue_size: int = 64
    """Most accepted requests waiting for a slot; beyond it requests are rejected at once."""
    prefill_chunk_size: int = 256
    """Most prompt tokens processed per model call."""
    stall_free: bool = True
    """While streams decode, bound each round's prompt work by a step-time budget (pacing.py).
    False: one whole chunk per round, however long it takes."""
    max_step_seconds: float | None = None
    """The stall-free budget's target for a round (prompt work and one decode step); None: a
    multiple of the measured decode step."""
    prefix_cache_bytes: int = 0
    """Memory for cached prompt prefixes' KV rows; 0 turns prefix caching off."""
    prefix_block_tokens: int = 16
    """Prompt tokens per prefix-cache block: prefixes are reused in whole blocks."""
    batch_reserved_slots: int = 1
    """Slots BATCH requests leave to the others (at most all slots but one)."""
    preemption: bool = True
    """When every slot is busy and a waiting request is owed one, swap a running generation out
    (its KV rows copied aside) and back in later: BATCH work for a more urgent request, or the
    work of a caller holding more than its weighted share of the slots for a caller holding
    less. Only where the runner can copy KV rows (a cache in host memory)."""


@dataclass
class EngineStats:
    """Counters for tests and telemetry.

    The engine thread writes them all except `rejected` and `abort_requests`, which count what
    the event loop received; those live in the inbox and `Engine.stats` joins the two.
    """

    decode_steps: int = 0
    decoded_rows: int = 0
    rejected: int = 0
    """Requests refused at admission because the queue was full."""
    abort_requests: int = 0
    """Aborts callers asked for, of live requests (cancel, disconnect, deadline); not shutdown's."""
    prefill_chunks: int = 0
    finished: int = 0
    aborted: int = 0
    """Requests that an abort a caller asked for ended (a request may end by itself first)."""
    max_abort_latency_steps: int = 0
    """Most decode steps any aborted sequence took part in after its abort was requested."""
    orphaned_steps: int = 0
    """Decode steps run for aborted sequences beyond the one step an abort may take to land."""
    step_failures: int = 0
    prefill_tokens: int = 0
    """Prompt tokens the model processed (those copied from the prefix cache are not counted)."""
    preemptions: int = 0
    """Running generations swapped out of their slot for a request owed it."""
    resumptions: int = 0
    """Swapped-out generations swapped back in."""


@dataclass
class _SwappedOut:
    """A preempted generation: its state, and its KV rows copied out of the slot it gave up."""

    sequence: Sequence
    rows: np.ndarray


@dataclass
class _Waiting:
    key: int
    request: GenerationRequest
    sink: EventSink
    response_format: Future[CompiledFormat] | None = None
    """The request's compiled format, once a worker has it; the request waits until then."""
    swapped: _SwappedOut | None = None
    """Set for a started generation waiting to be swapped back into a slot."""

    @property
    def ready(self) -> bool:
        return self.response_format is None or self.response_format.done()

    @property
    def live(self) -> Sequence | _Waiting:
        """What a finish ends: the generation itself once it has started."""
        return self.swapped.sequence if self.swapped is not None else self

    @property
    def caller(self) -> Caller:
        return self.request.caller

    @property
    def priority(self) -> Priority:
        return self.request.priority


@dataclass(frozen=True)
class _Abort:
    key: int
    reason: AbortReason
    requested_at_step: int | None
    """Decode steps completed when a caller asked for the abort; None for the server's own (shutdown)."""


@dataclass
class _Inbox:
    """State shared between the event loop and the engine thread, guarded by the engine lock."""

    waiting: FairQueue[_Waiting] = field(default_factory=FairQueue)
    aborts: list[_Abort] = field(default_factory=list)
    live: set[int] = field(default_factory=set)
    decode_steps: int = 0
    """The engine's count of completed decode steps, published for the aborts to carry."""
    rejected: int = 0
    abort_requests: int = 0
    prefix_cache: PrefixCacheStats | None = None
    """The prefix cache's figures after the latest round, for readers off the engine thread."""


class Engine:
    """Schedules requests for one model onto its runner."""

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        config: EngineConfig,
        *,
        clock: Clock = time.monotonic,
        observer: EngineObserver | None = None,
        check_accepting: AdmissionCheck | None = None,
        formats: FormatCache | None = None,
    ) -> None:
        """`check_accepting` is asked before every submit: the server's lifecycle owns whether new
        work is taken, so a drain has one owner and one error. `formats` compiles response formats;
        without it a request with one is refused."""
        self._runner = runner
        self._tokenizer = tokenizer
        self._config = config
        self._clock = clock
        self._observer: EngineObserver = observer or NullObserver()
        self._check_accepting = check_accepting
        self._formats = formats
        self._masks = MaskWorkspace(runner.info.vocab_size, config.max_batch_size) if formats else None
        self._model = runner.info.name
        self._slots = min(config.max_batch_size, runner.capacity())
        self._batch_reserved = max(0, min(config.batch_reserved_slots, self._slots - 1))
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._inbox = _Inbox()
        self._stopping = False
        self._keys = itertools.count(1)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle: asyncio.Event | None = None
        # Engine-thread state.
        self._prefilling: deque[Sequence] = deque()
        self._decoding: dict[int, Sequence] = {}
        self._outbox: list[tuple[EventSink, EngineEvent]] = []
        self._service_seconds = 1.0  # moving average of started->finished, for retry hints
        self._stats = EngineStats()
        self._pacer = PrefillPacer(max_step_seconds=config.max_step_seconds)
        self._prefix_cache = _prefix_cache_for(runner, config)
        self._swapper = _row_copier(runner) if config.preemption else None
        if self._prefix_cache is not None:
            self._inbox.prefix_cache = self._prefix_cache.stats()

    # -- event-loop side -------------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self._model

    @property
    def config(self) -> EngineConfig:
        return self._config

    @property
    def slots(self) -> int:
        return self._slots

    @property
    def stats(self) -> EngineStats:
        """A snapshot of the counters: the engine thread's, with what the event loop received."""
        with self._lock:
            return replace(
                self._stats, rejected=self._inbox.rejected, abort_requests=self._inbox.abort_requests
            )

    def start(self) -> None:
        """Start the engine thread; events are delivered on the running event loop."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._idle = asyncio.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name=f"engine[{self._model}]", daemon=True)
        self._thread.start()

    def submit(self, request: GenerationRequest, sink: EventSink) -> RequestTicket:
        """Queue a validated request. Raises GenerationError when it cannot be accepted."""
        if self._check_accepting is not None:
            self._check_accepting()
        with self._lock:
            if self._stopping:
                raise GenerationError(
                    ErrorKind.UNAVAILABLE,
                    "the model's engine has stopped; retry elsewhere",
                    reason="SHUTDOWN",
                )
            refusal = self._queue_refusal_locked(request.caller)
            if refusal is not None:
                self._inbox.rejected += 1
                raise refusal
            compiled = self._prepare_format(request)
            key = next(self._keys)
            position = len(self._inbox.waiting)
            self._inbox.waiting.push(_Waiting(key, request, sink, compiled))
            self._inbox.live.add(key)
            if self._idle is not None:
                self._idle.clear()
            self._wakeup.notify()
        if compiled is not None and not compiled.done():
            compiled.add_done_callback(self._format_ready)
        return RequestTicket(key=key, queue_position=position)

    def _queue_refusal_locked(self, caller: Caller) -> GenerationError | None:
        """Why a request of `caller` cannot queue now, or None when it can.

        A caller with its own limit stops there. When the queue is full, a caller holding less
        than its weighted share of it (among the callers queueing now) still gets in, so one
        caller's flood cannot lock out the others; the queue may then run over its size by the
        shares of those callers, and never beyond twice its size.
        """
        waiting = self._inbox.waiting
        queued = waiting.queued_by(caller.name)
        size = self._config.max_queue_size
        reason = message = None
        if caller.max_queued is not None and queued >= caller.max_queued:
            reason = "CALLER_QUEUE_FULL"
            message = f"caller {caller.name!r} already has {queued} requests waiting, its limit"
        elif len(self._inbox.live) >= self._slots + size:
            share = waiting.share(caller, size)
            if queued < share and len(waiting) < 2 * size:
                return None
            if len(waiting) > queued:
                reason = "CALLER_OVER_SHARE"
                message = (
                    f"caller {caller.name!r} holds {queued} of the {len(waiting)} waiting requests, "
                    f"more than its share of {share:.1f}; other callers still get in"
                )
            else:
                reason = "QUEUE_FULL"
                message = f"work queue is full ({size} waiting, {self._slots} running)"
        if reason is None or message is None:
            return None
        retry_after = self._retry_after_locked()
        return GenerationError(
            ErrorKind.RESOURCE_EXHAUSTED,
            f"{message}; retry after {retry_after:.2f}s",
            retry_after=retry_after,
            reason=reason,
        )

    def _prepare_format(self, request: GenerationRequest) -> Future[CompiledFormat] | None:
        if request.response_format is None:
            return None
        if self._formats is None:
            raise invalid_format(request.response_format, f"model {self._model!r} does not support formats")
        return self._formats.prepare(request.response_format)

    def _format_ready(self, _: Future[CompiledFormat]) -> None:
        # Called on a compile worker or timer thread: wake the engine to admit the request.
        with self._lock:
            self._wakeup.notify()

    def abort(self, key: int, reason: AbortReason) -> None:
        """Stop a live request at the next step boundary (unknown or finished keys are ignored)."""
        with self._lock:
            if key not in self._inbox.live:
                return
            self._inbox.aborts.append(_Abort(key, reason, requested_at_step=self._inbox.decode_steps))
            self._inbox.abort_requests += 1
            self._wakeup.notify()

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The prefix cache's size and hits after the latest round; None when it is off."""
        with self._lock:
            return self._inbox.prefix_cache

    @property
    def live_count(self) -> int:
        with self._lock:
            return len(self._inbox.live)

    @property
    def queue_depth(self) -> int:
        with self._lock:
            return len(self._inbox.waiting)

    async def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no request is live; False if `timeout` passed first."""
        assert self._idle is not None, "engine not started"
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def shutdown(self) -> None:
        """Fail every live request with UNAVAILABLE, then stop the engine thread."""
        with self._lock:
            for key in self._inbox.live:
                self._inbox.aborts.append(_Abort(key, AbortReason.SHUTDOWN, requested_at_step=None))
            self._stopping = True
            self._wakeup.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        if self._formats is not None:
            self._formats.close()

    def run_round(self) -> None:
        """Run one scheduling round on the calling thread and deliver its events before returning.

        The seam for deterministic scheduler tests (a fake runner, a manual clock): they drive an
        engine that was never started, round by round, where the engine thread loops over the
        same rounds. A round with nothing to do does nothing instead of waiting for work.
        """
        if self._thread is not None:
            raise RuntimeError("run_round drives an engine that was never started")
        self._schedule_round(wait_for_work=False)

    def _retry_after_locked(self) -> float:
        # Time for the queue ahead to reach a slot: each batch of `slots` requests takes about one
        # average service time. Clamped so clients neither hammer nor give up.
        batches_ahead = math.ceil((len(self._inbox.waiting) + 1) / max(1, self._slots))
        return min(30.0, max(0.05, batches_ahead * self._service_seconds))

    # -- engine thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._schedule_round():
                pass
        except BaseException:  # the thread must never die silently with requests live
            log.exception("engine thread crashed; failing every live request")
            self._fail_everything(GenerationError(ErrorKind.INTERNAL, "engine failure"))
            raise

    def _schedule_round(self, *, wait_for_work: bool = True) -> bool:
        with self._lock:
            while (
                wait_for_work
                and not self._stopping
                and not any(w.ready for w in self._inbox.waiting)
                and not self._inbox.aborts
                and not self._prefilling
                and not self._decoding
            ):
                self._wakeup.wait()
            aborts, self._inbox.aborts = self._inbox.aborts, []
            stopping = self._stopping
        now = self._clock()
        self._apply_aborts(aborts, now)
        self._expire_deadlines(now)
        if stopping and not self._prefilling and not self._decoding:
            with self._lock:
                finished = not self._inbox.waiting and not self._inbox.aborts
            if finished:
                self._flush()
                return False
            return True
        self._admit()
        self._run_prefill()
        # First tokens go out now rather than after the decode step: that step's time is not
        # part of these requests' time to first token.
        self._flush()
        self._run_decode()
        self._report_occupancy()
        self._flush()
        return True

    def _admit(self) -> None:
        free = self._slots - len(self._prefilling) - len(self._decoding)
        admitted: list[_Waiting] = []
        # BATCH requests leave `batch_reserved_slots` free for the others, so an INTERACTIVE
        # request never waits behind BATCH work for more than the next round.
        batch_room = (
            self._slots
            - self._batch_reserved
            - sum(s.request.priority is Priority.BATCH for s in [*self._prefilling, *self._decoding.values()])
        )

        def allowed(entry: _Waiting) -> bool:
            return entry.priority is not Priority.BATCH or batch_room > 0

        preempted = self._preempt_for_next(allowed) if free == 0 else None
        with self._lock:
            if preempted is not None:
                owed, swapped = preempted
                # The slot goes to the request it was freed for, which takes its caller's turn.
                self._inbox.waiting.take(owed)
                admitted.append(owed)
            while free > 0:
                found = self._inbox.waiting.pop(allowed)
                if found is None:
                    break
                admitted.append(found)
                free -= 1
                batch_room -= found.priority is Priority.BATCH
            if preempted is not None:
                # Back at the head of its caller's line: it was already its caller's next.
                self._inbox.waiting.push_front(swapped)
        now = self._clock()
        info = self._runner.info
        for entry in admitted:
            if entry.swapped is not None:
                self._swap_in(entry.swapped, now)
                continue
            deadline = entry.request.deadline
            if deadline is not None and now >= deadline:
                self._finish(entry, _deadline_error("in the queue"), now)
                continue
            constraint = None
            if entry.response_format is not None:
                failure = entry.response_format.exception()
                if failure is not None:
                    self._finish(entry, _format_failure(failure), now)
                    continue
                constraint = entry.response_format.result().constraint()
            sequence = Sequence(
                key=entry.key,
                request=entry.request,
                sink=entry.sink,
                tokenizer=self._tokenizer,
                eos_token_ids=info.eos_token_ids,
                context_length=info.context_length,
                started_at=now,
                constraint=constraint,
            )
            self._prefilling.append(sequence)
            self._emit(entry.sink, Started(now - entry.request.received_at, len(entry.request.prompt_ids)))

    def _preempt_for_next(self, allowed: Callable[[_Waiting], bool]) -> tuple[_Waiting, _Waiting] | None:
        """Swap one running generation out for the next waiting request owed a slot (see
        `EngineConfig.preemption`): that request, still queued, and the swapped-out work, to queue
        again; or None.

        At most one a round, and at most as many swapped out at once as there are slots, which
        bounds the copied rows to the KV cache's own size.
        """
        if self._swapper is None or not self._decoding:
            return None
        with self._lock:
            waiting = self._inbox.waiting
            if sum(entry.swapped is not None for entry in waiting) >= self._slots:
                return None
            queueing = {priority: waiting.callers_at(priority) for priority in Priority}
            # Whether a caller is owed a slot depends on its caller and priority alone: asked once
            # for each, not once for every request a flooding caller has queued.
            owed_by: dict[tuple[Priority, str], bool] = {}

            def owed(entry: _Waiting) -> bool:
                if not allowed(entry):
                    return False
                key = (entry.priority, entry.caller.name)
                if key not in owed_by:
                    owed_by[key] = self._victim_for(entry, queueing[entry.priority]) is not None
                return owed_by[key]

            # The next request in fair order among those owed a slot: a request of a caller at its
            # share, even one ahead in the fair order, takes nothing from anyone.
            candidate = waiting.peek(owed)
        if candidate is None:
            return None
        victim = self._victim_for(candidate, queueing[candidate.priority])
        assert victim is not None
        try:
            rows = self._swapper.read_kv(victim.key, 0, victim.cached_positions)
        except Exception:
            log.exception("swapping out request %s failed; it keeps its slot", victim.request.request_id)
            return None
        del self._decoding[victim.key]
        self._runner.release(victim.key)
        self._stats.preemptions += 1
        self._observer.preempted(model=self._model, caller=victim.request.caller.name)
        log.debug(
            "request %s of caller %s gave its slot to a request of caller %s",
            victim.request.request_id,
            victim.request.caller.name,
            candidate.caller.name,
        )
        return candidate, _Waiting(victim.key, victim.request, victim.sink, swapped=_SwappedOut(victim, rows))

    def _victim_for(self, candidate: _Waiting, queueing: dict[str, float]) -> Sequence | None:
        """The running generation that owes `candidate` its slot, if one does: the cheapest to swap
        (fewest cached positions) of the BATCH work when `candidate` is more urgent, else of the
        caller furthest over its share at `candidate`'s priority, while `candidate`'s caller,
        given the slot, would still hold no more than its own share (so two callers never take a
        slot back and forth)."""
        swappable = [s for s in self._decoding.values() if s.output_ids]
        if candidate.priority is not Priority.BATCH:
            batch = [s for s in swappable if s.request.priority is Priority.BATCH]
            if batch:
                return min(batch, key=lambda s: s.cached_positions)
        level = candidate.priority
        everything = [*self._prefilling, *self._decoding.values()]
        running = [s for s in everything if s.request.priority is level]
        # The level's callers share the slots that more urgent work leaves them.
        capacity = self._slots - sum(s.request.priority.value < level.value for s in everything)
        held = Counter(s.request.caller.name for s in running)
        weights = dict(queueing)
        weights.update((s.request.caller.name, s.request.caller.weight) for s in running)
        total = sum(weights.values())

        def excess(name: str) -> float:
            return held[name] - capacity * weights[name] / total

        if total <= 0 or excess(candidate.caller.name) + 1 > 0:
            return None
        over = [s for s in swappable if s.request.priority is level and excess(s.request.caller.name) > 0]
        if not over:
            return None
        return min(over, key=lambda s: (-excess(s.request.caller.name), s.cached_positions))

    def _swap_in(self, swapped: _SwappedOut, now: float) -> None:
        """Give a preempted generation a slot again: its rows copied back, it decodes on."""
        sequence = swapped.sequence
        assert self._swapper is not None
        try:
            self._swapper.start_from_kv(sequence.key, [swapped.rows])
        except Exception as error:
            log.exception("swapping in request %s failed", sequence.request.request_id)
            self._stats.step_failures += 1
            self._finish(sequence, _model_error(error), now)
            return
        self._stats.resumptions += 1
        self._decoding[sequence.key] = sequence

    def _prefill_budget(self) -> float:
        """Prompt tokens this round may process: unbounded when nothing decodes."""
        decoding = bool(self._decoding)
        if not self._config.stall_free:
            return self._config.prefill_chunk_size if decoding else math.inf
        tokens = self._pacer.budget(decoding=decoding).tokens
        return math.inf if tokens is None else tokens

    def _next_prompt(self) -> Sequence:
        """The prompt that gets the round's prompt budget next.

        The most urgent priority first; within it, the prompt of the caller holding the fewest
        slots for its weight, so a flood's prompts never make a quieter caller's first token
        wait for theirs; among equals, first come, first served, which lets a prompt reuse the
        prefix a prompt ahead of it has just cached. A prompt set aside keeps what it has done.
        """
        held = Counter(s.request.caller.name for s in [*self._prefilling, *self._decoding.values()])

        def order(sequence: Sequence) -> tuple[int, float]:
            caller = sequence.request.caller
            return sequence.request.priority.value, held[caller.name] / max(caller.weight, 1e-6)

        return min(self._prefilling, key=order)  # min keeps the first of equals

    def _run_prefill(self) -> None:
        budget = self._prefill_budget()
        chunk_size = self._config.prefill_chunk_size
        while self._prefilling and budget > 0:
            sequence = self._next_prompt()
            own_work_began = self._clock()
            if sequence.prefix_lease is None and self._prefix_cache is not None:
                self._load_cached_prefix(sequence, self._prefix_cache)
            start = sequence.prefilled
            length = chunk_length(len(sequence.prompt_ids) - start, int(min(budget, chunk_size)))
            chunk = sequence.prompt_ids[start : start + length]
            began = self._clock()
            try:
                logits = self._runner.prefill(sequence.key, chunk, start=start)
            except Exception as error:
                log.exception("prefill failed for request %s", sequence.request.request_id)
                self._stats.step_failures += 1
                self._prefilling.remove(sequence)
                self._finish(sequence, _model_error(error), self._clock())
                continue
            now = self._clock()
            self._stats.prefill_chunks += 1
            self._stats.prefill_tokens += len(chunk)
            self._observer.prefill_chunk(model=self._model, tokens=len(chunk), seconds=now - began)
            self._pacer.observe_prefill(len(chunk), now - began)
            budget -= len(chunk)
            sequence.prefilled += len(chunk)
            if self._prefix_cache is not None:
                self._cache_prompt_blocks(sequence, self._prefix_cache)
                if sequence.prefill_done:
                    self._cache_prompt_tail(sequence, self._prefix_cache)
                now = self._clock()
            # The prompt's own work: its model call and its cache copies, in and out.
            sequence.prefill_seconds += now - own_work_began
            if sequence.prefill_done:
                self._prefilling.remove(sequence)
                # Join the decoding set first: _accept_tokens removes it again if it already ended.
                self._decoding[sequence.key] = sequence
                self._accept_tokens([sequence], logits[np.newaxis, :], now)
                # Its first token leaves now, not after the round's other prompts.
                self._flush()
                if math.isinf(budget):
                    # Streams decode from now on: the prompts behind it are paced.
                    budget = self._prefill_budget()

    def _load_cached_prefix(self, sequence: Sequence, cache: PrefixCache) -> None:
        """Start the sequence from the longest cached prefix of its prompt, if there is one."""
        prompt = sequence.prompt_ids
        # At least two prompt tokens are left to prefill: the last one's logits are needed, and a
        # one-token chunk would compute them differently from a prefill without the cache.
        lease = cache.lookup(prompt, limit=len(prompt) - 2, tenant=sequence.request.caller.tenant)
        sequence.prefix_lease = lease
        if not lease.tokens:
            return
        try:
            loaded = _rows(self._runner).start_from_kv(sequence.key, lease.kv())
        except Exception:
            log.exception("copying a cached prefix failed for request %s", sequence.request.request_id)
            cache.release(lease)  # it prefills from the start instead
            return
        sequence.prefilled = sequence.cached_prompt_tokens = loaded

    def _cache_prompt_blocks(self, sequence: Sequence, cache: PrefixCache) -> None:
        """Copy the prompt's newly completed full blocks into the prefix cache."""
        lease = sequence.prefix_lease
        size = cache.block_tokens
        if lease is None or sequence.prefix_cache_full:
            return
        have, full = len(lease.blocks), sequence.prefilled // size
        if full <= have:
            return
        runner = _rows(self._runner)
        try:
            # One read per block: each block is its own array, freed on its own when evicted.
            blocks = [runner.read_kv(sequence.key, i * size, (i + 1) * size) for i in range(have, full)]
        except Exception:
            log.exception("caching the prompt of request %s failed", sequence.request.request_id)
            sequence.prefix_cache_full = True
            return
        if cache.extend(lease, sequence.prompt_ids, blocks) < len(blocks):
            sequence.prefix_cache_full = True  # the rest would not fit either

    def _cache_prompt_tail(self, sequence: Sequence, cache: PrefixCache) -> None:
        """Copy the prompt's last, partial block into the prefix cache, for a chat's next turn."""
        lease = sequence.prefix_lease
        size = cache.block_tokens
        length = len(sequence.prompt_ids)
        if lease is None or sequence.prefix_cache_full or length % size == 0:
            return
        if len(lease.blocks) != length // size:
            return
        try:
            rows = _rows(self._runner).read_kv(sequence.key, length // size * size, length)
        except Exception:
            log.exception("caching the prompt of request %s failed", sequence.request.request_id)
            return
        cache.add_tail(lease, sequence.prompt_ids, rows)

    def _run_decode(self) -> None:
        rows = [s for s in self._decoding.values() if s.output_ids]
        if not rows:
            return
        began = self._clock()
        try:
            logits = self._runner.decode([s.key for s in rows], [s.last_token for s in rows])
        except Exception as error:
            log.exception("decode step failed for %d sequences", len(rows))
            self._stats.step_failures += 1
            now = self._clock()
            for sequence in rows:
                del self._decoding[sequence.key]
                self._finish(sequence, _model_error(error), now)
            return
        now = self._clock()
        self._pacer.observe_decode(now - began)
        self._stats.decode_steps += 1
        self._stats.decoded_rows += len(rows)
        with self._lock:
            self._inbox.decode_steps = self._stats.decode_steps
        self._observer.decode_step(model=self._model, batch_size=len(rows), seconds=now - began)
        self._accept_tokens(rows, logits, now)

    def _accept_tokens(self, rows: list[Sequence], logits: np.ndarray, now: float) -> None:
        """Sample one token per row, emit it, and retire the rows that finished."""
        # Sampling may rewrite logits in place (repetition penalty): keep the model's own
        # distribution for the rows that report log-probabilities.
        raw = {i: logits[i].copy() for i, s in enumerate(rows) if s.request.logprobs}
        tokens = pick_tokens(logits, [s.sampler for s in rows], self._masks)
        for i, (sequence, token) in enumerate(zip(rows, tokens, strict=True)):
            token_logprobs = (
                self._token_logprobs(raw[i], token, sequence.request.top_logprobs) if i in raw else None
            )
            output = sequence.add_token(token, now, token_logprobs)
            self._emit(sequence.sink, output.event)
            end: FinishReason | GenerationError | None = output.finish
            if end is None and sequence.constraint is not None and sequence.constraint.error is not None:
                assert sequence.request.response_format is not None
                end = invalid_format(
                    sequence.request.response_format, f"too costly to enforce: {sequence.constraint.error}"
                )
            if end is not None:
                self._decoding.pop(sequence.key, None)
                self._finish(sequence, end, now)

    def _token_logprobs(self, row: np.ndarray, token: int, top_n: int) -> TokenLogprobs:
        found = token_logprob(row, token, top_n)
        decode = self._tokenizer.decode
        return TokenLogprobs(
            token_id=token,
            token=decode([token], skip_special_tokens=False),
            logprob=found.logprob,
            top=tuple((tid, decode([tid], skip_special_tokens=False), lp) for tid, lp in found.top),
        )

    def _apply_aborts(self, aborts: list[_Abort], now: float) -> None:
        # A key with several aborts ends at the first; the rest find nothing, as do aborts of
        # requests that ended by themselves before the abort was taken.
        for abort in aborts:
            live: Sequence | _Waiting | None = self._decoding.pop(abort.key, None)
            if live is None:
                live = next((s for s in self._prefilling if s.key == abort.key), None)
                if live is not None:
                    self._prefilling.remove(live)
            if live is None:
                with self._lock:
                    entry = next((w for w in self._inbox.waiting if w.key == abort.key), None)
                    if entry is not None:
                        self._inbox.waiting.remove(entry)
                        live = entry.live
            if live is not None:
                self._count_abort(live, abort)
                self._finish(live, _abort_ending(abort.reason, started=isinstance(live, Sequence)), now)

    def _count_abort(self, live: Sequence | _Waiting, abort: _Abort) -> None:
        if abort.requested_at_step is None:
            return
        self._stats.aborted += 1
        if isinstance(live, Sequence):  # a request still queued took part in no step at all
            latency = self._stats.decode_steps - abort.requested_at_step
            self._stats.max_abort_latency_steps = max(self._stats.max_abort_latency_steps, latency)
            self._stats.orphaned_steps += max(0, latency - 1)

    def _expire_deadlines(self, now: float) -> None:
        expired = [
            s
            for s in [*self._prefilling, *self._decoding.values()]
            if s.request.deadline is not None and now >= s.request.deadline
        ]
        for sequence in expired:
            self._decoding.pop(sequence.key, None)
            if sequence in self._prefilling:
                self._prefilling.remove(sequence)
            self._finish(sequence, _deadline_error("during generation"), now)
        with self._lock:
            late = [
                w for w in self._inbox.waiting if w.request.deadline is not None and now >= w.request.deadline
            ]
            for entry in late:
                self._inbox.waiting.remove(entry)
        for entry in late:
            live = entry.live
            where = "during generation" if isinstance(live, Sequence) else "in the queue"
            self._finish(live, _deadline_error(where), now)

    # -- finishing -------------------------------------------------------------------------------

    def _finish(self, live: Sequence | _Waiting, end: FinishReason | GenerationError, now: float) -> None:
        """The one way a request leaves the engine: a result or a failure, started or not.

        Emits its terminal event (with timing), frees its slot, counts it and tells the observer.
        """
        if isinstance(live, Sequence):
            if end is FinishReason.CANCELLED:
                # Text held back (an incomplete character, a possible stop-string prefix) is real
                # output that will now never complete: hand it over before the summary.
                remainder = live.flush_text()
                if remainder:
                    self._emit(live.sink, TokensGenerated((), remainder))
            self._runner.release(live.key)
            if live.prefix_lease is not None and self._prefix_cache is not None:
                self._prefix_cache.release(live.prefix_lease)
            self._service_seconds = 0.8 * self._service_seconds + 0.2 * max(0.0, now - live.started_at)
            timing = live.timing(now)
            completion_tokens = len(live.output_ids)
        else:
            timing = _unstarted_timing(live, now)
            completion_tokens = 0
        event: TerminalEvent
        if isinstance(end, FinishReason):
            if isinstance(live, Sequence):
                result = live.result(end, now)
            else:
                result = _unstarted_result(live, end, timing)
            event = Completed(result)
        else:
            event = Failed(
                end, timing, completion_tokens=completion_tokens, prompt_tokens=len(live.request.prompt_ids)
            )
        self._emit(live.sink, event)
        self._stats.finished += 1
        self._observer.request_finished(
            model=self._model,
            outcome=event.outcome,
            finish_reason=end if isinstance(end, FinishReason) else None,
            prompt_tokens=len(live.request.prompt_ids),
            completion_tokens=completion_tokens,
            timing=timing,
            caller=live.request.caller.name,
        )
        self._forget(live.key)

    def _forget(self, key: int) -> None:
        with self._lock:
            self._inbox.live.discard(key)

    def _fail_everything(self, error: GenerationError) -> None:
        with self._lock:
            waiting = self._inbox.waiting.clear()
            self._stopping = True  # the thread is gone: refuse what it would never serve
        now = self._clock()
        everything = [*self._prefilling, *self._decoding.values(), *(w.live for w in waiting)]
        for live in everything:
            try:
                self._finish(live, error, now)
            except Exception:  # a broken runner must not keep the others from hearing
                log.exception("failing request %s", live.request.request_id)
                self._forget(live.key)
        self._prefilling.clear()
        self._decoding.clear()
        self._flush()

    # -- delivery --------------------------------------------------------------------------------

    def _emit(self, sink: EventSink, event: EngineEvent) -> None:
        self._outbox.append((sink, event))

    def _report_occupancy(self) -> None:
        cache_stats = self._prefix_cache.stats() if self._prefix_cache is not None else None
        with self._lock:
            queued = len(self._inbox.waiting)
            self._inbox.prefix_cache = cache_stats
        running = [*self._prefilling, *self._decoding.values()]
        self._observer.occupancy(
            model=self._model,
            queued=queued,
            running=len(running),
            slots=self._slots,
            kv_positions_used=sum(s.cached_positions for s in running),
            kv_positions=self._slots * self._runner.info.context_length,
        )

    def _flush(self) -> None:
        """Hand this round's events to the event loop in one call."""
        loop = self._loop
        batch, self._outbox = self._outbox, []
        with self._lock:
            idle = not self._inbox.live
        if not batch:
            return
        if loop is None:  # never started: run_round delivers on the calling thread
            self._deliver(batch, idle)
            return
        # A closed event loop means nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._deliver, batch, idle)

    def _deliver(self, batch: list[tuple[EventSink, EngineEvent]], idle: bool) -> None:
        for sink, event in batch:
            try:
                sink(event)
            except Exception:
                log.exception("event sink failed")
        if self._idle is not None and idle and self.live_count == 0:
            self._idle.set()


def _prefix_cache_for(runner: ModelRunner, config: EngineConfig) -> PrefixCache | None:
    """The prefix cache the settings ask for, where the runner can copy KV rows; reported at start."""
    if config.prefix_cache_bytes <= 0:
        return None
    token_bytes = runner.kv_bytes_per_token() if isinstance(runner, KvRowAccess) else 0
    name = runner.info.name
    if token_bytes <= 0:
        log.info("prefix cache off for %s: its runner cannot copy KV rows (a KV cache on a device)", name)
        return None
    log.info(
        "prefix cache for %s: %.0f MiB, room for about %d prompt tokens in blocks of %d",
        name,
        config.prefix_cache_bytes / 2**20,
        config.prefix_cache_bytes // token_bytes,
        config.prefix_block_tokens,
    )
    return PrefixCache(capacity_bytes=config.prefix_cache_bytes, block_tokens=config.prefix_block_tokens)


def _rows(runner: ModelRunner) -> KvRowAccess:
    # Only called with a prefix cache, which exists only for runners that copy rows.
    assert isinstance(runner, KvRowAccess)
    return runner


def _row_copier(runner: ModelRunner) -> KvRowAccess | None:
    """The runner as a copier of KV rows, where it can copy them (a cache in host memory)."""
    if isinstance(runner, KvRowAccess) and runner.kv_bytes_per_token() > 0:
        return runner
    name = runner.info.name
    log.info("preemption off for %s: its runner cannot copy KV rows (a KV cache on a device)", name)
    return None


def _abort_ending(reason: AbortReason, *, started: bool) -> FinishReason | GenerationError:
    """How an abort ends a request: cancelled (a result), or failed with the reason's error."""
    if reason is AbortReason.CANCELLED or reason is AbortReason.DISCONNECTED:
        return FinishReason.CANCELLED
    if reason is AbortReason.DEADLINE:
        return _deadline_error("during generation" if started else "in the queue")
    return _shutdown_error()


def _format_failure(failure: BaseException) -> GenerationError:
    if isinstance(failure, GenerationError):
        return failure
    log.error("compiling a response format failed", exc_info=failure)
    return GenerationError(
        ErrorKind.INTERNAL, "compiling the response format failed", reason="FORMAT_FAILURE"
    )


def _unstarted_result(entry: _Waiting, finish: FinishReason, timing: TimingReport) -> GenerationResult:
    return GenerationResult(
        request_id=entry.request.request_id,
        model=entry.request.model,
        text="",
        token_ids=(),
        finish_reason=finish,
        prompt_tokens=len(entry.request.prompt_ids),
        timing=timing,
    )


def _unstarted_timing(entry: _Waiting, now: float) -> TimingReport:
    return timing_report(
        received=entry.request.received_at,
        started=None,
        first_token=None,
        last_token=None,
        finished=now,
        tokens=0,
    )


def _deadline_error(where: str) -> GenerationError:
    return GenerationError(
        ErrorKind.DEADLINE_EXCEEDED, f"deadline exceeded {where}", reason="DEADLINE_EXCEEDED"
    )


def _shutdown_error() -> GenerationError:
    return GenerationError(
        ErrorKind.UNAVAILABLE, "server shut down before the request finished; retry", reason="SHUTDOWN"
    )


def _model_error(error: Exception) -> GenerationError:
    return GenerationError(ErrorKind.INTERNAL, f"model failure: {error}", reason="MODEL_FAILURE")
