"""What stalls a round: the steady-streams workload with the server's rounds, garbage collections
and event-loop lag recorded, and every long gap a client saw matched against them.

The server runs in a child process of this script (`--serve`), built as `tokenwire serve` builds
it (the default model, `--max-batch-size 16`, two ONNX Runtime threads, the prefix cache off, as
in benchmarks/stall_free.py), with three recorders on one clock (CLOCK_MONOTONIC, which every
process on the machine shares):

- the engine's observer: when each prompt chunk and decode step ran and how long it took, and
  when each round ended (its `occupancy` call): a round's wall time, and how much of it the model
  calls account for;
- `gc.callbacks`: every collection, its generation, the thread it ran on and how long it took;
- a task on the event loop that wakes every 2 ms and records how late it woke.

This process streams the closed loop of benchmarks/stall_free.py (N streams of 100-token
prompts, 128 new tokens each, greedy) and records the arrival time of every chunk, with its own
event loop's lag and the machine's CPU use by every process (/proc/stat, and the two processes'
own CPU time from /proc/PID/stat), sampled every 100 ms. Each inter-token gap over
`--long-gap-factor` times the median is then explained by what overlapped it on the server:
a long round (model calls or not), a collection, a late event loop, or nothing there, in which
case the gap is the client's or the machine's.

    python benchmarks/round_stalls.py --streams 8,16 --duration 30 [--name round_stalls]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import benchkit

HERE = Path(__file__).resolve().parent
LOOP_TICK = 0.002
SAMPLE_EVERY = 0.1


# -- the child: an instrumented server ---------------------------------------------------------------


class Timeline:
    """Events on the shared monotonic clock, appended from any thread (list.append is atomic)."""

    def __init__(self) -> None:
        self.rounds: list[tuple[float, int, int]] = []
        """(end, running, queued)."""
        self.calls: list[tuple[float, float, str, int]] = []
        """(end, seconds, "decode" or "prefill", batch size or tokens)."""
        self.collections: list[tuple[float, float, int, str]] = []
        """(end, seconds, generation, thread)."""
        self.loop_lag: list[tuple[float, float]] = []
        """(when the loop woke, how late), for wake-ups later than 5 ms."""
        self._gc_started: dict[int, float] = {}

    def on_gc(self, phase: str, info: dict[str, Any]) -> None:
        thread = threading.get_ident()
        now = time.monotonic()
        if phase == "start":
            self._gc_started[thread] = now
        elif thread in self._gc_started:
            began = self._gc_started.pop(thread)
            self.collections.append(
                (now, now - began, int(info["generation"]), threading.current_thread().name)
            )


class Observer:
    """The engine's observer hooks, recording into a Timeline (called on the engine thread)."""

    def __init__(self, timeline: Timeline) -> None:
        self._timeline = timeline

    def request_finished(self, **_: Any) -> None:
        return None

    def decode_step(self, *, model: str, batch_size: int, seconds: float) -> None:
        self._timeline.calls.append((time.monotonic(), seconds, "decode", batch_size))

    def prefill_chunk(self, *, model: str, tokens: int, seconds: float) -> None:
        self._timeline.calls.append((time.monotonic(), seconds, "prefill", tokens))

    def drafts_verified(self, **_: Any) -> None:
        return None

    def preempted(self, **_: Any) -> None:
        return None

    def occupancy(self, *, model: str, queued: int, running: int, **_: Any) -> None:
        self._timeline.rounds.append((time.monotonic(), running, queued))


async def watch_loop(lag: list[tuple[float, float]], stopping: asyncio.Event) -> None:
    """Wake every LOOP_TICK; record (when, how late) each wake-up more than 5 ms late."""
    while not stopping.is_set():
        asked = time.monotonic()
        await asyncio.sleep(LOOP_TICK)
        late = time.monotonic() - asked - LOOP_TICK
        if late > 0.005:
            lag.append((time.monotonic(), late))


async def serve(model: Path, slots: int, out: Path) -> None:
    from tokenwire.server.app import TokenwireServer
    from tokenwire.server.config import ModelSource, ServerSettings
    from tokenwire.server.engine.config import EngineConfig
    from tokenwire.server.telemetry.settings import TelemetrySettings

    timeline = Timeline()
    settings = ServerSettings(
        models=(ModelSource(model, "default"),),
        host=benchkit.LOOPBACK,
        port=0,
        engine=EngineConfig(max_batch_size=slots, max_queue_size=256, prefix_cache_mb=0),
        device="cpu",
        intra_op_threads=benchkit.THREADS,
        telemetry=TelemetrySettings(metrics_port=None),
    )
    server = TokenwireServer(settings, observer=Observer(timeline))  # type: ignore[arg-type]
    await server.start()
    await server.load()
    gc.callbacks.append(timeline.on_gc)
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()

    watcher = asyncio.create_task(watch_loop(timeline.loop_lag, stopping))
    print(json.dumps({"port": server.port}), flush=True)
    await loop.run_in_executor(None, sys.stdin.read)  # until the parent closes our stdin
    stopping.set()
    await watcher
    gc.callbacks.remove(timeline.on_gc)
    await server.stop(grace=0)
    out.write_text(  # noqa: ASYNC240 - once, after the server stopped
        json.dumps(
            {
                "rounds": timeline.rounds,
                "calls": timeline.calls,
                "collections": timeline.collections,
                "loop_lag": timeline.loop_lag,
            }
        )
    )


# -- the parent: the workload, the machine, the matching ----------------------------------------------


def machine_cpu_seconds() -> tuple[float, float]:
    """(busy, stolen) CPU seconds of the whole machine so far: busy is user, nice, system, irq
    and softirq time (guest time is inside user); stolen is time the hypervisor gave our virtual
    CPUs' turn to something else."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = values[:8]
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / tick, steal / tick


class MachineSampler:
    """Every SAMPLE_EVERY seconds: the CPU the machine spent, and how much of it was ours."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.samples: list[tuple[float, float, float, float]] = []
        """(when, cores busy in all, cores busy in the server and this client, cores stolen)."""
        self._pids = pids
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _read(self) -> tuple[float, float, float, float]:
        busy, stolen = machine_cpu_seconds()
        return time.monotonic(), busy, sum(benchkit.cpu_seconds(p) for p in self._pids), stolen

    def _run(self) -> None:
        last = self._read()
        while not self._done.wait(SAMPLE_EVERY):
            now = self._read()
            span = now[0] - last[0]
            self.samples.append(
                (now[0], (now[1] - last[1]) / span, (now[2] - last[2]) / span, (now[3] - last[3]) / span)
            )
            last = now

    def __enter__(self) -> MachineSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._done.set()
        self._thread.join()


async def stream_all(
    target: str, streams: int, duration: float, prompt: list[int]
) -> tuple[list[list[float]], list[tuple[float, float]]]:
    """Closed loop: `streams` callers, each streaming one generation after another for
    `duration` seconds. (chunk arrival times per generation, this loop's own lag)."""
    from tokenwire.client import AsyncClient, Chunk, GenerateOptions, Sampling, Stopping

    options = GenerateOptions(sampling=Sampling(temperature=0.0), stopping=Stopping(128, ignore_eos=True))
    arrivals: list[list[float]] = []
    lag: list[tuple[float, float]] = []
    end = time.monotonic() + duration
    stopping = asyncio.Event()

    async with AsyncClient(target, retries=False) as client:

        async def caller() -> None:
            while time.monotonic() < end:
                times: list[float] = []
                async for event in client.stream(prompt, options):
                    if isinstance(event, Chunk) and event.token_ids:
                        times.append(time.monotonic())
                arrivals.append(times)

        watcher = asyncio.create_task(watch_loop(lag, stopping))
        await asyncio.gather(*(caller() for _ in range(streams)))
        stopping.set()
        await watcher
    return arrivals, lag


def overlapping(
    intervals: Sequence[tuple[float, float]], start: float, end: float
) -> list[tuple[float, float]]:
    return [(a, b) for a, b in intervals if a < end and b > start]


def explain(
    gap: tuple[float, float],
    server: dict[str, Any],
    client_lag: list[tuple[float, float]],
    machine: MachineSampler,
) -> dict[str, Any]:
    """What overlapped one long gap (start, end)."""
    start, end = gap
    rounds = server["rounds"]
    ends = [r[0] for r in rounds]
    spans = list(itertools.pairwise(ends))
    longest = max(((b - a, a, b) for a, b in spans if a < end and b > start), default=(0.0, 0.0, 0.0))
    _, round_start, round_end = longest
    model = sum(seconds for when, seconds, _, _ in server["calls"] if round_start < when <= round_end)
    kinds = sorted({kind for when, _, kind, _ in server["calls"] if round_start < when <= round_end})
    collections = [c for c in server["collections"] if c[0] - c[1] < end and c[0] > start]
    loop = [lag for when, lag in server["loop_lag"] if when - lag < end and when > start]
    mine = [lag for when, lag in client_lag if when - lag < end and when > start]
    near = [s for s in machine.samples if start - SAMPLE_EVERY <= s[0] <= end + SAMPLE_EVERY]
    others = statistics.mean(max(0.0, total - ours) for _, total, ours, _ in near) if near else 0.0
    stolen = statistics.mean(steal for *_, steal in near) if near else 0.0
    return {
        "gap_ms": (end - start) * 1000,
        "longest_round_ms": (round_end - round_start) * 1000,
        "model_calls_ms": model * 1000,
        "round_kinds": kinds,
        "gc_ms": sum(c[1] for c in collections) * 1000,
        "gc": [(c[2], c[3], round(c[1] * 1000, 1)) for c in collections],
        "server_loop_late_ms": max(loop, default=0.0) * 1000,
        "client_loop_late_ms": max(mine, default=0.0) * 1000,
        "other_processes_cores": round(others, 2),
        "stolen_cores": round(stolen, 2),
    }


LOAD_BUCKETS = ((0.0, 0.1), (0.1, 0.5), (0.5, 1.0), (1.0, 99.0))
"""Cores other processes used, the buckets rounds are sorted into."""


def rounds_by_load(server: dict[str, Any], machine: MachineSampler) -> list[dict[str, Any]]:
    """Rounds sorted by how many cores other processes used while they ran: how long they took,
    and how much of that the model calls took. A stall the server makes shows in every bucket; one
    the machine makes, in the loaded ones only."""
    calls = server["calls"]
    ends = [r[0] for r in server["rounds"]]
    samples = machine.samples
    buckets: dict[tuple[float, float], list[tuple[float, float]]] = {b: [] for b in LOAD_BUCKETS}
    call_index = 0
    for begin, finish in itertools.pairwise(ends):
        model = 0.0
        while call_index < len(calls) and calls[call_index][0] <= finish:
            if calls[call_index][0] > begin:
                model += calls[call_index][1]
            call_index += 1
        covering = [
            max(0.0, total - ours)
            for when, total, ours, _ in samples
            if begin <= when <= finish + SAMPLE_EVERY
        ]
        if not covering:
            continue
        load = statistics.mean(covering)
        bucket = next(b for b in LOAD_BUCKETS if b[0] <= load < b[1])
        buckets[bucket].append((finish - begin, model))
    table = []
    for (low, high), rounds in buckets.items():
        if not rounds:
            continue
        lengths = sorted(r[0] for r in rounds)
        table.append(
            {
                "other_cores": f"{low:g}-{high:g}" if high < 99 else f">{low:g}",
                "rounds": len(rounds),
                "round_p50_ms": statistics.median(lengths) * 1000,
                "round_p99_ms": lengths[int(0.99 * (len(lengths) - 1))] * 1000,
                "round_max_ms": lengths[-1] * 1000,
                "model_share_of_time": sum(r[1] for r in rounds) / sum(r[0] for r in rounds),
                "rounds_over_500_ms": sum(1 for r in lengths if r > 0.5),
            }
        )
    return table


def run(
    streams: int, duration: float, long_factor: float, directory: Path, scratch: Path, hogs: int
) -> dict[str, Any]:
    out = scratch / f"server-{streams}.json"
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(directory), str(16), str(out)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdin is not None
    port = json.loads(child.stdout.readline())["port"]
    prompt = benchkit.prompt_ids(directory, benchkit.PROMPT_TOKENS)
    benchkit.wait_for_quiet()
    # Processes that only spin: a controlled share of the machine taken from the server.
    spinning = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
    try:
        with MachineSampler([child.pid, os.getpid()]) as machine:
            arrivals, client_lag = asyncio.run(
                stream_all(f"{benchkit.LOOPBACK}:{port}", streams, duration, prompt)
            )
    finally:
        for hog in spinning:
            hog.kill()
            hog.wait()
    child.stdin.close()
    child.wait(60)
    server = json.loads(out.read_text())
    gaps = [(a, b) for times in arrivals for a, b in itertools.pairwise(times)]
    lengths = sorted(b - a for a, b in gaps)
    p50 = statistics.median(lengths)
    p99 = lengths[int(0.99 * (len(lengths) - 1))]
    long_gaps = sorted((g for g in gaps if g[1] - g[0] > long_factor * p50), key=lambda g: g[0] - g[1])
    rounds = [r[0] for r in server["rounds"]]
    round_lengths = sorted(b - a for a, b in itertools.pairwise(rounds))
    explained = [explain(g, server, client_lag, machine) for g in long_gaps[:20]]
    by_load = rounds_by_load(server, machine)
    return {
        "streams": streams,
        "gaps": len(lengths),
        "itl_p50_ms": p50 * 1000,
        "itl_p99_ms": p99 * 1000,
        "itl_max_ms": lengths[-1] * 1000,
        "rounds": len(round_lengths),
        "round_p50_ms": statistics.median(round_lengths) * 1000,
        "round_p99_ms": round_lengths[int(0.99 * (len(round_lengths) - 1))] * 1000,
        "round_max_ms": round_lengths[-1] * 1000,
        "collections": len(server["collections"]),
        "gc_max_ms": max((c[1] for c in server["collections"]), default=0.0) * 1000,
        "gc_gen2": sum(1 for c in server["collections"] if c[2] == 2),
        "server_loop_late_max_ms": max((lag for _, lag in server["loop_lag"]), default=0.0) * 1000,
        "client_loop_late_max_ms": max((lag for _, lag in client_lag), default=0.0) * 1000,
        "other_processes_cores_mean": statistics.mean(max(0.0, t - o) for _, t, o, _ in machine.samples),
        "stolen_cores_mean": statistics.mean(st for *_, st in machine.samples),
        "hogs": hogs,
        "rounds_by_other_load": by_load,
        "long_gaps": len(long_gaps),
        "longest_gaps_explained": explained,
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        asyncio.run(serve(Path(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])))
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", default="8,16")
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--repetitions", type=int, default=1)
    parser.add_argument("--long-gap-factor", type=float, default=5.0)
    parser.add_argument("--name", default="round_stalls")
    parser.add_argument(
        "--hogs", default="0", help="comma-separated counts of spinning processes to run beside each run"
    )
    args = parser.parse_args()
    directory = benchkit.model_dir()
    scratch = Path(tempfile.mkdtemp(prefix="round-stalls-"))
    results = []
    for repetition in range(args.repetitions):
        pairs = [(int(n), int(h)) for n in args.streams.split(",") for h in args.hogs.split(",")]
        for streams, hogs in pairs:
            figures = run(streams, args.duration, args.long_gap_factor, directory, scratch, hogs)
            figures["repetition"] = repetition + 1
            results.append(figures)
            print(
                json.dumps(
                    {
                        k: v
                        for k, v in figures.items()
                        if k not in ("longest_gaps_explained", "rounds_by_other_load")
                    }
                ),
                flush=True,
            )
            for bucket in figures["rounds_by_other_load"]:
                print("  by load:", json.dumps(bucket), flush=True)
            for gap in figures["longest_gaps_explained"][:5]:
                print("   ", json.dumps(gap), flush=True)
    out = benchkit.save_results(args.name, {"machine": benchkit.machine_summary(), "runs": results})
    print(f"results: {out.relative_to(benchkit.REPO)}")


if __name__ == "__main__":
    main()
