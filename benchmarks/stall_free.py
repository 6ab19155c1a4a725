"""Stall-free prefill, before and after, on one machine in one run.

"Before" is another checkout of tokenwire with the same settings (`--baseline DIR`, served
through PYTHONPATH), or else this checkout with `--no-stall-free`; "after" is this checkout as it
ships. Prefix caching is off on the "after" servers (`--prefix-cache-mb 0`): the same seed sends
the same prompts every repetition, and hits would flatter the second one. Workloads, with
`tokenwire bench`'s own load generator:

- open loop: Poisson arrivals at 1 request/s, prompts uniform 50..400 tokens, 64..192 new tokens,
  seed 7, on 8-slot servers (the issue's line), and the same at 0.5 request/s (a load a 2-core
  machine sustains: at 1 request/s both sides' queues grow for the whole run);
- closed loop: 8 and 16 streams of 100-token prompts and 128 new tokens on 16-slot servers.

Each repetition runs every workload on both sides, the order alternating, each run starting once
the machine is quiet. Latency percentiles pool every request of the repetitions; throughput is the
median of the repetitions. `--sweep` adds "after" servers with fixed `--max-step-ms` targets for
every workload but the overloaded one, the knob's trade-off (`stall_free_knob.png`). `--name`
names the results files (default `stall_free`).

    python benchmarks/stall_free.py --baseline ../tokenwire-before [--repetitions 2] [--duration 40]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import benchkit

from tokenwire.client.bench import BenchConfig, LengthDistribution, LoadLevel, RequestRecord, run_bench
from tokenwire.client.bench.stats import percentile

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


@dataclass(frozen=True)
class Workload:
    name: str
    slots: int
    level: LoadLevel
    prompt: str
    new_tokens: str
    duration: float
    seed: int = 7
    swept: bool = True
    """Whether `--sweep` runs it (not where the queue grows whatever the knob says)."""


@dataclass
class Runs:
    records: list[RequestRecord] = field(default_factory=list)
    tok_per_s: list[float] = field(default_factory=list)

    def figures(self) -> dict[str, float]:
        ok = [r for r in self.records if r.outcome == "ok"]
        gaps = [g for r in ok for g in r.token_gaps]
        ttft = [r.first_token for r in ok if r.first_token is not None]

        def server(attribute: str) -> list[float]:
            values = [getattr(r, attribute) for r in ok]
            return [v for v in values if v is not None]

        def p(values: Sequence[float], q: float) -> float:
            return percentile(values, q) if values else float("nan")

        return {
            "requests": len(ok),
            "failed": len(self.records) - len(ok),
            "itl_p50": p(gaps, 50),
            "itl_p99": p(gaps, 99),
            "ttft_p50": p(ttft, 50),
            "ttft_p99": p(ttft, 99),
            "queued_p50": p(server("server_queued"), 50),
            "paced_p50": p(server("server_paced"), 50),
            "prefill_p50": p(server("server_prefill"), 50),
            "tok_per_s": statistics.median(self.tok_per_s) if self.tok_per_s else float("nan"),
        }


def bench_config(target: str, workload: Workload) -> BenchConfig:
    return BenchConfig(
        target=target,
        levels=(workload.level,),
        prompt_tokens=LengthDistribution.parse(workload.prompt),
        max_new_tokens=LengthDistribution.parse(workload.new_tokens),
        duration=workload.duration,
        warmup=2,
        seed=workload.seed,
    )


def run_once(target: str, workload: Workload, runs: Runs) -> None:
    report = asyncio.run(run_bench(bench_config(target, workload)))
    runs.records.extend(report.records[0])
    runs.tok_per_s.append(report.levels[0].output_tokens_per_second)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline", type=Path, help="checkout of the tokenwire version to compare against")
    parser.add_argument("--repetitions", type=int, default=2)
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of the open-loop workload")
    parser.add_argument("--closed-duration", type=float, default=30.0, help="seconds of each closed loop")
    parser.add_argument("--sweep", default="", help="comma-separated --max-step-ms values to sweep")
    parser.add_argument("--only", default="", help="comma-separated workload names to run (default all)")
    parser.add_argument("--name", default="stall_free", help="name of the results files")
    args = parser.parse_args()

    directory = benchkit.model_dir()
    workloads = [
        Workload(
            "1 req/s open loop",
            8,
            LoadLevel("rate", 1.0),
            "uniform:50:400",
            "uniform:64:192",
            args.duration,
            swept=False,
        ),
        Workload(
            "0.5 req/s open loop",
            8,
            LoadLevel("rate", 0.5),
            "uniform:50:400",
            "uniform:64:192",
            args.duration,
        ),
        Workload("8 streams", 16, LoadLevel("concurrency", 8), "100", "128", args.closed_duration),
        Workload("16 streams", 16, LoadLevel("concurrency", 16), "100", "128", args.closed_duration),
    ]
    if args.only:
        wanted = set(args.only.split(","))
        workloads = [w for w in workloads if w.name in wanted]
    after: dict[str, Any] = {"code": None, "extra": ("--prefix-cache-mb", "0")}
    if args.baseline is not None:
        # Another version of the code with the same settings: what changed is the code alone.
        before: dict[str, Any] = {"code": args.baseline.resolve(), "extra": after["extra"]}
        before_label = f"before ({args.baseline.name})"
    else:
        before = {"code": None, "extra": ("--no-stall-free", "--prefix-cache-mb", "0")}
        before_label = "before (--no-stall-free)"
    sides = {"before": before, "after": after}
    for value in [v for v in args.sweep.split(",") if v]:
        sides[f"max-step-ms {value}"] = {
            "code": None,
            "extra": ("--prefix-cache-mb", "0", "--max-step-ms", value),
        }

    runs: dict[tuple[str, str], Runs] = {(w.name, s): Runs() for w in workloads for s in sides}
    slot_counts = sorted({w.slots for w in workloads})
    servers: dict[tuple[str, int], benchkit.ServerProcess] = {}
    try:
        for side, spec in sides.items():
            for slots in slot_counts:
                server = benchkit.ServerProcess(
                    directory, max_batch_size=slots, code=spec["code"], extra=("--no-metrics", *spec["extra"])
                )
                servers[(side, slots)] = server.__enter__()
        for repetition in range(args.repetitions):
            for workload in workloads:
                order = [
                    s
                    for s in sides
                    if (s, workload.slots) in servers and (workload.swept or not s.startswith("max-step"))
                ]
                if repetition % 2:
                    order.reverse()
                for side in order:
                    benchkit.wait_for_quiet()
                    print(f"rep {repetition + 1}: {workload.name} on {side}", flush=True)
                    run_once(servers[(side, workload.slots)].target, workload, runs[(workload.name, side)])
    finally:
        for server in servers.values():
            server.__exit__()

    table: list[list[object]] = []
    data: dict[str, Any] = {"sides": {"before": before_label, "after": "after (stall-free, auto target)"}}
    for workload in workloads:
        for side in sides:
            if not runs[(workload.name, side)].records:
                continue
            f = runs[(workload.name, side)].figures()
            data.setdefault(workload.name, {})[side] = f
            label = {"before": before_label, "after": "after"}.get(side, side)
            table.append(
                [
                    workload.name,
                    label,
                    f["requests"],
                    f["itl_p50"] * 1000,
                    f["itl_p99"] * 1000,
                    f"{f['itl_p99'] / f['itl_p50']:.1f}x",
                    f["ttft_p50"] * 1000,
                    f["ttft_p99"] * 1000,
                    f["queued_p50"] * 1000,
                    f["paced_p50"] * 1000,
                    f["prefill_p50"] * 1000,
                    f["tok_per_s"],
                ]
            )
    columns = [
        "workload",
        "server",
        "requests",
        "ITL p50 ms",
        "ITL p99 ms",
        "p99/p50",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "queued p50 ms",
        "paced p50 ms",
        "prefill p50 ms",
        "output tok/s",
    ]
    print(f"\n## Stall-free prefill: before and after, {args.repetitions} repetitions\n")
    print(benchkit.markdown_table(columns, table))
    print("\n### Targets\n")
    for workload in workloads:
        figures = data.get(workload.name, {})
        if "before" not in figures or "after" not in figures:
            continue
        b, a = figures["before"], figures["after"]
        print(
            f"- {workload.name}: ITL p99 {a['itl_p99'] / a['itl_p50']:.2f}x p50 (target <= 3x, before "
            f"{b['itl_p99'] / b['itl_p50']:.1f}x); TTFT p50 {a['ttft_p50'] / b['ttft_p50']:.2f}x before "
            f"(target <= 1.25x); output tok/s {a['tok_per_s'] / b['tok_per_s']:.3f}x before (target >= 0.95x)"
        )
    out = benchkit.save_results(args.name, data)
    print(f"\nresults: {out.relative_to(benchkit.REPO)}")
    chart(data, workloads, RESULTS / f"{args.name}.png")


def chart(data: dict[str, Any], workloads: list[Workload], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        benchkit.skip("chart", "matplotlib is not installed")
        return
    names = [
        w.name for w in workloads if "before" in data.get(w.name, {}) and "after" in data.get(w.name, {})
    ]
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    width = 0.38
    x = range(len(names))
    for axis, (metric, title) in zip(
        axes,
        (("itl_p99", "ITL p99 (ms)"), ("ttft_p50", "TTFT p50 (ms)"), ("tok_per_s", "output tok/s")),
        strict=True,
    ):
        for offset, side, colour in ((-width / 2, "before", "#b0b0b0"), (width / 2, "after", "#2b7bba")):
            values = [data[n][side][metric] * (1 if metric == "tok_per_s" else 1000) for n in names]
            axis.bar([i + offset for i in x], values, width, label=side, color=colour)
        if metric == "itl_p99":
            for i, n in enumerate(names):
                bound = 3 * data[n]["after"]["itl_p50"] * 1000
                axis.hlines(bound, i - 0.45, i + 0.45, colors="black", linestyles="dashed")
        axis.set_xticks(list(x), [n.replace(" open", "\nopen") for n in names])
        axis.set_title(title)
        axis.legend()
    axes[0].set_ylabel("dashed: 3x the after side's ITL p50")
    figure.suptitle("Stall-free prefill: before and after (SmolLM2-135M, 2 CPU cores)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    swept = {
        n: sorted(
            (float(side.split()[-1]), f) for side, f in data[n].items() if side.startswith("max-step-ms")
        )
        for n in names
    }
    swept = {n: points for n, points in swept.items() if points}
    if not swept:
        return
    knob, knob_axes = plt.subplots(1, len(swept), figsize=(5.5 * len(swept), 4.5), squeeze=False)
    for axis, (n, points) in zip(knob_axes[0], swept.items(), strict=True):
        auto = data[n]["after"]
        xs = [v for v, _ in points]
        axis.plot(xs, [f["itl_p99"] * 1000 for _, f in points], "o-", color="#2b7bba", label="ITL p99")
        axis.plot(xs, [f["ttft_p50"] * 1000 for _, f in points], "s-", color="#d9822b", label="TTFT p50")
        axis.axhline(auto["itl_p99"] * 1000, color="#2b7bba", linestyle=":", label="ITL p99, auto target")
        axis.axhline(auto["ttft_p50"] * 1000, color="#d9822b", linestyle=":", label="TTFT p50, auto target")
        axis.set_xlabel("--max-step-ms")
        axis.set_ylabel("ms")
        axis.set_title(n)
        axis.legend(fontsize=8)
    knob.suptitle("The knob: a longer round gives prompts more of it")
    knob.tight_layout()
    knob.savefig(path.with_name(f"{path.stem}_knob.png"), dpi=110)


if __name__ == "__main__":
    main()
