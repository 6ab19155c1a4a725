"""OpenAI's official Node SDK (the `openai` npm package) against the HTTP API of a real server:
chat, completions, a stream with usage, errors, authentication, and an aborted stream that stops
its generation within one step. The Node client shares no code with tokenwire."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from tests.interop.conftest import require_node_module, require_tool, run_tool
from tests.server.openai_api.conftest import base_url, http_settings
from tests.support.polling import wait_until
from tests.support.servers import serving
from tests.support.stepping import StepGate
from tokenwire.client import AsyncClient, ChatMessage, GenerateOptions, Sampling, Stopping
from tokenwire.server.config import AuthSettings

TOKEN = "node-sdk-token"


async def test_the_openai_node_sdk_chats_completes_streams_errs_and_aborts(tiny_model_dir: Path) -> None:
    node = require_tool("node")
    require_node_module("openai")
    gate = StepGate()
    # Enough decode steps for the first requests (at most 7 + 4 + 7), never for the aborted
    # one's 150 tokens: it is still running, held, when the abort arrives.
    gate.allow(40)
    settings = http_settings(tiny_model_dir, max_batch_size=1, auth=AuthSettings(tokens=(TOKEN,)))
    async with serving(settings, gate=gate) as server:
        engine = server.registry.default.engine
        script = "tests/interop/openai_sdk.cjs"
        running = asyncio.ensure_future(run_tool(node, script, base_url(server), TOKEN))
        try:
            await wait_until(lambda: engine.stats.abort_requests == 1, timeout=60, what="the Node abort")
        except BaseException:
            running.cancel()
            raise
        finally:
            gate.open()
        finished = await running
        assert finished.code == 0, finished.stderr
        assert await engine.wait_idle(5)
        async with AsyncClient(f"127.0.0.1:{server.port}", retries=False, token=TOKEN) as grpc_client:
            reference = await grpc_client.generate(
                [ChatMessage("user", "Name a colour")],
                GenerateOptions(sampling=Sampling(temperature=0.0), stopping=Stopping(8)),
            )
    report = json.loads(finished.stdout)
    assert report["chat"]["role"] == "assistant" and report["chat"]["text"] == reference.text
    assert report["chat"]["completionTokens"] == reference.completion_tokens
    assert report["chat"]["timing"]["total"] > 0
    assert report["completion"]["completionTokens"] >= 1
    assert report["stream"]["text"] == reference.text
    assert report["stream"]["completionTokens"] == reference.completion_tokens
    assert report["badRequest"] == {"status": 400, "param": "temperature", "type": "invalid_request_error"}
    assert report["unauthenticated"] == {"status": 401, "code": "token_invalid"}
    assert report["aborted"]["chunks"] == 1
    assert engine.stats.aborted == 1
    assert engine.stats.max_abort_latency_steps <= 1
    assert engine.stats.orphaned_steps == 0
