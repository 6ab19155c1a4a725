"""Soak: the load mix against a real server process for a chosen time, watched over time.

    python -m tests.reliability.soak                      # 10 minutes, tiny model (Optimum layout)
    python -m tests.reliability.soak --duration 180 --layout genai --json soak.json

It starts a server process on 127.0.0.1 (tests/reliability/server_process.py) with the project's
tiny model, warms it up, then runs the mix of tests/reliability/workload.py from far more callers
than the server has slots and queue places, with a share of stream generations cancelled at
random points, until the duration has passed. Every `--sample-every` seconds it records the
server's RSS and open file descriptors. At the end it waits for the server to settle and reports
generations by outcome, hung streams, p50/p99 time to first token (server-measured, completed
generations), RSS and descriptors over time, memory drift (RSS at the end minus RSS after the
warm-up) and the engine's counters (orphaned decode steps, worst abort latency in steps). The
server's prefix cache has a small bound that the load fills early (see server_process.py), so
the drift is not the cache filling; the cache must stay within that bound.
Exit status 0 when every guarantee held, 1 otherwise. tests/reliability/test_soak.py runs a short
version in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tests.reliability.server_process import PREFIX_CACHE_MB, ServerProcess
from tests.reliability.workload import GenerationOutcome, Outcome, build_mix, endless_mix, run_load
from tokenwire.server.model_tools.tiny_gpt import TinyGptConfig, create_tiny_gpt
from tokenwire.server.model_tools.tiny_llama import create_tiny_llama

MIB = 1024 * 1024
DEFAULT_RSS_DRIFT_LIMIT_MIB = 32.0


@dataclass(frozen=True)
class Sample:
    seconds: float
    rss_mib: float
    open_fds: int
    generations: int


@dataclass
class SoakReport:
    layout: str
    duration_seconds: float
    concurrency: int
    max_batch_size: int
    max_queue_size: int
    requests: int = 0
    generations_by_outcome: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    rss_baseline_mib: float = 0.0
    rss_final_mib: float = 0.0
    rss_max_mib: float = 0.0
    fds_baseline: int = 0
    fds_final: int = 0
    fds_max: int = 0
    samples: list[Sample] = field(default_factory=list)
    engine: dict[str, int | str] = field(default_factory=dict)
    rss_drift_limit_mib: float = DEFAULT_RSS_DRIFT_LIMIT_MIB

    @property
    def hung(self) -> int:
        return self.generations_by_outcome.get(Outcome.HUNG.value, 0)

    @property
    def rss_drift_mib(self) -> float:
        return self.rss_final_mib - self.rss_baseline_mib

    def failures(self) -> list[str]:
        """Every broken guarantee, in words; empty when the soak passed."""
        found = list(self.problems[:20])
        if self.hung:
            found.append(f"{self.hung} generations hung")
        unexpected = self.generations_by_outcome.get(Outcome.UNEXPECTED.value, 0)
        if unexpected:
            found.append(f"{unexpected} generations ended unexpectedly")
        if self.engine.get("orphaned_steps", 0) != 0:
            found.append(f"{self.engine['orphaned_steps']} orphaned decode steps")
        if int(self.engine.get("max_abort_latency_steps", 0)) > 1:
            found.append(f"an abort took {self.engine['max_abort_latency_steps']} decode steps to land")
        if self.engine.get("live", 0) or self.engine.get("queued", 0):
            found.append(f"server did not settle: {self.engine}")
        if self.engine.get("phase") != "serving":
            found.append(f"server phase {self.engine.get('phase')} after the soak")
        cached = int(self.engine.get("prefix_cache_bytes", 0))
        capacity = int(self.engine.get("prefix_cache_capacity_bytes", 0))
        if cached > capacity:
            found.append(f"the prefix cache held {cached} bytes, over its {capacity}")
        if self.rss_drift_mib > self.rss_drift_limit_mib:
            found.append(f"RSS grew {self.rss_drift_mib:.1f} MiB (limit {self.rss_drift_limit_mib} MiB)")
        if self.fds_final > self.fds_baseline + 2:
            found.append(f"open descriptors {self.fds_baseline} -> {self.fds_final}")
        if not self.generations_by_outcome.get(Outcome.COMPLETED.value):
            found.append("nothing completed")
        return found

    def render(self) -> str:
        lines = [
            f"soak: {self.duration_seconds:.0f} s, {self.concurrency} callers, tiny model ({self.layout}), "
            f"{self.max_batch_size} slots + {self.max_queue_size} queue places",
            f"requests: {self.requests}; generations by outcome:",
            *(f"  {name:<20} {count}" for name, count in self.generations_by_outcome.items()),
            f"hung streams: {self.hung}",
            f"TTFT (server-measured, completed): p50 {_ms(self.ttft_p50_ms)}, p99 {_ms(self.ttft_p99_ms)}",
            f"RSS: {self.rss_baseline_mib:.1f} MiB after warm-up, {self.rss_final_mib:.1f} MiB at the end "
            f"(drift {self.rss_drift_mib:+.1f} MiB), {self.rss_max_mib:.1f} MiB at most",
            f"open descriptors: {self.fds_baseline} after warm-up, {self.fds_final} at the end, "
            f"{self.fds_max} at most",
            "engine: " + ", ".join(f"{k}={v}" for k, v in self.engine.items()),
            "over time:   seconds   RSS MiB   fds   generations",
            *(
                f"          {s.seconds:9.0f} {s.rss_mib:9.1f} {s.open_fds:5d}   {s.generations}"
                for s in self.samples
            ),
        ]
        failures = self.failures()
        lines.append("result: PASS" if not failures else "result: FAIL\n  " + "\n  ".join(failures))
        return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds:.1f} ms"


def percentile(values: Sequence[float], fraction: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def make_model(layout: str, directory: Path) -> Path:
    if layout == "optimum":
        return create_tiny_gpt(directory / "tiny-gpt", TinyGptConfig())
    return create_tiny_llama(directory / "tiny-llama")


async def run_soak(
    model_dir: Path,
    work_dir: Path,
    *,
    layout: str,
    duration: float,
    concurrency: int = 40,
    sample_every: float = 10.0,
    cancel_fraction: float = 0.1,
    max_batch_size: int = 4,
    max_queue_size: int = 8,
    prefix_cache_mb: int = PREFIX_CACHE_MB,
    seed: int = 11,
    rss_drift_limit_mib: float = DEFAULT_RSS_DRIFT_LIMIT_MIB,
    progress: bool = False,
) -> SoakReport:
    report = SoakReport(
        layout, duration, concurrency, max_batch_size, max_queue_size, rss_drift_limit_mib=rss_drift_limit_mib
    )
    process = await asyncio.to_thread(
        ServerProcess.start,
        model_dir,
        work_dir / "soak-server.log",
        max_batch_size=max_batch_size,
        max_queue_size=max_queue_size,
        prefix_cache_mb=prefix_cache_mb,
    )
    try:
        await run_load(process.target, build_mix(80, seed=seed + 1), concurrency=concurrency)
        await process.settled_stats(timeout=60.0)
        report.rss_baseline_mib = process.rss_bytes() / MIB
        report.fds_baseline = process.open_fds()
        counts = dict.fromkeys((o.value for o in Outcome), 0)
        ttfts: list[float] = []

        def record(outcome: GenerationOutcome) -> None:
            counts[outcome.outcome.value] += 1
            if outcome.outcome is Outcome.COMPLETED and outcome.time_to_first_token is not None:
                ttfts.append(outcome.time_to_first_token)

        started = time.monotonic()

        async def sample() -> None:
            while True:
                await asyncio.sleep(sample_every)
                point = Sample(
                    seconds=time.monotonic() - started,
                    rss_mib=process.rss_bytes() / MIB,
                    open_fds=process.open_fds(),
                    generations=sum(counts.values()),
                )
                report.samples.append(point)
                if progress:
                    rss, fds = f"RSS {point.rss_mib:6.1f} MiB", f"fds {point.open_fds}"
                    print(f"  {point.seconds:6.0f} s  {rss}  {fds}  {counts}", flush=True)

        sampler = asyncio.create_task(sample())
        try:
            run = await run_load(
                process.target,
                endless_mix(seed, cancel_fraction=cancel_fraction),
                concurrency=concurrency,
                stop_at=started + duration,
                keep_tokens=False,
                on_outcome=record,
                hang_timeout=60.0,
            )
        finally:
            sampler.cancel()
        stats = await process.settled_stats(timeout=60.0)
        report.rss_final_mib = process.rss_bytes() / MIB
        report.fds_final = process.open_fds()
        report.requests = run.requests
        report.generations_by_outcome = counts
        report.problems = run.problems()
        report.ttft_p50_ms = _scaled(percentile(ttfts, 0.50))
        report.ttft_p99_ms = _scaled(percentile(ttfts, 0.99))
        report.rss_max_mib = max([report.rss_final_mib, *(s.rss_mib for s in report.samples)])
        report.fds_max = max([report.fds_final, *(s.open_fds for s in report.samples)])
        report.engine = {k: v for k, v in asdict(stats).items()}
        if not process.alive():
            report.problems.append("the server process died")
    finally:
        await asyncio.to_thread(process.close)
    return report


def _scaled(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.reliability.soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    parser.add_argument("--layout", choices=("optimum", "genai"), default="optimum", help="tiny model layout")
    parser.add_argument("--concurrency", type=int, default=40, help="closed-loop callers (default 40)")
    parser.add_argument(
        "--sample-every", type=float, default=10.0, help="seconds between samples (default 10)"
    )
    parser.add_argument(
        "--cancel-fraction", type=float, default=0.1, help="share of stream generations cancelled"
    )
    parser.add_argument("--max-batch-size", type=int, default=4)
    parser.add_argument("--max-queue-size", type=int, default=8)
    parser.add_argument(
        "--prefix-cache-mb",
        type=int,
        default=PREFIX_CACHE_MB,
        help=f"the server's prefix cache bound (default {PREFIX_CACHE_MB}; 0 turns it off)",
    )
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--rss-drift-limit-mib", type=float, default=DEFAULT_RSS_DRIFT_LIMIT_MIB)
    parser.add_argument("--json", type=Path, help="also write the report here as JSON")
    args = parser.parse_args(argv)

    async def soak(work_dir: Path) -> SoakReport:
        return await run_soak(
            make_model(args.layout, work_dir),
            work_dir,
            layout=args.layout,
            duration=args.duration,
            concurrency=args.concurrency,
            sample_every=args.sample_every,
            cancel_fraction=args.cancel_fraction,
            max_batch_size=args.max_batch_size,
            max_queue_size=args.max_queue_size,
            prefix_cache_mb=args.prefix_cache_mb,
            seed=args.seed,
            rss_drift_limit_mib=args.rss_drift_limit_mib,
            progress=True,
        )

    with tempfile.TemporaryDirectory(prefix="tokenwire-soak-") as work:
        report = asyncio.run(soak(Path(work)))
    print(report.render())
    if args.json is not None:
        document = {**asdict(report), "hung": report.hung, "rss_drift_mib": report.rss_drift_mib}
        document["failures"] = report.failures()
        args.json.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    return 0 if not report.failures() else 1


if __name__ == "__main__":
    sys.exit(main())
