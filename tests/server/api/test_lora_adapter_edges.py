"""LoRA adapters at both edges of a real server: how they are named and listed, and every refusal
naming its field: an unknown adapter (NOT_FOUND / 404), one a caller's token is not given
(PERMISSION_DENIED / 403), bad start-up flags and a bad adapter file (one line naming it).

One tiny Llama with LoRA sites serves two PEFT adapters (a0, a1) to two callers: `full`, whose
token line sets no adapters (every one), and `limited`, given a0 only (`adapters=a0`).
"""

from __future__ import annotations

import argparse
import io
import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import openai
import pytest

from tests.conftest import tiny_settings
from tests.server.model_tools.hf_twins import hf_tiny_llama, make_peft_adapter
from tests.server.openai_api.conftest import base_url
from tests.support.prometheus import scrape
from tests.support.serve_process import serve_refused
from tests.support.servers import serving
from tokenwire.client import TokenwireError
from tokenwire.server import settings_sources
from tokenwire.server.app import TokenwireServer
from tokenwire.server.config import AuthSettings, LoraSource, TelemetrySettings
from tokenwire.server.model_tools.convert.lora_graph import LoraOptions
from tokenwire.server.model_tools.tiny_llama import create_tiny_llama
from tokenwire.server.models.adapters import AdapterError
from tokenwire.server.openai_api.settings import HttpSettings
from tokenwire.server.security.callers import parse_token_line
from tokenwire.v1 import inference_service_pb2 as pb
from tokenwire.v1 import inference_service_pb2_grpc as pb_grpc

FULL, LIMITED = "full-secret", "limited-secret"
PROMPT = [5, 17, 42, 99, 123, 7]


@pytest.fixture(scope="module")
def lora_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    work = tmp_path_factory.mktemp("lora-edges")
    model = create_tiny_llama(work / "model", lora=LoraOptions())
    adapters = [
        make_peft_adapter(
            hf_tiny_llama, work / f"a{i}", seed=20 + i, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]
        )
        for i in range(2)
    ]
    return model, adapters


@pytest.fixture
async def server(lora_files: tuple[Path, list[Path]]) -> AsyncIterator[TokenwireServer]:
    model, adapters = lora_files
    callers = (parse_token_line(f"full {FULL}"), parse_token_line(f"limited {LIMITED} adapters=a0"))
    settings = tiny_settings(
        model,
        loras=(LoraSource("a0", adapters[0]), LoraSource("a1", adapters[1])),
        max_lora_rank=4,
        http=HttpSettings(port=0),
        telemetry=TelemetrySettings(metrics_port=0),
        auth=AuthSettings(tokens=tuple(t for t, _ in callers), callers=tuple(c for _, c in callers)),
    )
    async with serving(settings) as running:
        yield running


def _bearer(token: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {token}"),)


def _request(adapter: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=PROMPT),
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_new_tokens=6, ignore_eos=True),
        adapter=adapter,
    )


async def _grpc_error(stub: pb_grpc.InferenceServiceStub, adapter: str, token: str) -> TokenwireError:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await stub.Generate(_request(adapter), metadata=_bearer(token))
    return TokenwireError.from_rpc_error(raised.value)


async def test_list_models_lists_each_adapter_with_its_base_rank_source_and_memory(
    server: TokenwireServer,
) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        listed = await pb_grpc.InferenceServiceStub(channel).ListModels(
            pb.ListModelsRequest(), metadata=_bearer(FULL)
        )
    (model,) = listed.models
    assert [(a.name, a.base, a.rank, a.source) for a in model.adapters] == [
        ("a0", "tiny", 4, "peft"),
        ("a1", "tiny", 4, "peft"),
    ]
    assert all(a.memory_bytes > 0 for a in model.adapters)


async def test_grpc_refuses_an_unknown_adapter_and_one_the_caller_lacks_naming_the_field(
    server: TokenwireServer,
) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        unknown = await _grpc_error(stub, "absent", FULL)
        denied = await _grpc_error(stub, "a1", LIMITED)
        allowed = await stub.Generate(_request("a0"), metadata=_bearer(LIMITED))
        other = await stub.Generate(_request("a1"), metadata=_bearer(FULL))
        base = await stub.Generate(_request(""), metadata=_bearer(LIMITED))
    assert unknown.code is grpc.StatusCode.NOT_FOUND
    assert [v.field for v in unknown.field_violations] == ["adapter"]
    assert "absent" in unknown.message and "a0, a1" in unknown.message
    assert denied.code is grpc.StatusCode.PERMISSION_DENIED
    assert [v.field for v in denied.field_violations] == ["adapter"]
    assert len(allowed.token_ids) == len(other.token_ids) == len(base.token_ids) == 6
    # The two adapters and the base are three models: their tokens are not all one sequence.
    assert len({tuple(allowed.token_ids), tuple(other.token_ids), tuple(base.token_ids)}) > 1


async def test_the_access_log_and_request_counts_name_the_adapter_a_request_ran_with(
    server: TokenwireServer, access_lines: io.StringIO
) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        await stub.Generate(_request("a1"), metadata=_bearer(FULL))
        await stub.Generate(_request(""), metadata=_bearer(FULL))
        await _grpc_error(stub, "a1", LIMITED)
        await _grpc_error(stub, "absent", FULL)
    assert server.metrics_port
    metrics = await scrape(server.metrics_port)
    lines = [json.loads(line) for line in access_lines.getvalue().splitlines()]
    # Only an adapter the request may run with is recorded: a refused name is the caller's text.
    assert [(line["caller"], line["code"], line["adapter"]) for line in lines] == [
        ("full", "OK", "a1"),
        ("full", "OK", None),
        ("limited", "PERMISSION_DENIED", None),
        ("full", "NOT_FOUND", None),
    ]
    counted = "tokenwire_server_requests_total"
    model = {"gen_ai_request_model": "tiny", "caller": "full"}
    assert metrics.value(counted, **model, outcome="ok", adapter="a1") == 1
    # The base model's series: the exporter gives every series of a counter the same labels.
    assert metrics.value(counted, **model, outcome="ok", adapter="") == 1
    assert "absent" not in metrics.text


def _openai(server: TokenwireServer, token: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url(server), api_key=token, max_retries=0)


async def test_the_openai_edge_names_adapters_in_model_as_vllm_does(server: TokenwireServer) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        expected = await stub.Generate(_request("a1"), metadata=_bearer(FULL))
    async with _openai(server, FULL) as client:
        models = await client.models.list()
        one = await client.models.retrieve("a1")
        by_pair = await client.completions.create(model="tiny:a1", prompt=PROMPT, max_tokens=6, temperature=0)
        by_name = await client.completions.create(model="a1", prompt=PROMPT, max_tokens=6, temperature=0)
    listed = {m.id: (m.model_extra or {}).get("parent") for m in models.data}
    assert listed == {"tiny": None, "a0": "tiny", "a1": "tiny"}
    assert (one.model_extra or {}).get("parent") == "tiny"
    assert by_pair.choices[0].text == by_name.choices[0].text == expected.text


async def test_the_openai_edge_refuses_unknown_and_withheld_adapters_naming_model(
    server: TokenwireServer,
) -> None:
    async with _openai(server, FULL) as client:
        with pytest.raises(openai.NotFoundError) as unknown:
            await client.completions.create(model="tiny:absent", prompt=PROMPT, max_tokens=2)
    async with _openai(server, LIMITED) as client:
        with pytest.raises(openai.PermissionDeniedError) as denied:
            await client.completions.create(model="a1", prompt=PROMPT, max_tokens=2)
        allowed = await client.completions.create(model="tiny:a0", prompt=PROMPT, max_tokens=2)
    assert unknown.value.status_code == 404
    assert isinstance(unknown.value.body, dict) and unknown.value.body["param"] == "model", unknown.value.body
    assert denied.value.status_code == 403
    assert isinstance(denied.value.body, dict) and denied.value.body["param"] == "model", denied.value.body
    assert allowed.usage is not None and allowed.usage.completion_tokens >= 1


def _problems(argv: list[str], model: Path) -> list[str]:
    parser = argparse.ArgumentParser()
    settings_sources.add_arguments(parser)
    with pytest.raises(settings_sources.SettingsError) as raised:
        settings_sources.load(parser.parse_args(["--model", str(model), *argv]), {})
    return list(raised.value.problems)


def test_bad_adapter_flags_are_start_up_errors_naming_the_flag(lora_files: tuple[Path, list[Path]]) -> None:
    model, adapters = lora_files
    a0, a1 = (str(path) for path in adapters)
    assert _problems(["--max-loras", "0"], model)[0].startswith("--max-loras:")
    assert _problems(["--max-lora-rank", "-1"], model)[0].startswith("--max-lora-rank:")
    assert _problems(["--lora", a0], model) == [f"--lora: {a0[:80]!r} is not NAME=PATH"]
    assert _problems(["--lora", f"x={a0}", "--lora", f"y={a1}", "--max-loras", "1"], model) == [
        "--lora: 2 adapters given, over --max-loras 1"
    ]
    (bad_name,) = _problems(["--lora", f"tiny:x={a0}"], model)
    assert bad_name.startswith("--lora: adapter name 'tiny:x' must be")
    assert _problems(["--lora", f"x={a0}", "--lora", f"x={a1}"], model) == [
        "--lora: two adapters are named 'x'"
    ]
    (missing,) = _problems(["--lora", "x=/nonexistent/adapter"], model)
    assert missing.startswith("--lora: x=/nonexistent/adapter is neither")


async def test_an_adapter_over_the_rank_bound_is_refused_at_load_in_one_line(
    lora_files: tuple[Path, list[Path]],
) -> None:
    model, adapters = lora_files
    settings = tiny_settings(model, loras=(LoraSource("wide", adapters[0]),), max_lora_rank=2)
    server = TokenwireServer(settings)
    try:
        await server.start()
        with pytest.raises(AdapterError) as raised:
            await server.load()
    finally:
        await server.stop(grace=0)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("adapter wide: ") and "rank 4, over the maximum LoRA rank 2" in message


def test_tokenwire_serve_exits_on_a_bad_adapter_file_with_one_line_naming_it(
    lora_files: tuple[Path, list[Path]], tmp_path: Path
) -> None:
    model, adapters = lora_files
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 0}', encoding="utf-8")
    over_rank = serve_refused(model, "--lora", f"wide={adapters[0]}", "--max-lora-rank", "2")
    bad_config = serve_refused(model, "--lora", f"broken={broken}")
    for finished, expected in (
        (
            over_rank,
            "adapter wide: module model.layers.0.self_attn.q_proj has rank 4, over the maximum LoRA rank 2",
        ),
        (bad_config, "adapter broken: adapter_config.json: r: must be a whole number of at least 1"),
    ):
        assert finished.returncode == 1, finished.stderr[-2000:]
        failures = [line for line in finished.stderr.splitlines() if "failed to load" in line]
        assert len(failures) == 1 and expected in failures[0], finished.stderr[-2000:]


async def test_lora_flags_on_a_graph_without_lora_sites_are_refused_at_load(
    tiny_model_dir: Path, lora_files: tuple[Path, list[Path]]
) -> None:
    settings = tiny_settings(tiny_model_dir, loras=(LoraSource("a0", lora_files[1][0]),))
    server = TokenwireServer(settings)
    try:
        await server.start()
        with pytest.raises(AdapterError, match=r"^--lora: model tiny's graph takes no LoRA adapters"):
            await server.load()
    finally:
        await server.stop(grace=0)


def test_a_token_line_s_adapters_option_is_the_caller_s_allow_list() -> None:
    assert parse_token_line("team tok adapters=a0,a1")[1].adapters == frozenset({"a0", "a1"})
    assert parse_token_line("team tok adapters=")[1].adapters == frozenset()
    assert parse_token_line("team tok")[1].adapters is None
    with pytest.raises(ValueError, match="adapter 'a:b' must be"):
        parse_token_line("team tok adapters=a:b")
