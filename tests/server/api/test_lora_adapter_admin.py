"""LoRA adapters loaded and unloaded while a real server serves, through the admin RPC and its
HTTP routes: a loaded adapter serves what the same file loaded at start-up serves, loads are
bounded by --max-loras and refused naming the field, only an unrestricted caller manages them,
and an unload waits for the requests running with the adapter (they finish whole) while new
ones are refused at once.

One tiny Llama with LoRA sites (test_lora_adapter_edges.py's files) serves adapter a0 from
start-up, with room for one more (--max-loras 2).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import openai
import pytest

from tests.conftest import tiny_settings
from tests.server.api.test_lora_adapter_edges import FULL, LIMITED, PROMPT, _bearer, _request, lora_files
from tests.server.openai_api.conftest import base_url
from tests.server.openai_api.raw_http import request
from tests.support.polling import wait_until
from tests.support.servers import serving
from tests.support.stepping import StepGate, gated
from tokenwire.client import TokenwireError
from tokenwire.server.app import TokenwireServer
from tokenwire.server.config import AuthSettings, LoraSource
from tokenwire.server.openai_api.settings import HttpSettings
from tokenwire.server.security.callers import parse_token_line
from tokenwire.v1 import adapter_admin_pb2 as admin_pb
from tokenwire.v1 import adapter_admin_pb2_grpc as admin_grpc
from tokenwire.v1 import inference_service_pb2 as pb
from tokenwire.v1 import inference_service_pb2_grpc as pb_grpc

__all__ = ["lora_files"]  # the module's fixture, used here too


def _settings(lora_files: tuple[Path, list[Path]]):  # type: ignore[no-untyped-def]
    model, adapters = lora_files
    callers = (parse_token_line(f"full {FULL}"), parse_token_line(f"limited {LIMITED} adapters=a0"))
    return tiny_settings(
        model,
        loras=(LoraSource("a0", adapters[0]),),
        max_loras=2,
        max_lora_rank=4,
        http=HttpSettings(port=0),
        auth=AuthSettings(tokens=tuple(t for t, _ in callers), callers=tuple(c for _, c in callers)),
    )


@pytest.fixture
async def server(lora_files: tuple[Path, list[Path]]) -> AsyncIterator[TokenwireServer]:
    async with serving(_settings(lora_files)) as running:
        yield running


async def _admin_error(call: object) -> TokenwireError:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call  # type: ignore[misc]
    return TokenwireError.from_rpc_error(raised.value)


async def test_an_adapter_loaded_at_run_time_serves_as_the_same_file_loaded_at_start_up(
    server: TokenwireServer, lora_files: tuple[Path, list[Path]]
) -> None:
    _, adapters = lora_files
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        admin = admin_grpc.AdapterAdminServiceStub(channel)
        stub = pb_grpc.InferenceServiceStub(channel)
        auth = _bearer(FULL)
        denied = await _admin_error(
            admin.LoadAdapter(
                admin_pb.LoadAdapterRequest(name="b0", path=str(adapters[0])), metadata=_bearer(LIMITED)
            )
        )
        missing = await _admin_error(
            admin.LoadAdapter(admin_pb.LoadAdapterRequest(name="b0", path="/nonexistent"), metadata=auth)
        )
        bad_name = await _admin_error(
            admin.LoadAdapter(
                admin_pb.LoadAdapterRequest(name="tiny:b0", path=str(adapters[0])), metadata=auth
            )
        )
        taken = await _admin_error(
            admin.LoadAdapter(admin_pb.LoadAdapterRequest(name="a0", path=str(adapters[1])), metadata=auth)
        )
        loaded = await admin.LoadAdapter(
            admin_pb.LoadAdapterRequest(name="b0", path=str(adapters[0])), metadata=auth
        )
        full = await _admin_error(
            admin.LoadAdapter(admin_pb.LoadAdapterRequest(name="b1", path=str(adapters[1])), metadata=auth)
        )
        listed = await stub.ListModels(pb.ListModelsRequest(), metadata=auth)
        at_start = await stub.Generate(_request("a0"), metadata=auth)
        at_run_time = await stub.Generate(_request("b0"), metadata=auth)
    assert denied.code is grpc.StatusCode.PERMISSION_DENIED
    assert missing.code is grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in missing.field_violations] == ["path"]
    assert [v.field for v in bad_name.field_violations] == ["name"]
    assert taken.code is grpc.StatusCode.ALREADY_EXISTS
    assert full.code is grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-loras" in full.message
    assert (loaded.adapter.name, loaded.adapter.base, loaded.adapter.rank) == ("b0", "tiny", 4)
    assert loaded.adapter.memory_bytes > 0 and loaded.free_slots == 0
    assert [a.name for a in listed.models[0].adapters] == ["a0", "b0"]
    assert list(at_run_time.token_ids) == list(at_start.token_ids)


async def test_unloading_an_adapter_in_use_refuses_new_requests_and_waits_for_the_running_ones(
    lora_files: tuple[Path, list[Path]],
) -> None:
    gate = StepGate()
    async with (
        serving(_settings(lora_files), wrap_model=gated(gate)) as server,
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        admin = admin_grpc.AdapterAdminServiceStub(channel)
        stub = pb_grpc.InferenceServiceStub(channel)
        auth = _bearer(FULL)
        expected_tokens = 6
        running = asyncio.ensure_future(stub.Generate(_request("a0"), metadata=auth))
        await wait_until(lambda: gate.waiting == 1, what="the a0 request decoding")
        unloading = asyncio.ensure_future(
            admin.UnloadAdapter(admin_pb.UnloadAdapterRequest(name="a0"), metadata=auth)
        )
        served = server.registry.default
        await wait_until(lambda: "a0" not in served.adapters.names, what="a0 taken from new requests")
        refused = await _admin_error(stub.Generate(_request("a0"), metadata=auth))
        # The running request holds the unload: its slot is still in use.
        assert not unloading.done()
        assert served.model.adapters is not None and "a0" in served.model.adapters.names
        gate.open()
        finished = await running
        unloaded = await unloading
        again = await admin.LoadAdapter(
            admin_pb.LoadAdapterRequest(name="a0", path=str(lora_files[1][0])), metadata=auth
        )
        after = await stub.Generate(_request("a0"), metadata=auth)
    assert refused.code is grpc.StatusCode.NOT_FOUND
    assert [v.field for v in refused.field_violations] == ["adapter"]
    assert len(finished.token_ids) == expected_tokens
    assert unloaded.freed_bytes > 0 and unloaded.free_slots == 2
    assert again.free_slots == 1
    assert list(after.token_ids) == list(finished.token_ids)


async def test_the_http_routes_load_and_unload_as_vllm_names_them(
    server: TokenwireServer, lora_files: tuple[Path, list[Path]]
) -> None:
    port = server.http_port
    assert port is not None
    full = {"authorization": f"Bearer {FULL}"}
    path = str(lora_files[1][1])
    denied = await request(
        port,
        "POST",
        "/v1/load_lora_adapter",
        {"lora_name": "b1", "lora_path": path},
        headers={"authorization": f"Bearer {LIMITED}"},
    )
    no_path = await request(port, "POST", "/v1/load_lora_adapter", {"lora_name": "b1"}, headers=full)
    bad_file = await request(
        port, "POST", "/v1/load_lora_adapter", {"lora_name": "b1", "lora_path": "/nonexistent"}, headers=full
    )
    loaded = await request(
        port, "POST", "/v1/load_lora_adapter", {"lora_name": "b1", "lora_path": path}, headers=full
    )
    async with openai.AsyncOpenAI(base_url=base_url(server), api_key=FULL, max_retries=0) as client:
        served = await client.completions.create(model="tiny:b1", prompt=PROMPT, max_tokens=4, temperature=0)
        unloaded = await request(port, "POST", "/v1/unload_lora_adapter", {"lora_name": "b1"}, headers=full)
        with pytest.raises(openai.NotFoundError) as gone:
            await client.completions.create(model="tiny:b1", prompt=PROMPT, max_tokens=4)
        unknown = await request(port, "POST", "/v1/unload_lora_adapter", {"lora_name": "b1"}, headers=full)
    assert denied.status == 403
    assert no_path.status == 400 and no_path.error()["param"] == "lora_path"
    assert bad_file.status == 400 and bad_file.error()["param"] == "lora_path"
    assert loaded.status == 200, loaded
    body = json.loads(loaded.body)
    assert (body["id"], body["parent"], body["rank"], body["free_slots"]) == ("b1", "tiny", 4, 0)
    assert served.usage is not None and served.usage.completion_tokens == 4
    assert unloaded.status == 200 and json.loads(unloaded.body)["freed_bytes"] == body["memory_bytes"]
    assert gone.value.status_code == 404
    assert unknown.status == 404 and unknown.error()["param"] == "lora_name"
