"""Continuous batching in a thread of its own.

The event loop hands requests and aborts to the engine through a lock-protected inbox; the
engine thread alone owns the model. Each round is schedule -> execute -> update: under the lock
the scheduler (scheduler.py) turns the aborts, deadlines and queue into a plan; outside it the
core (core.py) carries the plan out on the runner (prompt chunks, one batched decode step,
sampling, outputs); under the lock again the scheduler takes back what the round did. The
round's events reach the event loop in a single `call_soon_threadsafe` (first tokens earlier, as
soon as a prompt is done). Aborts (cancel, disconnect, deadline, shutdown) therefore take effect
at the next step boundary, within one decode step, and free the request's KV cache at once.

Thread ownership: the scheduler is touched only under the lock (by both threads); the core, the
runner and the KV reuse only by the engine thread; the inbox's fields only under the lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from tokenwire.server.engine.completions import CompletionGroup
from tokenwire.server.engine.config import EngineConfig
from tokenwire.server.engine.core import CoreHooks, EngineCore
from tokenwire.server.engine.embedding import EmbeddingJob, EmbeddingRequest, EmbeddingResult
from tokenwire.server.engine.errors import ErrorKind, FieldViolation, GenerationError
from tokenwire.server.engine.format_cache import FormatCache, invalid_format
from tokenwire.server.engine.kv_reuse import KvReuse
from tokenwire.server.engine.observer import EngineObserver, NullObserver
from tokenwire.server.engine.plan import Abort
from tokenwire.server.engine.prefix_cache import PrefixCacheStats
from tokenwire.server.engine.request import CompletionSet, Request
from tokenwire.server.engine.scheduler import Scheduler, SchedulerConfig
from tokenwire.server.engine.speculation import OFF, SpeculationSettings
from tokenwire.server.engine.stats import EngineStats
from tokenwire.server.engine.types import (
    AbortReason,
    Caller,
    EngineEvent,
    EventSink,
    GenerationRequest,
    RequestTicket,
    completion_seed,
)
from tokenwire.server.engine.verification import runs_speculation, startup_note
from tokenwire.server.models.runner import HiddenStates, ModelRunner
from tokenwire.server.sampling.constraint import CompiledFormat, MaskWorkspace
from tokenwire.server.text.tokenizer import Tokenizer

__all__ = ["AdmissionCheck", "Clock", "Engine", "EngineConfig", "EngineStats"]

log = logging.getLogger(__name__)

Clock = Callable[[], float]
AdmissionCheck = Callable[[], None]
"""Raises GenerationError while the server takes no new work (loading, draining)."""


@dataclass
class _Inbox:
    """State shared between the event loop and the engine thread, guarded by the engine lock."""

    aborts: list[Abort] = field(default_factory=list)
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
        self._config = config
        # Adapters being unloaded: refused to new requests while the live ones finish.
        self._retired_adapters: set[str] = set()
        self._delivery_waiters: list[asyncio.Event] = []
        self._clock = clock
        self._observer: EngineObserver = observer or NullObserver()
        self._check_accepting = check_accepting
        self._formats = formats
        self._model = runner.info.name
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._inbox = _Inbox()
        self._stopping = False
        self._keys = itertools.count(1)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle: asyncio.Event | None = None
        self._outbox: list[tuple[EventSink, EngineEvent]] = []
        self._stats = EngineStats()
        self._kv = KvReuse(
            runner,
            prefix_cache_bytes=config.prefix_cache_bytes,
            prefix_block_tokens=config.prefix_block_tokens,
            swapping=config.preemption,
        )
        for note in self._kv.notes:
            log.info("%s", note)
        slots = min(config.max_batch_size, runner.capacity())
        speculation = SpeculationSettings(config.speculative_tokens, config.speculative_max_batch)
        log.info("%s", startup_note(runner, speculation, slots))
        self._scheduler = Scheduler(
            SchedulerConfig(
                slots=slots,
                max_queue_size=config.max_queue_size,
                max_queued_tokens=config.max_queued_tokens,
                prefill_chunk_size=config.prefill_chunk_size,
                stall_free=config.stall_free,
                max_step_seconds=config.max_step_seconds,
                batch_reserved_slots=config.batch_reserved_slots,
                preemption=self._kv.can_swap,
                context_length=runner.info.context_length,
                speculation=speculation if runs_speculation(runner, speculation) else OFF,
                prefix_block_tokens=self._kv.block_tokens,
            ),
            look_up_prefix=self._kv.look_up,
        )
        self._core = EngineCore(
            runner,
            tokenizer,
            self._kv,
            stats=self._stats,
            observer=self._observer,
            masks=MaskWorkspace(runner.info.vocab_size, config.max_batch_size) if formats else None,
            hooks=CoreHooks(self._emit, self._flush, self._drop, self._publish_step),
            clock=clock,
            speculation=speculation,
        )
        self._inbox.prefix_cache = self._kv.prefix_stats()

    # -- event-loop side -------------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self._model

    @property
    def config(self) -> EngineConfig:
        return self._config

    @property
    def slots(self) -> int:
        return self._scheduler.slots

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
                raise _stopped()
            if request.adapter in self._retired_adapters:
                raise GenerationError(
                    ErrorKind.NOT_FOUND,
                    f"adapter {request.adapter!r} is being unloaded",
                    violations=(FieldViolation("adapter", "this adapter is being unloaded"),),
                    reason="ADAPTER_NOT_FOUND",
                )
            # n completions count as n requests against the queue (and their caller's share).
            refusal = self._scheduler.refusal(
                request.caller,
                live=len(self._scheduler) + request.n - 1,
                prompt_tokens=len(request.prompt_ids),
            )
            if refusal is not None:
                self._inbox.rejected += 1
                raise refusal
            compiled = self._prepare_format(request)
            position = self._scheduler.queue_depth
            requests = self._requests_for(request, sink, compiled)
            key = requests[0].key
            for each in requests:
                self._scheduler.add(each)
            if self._idle is not None:
                self._idle.clear()
            self._wakeup.notify()
        if compiled is not None and not compiled.done():
            compiled.add_done_callback(self._format_ready)
        return RequestTicket(key=key, queue_position=position)

    @property
    def embedding_size(self) -> int:
        """Floats in one of this model's embeddings; 0 where it serves none."""
        return self._runner.info.embedding_size if isinstance(self._runner, HiddenStates) else 0

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResult:
        """Embed a validated request's inputs in the engine's rounds (prefill-only work planned by
        the scheduler, run on the engine thread). Raises GenerationError when it cannot be served."""
        if not self.embedding_size:
            raise GenerationError.invalid(
                FieldViolation("model", f"model {self._model!r} serves no embeddings (no hidden states)")
            )
        if self._check_accepting is not None:
            self._check_accepting()
        loop = asyncio.get_running_loop()
        settled: asyncio.Future[EmbeddingResult | GenerationError] = loop.create_future()

        def deliver(result: EmbeddingResult | GenerationError) -> None:  # on the engine thread
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening
                loop.call_soon_threadsafe(_settle, settled, result)

        with self._lock:
            if self._stopping:
                raise _stopped()
            refusal = self._scheduler.add_embedding(EmbeddingJob(next(self._keys), request, deliver))
            if refusal is not None:
                self._inbox.rejected += 1
                raise refusal
            self._wakeup.notify()
        result = await settled
        if isinstance(result, GenerationError):
            raise result
        return result

    def check_room(self, caller: Caller) -> None:
        """Refuse now, before the request is validated, when the queue would refuse even the
        smallest request of `caller` (one completion of a one-token prompt): the refusal a full
        queue gives a caller over its share does not depend on the prompt, so a flood's refused
        requests cost no tokenizing. Raises the refusal `submit` would."""
        with self._lock:
            refusal = self._scheduler.refusal(caller, live=len(self._scheduler), prompt_tokens=1)
            if refusal is not None:
                self._inbox.rejected += 1
                raise refusal

    def _requests_for(
        self, request: GenerationRequest, sink: EventSink, compiled: Future[CompiledFormat] | None
    ) -> list[Request]:
        """The engine's requests for one submitted: itself, or one per completion (n > 1), the
        first prefilling the prompt for the others where the runner can copy KV rows (elsewhere
        each prefills it). Completion i samples with its own seed (types.completion_seed)."""
        if request.n == 1:
            return [Request(next(self._keys), request, sink, compiled)]
        keys = tuple(next(self._keys) for _ in range(request.n))
        merged = CompletionGroup(request.n, sink, functools.partial(self._stop_completions, keys[0]))
        group = CompletionSet(keys, shares_prompt=self._kv.can_fork)
        return [
            Request(
                key,
                replace(
                    request,
                    sampling=replace(request.sampling, seed=completion_seed(request.sampling.seed, i)),
                ),
                merged.sink_for(i),
                compiled,
                group=group,
            )
            for i, key in enumerate(keys)
        ]

    def _stop_completions(self, key: int) -> None:
        """One of a request's completions failed (the request did): the others stop unheard."""
        self.abort(key, AbortReason.DISCONNECTED)

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
        """Stop a live request at the next step boundary (unknown or finished keys are ignored);
        every one of its completions, for a request that asked for n > 1."""
        with self._lock:
            keys = self._scheduler.live_keys_of(key)
            if not keys:
                return
            step = self._inbox.decode_steps
            self._inbox.aborts.extend(Abort(k, reason, requested_at_step=step) for k in keys)
            self._inbox.abort_requests += 1
            self._wakeup.notify()

    # -- adapters being unloaded ------------------------------------------------------------------

    def retire_adapter(self, name: str) -> None:
        """Refuse new requests for adapter `name` (its unload has begun); live ones run on."""
        with self._lock:
            self._retired_adapters.add(name)

    def restore_adapter(self, name: str) -> None:
        """Its slot is free (or the unload gave up): the name may be loaded and used again."""
        with self._lock:
            self._retired_adapters.discard(name)

    def adapter_in_use(self, name: str) -> bool:
        """Whether a live request (queued or running) runs with adapter `name`."""
        with self._lock:
            live = (self._scheduler.get(key) for key in self._scheduler.live_keys())
            return any(request is not None and request.adapter == name for request in live)

    async def wait_adapter_unused(self, name: str) -> None:
        """Until no live request runs with adapter `name`: checked again after every batch of
        events the engine delivers, which is how each request's end reaches the event loop."""
        while True:
            delivered = asyncio.Event()
            self._delivery_waiters.append(delivered)
            if not self.adapter_in_use(name):
                return
            await delivered.wait()

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The prefix cache's size and hits after the latest round; None when it is off."""
        with self._lock:
            return self._inbox.prefix_cache

    @property
    def live_count(self) -> int:
        with self._lock:
            return len(self._scheduler)

    @property
    def queue_depth(self) -> int:
        with self._lock:
            return self._scheduler.queue_depth

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
            for key in self._scheduler.live_keys():
                self._inbox.aborts.append(Abort(key, AbortReason.SHUTDOWN, requested_at_step=None))
            self._stopping = True
            embeddings = self._scheduler.take_embeddings()
            self._wakeup.notify()
        for job in embeddings:
            job.deliver(_stopped())
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
        self._round(wait_for_work=False)

    # -- engine thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._round():
                pass
        except BaseException:  # the thread must never die silently with requests live
            log.exception("engine thread crashed; failing every live request")
            self._fail_everything(GenerationError(ErrorKind.INTERNAL, "engine failure"))
            raise

    def _round(self, *, wait_for_work: bool = True) -> bool:
        """One round: schedule, execute, update. False once the engine has stopped."""
        with self._lock:
            while (
                wait_for_work
                and not self._stopping
                and not self._inbox.aborts
                and not self._scheduler.has_work()
            ):
                self._wakeup.wait()
            aborts, self._inbox.aborts = self._inbox.aborts, []
            stopping = self._stopping
            plan = self._scheduler.schedule(self._clock(), aborts, admit=not stopping)
        outcome = self._core.execute(plan)
        with self._lock:
            self._scheduler.update(outcome)
            done = stopping and not self._scheduler.running()
            finished = done and not self._scheduler.queue_depth and not self._inbox.aborts
        if done:
            self._flush()
            return not finished
        self._report_occupancy()
        self._flush()
        return True

    def _fail_everything(self, error: GenerationError) -> None:
        with self._lock:
            everything = self._scheduler.clear()
            self._stopping = True  # the thread is gone: refuse what it would never serve
        now = self._clock()
        for request in everything:
            try:
                self._core.finish(request, error, now)
            except Exception:  # a broken runner must not keep the others from hearing
                log.exception("failing request %s", request.submitted.request_id)
        self._flush()

    def _drop(self, request: Request) -> None:
        """The core has ended a request: the scheduler drops its record."""
        with self._lock:
            self._scheduler.finish(request)

    def _publish_step(self, steps: int) -> None:
        with self._lock:
            self._inbox.decode_steps = steps

    # -- delivery --------------------------------------------------------------------------------

    def _emit(self, sink: EventSink, event: EngineEvent) -> None:
        self._outbox.append((sink, event))

    def _report_occupancy(self) -> None:
        cache_stats = self._kv.prefix_stats()
        with self._lock:
            occupancy = self._scheduler.occupancy()
            self._inbox.prefix_cache = cache_stats
        self._observer.occupancy(
            model=self._model,
            queued=occupancy.queued,
            running=occupancy.running,
            slots=self._scheduler.slots,
            kv_positions_used=occupancy.kv_positions_used,
            kv_positions=self._scheduler.slots * self._runner.info.context_length,
        )

    def _flush(self) -> None:
        """Hand the events emitted so far to the event loop in one call."""
        loop = self._loop
        batch, self._outbox = self._outbox, []
        with self._lock:
            idle = not len(self._scheduler)
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
        waiters, self._delivery_waiters = self._delivery_waiters, []
        for waiter in waiters:
            waiter.set()


def _stopped() -> GenerationError:
    return GenerationError(
        ErrorKind.UNAVAILABLE, "the model's engine has stopped; retry elsewhere", reason="SHUTDOWN"
    )


def _settle(
    future: asyncio.Future[EmbeddingResult | GenerationError], result: EmbeddingResult | GenerationError
) -> None:
    if not future.done():  # the caller may have gone (its task cancelled)
        future.set_result(result)
