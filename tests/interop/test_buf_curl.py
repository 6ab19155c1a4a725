"""`buf curl` (from npm, no local proto files: it learns the service through server reflection)
runs Generate and StreamGenerate, and reads the rich error of a bad request."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import grpc
import jsonschema
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from tests.interop.conftest import ROOT, require_node_module, require_tool, run_tool
from tests.reliability.recovery import assert_recovered
from tokenwire.client import AsyncClient, GenerateOptions, Sampling, Stopping
from tokenwire.server.app import TokenwireServer

SERVICE = "tokenwire.v1.InferenceService"


async def buf_curl(port: int, *arguments: str, stdin: str | None = None) -> tuple[int, str, str]:
    npx = require_tool("npx")
    require_node_module("@bufbuild/buf")
    finished = await run_tool(
        npx,
        "--no-install",
        "buf",
        "curl",
        "--protocol",
        "grpc",
        "--http2-prior-knowledge",
        *arguments,
        stdin=stdin,
    )
    return finished.code, finished.stdout, finished.stderr


def json_values(text: str) -> list[Any]:
    """The JSON documents buf curl printed one after another."""
    decoder = json.JSONDecoder()
    values, at = [], 0
    while (at := len(text) - len(text[at:].lstrip())) < len(text):
        value, at = decoder.raw_decode(text, at)
        values.append(value)
    return values


async def test_buf_curl_lists_the_methods_through_reflection(server: TokenwireServer) -> None:
    code, out, err = await buf_curl(server.port, "--list-methods", f"http://127.0.0.1:{server.port}")
    assert code == 0, err
    methods = set(out.split())
    rpcs = ("Generate", "GenerateStream", "StreamGenerate", "ListModels")
    assert {f"{SERVICE}/{rpc}" for rpc in rpcs} <= methods
    assert "grpc.health.v1.Health/Check" in methods


async def test_buf_curl_generate_returns_the_same_tokens_as_the_python_client(
    server: TokenwireServer,
) -> None:
    body = {
        "prompt": "The capital of France is",
        "sampling": {"temperature": 0},
        "stopping": {"maxNewTokens": 16},
    }
    code, out, err = await buf_curl(
        server.port, "-d", json.dumps(body), f"http://127.0.0.1:{server.port}/{SERVICE}/Generate"
    )
    assert code == 0, err
    response = json.loads(out)
    async with AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client:
        reference = await client.generate(
            "The capital of France is",
            GenerateOptions(sampling=Sampling(temperature=0.0), stopping=Stopping(max_new_tokens=16)),
        )
    assert response["tokenIds"] == list(reference.token_ids)
    assert response["text"] == reference.text
    assert response["usage"]["completionTokens"] == reference.completion_tokens
    assert response["finishReason"] == f"FINISH_REASON_{reference.finish_reason.name}"
    assert response["requestId"].startswith("gen-")
    await assert_recovered(server)


async def test_buf_curl_generate_with_n_returns_each_completion_as_a_choice(server: TokenwireServer) -> None:
    body = {
        "prompt": "The capital of France is",
        "n": 2,
        "sampling": {"temperature": 1.5, "seed": "31"},
        "stopping": {"maxNewTokens": 8, "ignoreEos": True},
    }
    code, out, err = await buf_curl(
        server.port, "-d", json.dumps(body), f"http://127.0.0.1:{server.port}/{SERVICE}/Generate"
    )
    assert code == 0, err
    response = json.loads(out)
    async with AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client:
        reference = await client.generate(
            "The capital of France is",
            GenerateOptions(
                sampling=Sampling(temperature=1.5, seed=31),
                stopping=Stopping(max_new_tokens=8, ignore_eos=True),
                n=2,
            ),
        )
    # proto3 JSON leaves out a field at its default: completion 0's index and the empty top level.
    choices = response["choices"]
    assert [choice.get("index", 0) for choice in choices] == [0, 1]
    assert [choice["tokenIds"] for choice in choices] == [list(c.token_ids) for c in reference.choices]
    assert [choice["finishReason"] for choice in choices] == ["FINISH_REASON_LENGTH"] * 2
    assert "tokenIds" not in response and "text" not in response
    assert response["usage"]["completionTokens"] == 16 == reference.completion_tokens
    await assert_recovered(server)


async def test_buf_curl_streams_two_generations_on_one_call(server: TokenwireServer) -> None:
    lines = "\n".join(
        json.dumps(
            {
                "generate": {
                    "requestId": rid,
                    "prompt": "Hi",
                    "stopping": {"maxNewTokens": n, "ignoreEos": True},
                }
            }
        )
        for rid, n in (("a", 5), ("b", 3))
    )
    code, out, err = await buf_curl(
        server.port, "-d", "@-", f"http://127.0.0.1:{server.port}/{SERVICE}/StreamGenerate", stdin=lines
    )
    assert code == 0, err
    events: dict[str, list[str]] = {}
    tokens: dict[str, list[int]] = {}
    for message in json_values(out):
        kind = next(k for k in message if k != "requestId")
        events.setdefault(message["requestId"], []).append(kind)
        if kind == "chunk":
            tokens.setdefault(message["requestId"], []).extend(message["chunk"]["tokenIds"])
    for request_id, count in (("a", 5), ("b", 3)):
        assert events[request_id][:2] == ["queued", "started"]
        assert events[request_id][-1] == "completed"
        assert len(tokens[request_id]) == count
    await assert_recovered(server)


def readme_stream_request() -> dict[str, Any]:
    """The StreamGenerate message the README's buf curl example pipes in."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    (line,) = [line for line in readme.splitlines() if line.startswith("echo '") and '"generate"' in line]
    loaded: dict[str, Any] = json.loads(line.removeprefix("echo '").rsplit("'", 1)[0])
    return loaded


async def stream_events(port: int, *messages: dict[str, Any]) -> list[dict[str, Any]]:
    code, out, err = await buf_curl(
        port,
        "-d",
        "@-",
        f"http://127.0.0.1:{port}/{SERVICE}/StreamGenerate",
        stdin="\n".join(json.dumps(m) for m in messages),
    )
    assert code == 0, err
    return json_values(out)


async def test_the_readme_stream_example_runs_twice_in_a_row_with_different_content(
    server: TokenwireServer,
) -> None:
    example = readme_stream_request()
    other = json.loads(json.dumps(example))
    other["generate"]["messages"][0]["content"] = "What is light?"
    finished_before = server.registry.default.engine.stats.finished
    for message in (example, other):
        events = await stream_events(server.port, message)
        kinds = [next(k for k in event if k != "requestId") for event in events]
        assert {event["requestId"] for event in events} == {example["generate"]["requestId"]}
        assert kinds[:2] == ["queued", "started"] and kinds[-1] == "completed", kinds
    assert server.registry.default.engine.stats.finished == finished_before + 2


async def test_buf_curl_sees_a_reused_idempotency_key_refused_naming_it(server: TokenwireServer) -> None:
    example = readme_stream_request()
    example["generate"]["idempotencyKey"] = "readme-key"
    example["generate"]["stopping"] = {"maxNewTokens": 4}
    other = json.loads(json.dumps(example))
    other["generate"]["messages"][0]["content"] = "What is light?"
    first = await stream_events(server.port, example)
    assert "completed" in first[-1]
    (refused,) = await stream_events(server.port, other)
    assert refused["error"]["code"] == grpc.StatusCode.ALREADY_EXISTS.value[0]
    assert "idempotency_key" in refused["error"]["message"]


async def test_buf_curl_shows_invalid_argument_with_its_bad_request_detail(server: TokenwireServer) -> None:
    code, _, err = await buf_curl(
        server.port, "-d", json.dumps({"prompt": ""}), f"http://127.0.0.1:{server.port}/{SERVICE}/Generate"
    )
    assert code != 0
    error = json.loads(err)
    assert error["code"] == "invalid_argument"
    assert "prompt" in error["message"]
    assert [d["type"] for d in error["details"]] == ["google.rpc.BadRequest"]


def decode_with_reflection(port: int, type_name: str, value: bytes) -> tuple[str, dict[str, Any]]:
    """The file the server's reflection serves for `type_name`, and `value` decoded with it in a
    pool that holds nothing else, as a reflection client such as grpcurl decodes it."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
        descriptor = pool.FindMessageTypeByName(type_name)
        message = message_factory.GetMessageClass(descriptor).FromString(value)
        return descriptor.file.name, json_format.MessageToDict(message)


async def test_the_bad_request_detail_buf_curl_prints_reads_as_json_with_the_served_schema(
    server: TokenwireServer,
) -> None:
    # buf curl prints a detail's bytes in base64 and decodes only the types built into buf itself;
    # the server's reflection serves google/rpc/error_details.proto, which turns them into JSON.
    code, _, err = await buf_curl(
        server.port, "-d", json.dumps({"prompt": ""}), f"http://127.0.0.1:{server.port}/{SERVICE}/Generate"
    )
    assert code != 0
    (detail,) = json.loads(err)["details"]
    assert detail["type"] == "google.rpc.BadRequest"
    value = base64.b64decode(detail["value"] + "=" * (-len(detail["value"]) % 4))

    served, readable = await asyncio.to_thread(decode_with_reflection, server.port, detail["type"], value)
    assert served == "google/rpc/error_details.proto"
    assert readable == {"fieldViolations": [{"field": "prompt", "description": "must not be empty"}]}


async def test_buf_curl_asks_for_json_that_validates_against_a_schema(server: TokenwireServer) -> None:
    schema = {
        "type": "object",
        "properties": {"label": {"enum": ["spam", "ham"]}, "score": {"type": "integer", "maximum": 9}},
        "required": ["label", "score"],
        "additionalProperties": False,
    }
    body = {
        "prompt": "Classify:",
        "sampling": {"temperature": 1, "seed": "5"},
        "responseFormat": {"jsonSchema": json.dumps(schema)},
    }
    code, out, err = await buf_curl(
        server.port, "-d", json.dumps(body), f"http://127.0.0.1:{server.port}/{SERVICE}/Generate"
    )
    assert code == 0, err
    response = json.loads(out)
    assert response["finishReason"] == "FINISH_REASON_EOS"
    jsonschema.validate(json.loads(response["text"]), schema)


async def test_buf_curl_sends_logit_bias_and_penalties_as_the_python_client_does(
    server: TokenwireServer,
) -> None:
    # In JSON a map's keys are strings: {"40": 100} is OpenAI's own spelling of a logit bias.
    body = {
        "prompt": "The capital of France is",
        "sampling": {
            "temperature": 0.8,
            "seed": "3",
            "logitBias": {"40": 100, "41": -100},
            "presencePenalty": 0.5,
            "frequencyPenalty": 1.5,
        },
        "stopping": {"maxNewTokens": 6, "ignoreEos": True},
    }
    code, out, err = await buf_curl(
        server.port, "-d", json.dumps(body), f"http://127.0.0.1:{server.port}/{SERVICE}/Generate"
    )
    assert code == 0, err
    response = json.loads(out)
    assert response["tokenIds"] == [40] * 6
    unforced = {**body, "sampling": {**body["sampling"], "logitBias": {"41": -100}}}
    code, out, err = await buf_curl(
        server.port, "-d", json.dumps(unforced), f"http://127.0.0.1:{server.port}/{SERVICE}/Generate"
    )
    assert code == 0, err
    async with AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client:
        reference = await client.generate(
            "The capital of France is",
            GenerateOptions(
                sampling=Sampling(
                    temperature=0.8,
                    seed=3,
                    logit_bias={41: -100.0},
                    presence_penalty=0.5,
                    frequency_penalty=1.5,
                ),
                stopping=Stopping(max_new_tokens=6, ignore_eos=True),
            ),
        )
    assert json.loads(out)["tokenIds"] == list(reference.token_ids)
    assert 41 not in reference.token_ids


async def test_buf_curl_reads_which_bias_or_penalty_was_refused(server: TokenwireServer) -> None:
    body = {"prompt": "Hi", "sampling": {"logitBias": {"50000": 1, "7": 250}, "presencePenalty": 3}}
    code, _, err = await buf_curl(
        server.port, "-d", json.dumps(body), f"http://127.0.0.1:{server.port}/{SERVICE}/Generate"
    )
    assert code != 0
    error = json.loads(err)
    assert error["code"] == "invalid_argument"
    (detail,) = error["details"]
    value = base64.b64decode(detail["value"] + "=" * (-len(detail["value"]) % 4))
    _, readable = await asyncio.to_thread(decode_with_reflection, server.port, detail["type"], value)
    assert [v["field"] for v in readable["fieldViolations"]] == [
        "sampling.presence_penalty",
        "sampling.logit_bias[7]",
        "sampling.logit_bias[50000]",
    ]
    assert "sampling.logit_bias[50000]" in error["message"]
