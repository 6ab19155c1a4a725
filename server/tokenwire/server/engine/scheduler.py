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
  round too: only between rounds can it take a slot), and paced from the first prompt that gets
  its first token on; the budget goes to the most urgent priority first, then to the caller
  holding the least work in slots for its weight, cut into chunks (pacing.chunk_length). A
  prompt's first chunk looks its prefix up in the prefix cache (the lookup the engine gives the
  scheduler): the cached positions are copied in, not prefilled, and cost no budget. A prompt
  whose shared prefix an earlier prompt of the same tenant is prefilling in the same round starts
  in the next one, where it finds those blocks cached.
- **Drafts**: how many speculative drafts each decode row may verify (speculation.py), within
  what the step's other streams can spare; drafts rejected are charged to their caller's turns.
- **Endings**: aborts and passed deadlines end requests at the round's start.
- **Forks** (n completions): the followers of a fork wait until its source's prompt rows are
  kept, then take slots like any request and copy the prompt instead of prefilling it.

The scheduler owns every live request's record (request.py): it alone moves a request from one
status to another, and finishing a request (`finish`) drops its record.

Not thread-safe: the engine calls it under its lock, from the engine thread (planning, taking
back outcomes and finishing requests, all short) and from the event loop (queueing, refusals,
retry hints, aborts).
"""

from __future__ import annotations

import logging
import math
from collections import Counter, deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenwire.server.engine.embedding import EmbeddingJob
from tokenwire.server.engine.errors import ErrorKind, GenerationError
from tokenwire.server.engine.fair_queue import FairQueue
from tokenwire.server.engine.pacing import PrefillPacer, chunk_length
from tokenwire.server.engine.plan import (
    Abort,
    Admission,
    DecodeRow,
    Ending,
    Entry,
    Preemption,
    PromptChunk,
    RoundOutcome,
    RoundPlan,
)
from tokenwire.server.engine.request import QUEUED, Request, RequestStatus, RequestTable
from tokenwire.server.engine.shares import fair_share, held_per_share
from tokenwire.server.engine.speculation import (
    OFF,
    NeighbourBudget,
    SpeculationSettings,
    draft_limits,
    record_verification,
)
from tokenwire.server.engine.types import AbortReason, Caller, FinishReason, Priority, unread_output_error

if TYPE_CHECKING:  # opaque here: the scheduler only waits for a format to compile
    from tokenwire.server.sampling.constraint import CompiledFormat

log = logging.getLogger(__name__)

_SERVICE_SMOOTHING = 0.2

PrefixLookup = Callable[[Request], int]
"""Looks a request's prompt up in the prefix cache, keeping what it found in the request's KV
holding; the count of prompt tokens found cached (0: none, or no cache)."""


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
    context_length: int = 2**31
    """Positions a slot holds: no speculative run may pass it."""
    speculation: SpeculationSettings = OFF
    """Drafts the decode rows may verify; OFF where the runner cannot verify runs of tokens."""
    prefix_block_tokens: int = 0
    """The prefix cache's block size (0: no prefix cache)."""


@dataclass(frozen=True)
class Occupancy:
    """What the engine holds after a round, for the occupancy gauges and the gateway's load."""

    queued: int
    """Requests waiting for a slot, those swapped out among them (they wait in the same queue,
    to resume where they were)."""
    running: int
    kv_positions_used: int
    """KV positions the running requests have computed, of the slots' positions: the share of
    the cache in use, not the share allocated."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, look_up_prefix: PrefixLookup | None = None) -> None:
        self._config = config
        self._look_up_prefix = look_up_prefix if config.prefix_block_tokens > 0 else None
        self._slots = config.slots
        self._batch_reserved = max(0, min(config.batch_reserved_slots, self._slots - 1))
        self._requests = RequestTable()
        self._waiting: FairQueue[Request] = FairQueue()
        self._prefilling: list[Request] = []
        """In slots, prompts not done, in admission order."""
        self._decoding: dict[int, Request] = {}
        """In slots, decoding, in the order they began to."""
        self._pacer = PrefillPacer(max_step_seconds=config.max_step_seconds)
        self._neighbours = NeighbourBudget(config.speculation)
        self._service_seconds = 1.0
        """Moving average of start-to-finish times, for retry hints."""
        self._embeddings: deque[EmbeddingJob] = deque()
        """Embedding jobs waiting for a round, oldest first."""
        self._planned: RoundPlan | None = None
        """This round's plan, until its outcome is in: its progress counts unless the outcome says
        otherwise."""
        self._beneficiary_was: RequestStatus | None = None
        """The status the plan's preemption's beneficiary had before it was given the slot."""

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
        """Whether a round now would do anything (a request ready to admit, one running, or an
        embedding queued)."""
        return bool(self._prefilling or self._decoding or self._embeddings) or any(
            r.ready for r in self._waiting
        )

    # -- embeddings ------------------------------------------------------------------------------

    def add_embedding(self, job: EmbeddingJob) -> GenerationError | None:
        """Queue an embedding job, or the refusal of a full queue (it then is not queued)."""
        if len(self._embeddings) >= self._config.max_queue_size:
            return GenerationError(
                ErrorKind.RESOURCE_EXHAUSTED,
                f"{len(self._embeddings)} embedding requests are queued, the most this server queues",
                retry_after=self._service_seconds,
                reason="QUEUE_FULL",
            )
        self._embeddings.append(job)
        return None

    def take_embeddings(self) -> list[EmbeddingJob]:
        """Every queued embedding job, taken off the queue (the engine is stopping)."""
        jobs, self._embeddings = list(self._embeddings), deque()
        return jobs

    def _embedding_work(self) -> tuple[EmbeddingJob, ...]:
        """The jobs this round runs: oldest first while their tokens fit one prompt chunk's budget,
        and always the oldest one (a job's inputs are bounded by the context)."""
        planned: list[EmbeddingJob] = []
        tokens = 0
        while self._embeddings:
            job = self._embeddings[0]
            if planned and tokens + job.request.tokens > self._config.prefill_chunk_size:
                break
            planned.append(self._embeddings.popleft())
            tokens += job.request.tokens
        return tuple(planned)

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
        """Finish every live request at once (the engine fails them); the queue and slots are empty
        after."""
        everything = [*self._prefilling, *self._decoding.values(), *self._waiting.clear()]
        self._prefilling.clear()
        self._decoding.clear()
        self._requests = RequestTable()
        for request in everything:
            request.transition(RequestStatus.FINISHED)
        return everything

    def live_keys(self) -> list[int]:
        return self._requests.keys()

    def live_keys_of(self, ticket: int) -> list[int]:
        """The live requests that aborting `ticket` stops: it, or its request's live completions."""
        return self._requests.live_keys_of(ticket)

    def finish(self, request: Request) -> None:
        """A request has ended (the core emitted its terminal event): drop its record, from the
        queue or its slot and from the table. A request the plan ended is dropped already."""
        if not request.finished:
            self._end(request)
        self._requests.remove(request.key)

    # -- planning (engine thread) ----------------------------------------------------------------

    def schedule(self, now: float, aborts: Iterable[Abort] = (), *, admit: bool = True) -> RoundPlan:
        """The round's plan. `admit` False (the server is stopping): nothing new takes a slot."""
        endings = [*self._abort(aborts), *self._expire(now)]
        preemption: Preemption | None = None
        admitted: list[Admission] = []
        if admit:
            preemption, admitted, failed_formats = self._admit(now)
            endings.extend(failed_formats)
        decoding = list(self._decoding.values())
        prompts, completing = self._prompt_work()
        forked = [self._requests[a.key] for a in admitted if a.entry is Entry.FORKED]
        rows = [*decoding, *completing, *forked]
        limits = self._neighbours.limit(
            rows,
            draft_limits(
                self._config.speculation,
                rows,
                [False] * len(decoding) + [True] * (len(completing) + len(forked)),
                context_length=self._config.context_length,
            ),
        )
        named = {ending.key: ending.request for ending in endings}
        named.update((r.key, r) for r in (*self._prefilling, *self._decoding.values()))
        if preemption is not None:
            named[preemption.victim] = self._requests[preemption.victim]
        plan = RoundPlan(
            now=now,
            endings=tuple(Ending(e.key, e.end, e.abort) for e in endings),
            preemption=preemption,
            admitted=tuple(admitted),
            prompts=tuple(prompts),
            decode=tuple(DecodeRow(r.key, limit) for r, limit in zip(rows, limits, strict=True)),
            requests=named,
            embeddings=self._embedding_work() if admit else (),
        )
        self._planned = plan
        return plan

    def _abort(self, aborts: Iterable[Abort]) -> list[_Ended]:
        # A key with several aborts ends at the first; the rest find nothing, as do aborts of
        # requests that ended by themselves before the abort was taken.
        endings = []
        for abort in aborts:
            request = self._requests.get(abort.key)
            if request is None:
                continue
            started = request.started_at is not None
            self._drop(request)
            endings.append(_Ended(request, _abort_ending(abort.reason, started=started), abort))
        return endings

    def _expire(self, now: float) -> list[_Ended]:
        endings = []
        for request in [*self.running(), *(r for r in self._waiting if r.past_deadline(now))]:
            if request.past_deadline(now):
                where = "during generation" if request.started_at is not None else "in the queue"
                self._drop(request)
                endings.append(_Ended(request, _deadline_error(where)))
        return endings

    def _end(self, request: Request) -> None:
        """Take a request out of the queue or its slot, finished."""
        if request.status in QUEUED:
            self._waiting.remove(request)
        else:
            self._leave_slot(request)
        self._mark_finished(request)

    def _mark_finished(self, request: Request) -> None:
        keeps_prompt = request.keeps_prompt
        request.transition(RequestStatus.FINISHED)
        group = request.group
        if group is not None:
            group.ended.add(request.key)
            if keeps_prompt:
                group.abandoned = True  # its followers prefill the prompt themselves

    def _drop(self, request: Request) -> None:
        self._end(request)
        self._requests.remove(request.key)

    def _admit(self, now: float) -> tuple[Preemption | None, list[Admission], list[_Ended]]:
        for request in self._waiting:
            if request.status is RequestStatus.WAITING_FOR_FORMAT and request.ready:
                request.transition(RequestStatus.WAITING)
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
            self._beneficiary_was = beneficiary.status
            # The slot goes to the request it was freed for, which takes its caller's turn.
            self._waiting.take(beneficiary)
            chosen.append(beneficiary)
            # Back at the head of its caller's line: it was already its caller's next.
            victim.transition(RequestStatus.SWAPPED_OUT)
            self._waiting.push_front(victim)
        while free > 0:
            found = self._waiting.pop(allowed)
            if found is None:
                break
            chosen.append(found)
            free -= 1
            batch_room -= found.priority is Priority.BATCH
        admitted: list[Admission] = []
        failed: list[_Ended] = []
        for request in chosen:
            failure = _format_failure(request.response_format)
            if failure is not None:
                self._mark_finished(request)  # out of the queue already
                self._requests.remove(request.key)
                failed.append(_Ended(request, failure))
                continue
            if request.status is RequestStatus.SWAPPED_OUT:
                self._resume(request)
                admitted.append(Admission(request.key, Entry.RESUMED))
                continue
            request.transition(RequestStatus.PREFILLING)
            request.started_at = now
            self._prefilling.append(request)
            admitted.append(Admission(request.key, Entry.FORKED if request.copies_prompt else Entry.NEW))
        return preemption, admitted, failed

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
            victim.submitted.request_id,
            victim.caller.name,
            candidate.caller.name,
        )
        # A victim that was decoding decodes on if the copy fails; one mid-prompt has no token.
        if_kept = DecodeRow(victim.key) if victim.status is RequestStatus.DECODING else None
        return Preemption(
            victim=victim.key, positions=victim.computed_tokens, beneficiary=candidate.key, if_kept=if_kept
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

    def _prompt_work(self) -> tuple[list[PromptChunk], list[Request]]:
        """The round's prompt chunks, and the requests whose prompt they finish (in that order).

        The most urgent priority first; within it, the prompt of the caller holding the least
        work in slots (shares.work of each request there) for its weight, so a flood's prompts,
        many or long, never make a quieter caller's first token wait for theirs; among equals,
        first come, first served. A prompt set aside keeps what it has done.
        """
        held: Counter[str] = Counter()
        for running in self.running():
            held[running.caller.name] += running.work

        def order(request: Request) -> tuple[int, float]:
            return request.priority.value, held_per_share(held[request.caller.name], request.caller.weight)

        # A follower admitted this round copies its prompt: it has no prompt work.
        prompts = sorted((r for r in self._prefilling if not r.copies_prompt), key=order)  # stable
        # A request waiting for a slot is stalled by a long round as a decoding stream is: the next
        # round is when it can take a slot (or one is taken back for it). So the prompt budget is
        # unbounded only when nothing decodes and nothing waits.
        stalls = bool(self._decoding) or any(r.ready for r in self._waiting)
        budget = self._prompt_budget(decoding=stalls)
        chunk_size = self._config.prefill_chunk_size
        chunks: list[PromptChunk] = []
        completing: list[Request] = []
        planned: list[tuple[Request, int, int]] = []
        """(request, first position, end) of each prompt with chunks this round, so far."""
        for request in prompts:
            if budget <= 0:
                break
            start = cached = 0
            if request.kv.prefix is None and self._look_up_prefix is not None:
                if self._waits_for_shared_prefix(request, planned):
                    continue
                cached = self._look_up_prefix(request)
            start = request.computed_tokens + cached
            first = start
            length = request.prompt_length
            while budget > 0 and start < length:
                size = chunk_length(length - start, int(min(budget, chunk_size)))
                done = start + size >= length
                chunks.append(
                    PromptChunk(
                        request.key,
                        start,
                        size,
                        cached=cached if start == first else 0,
                        keep_for_group=done and request.keeps_prompt,
                    )
                )
                budget -= size
                start += size
            planned.append((request, first, start))
            if start >= length:
                completing.append(request)
                if math.isinf(budget):
                    # Streams decode from now on: the prompts behind it are paced.
                    budget = self._prompt_budget(decoding=True)
        return chunks, completing

    def _waits_for_shared_prefix(self, request: Request, planned: list[tuple[Request, int, int]]) -> bool:
        """Whether a prompt about to be looked up in the prefix cache should wait for the next
        round: an earlier prompt of its tenant completes, this round, a block of the prefix the
        two share, which it would find cached then instead of prefilling it again."""
        block = self._config.prefix_block_tokens
        prompt = request.prompt_ids
        tenant = request.caller.tenant
        for other, first, end in planned:
            if other.caller.tenant != tenant or other.prompt_ids[:block] != prompt[:block]:
                continue
            shared = _common_prefix(prompt, other.prompt_ids, limit=end)
            if shared // block * block > first:
                return True
        return False

    def _prompt_budget(self, *, decoding: bool) -> float:
        """Prompt tokens a round may process: unbounded when nothing would be stalled (`decoding`
        False: no stream decodes and no request waits for a slot)."""
        if not self._config.stall_free:
            return self._config.prefill_chunk_size if decoding else math.inf
        tokens = self._pacer.budget(decoding=decoding).tokens
        return math.inf if tokens is None else tokens

    # -- taking back what a round did (engine thread) --------------------------------------------

    def update(self, outcome: RoundOutcome) -> None:
        """Count the progress the round's plan made, but for what the outcome says did not run."""
        plan, self._planned = self._planned, None
        if plan is not None:
            self._count_progress(plan, outcome)
        if outcome.preemption_failed:
            self._undo_preemption(plan)
        self._beneficiary_was = None
        for key, kept in outcome.prompts_kept.items():
            # The plan names the source, which may have ended at its first token.
            group = plan.requests[key].group if plan is not None else None
            assert group is not None, "a prompt kept for a request without a group"
            # Without the rows its followers prefill the prompt themselves.
            group.ready, group.abandoned = kept, not kept
        for finished in outcome.finished:
            if finished.service_seconds is not None:
                self._service_seconds = (
                    1 - _SERVICE_SMOOTHING
                ) * self._service_seconds + _SERVICE_SMOOTHING * max(0.0, finished.service_seconds)
        for tokens, seconds in outcome.prompt_chunks:
            self._pacer.observe_prefill(tokens, seconds)
        if outcome.decode_seconds is not None and not outcome.verified:
            self._pacer.observe_decode(outcome.decode_seconds)  # a plain step's model call
        if outcome.step_seconds is not None:
            rows = len(plan.decode) if plan is not None else 0
            self._neighbours.observe(
                step_seconds=outcome.step_seconds,
                positions=sum(v.drafted + 1 for v in outcome.verified.values()),
                shared=rows > len(outcome.verified),
            )

    def _count_progress(self, plan: RoundPlan, outcome: RoundOutcome) -> None:
        def live(key: int) -> Request | None:
            request = self._requests.get(key)
            return None if request is None or key in outcome.skipped else request

        decoding_before = set(self._decoding)
        firsts: list[Request] = []
        for chunk in plan.prompts:
            request = live(chunk.key)
            if request is None:
                continue
            request.computed_tokens = chunk.end
            if chunk.end >= request.prompt_length:
                firsts.append(request)
        for admission in plan.admitted:
            request = live(admission.key)
            if admission.entry is Entry.FORKED and request is not None:
                request.computed_tokens = request.prompt_length
                firsts.append(request)
        rows_by_key = {row.key: row for row in plan.decode}
        rows = [row for row in plan.decode if row.key in decoding_before]
        preemption = plan.preemption
        if outcome.preemption_failed and preemption is not None and preemption.if_kept is not None:
            rows.append(preemption.if_kept)
        for row in rows:
            request = live(row.key)
            if request is None:
                continue
            self._count_step(request, row, outcome)
        for request in firsts:
            self._prefilling.remove(request)
            request.transition(RequestStatus.DECODING)
            self._decoding[request.key] = request
            # Its first token came before the step; the step gave it one more, or a run.
            self._count_step(request, rows_by_key[request.key], outcome)

    def _count_step(self, request: Request, row: DecodeRow, outcome: RoundOutcome) -> None:
        """A row the decode step gave a token, or a run: one position, and each draft kept."""
        verified = outcome.verified.get(request.key)
        if verified is None:
            request.computed_tokens += 1
            if row.max_drafts:
                request.drafting.verifying = False  # it could have drafted and found nothing
            return
        request.drafting.verifying = True
        request.computed_tokens += 1 + verified.accepted
        record_verification(request.drafting, drafted=verified.drafted, accepted=verified.accepted)
        self._waiting.charge(request.caller, request.priority, verified.drafted - verified.accepted)

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
            request.transition(RequestStatus.PREFILLING)
            self._prefilling.append(request)
        else:
            request.transition(RequestStatus.DECODING)
            self._decoding[request.key] = request

    def _undo_preemption(self, plan: RoundPlan | None) -> None:
        # The victim keeps its slot; the request it was swapped out for waits at the head of its
        # caller's line again (its caller's turn stays used: the next turn is another caller's).
        preemption = plan.preemption if plan is not None else None
        was = self._beneficiary_was
        assert preemption is not None and was is not None, "a preemption failed that was never planned"
        victim = self._requests.get(preemption.victim)
        if victim is not None:
            self._waiting.remove(victim)
            self._resume(victim)
        beneficiary = self._requests.get(preemption.beneficiary)
        if beneficiary is None:
            return
        self._leave_slot(beneficiary)
        if beneficiary.status is RequestStatus.PREFILLING and was is not RequestStatus.SWAPPED_OUT:
            beneficiary.started_at = None  # it never began after all
        beneficiary.transition(was)
        self._waiting.push_front(beneficiary)


@dataclass(frozen=True)
class _Ended:
    """A request the plan ends, with its record (dropped from the table already)."""

    request: Request
    end: FinishReason | GenerationError
    abort: Abort | None = None

    @property
    def key(self) -> int:
        return self.request.key


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...], *, limit: int) -> int:
    """How many leading tokens `a` and `b` share, counting at most `limit`."""
    length = min(len(a), len(b), limit)
    for i in range(length):
        if a[i] != b[i]:
            return i
    return length


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
