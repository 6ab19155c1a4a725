"""A Node.js client (@grpc/grpc-js + @grpc/proto-loader, loading proto/ as it is) streams and cancels.

The client shares no code with tokenwire: it knows the service only from the .proto files. A step
gate lets 100 decode steps through and then holds the engine until the client's cancel has
arrived, so the cancelled generation can never run to its 200-token limit first.
"""

from __future__ import annotations

import asyncio
import json
import re

import grpc

from tests.conftest import ServerFactory
from tests.interop.conftest import require_node_module, require_tool, run_tool
from tests.reliability.recovery import assert_recovered
from tests.support.options import greedy
from tests.support.polling import wait_until
from tests.support.stepping import StepGate, gated
from tokenwire.client import AsyncClient
from tokenwire.server.app import TokenwireServer


async def test_node_grpc_js_client_streams_cancels_one_generation_and_half_closes(
    start_server: ServerFactory,
) -> None:
    node = require_tool("node")
    require_node_module("@grpc/grpc-js")
    require_node_module("@grpc/proto-loader")
    gate = StepGate()
    gate.allow(100)
    server = await start_server(wrap_model=gated(gate))
    engine = server.registry.default.engine
    running = asyncio.ensure_future(
        run_tool(node, "tests/interop/stream_cancel.cjs", f"127.0.0.1:{server.port}")
    )
    try:
        await wait_until(
            lambda: engine.stats.abort_requests == 1, timeout=30, what="the Node client's cancel"
        )
    except BaseException:
        running.cancel()
        raise
    finally:
        gate.open()
    finished = await running
    assert finished.code == 0, finished.stderr
    report = json.loads(finished.stdout)

    assert report["status"]["code"] == grpc.StatusCode.OK.value[0]
    kept, cancelled = report["events"]["kept"], report["events"]["cancelled"]
    for events in (kept, cancelled):
        assert events[:2] == ["queued", "started"]
        assert events[-1] == "completed"
        assert set(events[2:-1]) == {"chunk"}
    assert report["finishReasons"] == {"kept": "FINISH_REASON_LENGTH", "cancelled": "FINISH_REASON_CANCELLED"}
    kept_tokens, cancelled_tokens = report["tokens"]["kept"], report["tokens"]["cancelled"]
    assert report["completionTokens"] == {"kept": 12, "cancelled": len(cancelled_tokens)}
    assert 1 <= len(cancelled_tokens) < 200

    async with AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client:
        reference = await client.generate("The capital of France is", greedy(200))
    assert kept_tokens == list(reference.token_ids[:12])
    assert cancelled_tokens == list(reference.token_ids[: len(cancelled_tokens)])
    await assert_recovered(server)


async def test_node_grpc_js_client_gets_output_shaped_by_each_response_format(
    server: TokenwireServer,
) -> None:
    node = require_tool("node")
    require_node_module("@grpc/grpc-js")
    require_node_module("@grpc/proto-loader")
    finished = await run_tool(node, "tests/interop/response_format.cjs", f"127.0.0.1:{server.port}")
    assert finished.code == 0, finished.stderr
    report = json.loads(finished.stdout)
    shaped = json.loads(report["jsonSchema"]["text"])
    assert isinstance(shaped["ok"], bool) and 0 <= shaped["n"] <= 99 and set(shaped) == {"ok", "n"}
    assert re.fullmatch("[a-f]{3}-[0-9]{2}", report["regex"]["text"])
    assert report["choice"]["text"] in ("left", "right")
    assert all(report[k]["finishReason"] == "FINISH_REASON_EOS" for k in ("jsonSchema", "regex", "choice"))
    assert report["badRegex"]["code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "response_format.regex" in report["badRegex"]["details"]
