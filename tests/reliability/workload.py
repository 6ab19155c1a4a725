"""The load mix shared by the load test and the soak: unary calls, streams, multiplexed streams.

Requests are drawn deterministically from (seed, index), so a failing run can be replayed. Every
generation in the mix ends in exactly one `Outcome`; a generation whose events break the
contract's order (queued, started, chunks, then exactly one of completed or error), whose
completion disagrees with what was streamed, or whose error is not one the request could
legitimately get, is UNEXPECTED with a description. A generation that has not ended within the
hang bound is HUNG: waits are bounded everywhere, nothing waits forever.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Literal

import grpc

from tokenwire.client import (
    AsyncClient,
    ChatMessage,
    Chunk,
    Completed,
    Failed,
    FinishReason,
    GenerateOptions,
    Queued,
    Sampling,
    Started,
    Stopping,
    StreamEvent,
    TokenwireError,
)

Api = Literal["unary", "stream", "multiplexed"]
Prompt = str | tuple[ChatMessage, ...]

TOPICS = (
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "Gravity is",
    "Les nuages sont",
    "Ünïcödé → 東京 🌍",
    "1, 2, 3, 4,",
)


class Outcome(str, Enum):
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    """Completed with FINISH_REASON_CANCELLED after the client cancelled it (soak mix only)."""
    REJECTED = "resource_exhausted"
    DEADLINE = "deadline_exceeded"
    UNAVAILABLE = "unavailable"
    """Refused because the server is draining (retryable); never after the request was accepted."""
    HUNG = "hung"
    UNEXPECTED = "unexpected"


@dataclass(frozen=True)
class GenerationSpec:
    request_id: str
    prompt: Prompt
    options: GenerateOptions
    cancel_after_chunks: int | None = None
    """Send a CancelRequest once this many chunks arrived (0: right after `queued`)."""


@dataclass(frozen=True)
class LoadRequest:
    index: int
    api: Api
    generations: tuple[GenerationSpec, ...]
    call_deadline: float | None = None
    """gRPC deadline of the whole call, in seconds."""

    @property
    def has_deadline(self) -> bool:
        return self.call_deadline is not None or any(g.options.timeout is not None for g in self.generations)


@dataclass(frozen=True)
class GenerationOutcome:
    request: LoadRequest
    spec: GenerationSpec
    outcome: Outcome
    token_ids: tuple[int, ...] = ()
    time_to_first_token: float | None = None
    """Server-measured TTFT of a completed generation, in seconds."""
    retry_after: float | None = None
    detail: str = ""


def make_request(index: int, seed: int, *, cancel_fraction: float = 0.0) -> LoadRequest:
    """The `index`-th request of the mix drawn with `seed`."""
    rng = random.Random(seed * 1_000_003 + index)
    api: Api = rng.choices(("unary", "stream", "multiplexed"), weights=(4, 4, 2))[0]
    specs = []
    for part in range(3 if api == "multiplexed" else 1):
        topic = rng.choice(TOPICS)
        prompt: Prompt = (
            (ChatMessage("user", f"{topic} ({index}.{part})"),)
            if rng.random() < 0.25
            else f"{topic} ({index}.{part})"
        )
        timeout = rng.choice((0.001, 0.01, 0.05)) if rng.random() < 0.1 else None
        options = GenerateOptions(
            sampling=Sampling(
                temperature=rng.choice((0.0, 0.7, 1.0)),
                top_k=rng.choice((0, 20)),
                top_p=rng.choice((None, 0.9)),
                seed=index * 10 + part,
            ),
            stopping=Stopping(max_new_tokens=rng.choice((4, 16, 32, 64, 128)), ignore_eos=rng.random() < 0.8),
            timeout=timeout,
        )
        cancel = rng.randint(0, 3) if api != "unary" and rng.random() < cancel_fraction else None
        # The seed keeps ids apart across mixes on one server, so logs tell their requests apart.
        specs.append(GenerationSpec(f"s{seed}-r{index}.{part}", prompt, options, cancel))
    call_deadline = 0.02 if api == "unary" and rng.random() < 0.05 else None
    return LoadRequest(index, api, tuple(specs), call_deadline)


def build_mix(count: int, seed: int, *, cancel_fraction: float = 0.0) -> list[LoadRequest]:
    return [make_request(i, seed, cancel_fraction=cancel_fraction) for i in range(count)]


def endless_mix(seed: int, *, cancel_fraction: float = 0.0) -> Iterator[LoadRequest]:
    return (make_request(i, seed, cancel_fraction=cancel_fraction) for i in itertools.count())


# -- running one request ---------------------------------------------------------------------------


def _error_outcome(request: LoadRequest, spec: GenerationSpec, error: Exception) -> GenerationOutcome:
    if not isinstance(error, TokenwireError):
        return GenerationOutcome(request, spec, Outcome.UNEXPECTED, detail=f"not a TokenwireError: {error!r}")
    if error.code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        if error.retry_after is None:
            return GenerationOutcome(request, spec, Outcome.UNEXPECTED, detail=f"no RetryInfo: {error}")
        return GenerationOutcome(request, spec, Outcome.REJECTED, retry_after=error.retry_after)
    if error.code is grpc.StatusCode.DEADLINE_EXCEEDED:
        if not request.has_deadline:
            return GenerationOutcome(
                request, spec, Outcome.UNEXPECTED, detail=f"no deadline was set: {error}"
            )
        return GenerationOutcome(request, spec, Outcome.DEADLINE)
    if error.code is grpc.StatusCode.UNAVAILABLE and error.retryable:
        return GenerationOutcome(request, spec, Outcome.UNAVAILABLE)
    return GenerationOutcome(request, spec, Outcome.UNEXPECTED, detail=str(error))


async def _run_unary(client: AsyncClient, request: LoadRequest, *, keep: bool) -> list[GenerationOutcome]:
    spec = request.generations[0]
    try:
        generation = await client.generate(
            spec.prompt, spec.options, request_id=spec.request_id, deadline=request.call_deadline
        )
    except TokenwireError as error:
        return [_error_outcome(request, spec, error)]
    if generation.finish_reason is FinishReason.CANCELLED:
        return [GenerationOutcome(request, spec, Outcome.UNEXPECTED, detail="unary call came back cancelled")]
    if generation.completion_tokens != len(generation.token_ids):
        return [
            GenerationOutcome(
                request,
                spec,
                Outcome.UNEXPECTED,
                detail=f"usage says {generation.completion_tokens} tokens, got {len(generation.token_ids)}",
            )
        ]
    return [
        GenerationOutcome(
            request,
            spec,
            Outcome.COMPLETED,
            token_ids=generation.token_ids if keep else (),
            time_to_first_token=generation.timing.time_to_first_token,
        )
    ]


def _order_problem(events: Sequence[StreamEvent]) -> str | None:
    """Why this generation's events break the documented order, or None when they follow it."""
    letters = "".join(
        "Q"
        if isinstance(e, Queued)
        else "S"
        if isinstance(e, Started)
        else "K"
        if isinstance(e, Chunk)
        else "C"
        if isinstance(e, Completed)
        else "F"
        for e in events
    )
    ok = letters == "F" or (
        len(letters) >= 2
        and letters[0] == "Q"
        and letters[-1] in "CF"
        and (len(letters) == 2 or (letters[1] == "S" and set(letters[2:-1]) <= {"K"}))
    )
    return None if ok else f"events out of order: {letters}"


def _stream_outcome(
    request: LoadRequest, spec: GenerationSpec, events: Sequence[StreamEvent], *, keep: bool
) -> GenerationOutcome:
    if not events:
        return GenerationOutcome(request, spec, Outcome.UNEXPECTED, detail="no event at all")
    problem = _order_problem(events)
    if problem is not None:
        return GenerationOutcome(request, spec, Outcome.UNEXPECTED, detail=problem)
    last = events[-1]
    if isinstance(last, Failed):
        failed = _error_outcome(request, spec, last.error)
        if failed.outcome is Outcome.UNAVAILABLE and isinstance(events[0], Queued):
            return replace(failed, outcome=Outcome.UNEXPECTED, detail=f"accepted, then failed: {last.error}")
        return failed
    assert isinstance(last, Completed)
    tokens = tuple(t for e in events if isinstance(e, Chunk) for t in e.token_ids)
    generation = last.generation
    if generation.completion_tokens != len(tokens):
        return GenerationOutcome(
            request,
            spec,
            Outcome.UNEXPECTED,
            detail=f"completed says {generation.completion_tokens} tokens, chunks carried {len(tokens)}",
        )
    if generation.finish_reason is FinishReason.CANCELLED:
        if spec.cancel_after_chunks is None:
            return GenerationOutcome(request, spec, Outcome.UNEXPECTED, detail="cancelled without a cancel")
        return GenerationOutcome(request, spec, Outcome.CANCELLED)
    return GenerationOutcome(
        request,
        spec,
        Outcome.COMPLETED,
        token_ids=tokens if keep else (),
        time_to_first_token=generation.timing.time_to_first_token,
    )


async def _run_stream(client: AsyncClient, request: LoadRequest, *, keep: bool) -> list[GenerationOutcome]:
    events: dict[str, list[StreamEvent]] = {g.request_id: [] for g in request.generations}
    to_cancel = {
        g.request_id: g.cancel_after_chunks for g in request.generations if g.cancel_after_chunks is not None
    }
    call_error: TokenwireError | None = None
    async with client.open_stream(deadline=request.call_deadline) as stream:
        try:
            for spec in request.generations:
                await stream.submit(spec.request_id, spec.prompt, spec.options)
            if not to_cancel:
                await stream.close_requests()
            async for event in stream.events():
                seen = events[event.request_id]
                seen.append(event)
                after = to_cancel.get(event.request_id)
                if after is None:
                    continue
                chunks = sum(isinstance(e, Chunk) for e in seen)
                due = isinstance(event, Queued | Chunk) and chunks >= after
                if due or isinstance(event, Completed | Failed):
                    del to_cancel[event.request_id]
                    if due:
                        await stream.cancel(event.request_id)
                    if not to_cancel:
                        await stream.close_requests()
        except TokenwireError as error:
            call_error = error
    outcomes = []
    for spec in request.generations:
        seen = events[spec.request_id]
        if call_error is not None and not (seen and isinstance(seen[-1], Completed | Failed)):
            outcomes.append(_error_outcome(request, spec, call_error))
        else:
            outcomes.append(_stream_outcome(request, spec, seen, keep=keep))
    return outcomes


async def run_request(
    client: AsyncClient, request: LoadRequest, *, hang_timeout: float, keep_tokens: bool = True
) -> list[GenerationOutcome]:
    """Run one request of the mix; every generation in it gets exactly one outcome."""
    run = _run_unary if request.api == "unary" else _run_stream
    try:
        return await asyncio.wait_for(run(client, request, keep=keep_tokens), hang_timeout)
    except TimeoutError:
        return [
            GenerationOutcome(request, spec, Outcome.HUNG, detail=f"no end within {hang_timeout}s")
            for spec in request.generations
        ]


# -- running the mix -------------------------------------------------------------------------------


@dataclass
class LoadRun:
    outcomes: list[GenerationOutcome] = field(default_factory=list)
    requests: int = 0

    def count(self, outcome: Outcome) -> int:
        return sum(o.outcome is outcome for o in self.outcomes)

    def by_outcome(self) -> dict[str, int]:
        return {kind.value: self.count(kind) for kind in Outcome}

    def problems(self) -> list[str]:
        return [
            f"{o.spec.request_id} ({o.request.api}): {o.outcome.value} {o.detail}"
            for o in self.outcomes
            if o.outcome in (Outcome.HUNG, Outcome.UNEXPECTED)
        ]


async def run_load(
    target: str,
    requests: Iterable[LoadRequest],
    *,
    concurrency: int,
    hang_timeout: float = 60.0,
    stop_at: float | None = None,
    channels: int = 4,
    backoff_cap: float = 1.0,
    keep_tokens: bool = True,
    on_outcome: Callable[[GenerationOutcome], None] | None = None,
) -> LoadRun:
    """Closed-loop load: `concurrency` callers share the requests until they run out or `stop_at`.

    A caller that is refused with RESOURCE_EXHAUSTED waits the server's RetryInfo delay (at most
    `backoff_cap` seconds) before its next request, as a well-behaved client does; the refused
    request is recorded, not retried, so every request has exactly one outcome.
    """
    run = LoadRun()
    source = iter(requests)
    clients = [AsyncClient(target, retries=False) for _ in range(channels)]

    async def caller(number: int) -> None:
        client = clients[number % len(clients)]
        while stop_at is None or time.monotonic() < stop_at:
            request = next(source, None)
            if request is None:
                return
            run.requests += 1
            outcomes = await run_request(client, request, hang_timeout=hang_timeout, keep_tokens=keep_tokens)
            run.outcomes.extend(outcomes)
            if on_outcome is not None:
                for outcome in outcomes:
                    on_outcome(outcome)
            delays = [o.retry_after for o in outcomes if o.retry_after is not None]
            if delays:
                await asyncio.sleep(min(max(delays), backoff_cap))

    try:
        await asyncio.gather(*(caller(n) for n in range(concurrency)))
    finally:
        await asyncio.gather(*(client.close() for client in clients))
    return run


async def rerun_through_the_other_api(client: AsyncClient, outcome: GenerationOutcome) -> tuple[int, ...]:
    """The tokens of the same seeded generation, asked alone through the other method.

    A generation that completed under load as a stream is asked again with unary Generate and
    vice versa; per-request deadlines are dropped, since only the tokens are compared. The rerun is
    a new request, so it takes a new id, for the logs to tell the two apart.
    """
    spec = outcome.spec
    options = replace(spec.options, timeout=None)
    if outcome.request.api != "unary":
        generation = await client.generate(spec.prompt, options)
        return generation.token_ids
    tokens: list[int] = []
    async for event in client.stream(spec.prompt, options, request_id=f"{spec.request_id}-rerun"):
        if isinstance(event, Chunk):
            tokens.extend(event.token_ids)
        elif isinstance(event, Failed):
            raise event.error
    return tuple(tokens)


async def bounded_gather(limit: int, jobs: Iterable[Callable[[], Awaitable[object]]]) -> list[object]:
    """Run the jobs with at most `limit` in flight; results in order."""
    semaphore = asyncio.Semaphore(limit)

    async def one(job: Callable[[], Awaitable[object]]) -> object:
        async with semaphore:
            return await job()

    return list(await asyncio.gather(*(one(job) for job in jobs)))
