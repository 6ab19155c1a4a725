"""`tokenwire bench` against a real server on the tiny model: every request accounted for, figures
consistent with each other, table, JSON and chart written. No assertion depends on how fast it ran."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import ServerFactory
from tests.support.stepping import steady
from tokenwire.client.bench import (
    BenchConfig,
    BenchReport,
    LengthDistribution,
    LevelSummary,
    LoadLevel,
    Summary,
    percentile,
    run_bench,
)
from tokenwire.client.bench.report import format_table, to_json
from tokenwire.server.app import TokenwireServer
from tokenwire.server.cli import main

SUMMARY_FIELDS = (
    "time_to_first_token",
    "server_queued",
    "server_time_to_first_token",
    "server_prefill",
    "inter_token_latency",
    "time_per_output_token",
    "latency",
    "server_paced",
)


def small_sweep(port: int, **overrides: object) -> BenchConfig:
    settings: dict[str, object] = {
        "target": f"127.0.0.1:{port}",
        "levels": (LoadLevel("concurrency", 1), LoadLevel("concurrency", 2)),
        "prompt_tokens": LengthDistribution(3, 12),
        "max_new_tokens": LengthDistribution(4, 8),
        "requests": 5,
        "warmup": 1,
        "seed": 3,
    }
    settings.update(overrides)
    return BenchConfig(**settings)  # type: ignore[arg-type]


def assert_ordered(summary: Summary) -> None:
    assert summary.minimum <= summary.p50 <= summary.p90 <= summary.p99 <= summary.maximum
    assert summary.minimum <= summary.mean <= summary.maximum
    assert summary.count > 0


def assert_consistent(level: LevelSummary, report: BenchReport, index: int) -> None:
    records = report.records[index]
    assert level.sent == len(records) == level.completed + level.rejected + level.failed
    assert sorted(r.index for r in records) == list(range(len(records)))
    for name in SUMMARY_FIELDS:
        summary = getattr(level, name)
        if summary is not None:
            assert_ordered(summary)
    ok = [r for r in records if r.outcome == "ok"]
    assert level.output_tokens == sum(r.output_tokens for r in ok)
    if ok:
        assert level.wall_seconds > 0
        assert math.isclose(level.output_tokens_per_second, level.output_tokens / level.wall_seconds)
        assert math.isclose(level.requests_per_second, len(ok) / level.wall_seconds)
    for record in ok:
        # Greedy and ignoring EOS: exactly the lengths that were asked for.
        assert record.output_tokens == record.max_new_tokens
        assert record.server_prompt_tokens == record.prompt_tokens
        assert record.latency is not None
        assert record.server_queued is not None
        assert record.server_first_token is not None
        # The server's clock starts when it receives the request, after this client sent it.
        assert record.server_queued <= record.server_first_token <= record.latency
    for record in records:
        assert (record.error is None) == (record.outcome == "ok")


async def test_streaming_sweep_accounts_for_every_request(start_server: ServerFactory) -> None:
    # Decode steps of 20 ms, so each stream's tokens leave in several chunks and the sweep has
    # gaps between them to report (the tiny model's own steps can finish before the server has
    # written a stream's first chunk, and its tokens then go out as one).
    server = await start_server(wrap_model=steady(0.02))
    report = await run_bench(small_sweep(server.port))

    expected_levels = [LoadLevel("concurrency", 1), LoadLevel("concurrency", 2)]
    assert [level.level for level in report.levels] == expected_levels
    for index, level in enumerate(report.levels):
        assert_consistent(level, report, index)
        # Well within the server's batch and queue: nothing is refused.
        assert (level.completed, level.rejected, level.failed) == (5, 0, 0)
        assert level.time_to_first_token is not None
        assert level.inter_token_latency is not None
        for record in report.records[index]:
            assert record.first_token is not None
            assert record.latency is not None
            assert record.server_queued is not None
            assert record.server_queued <= record.first_token <= record.latency
            assert len(record.token_gaps) <= record.output_tokens - 1
    table = format_table(report)
    assert re.search(r"^\|\s*c=1\s*\|\s*5\s*\|", table, re.MULTILINE)
    assert table.count("\n| ") == 3  # header and one row per level


async def test_same_seed_sends_the_same_requests(server: TokenwireServer) -> None:
    config = small_sweep(server.port, levels=(LoadLevel("concurrency", 2),), warmup=0)
    first, second = await run_bench(config), await run_bench(config)
    shape = [[(r.prompt_tokens, r.max_new_tokens) for r in records] for records in first.records]
    assert shape == [[(r.prompt_tokens, r.max_new_tokens) for r in records] for records in second.records]


async def test_unary_sweep_reports_server_timing_without_client_ttft(server: TokenwireServer) -> None:
    report = await run_bench(small_sweep(server.port, streaming=False, levels=(LoadLevel("concurrency", 2),)))

    level = report.levels[0]
    assert_consistent(level, report, 0)
    assert level.completed == 5
    assert level.time_to_first_token is None
    assert level.inter_token_latency is None
    assert level.server_time_to_first_token is not None
    assert level.latency is not None


async def test_open_loop_overload_is_counted_as_rejected(start_server: ServerFactory) -> None:
    server = await start_server(max_batch_size=1, max_queue_size=1)
    # Twelve arrivals within milliseconds against room for two: the rest are refused at admission.
    config = small_sweep(
        server.port,
        levels=(LoadLevel("rate", 20_000),),
        requests=12,
        max_new_tokens=LengthDistribution(200, 200),
        warmup=0,
    )
    report = await run_bench(config)

    level = report.levels[0]
    assert_consistent(level, report, 0)
    assert level.sent == 12
    assert level.failed == 0
    assert level.rejected >= 1
    assert level.completed >= 1
    rejected = [r for r in report.records[0] if r.outcome == "rejected"]
    assert all(r.error is not None and r.error.startswith("RESOURCE_EXHAUSTED") for r in rejected)


async def test_cli_prints_table_and_writes_json(
    server: TokenwireServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = tmp_path / "out" / "bench.json"
    argv = [
        "bench",
        "--server",
        f"127.0.0.1:{server.port}",
        "--concurrency",
        "1,2",
        "--requests",
        "3",
        "--prompt-tokens",
        "uniform:4:10",
        "--max-new-tokens",
        "5",
        "--warmup",
        "1",
        "--json",
        str(results),
        "--no-progress",
    ]
    # The server runs on this test's event loop; the command runs its own loop in a thread.
    assert await asyncio.to_thread(main, argv) == 0

    printed = capsys.readouterr().out
    assert re.search(r"^\|\s*c=2\s*\|\s*3\s*\|", printed, re.MULTILINE)
    assert "TTFT p99" in printed
    assert "queued p50" in printed
    data = json.loads(results.read_text())
    assert [level["level"] for level in data["levels"]] == [
        {"kind": "concurrency", "value": 1},
        {"kind": "concurrency", "value": 2},
    ]
    assert "token" not in data["config"]
    for level in data["levels"]:
        assert level["sent"] == len(level["requests"]) == 3
        assert level["completed"] + level["rejected"] + level["failed"] == 3
        assert all(request["output_tokens"] == 5 for request in level["requests"])
        ttft = level["time_to_first_token"]
        assert ttft["p50"] <= ttft["p90"] <= ttft["p99"]
        assert level["server_queued"]["p99"] <= ttft["maximum"]


async def test_cli_draws_chart(server: TokenwireServer, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="matplotlib (the bench extra) is not installed: chart skipped")
    chart = tmp_path / "bench.png"
    argv = ["bench", "--server", f"127.0.0.1:{server.port}", "--concurrency", "1,2", "--requests", "2"]
    argv += ["--max-new-tokens", "4", "--prompt-tokens", "6", "--chart", str(chart), "--no-progress"]
    assert await asyncio.to_thread(main, argv) == 0
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_rejects_an_unbounded_level(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--concurrency", "1", "--requests", "0", "--no-progress"]) == 2
    assert "at least 1" in capsys.readouterr().err


def test_json_leaves_out_nothing_the_table_shows(server_free_report: BenchReport) -> None:
    data = json.loads(json.dumps(to_json(server_free_report)))
    level = data["levels"][0]
    for name in SUMMARY_FIELDS:
        assert name in level
    assert level["requests"][0]["token_gaps"] == [0.01, 0.02]


@pytest.fixture
def server_free_report() -> BenchReport:
    from tokenwire.client.bench import RequestRecord
    from tokenwire.client.bench.stats import summarize_level
    from tokenwire.client.types import ModelDescription

    record = RequestRecord(
        index=0,
        sent_at=0.0,
        prompt_tokens=4,
        max_new_tokens=3,
        outcome="ok",
        latency=0.05,
        first_token=0.02,
        token_gaps=(0.01, 0.02),
        output_tokens=3,
        server_prompt_tokens=4,
        server_queued=0.001,
        server_first_token=0.015,
    )
    level = LoadLevel("concurrency", 1)
    config = BenchConfig("127.0.0.1:1", (level,), requests=1)
    model = ModelDescription("m", 256, 512, False, True, 4, "optimum")
    return BenchReport(config, model, (summarize_level(level, [record], 0.1),), ((record,),))


@given(st.lists(st.floats(min_value=-1e6, max_value=1e6), min_size=1, max_size=50), st.floats(0, 100))
def test_percentile_matches_numpy(values: list[float], q: float) -> None:
    assert math.isclose(percentile(values, q), float(np.percentile(values, q)), rel_tol=1e-9, abs_tol=1e-6)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("100", LengthDistribution(100, 100)), ("uniform:50:150", LengthDistribution(50, 150))],
)
def test_length_distribution_parses(text: str, expected: LengthDistribution) -> None:
    assert LengthDistribution.parse(text) == expected


@pytest.mark.parametrize("text", ["0", "uniform:9:3", "normal:1:2", "abc", "uniform:1"])
def test_length_distribution_rejects_nonsense(text: str) -> None:
    with pytest.raises(ValueError, match=r"N|LOW"):
        LengthDistribution.parse(text)


async def test_a_shared_prefix_lengthens_every_prompt_by_the_same_tokens(server: TokenwireServer) -> None:
    config = small_sweep(server.port, levels=(LoadLevel("concurrency", 2),), shared_prefix_tokens=20)
    report = await run_bench(config)

    level = report.levels[0]
    assert_consistent(level, report, 0)
    for record in report.records[0]:
        assert 20 + 3 <= record.prompt_tokens <= 20 + 12
    assert "shared prefix of 20 tokens" in format_table(report)


async def test_a_chat_turn_resends_the_conversation_so_far(server: TokenwireServer) -> None:
    config = small_sweep(server.port, levels=(LoadLevel("concurrency", 1),), requests=7, chat_turns=3)
    report = await run_bench(config)

    records = sorted(report.records[0], key=lambda r: r.index)
    assert [r.turn for r in records] == [0, 1, 2, 0, 1, 2, 0]
    assert all(r.outcome == "ok" for r in records)
    for previous, record in itertools.pairwise(records):
        if record.turn == 0:
            assert 3 <= record.prompt_tokens <= 12
            continue
        # The previous prompt and its answer, then a new question of 3..12 tokens.
        history = previous.prompt_tokens + previous.output_tokens
        assert history + 3 <= record.prompt_tokens <= history + 12
        assert record.server_prompt_tokens == record.prompt_tokens


async def test_open_loop_chats_send_every_turn_of_each_conversation(server: TokenwireServer) -> None:
    config = small_sweep(server.port, levels=(LoadLevel("rate", 50),), requests=4, chat_turns=2, warmup=0)
    report = await run_bench(config)

    records = sorted(report.records[0], key=lambda r: r.index)
    assert [r.turn for r in records] == [0, 1, 0, 1]
    assert records[1].prompt_tokens > records[0].prompt_tokens + records[0].output_tokens


def test_bench_config_refuses_a_negative_prefix_and_zero_turns() -> None:
    level = LoadLevel("concurrency", 1)
    with pytest.raises(ValueError, match="shared prefix"):
        BenchConfig("127.0.0.1:1", (level,), requests=1, shared_prefix_tokens=-1)
    with pytest.raises(ValueError, match="chat turns"):
        BenchConfig("127.0.0.1:1", (level,), requests=1, chat_turns=0)
