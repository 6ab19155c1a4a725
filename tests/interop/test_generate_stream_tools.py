"""GenerateStream driven by grpcurl and buf curl, tools that learn the service through reflection
alone: the events of one generation, a bad request's status, the call's deadline, and a tool
killed mid-generation, whose generation stops within one decode step on the real server."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.conftest import ServerFactory
from tests.interop.conftest import ROOT, require_node_module, require_tool, run_tool
from tests.interop.test_buf_curl import json_values
from tests.interop.test_grpcurl import grpcurl
from tests.support.polling import wait_until
from tests.support.stepping import StepGate, gated
from tokenwire.server.app import TokenwireServer

METHOD = "tokenwire.v1.InferenceService/GenerateStream"
TOOLS = ("grpcurl", "buf curl")


def command(tool: str, port: int, body: dict[str, Any], *extra: str) -> list[str]:
    """The tool's command line for one GenerateStream call with `body` as its request."""
    data = json.dumps(body)
    if tool == "grpcurl":
        return [grpcurl(), "-plaintext", "-format-error", *extra, "-d", data, f"127.0.0.1:{port}", METHOD]
    require_node_module("@bufbuild/buf")
    return [
        require_tool("npx"),
        "--no-install",
        "buf",
        "curl",
        "--protocol",
        "grpc",
        "--http2-prior-knowledge",
        *extra,
        "-d",
        data,
        f"http://127.0.0.1:{port}/{METHOD}",
    ]


def field(message: dict[str, Any], camel: str) -> Any:
    """A field of the printed JSON: grpcurl prints proto names (request_id), buf curl JSON names."""
    snake = "".join(f"_{c.lower()}" if c.isupper() else c for c in camel)
    return message[camel] if camel in message else message[snake]


def body(max_new_tokens: int, **fields: Any) -> dict[str, Any]:
    return {
        "prompt": "The capital of France is",
        "sampling": {"temperature": 0},
        "stopping": {"maxNewTokens": max_new_tokens, "ignoreEos": True},
        **fields,
    }


@pytest.fixture
def gate() -> StepGate:
    return StepGate()


@pytest.fixture
async def one_slot(start_server: ServerFactory, gate: StepGate) -> AsyncIterator[TokenwireServer]:
    server = await start_server(wrap_model=gated(gate), max_batch_size=1)
    yield server
    gate.open()


@pytest.mark.parametrize("tool", TOOLS)
async def test_the_tool_prints_one_generations_events_in_order(server: TokenwireServer, tool: str) -> None:
    finished = await run_tool(*command(tool, server.port, body(6, requestId="tool-1")))
    assert finished.code == 0, finished.stderr
    messages = json_values(finished.stdout)
    kinds = [next(k for k in m if k not in ("requestId", "request_id")) for m in messages]
    assert kinds[:2] == ["queued", "started"] and kinds[-1] == "completed"
    assert set(kinds[2:-1]) == {"chunk"}
    assert {field(m, "requestId") for m in messages} == {"tool-1"}
    tokens = [t for m in messages if "chunk" in m for t in field(m["chunk"], "tokenIds")]
    completed = messages[-1]["completed"]
    assert len(tokens) == field(completed["usage"], "completionTokens") == 6
    assert field(completed, "finishReason") == "FINISH_REASON_LENGTH"
    assert field(completed["timing"], "timeToFirstToken").endswith("s")


@pytest.mark.parametrize("tool", TOOLS)
async def test_a_bad_request_ends_the_call_with_invalid_argument_naming_the_field(
    server: TokenwireServer, tool: str
) -> None:
    finished = await run_tool(*command(tool, server.port, body(4, sampling={"topP": 1.5})))
    assert finished.code != 0
    assert finished.stdout.strip() == ""  # no event: the call itself failed
    error = json.loads(finished.stderr)
    if tool == "grpcurl":  # grpcurl decodes the details through reflection
        assert error["code"] == 3
        (bad_request,) = [d for d in error["details"] if d["@type"].endswith("google.rpc.BadRequest")]
        assert [v["field"] for v in bad_request["field_violations"]] == ["sampling.top_p"]
    else:
        assert error["code"] == "invalid_argument"
        assert "sampling.top_p" in error["message"]
        assert "google.rpc.BadRequest" in [d["type"] for d in error["details"]]


@pytest.mark.parametrize("tool", TOOLS)
async def test_the_tools_deadline_ends_the_call_and_stops_the_generation(
    one_slot: TokenwireServer, gate: StepGate, tool: str
) -> None:
    engine = one_slot.registry.default.engine
    deadline = ("-max-time", "2") if tool == "grpcurl" else ("--timeout", "2s")
    gate.allow(2)  # then every step is held: the generation cannot finish before the deadline
    finished = await run_tool(*command(tool, one_slot.port, body(150), *deadline))
    assert finished.code != 0
    assert "deadline" in finished.stderr.lower(), finished.stderr
    assert '"queued"' in finished.stdout  # the events before the deadline were printed
    await wait_until(lambda: engine.stats.abort_requests == 1, what="the deadline to reach the engine")
    gate.open()
    assert await engine.wait_idle(5)
    assert engine.stats.aborted == 1
    assert engine.stats.max_abort_latency_steps <= 1
    assert engine.stats.orphaned_steps == 0


@pytest.mark.parametrize("tool", TOOLS)
async def test_killing_the_tool_mid_generation_stops_it_within_one_step(
    one_slot: TokenwireServer, gate: StepGate, tool: str
) -> None:
    engine = one_slot.registry.default.engine
    gate.allow(2)
    process = await asyncio.create_subprocess_exec(
        *command(tool, one_slot.port, body(150)),
        cwd=ROOT,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        start_new_session=True,  # npx runs buf as a child: the whole group is killed
    )
    assert process.stdout is not None
    try:
        # The tool printed a chunk: the generation runs. One, not more: tokens that arrive
        # together are sent as one chunk, so how many chunks two steps make is not fixed.
        while True:
            line = await asyncio.wait_for(process.stdout.readline(), 60)
            assert line, "the tool ended before printing a chunk"
            if b'"chunk"' in line:
                break
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # no goodbye: the connection just closes
        await process.wait()
    await wait_until(lambda: engine.stats.abort_requests == 1, what="the server to notice the dead client")
    steps_at_cancel = engine.stats.decode_steps
    gate.open()
    assert await engine.wait_idle(5)
    assert engine.stats.aborted == 1
    assert engine.stats.max_abort_latency_steps <= 1
    assert engine.stats.orphaned_steps == 0
    assert engine.stats.decode_steps - steps_at_cancel <= 1
