"""Present a benchmark: a markdown table for the terminal, JSON with every figure, a PNG chart.

matplotlib is an optional extra (`pip install 'tokenwire[bench]'`), imported only when a chart
is asked for.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path
from typing import Any

from tokenwire.client.bench.load import BenchReport
from tokenwire.client.bench.stats import LevelSummary, Summary


class ChartUnavailableError(RuntimeError):
    """matplotlib is not installed, so no chart can be drawn."""


def format_table(report: BenchReport) -> str:
    """One row per load level; times in milliseconds. Client-measured unless marked "server"."""
    config = report.config
    mode = "streaming" if config.streaming else "unary"
    header = (
        f"model {report.model.name} (max batch {report.model.max_batch_size}), {mode}, "
        f"prompt {config.prompt_tokens.describe()} tokens, "
        f"max_new_tokens {config.max_new_tokens.describe()}, greedy"
    )
    if config.shared_prefix_tokens:
        header += f", every prompt after a shared prefix of {config.shared_prefix_tokens} tokens"
    if config.chat_turns > 1:
        header += f", chats of {config.chat_turns} turns (each resends the conversation)"
    columns = [
        "load",
        "ok",
        "rejected",
        "failed",
        "TTFT p50",
        "TTFT p90",
        "TTFT p99",
        "queued p50",
        "queued p99",
        "server TTFT p50",
        "server TTFT p99",
        "ITL p50",
        "ITL p99",
        "E2E p50",
        "E2E p99",
        "output tok/s",
        "req/s",
        "cached",
    ]
    rows = [_row(level) for level in report.levels]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
    lines = [
        header,
        "",
        _markdown_row(columns, widths),
        "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|",
        *(_markdown_row(row, widths) for row in rows),
        "",
        "times in ms; TTFT, ITL and E2E measured by this client from the moment it sent the request; "
        "queued and server TTFT are the server's own timing fields (from receipt); cached: share of "
        "prompt tokens the server took from its prefix cache.",
    ]
    return "\n".join(lines)


def _row(level: LevelSummary) -> list[str]:
    return [
        level.level.label,
        str(level.completed),
        str(level.rejected),
        str(level.failed),
        _ms(level.time_to_first_token, "p50"),
        _ms(level.time_to_first_token, "p90"),
        _ms(level.time_to_first_token, "p99"),
        _ms(level.server_queued, "p50"),
        _ms(level.server_queued, "p99"),
        _ms(level.server_time_to_first_token, "p50"),
        _ms(level.server_time_to_first_token, "p99"),
        _ms(level.inter_token_latency, "p50"),
        _ms(level.inter_token_latency, "p99"),
        _ms(level.latency, "p50"),
        _ms(level.latency, "p99"),
        f"{level.output_tokens_per_second:.1f}",
        f"{level.requests_per_second:.2f}",
        f"{100 * level.cached_prompt_tokens / level.prompt_tokens:.0f}%" if level.prompt_tokens else "-",
    ]


def _ms(summary: Summary | None, field: str) -> str:
    if summary is None:
        return "-"
    return f"{getattr(summary, field) * 1000:.1f}"


def _markdown_row(cells: list[str], widths: list[int]) -> str:
    return "| " + " | ".join(cell.rjust(width) for cell, width in zip(cells, widths, strict=True)) + " |"


def to_json(report: BenchReport, *, include_requests: bool = True) -> dict[str, Any]:
    """Every figure of the report as JSON-ready values (seconds, tokens, counts)."""
    levels: list[dict[str, Any]] = []
    for summary, records in zip(report.levels, report.records, strict=True):
        entry = dataclasses.asdict(summary)
        if include_requests:
            entry["requests"] = [dataclasses.asdict(r) for r in records]
        levels.append(entry)
    config = dataclasses.asdict(report.config)
    config.pop("token", None)  # a credential has no place in a results file
    return {
        "units": "seconds for times, tokens for lengths",
        "config": config,
        "model": dataclasses.asdict(report.model),
        "levels": levels,
    }


def write_json(report: BenchReport, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_json(report), indent=2) + "\n", encoding="utf-8")


def write_chart(report: BenchReport, path: Path) -> None:
    """Latency (TTFT, queued, ITL) and throughput against load, side by side."""
    try:
        # Imported by name so that type checking does not need the optional extra installed.
        matplotlib: Any = importlib.import_module("matplotlib")
        matplotlib.use("Agg")  # files only: no display needed, none opened
        plt: Any = importlib.import_module("matplotlib.pyplot")
    except ImportError as error:
        raise ChartUnavailableError(
            "--chart needs matplotlib: pip install 'tokenwire[bench]' (or pip install matplotlib)"
        ) from error

    levels = report.levels
    kind = levels[0].level.kind if levels else "concurrency"
    x = [level.level.value for level in levels]
    x_label = "concurrent streams (closed loop)" if kind == "concurrency" else "arrival rate, req/s (Poisson)"

    def series(attribute: str, field: str) -> list[float]:
        values: list[float] = []
        for level in levels:
            summary: Summary | None = getattr(level, attribute)
            values.append(float("nan") if summary is None else getattr(summary, field) * 1000)
        return values

    figure, (latency_axes, throughput_axes) = plt.subplots(1, 2, figsize=(12, 4.5))
    plotted = [
        ("time_to_first_token", "p50", "TTFT p50", "-o"),
        ("time_to_first_token", "p99", "TTFT p99", "--o"),
        ("server_queued", "p50", "queued p50 (server)", "-s"),
        ("inter_token_latency", "p50", "ITL p50", "-^"),
        ("inter_token_latency", "p99", "ITL p99", "--^"),
    ]
    if not report.config.streaming:
        plotted = [
            ("server_time_to_first_token", "p50", "TTFT p50 (server)", "-o"),
            ("server_queued", "p50", "queued p50 (server)", "-s"),
            ("latency", "p50", "E2E p50", "-d"),
        ]
    for attribute, field, label, style in plotted:
        latency_axes.plot(x, series(attribute, field), style, label=label)
    latency_axes.set_yscale("log")
    latency_axes.set_xlabel(x_label)
    latency_axes.set_ylabel("ms (log scale)")
    latency_axes.set_title("Latency against load")
    latency_axes.grid(True, which="both", alpha=0.3)
    latency_axes.legend()

    throughput_axes.plot(x, [level.output_tokens_per_second for level in levels], "-o", label="output tok/s")
    throughput_axes.set_xlabel(x_label)
    throughput_axes.set_ylabel("output tokens/s")
    throughput_axes.set_ylim(bottom=0)
    throughput_axes.set_title("Throughput against load")
    throughput_axes.grid(True, alpha=0.3)
    if kind == "concurrency":
        for axes in (latency_axes, throughput_axes):
            axes.set_xscale("log", base=2)
            axes.set_xticks(x, [f"{v:g}" for v in x])
    figure.suptitle(
        f"tokenwire bench: {report.model.name}, prompt {report.config.prompt_tokens.describe()}, "
        f"new {report.config.max_new_tokens.describe()} tokens"
    )
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
