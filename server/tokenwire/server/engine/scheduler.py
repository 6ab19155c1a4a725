"""Who runs when: admission, priorities, fair shares, preemption, deadlines and prompt pacing.

Policy only. Given the live requests and a clock reading, `schedule` returns the round's plan as
plain data (plan.py) and `update` takes back what the round did; the engine core carries the
plan out. This module imports no runner, tokenizer, sampler, protobuf or gRPC, so its tests
build requests by hand and check plans.

What it decides:
- **Queue admission**: a request is refused when its caller is at its own limit, or when the
  queue is full, in requests or in prompt tokens (`max_queued_tokens`), and the caller already
  holds its weighted share of it, counted the same way (so one caller's flood, of many requests
  or of long prompts, cannot lock out the others).
- **Slots**: the fair queue (fair_queue.py) gives free slots by priority, then between callers
  in proportion to their weights, counted in work (shares.work: prompt tokens plus tokens to
  generate), not turns. BATCH requests leave `batch_reserved_slots` to the others.
- **Preemption**: when every slot is busy, a waiting request owed one takes one at the next step:
  BATCH work gives way to more urgent work, and within a priority the caller furthest over its
  share of the slots gives way to one under its share. The victim may be decoding or still
  prefilling its prompt (a flood of long prompts holds slots for seconds before a first token);
  it resumes where it was. At most one a round.
- **Prompt work**: stall-free pacing (pacing.py) sizes the round's prompt budget, unbounded only
  when no stream decodes and no request waits for a slot (a waiting request is stalled by a long
  round too: only between rounds can it take a slot); the budget goes to the most urgent priority
  first, then to the caller holding the least work in slots for its weight.
- **Endings**: aborts and passed deadlines end requests at the round's start.
- **Forks** (n completions): the followers of a fork wait until its source's prompt rows are
  kept, then take slots like any request and copy the prompt instead of prefilling it.

Not thread-safe: the engine calls it under its lock, from the engine thread (planning and taking
back outcomes, both short) and from the event loop (queueing, refusals, retry hints).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenwire.server.engine.errors import ErrorKind, GenerationError
from tokenwire.server.engine.fair_queue import FairQueue
from tokenwire.server.engine.pacing import PrefillPacer
from tokenwire.server.engine.plan import Abort, Ending, Preemption, PromptWork, RoundOutcome, RoundPlan
from tokenwire.server.engine.request import QUEUED, Request, RequestStatus, RequestTable
from tokenwire.server.engine.shares import fair_share, held_per_share
from tokenwire.server.engine.types import AbortReason, Caller, FinishReason, Priority, unread_output_error

if TYPE_CHECKING:  # opaque here: the scheduler only waits for a format to compile
    from tokenwire.server.sampling.constraint import CompiledFormat

log = logging.getLogger(__name__)

_SERVICE_SMOOTHING = 0.2


@dataclass(frozen=True)
class SchedulerConfig:
    slots: int
    """Requests that can hold a slot (KV cache) at once."""
    max_queue_size: int
    prefill_chunk_size: int
    stall_free: bool
    max_step_seconds: float | None
    batch_reserved_slots: int
    preemption: bool
    """Whether a running generation may be swapped out (the runner can copy its KV rows)."""
    max_queued_tokens: int = 0
    """Most prompt tokens waiting for a slot, all callers together; 0: no bound."""


@dataclass(frozen=True)
class Occupancy:
    queued: int
    running: int
    kv_positions_used: int


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self._config = config
        self._slots = config.slots
        self._batch_reserved = max(0, min(config.batch_reserved_slots, self._slots - 1))
        self._requests = RequestTable()
        self._waiting: FairQueue[Request] = FairQueue()
        self._prefilling: list[Request] = []
        """In slots, prompts not done, in admission order."""
        self._decoding: dict[int, Request] = {}
        """In slots, decoding, in the order they began to."""
        self._pacer = PrefillPacer(max_step_seconds=config.max_step_seconds)
        self._service_seconds = 1.0
        """Moving average of start-to-finish times, for retry hints."""
        self._planned_preemption: tuple[Preemption, RequestStatus] | None = None
        """This round's preemption and its beneficiary's status before, until the outcome is in."""

    # -- queries ---------------------------------------------------------------------------------

    @property
    def slots(self) -> int:
        return self._slots

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def pacer(self) -> PrefillPacer:
        return self._pacer

    def get(self, key: int) -> Request | None:
        return self._requests.get(key)

    def __len__(self) -> int:
        return len(self._requests)

    def has_work(self) -> bool:
        """Whether a round now would do anything (a request ready to admit, or one running)."""
        return bool(self._prefilling or self._decoding) or any(r.ready for r in self._waiting)

    def running(self) -> list[Request]:
        return [*self._prefilling, *self._decoding.values()]

    def occupancy(self) -> Occupancy:
        running = self.running()
        return Occupancy(
            queued=len(self._waiting),
            running=len(running),
            kv_positions_used=sum(r.computed_tokens for r in running),
        )

    # -- queueing (event loop, under the engine's lock) ------------------------------------------

    def refusal(self, caller: Caller, *, live: int, prompt_tokens: int = 0) -> GenerationError | None:
        """Why a request of `caller` with `prompt_tokens` cannot queue now (`live` requests are in
        the engine), or None.

        A caller with its own limit stops there. When the queue is full, a caller holding less
        than its weighted share of it (among the callers queueing now) still gets in, so one
        caller's flood cannot lock out the others; the queue may then run over its size by the
        shares of those callers, and never beyond twice its size. The prompt tokens waiting are
        bounded the same way, by tokens: a request that would take them over `max_queued_tokens`
        gets in only while its caller holds less than its share of them. A request that finds a
        free slot, or an empty queue, is never refused for its tokens, so a prompt longer than
        the bound still runs once nothing waits ahead of it.
        """
        refused = self._request_refusal(caller, live=live) or self._token_refusal(
            caller, live=live, prompt_tokens=prompt_tokens
        )
        if refused is None:
            return None
        reason, message = refused
        retry_after = self.retry_after()
        return GenerationError(
            ErrorKind.RESOURCE_EXHAUSTED,
            f"{message}; retry after {retry_after:.2f}s",
            retry_after=retry_after,
            reason=reason,
        )

    def _request_refusal(self, caller: Caller, *, live: int) -> tuple[str, str] | None:
        waiting = self._waiting
        queued = waiting.queued_by(caller.name)
        size = self._config.max_queue_size
        if caller.max_queued is not None and queued >= caller.max_queued:
            return (
                "CALLER_QUEUE_FULL",
                f"caller {caller.name!r} already has {queued} requests waiting, its limit",
            )
        if live < self._slots + size:
            return None
        share = waiting.share(caller, size)
        if queued < share and len(waiting) < 2 * size:
            return None
        if len(waiting) > queued:
            return (
                "CALLER_OVER_SHARE",
                f"caller {caller.name!r} holds {queued} of the {len(waiting)} waiting requests, "
                f"more than its share of {share:.1f}; other callers still get in",
            )
        return "QUEUE_FULL", f"work queue is full ({size} waiting, {self._slots} running)"

    def _token_refusal(self, caller: Caller, *, live: int, prompt_tokens: int) -> tuple[str, str] | None:
        bound = self._config.max_queued_tokens
        waiting = self._waiting
        if bound <= 0 or live < self._slots or not waiting:
            return None
        total = waiting.queued_tokens
        if total + prompt_tokens <= bound:
            return None
        mine = waiting.queued_tokens_by(caller.name)
        share = waiting.share(caller, bound)
        others_waiting = total > mine  # a lone caller sees the plain bound
        if others_waiting and mine < share:
            if total + prompt_tokens <= 2 * bound:
                return None
        elif others_waiting:
            return (
                "CALLER_OVER_TOKEN_SHARE",
                f"caller {caller.name!r} holds {mine} of the {total} prompt tokens waiting, "
                f"more than its share of {share:.0f}; other callers still get in",
            )
        return (
            "QUEUED_TOKENS_FULL",
            f"work queue holds {total} prompt tokens; {prompt_tokens} more would pass its bound of "
            f"{bound} (--max-queued-tokens)",
        )

    def retry_after(self) -> float:
        """Seconds for the queue ahead to reach a slot: each batch of `slots` requests takes about
        one average service time. Clamped so clients neither hammer nor give up."""
        batches_ahead = math.ceil((len(self._waiting) + 1) / max(1, self._slots))
        return min(30.0, max(0.05, batches_ahead * self._service_seconds))

    def add(self, request: Request) -> None:
        self._requests.add(request)
        self._waiting.push(request)

    def clear(self) -> list[Request]:
        """Forget every live request (the engine fails them); the queue and slots are empty after."""
        everything = [*self._prefilling, *self._decoding.values(), *self._waiting.clear()]
        self._prefilling.clear()
        self._decoding.clear()
        self._requests = RequestTable()
        return everything

    # -- planning (engine thread) ----------------------------------------------------------------

    def schedule(self, now: float, aborts: Iterable[Abort] = (), *, admit: bool = True) -> RoundPlan:
        """The round's plan. `admit` False (the server is stopping): nothing new takes a slot."""
        endings = [*self._abort(aborts), *self._expire(now)]
        preemption: Preemption | None = None
        admitted: tuple[int, ...] = ()
        if admit:
            preemption, admitted, failed_formats = self._admit(now)
            endings.extend(failed_formats)
        decode = tuple(key for key, r in self._decoding.items() if r.generated_tokens > 0)
        prompts = self._prompt_work()
        named = self._named(endings, admitted, prompts.order, decode)
        if preemption is not None:
            named[preemption.victim] = self._requests[preemption.victim]
        return RoundPlan(
            now=now,
            endings=tuple(endings),
            preemption=preemption,
            admitted=admitted,
            prompts=prompts,
            decode=decode,
            requests=named,
        )

    def _named(self, endings: Iterable[Ending], *keys: Iterable[int]) -> dict[int, Request]:
        named = {ending.key: self._requests[ending.key] for ending in endings}
        named.update((key, self._requests[key]) for group in keys for key in group)
        return named

    def _abort(self, aborts: Iterable[Abort]) -> list[Ending]:
        # A key with several aborts ends at the first; the rest find nothing, as do aborts of
        # requests that ended by themselves before the abort was taken.
        endings = []
        for abort in aborts:
            request = self._requests.get(abort.key)
            if request is None or request.status is RequestStatus.FINISHED:
                continue
            started = request.started_at is not None
            self._end(request)
            endings.append(Ending(abort.key, _abort_ending(abort.reason, started=started), abort))
        return endings

    def _expire(self, now: float) -> list[Ending]:
        endings = []
        for request in [*self.running(), *(r for r in self._waiting if r.past_deadline(now))]:
            if request.past_deadline(now):
                where = "during generation" if request.started_at is not None else "in the queue"
                self._end(request)
                endings.append(Ending(request.key, _deadline_error(where)))
        return endings

    def _end(self, request: Request) -> None:
        """Take a request out of the queue or its slot; the core finishes it."""
        if request.status in QUEUED:
            self._waiting.remove(request)
        else:
            self._leave_slot(request)
        request.status = RequestStatus.FINISHED

    def _admit(self, now: float) -> tuple[Preemption | None, tuple[int, ...], list[Ending]]:
        for request in self._waiting:
            if request.status is RequestStatus.WAITING_FOR_FORMAT and request.ready:
                request.status = RequestStatus.WAITING
        free = self._slots - len(self._prefilling) - len(self._decoding)
        # BATCH requests leave `batch_reserved_slots` free for the others, so an INTERACTIVE
        # request never waits behind BATCH work for more than the next round.
        batch_room = (
            self._slots - self._batch_reserved - sum(r.priority is Priority.BATCH for r in self.running())
        )

        def allowed(request: Request) -> bool:
            return request.priority is not Priority.BATCH or batch_room > 0

        chosen: list[Request] = []
        preemption = self._preempt_for_next(allowed) if free == 0 else None
        if preemption is not None:
            victim, beneficiary = self._requests[preemption.victim], self._requests[preemption.beneficiary]
            self._leave_slot(victim)
            self._planned_preemption = (preemption, beneficiary.status)
            # The slot goes to the request it was freed for, which takes its caller's turn.
            self._waiting.take(beneficiary)
            chosen.append(beneficiary)
            # Back at the head of its caller's line: it was already its caller's next.
            victim.status = RequestStatus.SWAPPED_OUT
            self._waiting.push_front(victim)
        while free > 0:
            found = self._waiting.pop(allowed)
            if found is None:
                break
            chosen.append(found)
            free -= 1
            batch_room -= found.priority is Priority.BATCH
        admitted, failed = [], []
        for request in chosen:
            failure = _format_failure(request.response_format)
            if failure is not None:
                request.status = RequestStatus.FINISHED
                failed.append(Ending(request.key, failure))
                continue
            if request.status is RequestStatus.SWAPPED_OUT:
                self._resume(request)
            else:
                request.status = RequestStatus.PREFILLING
                request.started_at = now
                self._prefilling.append(request)
            admitted.append(request.key)
        return preemption, tuple(admitted), failed

    def _preempt_for_next(self, allowed: Callable[[Request], bool]) -> Preemption | None:
        """The generation to swap out for the next waiting request owed a slot, if any.

        At most as many swapped out at once as there are slots, which bounds the rows set aside
        to the KV cache's own size.
        """
        if not self._config.preemption or not any(r.swappable for r in self.running()):
            return None
        waiting = self._waiting
        if sum(r.status is RequestStatus.SWAPPED_OUT for r in waiting) >= self._slots:
            return None
        queueing = {priority: waiting.callers_at(priority) for priority in Priority}
        # Whether a caller is owed a slot depends on its caller and priority alone: asked once
        # for each, not once for every request a flooding caller has queued.
        owed_by: dict[tuple[Priority, str], bool] = {}

        def owed(request: Request) -> bool:
            if not allowed(request):
                return False
            key = (request.priority, request.caller.name)
            if key not in owed_by:
                owed_by[key] = self._victim_for(request, queueing[request.priority]) is not None
            return owed_by[key]

        # The next request in fair order among those owed a slot: a request of a caller at its
        # share, even one ahead in the fair order, takes nothing from anyone.
        candidate = waiting.peek(owed)
        if candidate is None:
            return None
        victim = self._victim_for(candidate, queueing[candidate.priority])
        assert victim is not None
        log.debug(
            "request %s of caller %s gives its slot to a request of caller %s",
            victim.spec.request_id,
            victim.caller.name,
            candidate.caller.name,
        )
        return Preemption(
            victim=victim.key,
            positions=victim.computed_tokens,
            beneficiary=candidate.key,
            prefilling=victim.status is RequestStatus.PREFILLING,
        )

    def _victim_for(self, candidate: Request, queueing: dict[str, float]) -> Request | None:
        """The request in a slot that owes `candidate` its slot, if one does: the cheapest to swap
        (fewest cached positions) of the BATCH work when `candidate` is more urgent, else of the
        caller furthest over its share at `candidate`'s priority, while `candidate`'s caller,
        given the slot, would still hold no more than its own share (so two callers never take a
        slot back and forth). Prompts mid-prefill count: they hold their slots like generations."""
        swappable = [r for r in self.running() if r.swappable]
        if candidate.priority is not Priority.BATCH:
            batch = [r for r in swappable if r.priority is Priority.BATCH]
            if batch:
                return min(batch, key=lambda r: r.computed_tokens)
        level = candidate.priority
        everything = self.running()
        running = [r for r in everything if r.priority is level]
        # The level's callers share the slots that more urgent work leaves them.
        capacity = self._slots - sum(r.priority.value < level.value for r in everything)
        held = Counter(r.caller.name for r in running)
        weights = dict(queueing)
        weights.update((r.caller.name, r.caller.weight) for r in running)
        if sum(weights.values()) <= 0:
            return None

        def excess(name: str) -> float:
            return held[name] - fair_share(capacity, weights[name], weights)

        if excess(candidate.caller.name) + 1 > 0:
            return None
        over = [r for r in swappable if r.priority is level and excess(r.caller.name) > 0]
        if not over:
            return None
        return min(over, key=lambda r: (-excess(r.caller.name), r.computed_tokens))

    def _prompt_work(self) -> PromptWork:
        """The round's prompt budget and the order prompts get it.

        The most urgent priority first; within it, the prompt of the caller holding the least
        work in slots (shares.work of each request there) for its weight, so a flood's prompts,
        many or long, never make a quieter caller's first token wait for theirs; among equals,
        first come, first served, which lets a prompt reuse the prefix a prompt ahead of it has
        just cached. A prompt set aside keeps what it has done.
        """
        held: Counter[str] = Counter()
        for running in self.running():
            held[running.caller.name] += running.work

        def order(request: Request) -> tuple[int, float]:
            return request.priority.value, held_per_share(held[request.caller.name], request.caller.weight)

        # A follower admitted this round copies its prompt: it has no prompt work.
        prefilling = [r for r in self._prefilling if not r.copies_prompt]
        prompts = sorted(prefilling, key=order)  # a stable sort keeps arrival order among equals
        # A request waiting for a slot is stalled by a long round as a decoding stream is: the next
        # round is when it can take a slot (or one is taken back for it). So the prompt budget is
        # unbounded only when nothing decodes and nothing waits.
        stalls = bool(self._decoding) or any(r.ready for r in self._waiting)
        return PromptWork(
            order=tuple(r.key for r in prompts),
            budget=self._prompt_budget(decoding=stalls),
            paced_budget=self._prompt_budget(decoding=True),
            chunk_size=self._config.prefill_chunk_size,
        )

    def _prompt_budget(self, *, decoding: bool) -> float:
        """Prompt tokens a round may process: unbounded when nothing would be stalled (`decoding`
        False: no stream decodes and no request waits for a slot)."""
        if not self._config.stall_free:
            return self._config.prefill_chunk_size if decoding else math.inf
        tokens = self._pacer.budget(decoding=decoding).tokens
        return math.inf if tokens is None else tokens

    # -- taking back what a round did (engine thread) --------------------------------------------

    def update(self, outcome: RoundOutcome) -> None:
        for key, positions in outcome.prompt_positions.items():
            self._requests[key].computed_tokens += positions
        for key, kept in outcome.prompts_kept.items():
            fork = self._requests[key].fork
            assert fork is not None, "a prompt kept for a request without a fork"
            fork.ready, fork.abandoned = kept, not kept
        for key in outcome.first_tokens:
            request = self._requests[key]
            self._prefilling.remove(request)
            request.status = RequestStatus.DECODING
            request.generated_tokens = 1
            self._decoding[key] = request
        for key in outcome.decoded:
            request = self._requests[key]
            gained = 1 + outcome.extra_tokens.get(key, 0)
            request.computed_tokens += gained
            request.generated_tokens += gained
        if outcome.preemption_failed:
            self._undo_preemption()
        self._planned_preemption = None
        for finished in outcome.finished:
            ended = self._requests.get(finished.key)
            if ended is not None and ended.keeps_prompt:
                assert ended.fork is not None
                ended.fork.abandoned = True  # its followers prefill the prompt themselves
            ended = self._requests.remove(finished.key)
            if ended is not None and ended.status is not RequestStatus.FINISHED:
                self._end(ended)
            if finished.service_seconds is not None:
                self._service_seconds = (
                    1 - _SERVICE_SMOOTHING
                ) * self._service_seconds + _SERVICE_SMOOTHING * max(0.0, finished.service_seconds)
        for tokens, seconds in outcome.prompt_chunks:
            self._pacer.observe_prefill(tokens, seconds)
        if outcome.decode_seconds is not None:
            self._pacer.observe_decode(outcome.decode_seconds)

    def _leave_slot(self, request: Request) -> None:
        """A request leaves its slot (it ended, or was preempted), prompt mid-way or decoding."""
        if request.status is RequestStatus.PREFILLING:
            self._prefilling.remove(request)
        else:
            self._decoding.pop(request.key, None)

    def _resume(self, request: Request) -> None:
        """A swapped-out request back in a slot, where it was: its prompt's remaining chunks
        (it keeps the start time of its first admission), or its next token."""
        if request.resumes_prompt:
            request.status = RequestStatus.PREFILLING
            self._prefilling.append(request)
        else:
            request.status = RequestStatus.DECODING
            self._decoding[request.key] = request

    def _undo_preemption(self) -> None:
        # The victim keeps its slot; the request it was swapped out for waits at the head of its
        # caller's line again (its caller's turn stays used: the next turn is another caller's).
        assert self._planned_preemption is not None, "a preemption failed that was never planned"
        preemption, beneficiary_was = self._planned_preemption
        victim = self._requests[preemption.victim]
        self._waiting.remove(victim)
        self._resume(victim)
        beneficiary = self._requests.get(preemption.beneficiary)
        if beneficiary is None or beneficiary.status is RequestStatus.FINISHED:
            return
        if beneficiary.status is RequestStatus.PREFILLING:
            self._prefilling.remove(beneficiary)
            if beneficiary_was is not RequestStatus.SWAPPED_OUT:
                beneficiary.started_at = None  # it never began after all
        else:
            self._decoding.pop(beneficiary.key, None)
        beneficiary.status = beneficiary_was
        self._waiting.push_front(beneficiary)


def _format_failure(response_format: Future[CompiledFormat] | None) -> GenerationError | None:
    if response_format is None:
        return None
    failure = response_format.exception()
    if failure is None:
        return None
    if isinstance(failure, GenerationError):
        return failure
    log.error("compiling a response format failed", exc_info=failure)
    return GenerationError(
        ErrorKind.INTERNAL, "compiling the response format failed", reason="FORMAT_FAILURE"
    )


def _abort_ending(reason: AbortReason, *, started: bool) -> FinishReason | GenerationError:
    """How an abort ends a request: cancelled (a result), or failed with the reason's error."""
    if reason is AbortReason.CANCELLED or reason is AbortReason.DISCONNECTED:
        return FinishReason.CANCELLED
    if reason is AbortReason.DEADLINE:
        return _deadline_error("during generation" if started else "in the queue")
    unread = unread_output_error(reason)
    if unread is not None:
        return unread
    return GenerationError(
        ErrorKind.UNAVAILABLE, "server shut down before the request finished; retry", reason="SHUTDOWN"
    )


def _deadline_error(where: str) -> GenerationError:
    return GenerationError(
        ErrorKind.DEADLINE_EXCEEDED, f"deadline exceeded {where}", reason="DEADLINE_EXCEEDED"
    )
