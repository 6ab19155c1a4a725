"""A rolling update and a crash under load: three `tokenwire serve` processes, one fleet client.

Replicas r1, r2 and r3 listen on 127.0.0.1, 127.0.0.2 and 127.0.0.3 and serve the tiny model
under their own names, so each completed generation names its replica. Workers keep streamed and
unary generations going through one client (weighted round robin, health checks, retries) while
r1 gets SIGTERM (a rolling update: it drains and exits 0) and then r2 gets SIGKILL (a crash).

Every request must end in exactly one defined outcome: completed, or failed with UNAVAILABLE
because it was a generation streaming on r2 when r2 died. Requests r1 refused while draining are
sent again by the client and complete, so the caller never sees them; a generation that was
already admitted is never sent again. Nothing hangs: every request has a deadline, and the
run as a whole a bound.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import grpc

from tests.support.events import Transcript, read_until
from tests.support.options import greedy
from tests.support.serve_process import ServeProcess, start_serve
from tokenwire.client import (
    AsyncClient,
    Chunk,
    Completed,
    Failed,
    Queued,
    Routing,
    Started,
    TokenwireError,
)

STREAM_WORKERS = 6
UNARY_WORKERS = 2
OPTIONS = greedy(24)
REQUEST_DEADLINE = 60.0
"""Seconds: far beyond any generation here, so a request that reaches it has hung."""
COMPLETIONS_PER_PHASE = 30
LONG_GENERATIONS = 8
LONG_TOKENS = 200
PHASE_BOUND = 120.0
"""Seconds a phase may take before the test calls it stuck."""


@dataclass(frozen=True)
class Outcome:
    shape: str
    """stream or unary."""
    model: str | None
    """The replica that completed it; None when it failed."""
    code: grpc.StatusCode | None = None
    admitted: bool = False
    """A queued, started or token event arrived before the failure."""
    ended: float = 0.0


class Load:
    """Workers sending generations back to back until stopped, through each client in turn;
    every request's outcome kept."""

    def __init__(self, clients: list[AsyncClient]) -> None:
        self._stopping = asyncio.Event()
        self._changed = asyncio.Condition()
        self.outcomes: list[Outcome] = []
        self._clients = list(clients)
        self._workers = [
            asyncio.create_task(self._loop(self._streamed, i % len(clients))) for i in range(STREAM_WORKERS)
        ]
        self._workers += [
            asyncio.create_task(self._loop(self._unary, i % len(clients))) for i in range(UNARY_WORKERS)
        ]

    def send_through(self, instead: AsyncClient, of: AsyncClient) -> None:
        """From the next request on, the workers that used `of` use `instead`."""
        self._clients = [instead if client is of else client for client in self._clients]

    def completed(self, model: str | None = None, *, since: float = 0.0) -> int:
        return sum(
            1
            for o in self.outcomes
            if o.model is not None and (model is None or o.model == model) and o.ended >= since
        )

    async def until_completed(self, count: int, *, since: float = 0.0, model: str | None = None) -> None:
        async with self._changed:
            await asyncio.wait_for(
                self._changed.wait_for(lambda: self.completed(model, since=since) >= count), PHASE_BOUND
            )

    async def stop(self) -> None:
        self._stopping.set()
        await asyncio.wait_for(asyncio.gather(*self._workers), PHASE_BOUND)

    async def _loop(self, send, slot: int) -> None:  # type: ignore[no-untyped-def]
        while not self._stopping.is_set():
            outcome = await send(self._clients[slot])
            async with self._changed:
                self.outcomes.append(outcome)
                self._changed.notify_all()

    async def _streamed(self, client: AsyncClient) -> Outcome:
        admitted = False
        try:
            async for event in client.stream("Roll", OPTIONS, deadline=REQUEST_DEADLINE):
                if isinstance(event, Queued | Started | Chunk):
                    admitted = True
                elif isinstance(event, Completed):
                    return Outcome("stream", event.generation.model, ended=time.monotonic())
                elif isinstance(event, Failed):
                    code = event.error.code if isinstance(event.error, TokenwireError) else None
                    return Outcome("stream", None, code, admitted, time.monotonic())
        except TokenwireError as error:
            return Outcome("stream", None, error.code, admitted, time.monotonic())
        raise AssertionError("a stream ended without a last event")

    async def _unary(self, client: AsyncClient) -> Outcome:
        try:
            result = await client.generate("Roll", OPTIONS, deadline=REQUEST_DEADLINE)
        except TokenwireError as error:
            return Outcome("unary", None, error.code, False, time.monotonic())
        return Outcome("unary", result.model, ended=time.monotonic())


def refusals_while_draining(log: Path) -> int:
    """Requests the replica refused with UNAVAILABLE, reason DRAINING (its JSON access log)."""
    count = 0
    for line in log.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("reason") == "DRAINING":
            count += 1
    return count


async def test_a_rolling_update_and_a_crash_lose_only_the_crashed_replicas_streams(
    tiny_model_dir: Path, serve_processes: list[ServeProcess], tmp_path: Path
) -> None:
    logs = [tmp_path / f"r{index}.log" for index in (1, 2, 3)]
    for index, log in enumerate(logs, start=1):
        serve_processes.append(
            await asyncio.to_thread(
                start_serve,
                "--host",
                f"127.0.0.{index}",
                "--model",
                f"r{index}={tiny_model_dir}",
                "--max-batch-size",
                "4",
                "--max-queue-size",
                "32",
                "--drain-timeout",
                "30",
                "--no-metrics",
                "--log-format",
                "json",
                log=log,
            )
        )
    r1, r2, r3 = serve_processes
    target = "ipv4:" + ",".join(f"127.0.0.{i}:{p.port}" for i, p in enumerate(serve_processes, start=1))
    # Half the work goes through a client that watches health, as a fleet client should; the
    # other half through one that does not, standing for any client whose view of health lags,
    # so the draining replica is sure to refuse some requests, which must be sent again unseen.
    async with (
        AsyncClient(target, routing=Routing(blackout_period=0.5)) as watching,
        AsyncClient(target, routing=Routing(blackout_period=0.5, health_checks=False)) as lagging,
        AsyncClient(f"127.0.0.1:{r1.port}") as direct_to_r1,
        AsyncClient(f"127.0.0.2:{r2.port}") as direct_to_r2,
    ):
        load = Load([watching, lagging])
        for name in ("r1", "r2", "r3"):  # every replica is in the rotation before anything stops
            await load.until_completed(1, model=name)
        await load.until_completed(COMPLETIONS_PER_PHASE)

        # Two waves of long generations (r1 runs 4 at a time) keep r1 draining for a while: the
        # drain must let every one of them finish, the queued wave included.
        long_stream = direct_to_r1.open_stream(deadline=REQUEST_DEADLINE)
        for index in range(LONG_GENERATIONS):
            await long_stream.submit(f"long{index}", "Long", greedy(LONG_TOKENS))
        await long_stream.close_requests()
        long_transcript = Transcript()
        long_events = long_stream.events()
        # Every one admitted (queued) before the signal: one submitted but not yet read by r1
        # would be refused as DRAINING, which on a long-lived stream is the caller's to resend.
        await read_until(
            long_events,
            long_transcript,
            lambda t: bool(t.tokens("long0")) and all(t.events[f"long{i}"] for i in range(LONG_GENERATIONS)),
        )
        r1.process.send_signal(signal.SIGTERM)  # a rolling update: drain, then exit
        # The lagging client's view of health catches up once r1 has refused it while draining,
        # and before r1's drain can end (a long generation is still running). A client that never
        # learns would keep sending until r1's gRPC server stops, and a call that reaches r1 as
        # it stops is cancelled by gRPC itself (CANCELLED) before tokenwire ever sees it, which no
        # server can turn into a retryable refusal: only a client that leaves a NOT_SERVING
        # replica is sure never to meet that moment.
        lagging_caught_up = False
        async for event in long_events:
            long_transcript.add(event)
            if not lagging_caught_up and refusals_while_draining(logs[0]) >= 1:
                load.send_through(watching, of=lagging)
                lagging_caught_up = True
        long_completed = [
            len(long_transcript.tokens(f"long{i}"))
            for i in range(LONG_GENERATIONS)
            if isinstance(long_transcript.final(f"long{i}"), Completed)
        ]
        r1_exit = await asyncio.wait_for(asyncio.to_thread(r1.process.wait), PHASE_BOUND)
        drained = time.monotonic()
        await load.until_completed(COMPLETIONS_PER_PHASE, since=drained)

        # A generation known to be streaming on r2 when it crashes, besides whatever the load
        # has there at that moment.
        doomed = direct_to_r2.stream("Doomed", greedy(LONG_TOKENS), deadline=REQUEST_DEADLINE)
        doomed_transcript = Transcript()
        await read_until(doomed, doomed_transcript, lambda t: any(t.tokens(r) for r in list(t.events)))
        r2.process.kill()  # a crash: streams on it break mid-generation
        killed = time.monotonic()
        # The broken call is the generation's last event (stream runs on GenerateStream).
        await read_until(doomed, doomed_transcript, lambda t: any(t.finished(r) for r in list(t.events)))
        (doomed_events,) = doomed_transcript.events.values()
        doomed_end = doomed_events[-1]
        assert isinstance(doomed_end, Failed) and isinstance(doomed_end.error, TokenwireError)
        await asyncio.to_thread(r2.process.wait)
        await load.until_completed(COMPLETIONS_PER_PHASE, since=killed)
        await load.stop()

    outcomes = load.outcomes
    completed = [o for o in outcomes if o.model is not None]
    failed = [o for o in outcomes if o.model is None]
    by_replica = Counter(o.model for o in completed)
    by_shape = Counter(
        (o.shape, "completed" if o.model else o.code.name if o.code else "?") for o in outcomes
    )
    print(
        f"\nrollout: {len(outcomes)} requests: {len(completed)} completed "
        f"(r1 {by_replica['r1']}, r2 {by_replica['r2']}, r3 {by_replica['r3']}), "
        f"{len(failed)} failed with UNAVAILABLE (streaming on the killed r2; so did the one generation "
        f"sent straight to r2 before the kill); "
        f"by shape: {dict(sorted(by_shape.items()))}; "
        f"r1 refused {refusals_while_draining(logs[0])} while draining (sent again, completed elsewhere, "
        f"unseen by the caller)"
    )
    assert r1_exit == 0, f"r1 exited with {r1_exit} after SIGTERM"
    assert long_completed == [LONG_TOKENS] * LONG_GENERATIONS
    assert lagging_caught_up, "the lagging client should have met the drain while long generations ran"
    assert refusals_while_draining(logs[0]) >= 1
    assert "drain timeout passed" not in logs[0].read_text(encoding="utf-8")
    # Exactly one defined outcome each: completed, or a stream that was live on r2 as it died.
    unexpected = [
        o
        for o in failed
        if not (
            o.shape == "stream" and o.code == grpc.StatusCode.UNAVAILABLE and o.admitted and o.ended >= killed
        )
    ]
    assert unexpected == [], unexpected
    assert doomed_end.error.code == grpc.StatusCode.UNAVAILABLE
    assert len(failed) <= STREAM_WORKERS
    r3.process.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(asyncio.to_thread(r3.process.wait), PHASE_BOUND) == 0
