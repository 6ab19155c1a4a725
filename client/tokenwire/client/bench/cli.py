"""The `tokenwire bench` command: sweep a running server with load and report what it did.

tqdm and matplotlib are imported only when the command runs, so other commands start fast.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, TextIO

from tokenwire.client.bench.load import BenchConfig, LengthDistribution, Progress, run_bench
from tokenwire.client.bench.stats import LevelSummary, LoadLevel, RequestRecord
from tokenwire.client.errors import TokenwireError

DEFAULT_SERVER = "localhost:50051"
DEFAULT_DURATION = 20.0


def add_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = commands.add_parser(
        "bench",
        help="measure a running server under load (latency and throughput per load level)",
        description="Closed-loop concurrency sweeps or open-loop Poisson arrival rates against a running "
        "tokenwire server. Requests are greedy token-id prompts that ignore end-of-sequence, so prompt "
        "and output lengths are exact. Per level: TTFT, time queued, inter-token latency, end-to-end "
        "latency, throughput, rejected and failed requests.",
    )
    bench.add_argument(
        "--server", default=os.environ.get("TOKENWIRE_SERVER", DEFAULT_SERVER), help="host:port of the server"
    )
    bench.add_argument("--token", default=os.environ.get("TOKENWIRE_TOKEN"), help="bearer token")
    bench.add_argument("--model", default="", help="model name (default: the server's default)")
    load = bench.add_mutually_exclusive_group()
    load.add_argument(
        "--concurrency",
        type=_numbers(int),
        help="closed loop: comma-separated numbers of clients, each sending its next request when the "
        "previous one ends (default: 1,2,4,8)",
    )
    load.add_argument(
        "--rate", type=_numbers(float), help="open loop: comma-separated Poisson arrival rates in requests/s"
    )
    bench.add_argument(
        "--prompt-tokens", default="100", help="prompt length: N or uniform:LOW:HIGH (default: 100)"
    )
    bench.add_argument(
        "--max-new-tokens", default="128", help="output length: N or uniform:LOW:HIGH (default: 128)"
    )
    bench.add_argument(
        "--shared-prefix-tokens",
        type=int,
        default=0,
        metavar="N",
        help="start every prompt with the same N tokens, like a shared system prompt (default: 0)",
    )
    bench.add_argument(
        "--chat-turns",
        type=int,
        default=1,
        metavar="K",
        help="multi-turn chats of K turns: each turn's prompt is the conversation so far (earlier "
        "prompts and answers) plus a new question of --prompt-tokens tokens (default: 1, no chat)",
    )
    bench.add_argument("--unary", action="store_true", help="use unary Generate instead of streaming")
    bench.add_argument("--requests", type=int, help="requests per level")
    bench.add_argument(
        "--duration",
        type=float,
        help=f"seconds per level during which requests are sent (default: {DEFAULT_DURATION:g} "
        "when --requests is not given)",
    )
    bench.add_argument(
        "--warmup", type=int, default=2, help="requests sent once before measuring, left out (default: 2)"
    )
    bench.add_argument("--seed", type=int, default=0, help="seed for lengths, prompts and arrivals")
    bench.add_argument(
        "--timeout", type=float, default=300.0, help="deadline of each request in seconds (default: 300)"
    )
    bench.add_argument("--json", type=Path, metavar="PATH", help="write every figure as JSON")
    bench.add_argument(
        "--chart", type=Path, metavar="PATH.png", help="draw latency and throughput against load (matplotlib)"
    )
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.set_defaults(handler=run_bench_command)


def _numbers(kind: type[int] | type[float]) -> Any:
    def parse(text: str) -> list[float]:
        try:
            values = [float(kind(part)) for part in text.split(",") if part.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
        if not values or any(v <= 0 for v in values):
            raise argparse.ArgumentTypeError(f"{text!r}: give one or more positive numbers")
        return values

    return parse


def run_bench_command(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout  # looked up per call, so redirected output is honoured
    from tokenwire.client.bench.report import format_table, write_chart, write_json

    if args.chart is not None and importlib.util.find_spec("matplotlib") is None:
        print(
            "tokenwire bench: --chart needs matplotlib: pip install 'tokenwire[bench]' "
            "(or pip install matplotlib)",
            file=sys.stderr,
        )
        return 2
    if args.rate:
        levels = tuple(LoadLevel("rate", value) for value in args.rate)
    else:
        levels = tuple(LoadLevel("concurrency", value) for value in (args.concurrency or [1, 2, 4, 8]))
    duration = args.duration
    if duration is None and args.requests is None:
        duration = DEFAULT_DURATION
    try:
        config = BenchConfig(
            target=args.server,
            levels=levels,
            prompt_tokens=LengthDistribution.parse(args.prompt_tokens),
            max_new_tokens=LengthDistribution.parse(args.max_new_tokens),
            streaming=not args.unary,
            requests=args.requests,
            duration=duration,
            warmup=args.warmup,
            model=args.model,
            seed=args.seed,
            request_timeout=args.timeout,
            token=args.token,
            shared_prefix_tokens=args.shared_prefix_tokens,
            chat_turns=args.chat_turns,
        )
    except ValueError as error:
        print(f"tokenwire bench: {error}", file=sys.stderr)
        return 2
    progress = None if args.no_progress else _BarProgress()
    try:
        report = asyncio.run(run_bench(config, progress))
    except TokenwireError as error:
        print(f"tokenwire bench: {error}", file=sys.stderr)
        return 1
    finally:
        if progress is not None:
            progress.close()
    out.write(format_table(report) + "\n")
    if args.json is not None:
        write_json(report, args.json)
        out.write(f"wrote {args.json}\n")
    if args.chart is not None:
        write_chart(report, args.chart)
        out.write(f"wrote {args.chart}\n")
    return 0


class _BarProgress(Progress):
    """A tqdm bar per level, on stderr, so stdout holds only the results."""

    def __init__(self) -> None:
        self._bar: Any = None

    def level_started(self, level: LoadLevel, expected_requests: int | None) -> None:
        from tqdm import tqdm

        self.close()
        self._bar = tqdm(total=expected_requests, desc=level.label, unit="req", file=sys.stderr, leave=True)

    def request_finished(self, record: RequestRecord) -> None:
        if self._bar is not None:
            self._bar.update(1)
            if record.outcome != "ok":
                self._bar.set_postfix_str(record.outcome)

    def level_finished(self, summary: LevelSummary) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(f"{summary.output_tokens_per_second:.0f} tok/s")
        self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
