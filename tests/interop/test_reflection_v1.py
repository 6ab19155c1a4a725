"""Reflection v1 beside v1alpha, as clients no one here wrote use it.

buf curl is told to speak v1 only (`--reflect-protocol grpc-v1`: without v1 it fails with
UNIMPLEMENTED rather than falling back), so these pass only because v1 is served. The pinned
grpcurl (1.8.6) asks v1alpha; it describes v1's service through it, which shows v1's schema is
served under its own name. A raw call on each name shows both answer with the same bytes.
"""

from __future__ import annotations

import json

import grpc

from tests.interop.conftest import run_tool
from tests.interop.test_buf_curl import buf_curl
from tests.interop.test_grpcurl import grpcurl
from tokenwire.server.app import TokenwireServer

SERVICE = "tokenwire.v1.InferenceService"


async def test_buf_curl_lists_the_methods_over_reflection_v1(server: TokenwireServer) -> None:
    code, out, err = await buf_curl(
        server.port, "--reflect-protocol", "grpc-v1", "--list-methods", f"http://127.0.0.1:{server.port}"
    )
    assert code == 0, err
    methods = set(out.split())
    assert {f"{SERVICE}/Generate", f"{SERVICE}/GenerateStream", f"{SERVICE}/StreamGenerate"} <= methods
    assert "grpc.reflection.v1.ServerReflection/ServerReflectionInfo" in methods
    assert "grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo" in methods


async def test_buf_curl_calls_generate_with_the_schema_from_reflection_v1(server: TokenwireServer) -> None:
    body = {
        "prompt": "Hi",
        "sampling": {"temperature": 0},
        "stopping": {"maxNewTokens": 3, "ignoreEos": True},
    }
    code, out, err = await buf_curl(
        server.port,
        "--reflect-protocol",
        "grpc-v1",
        "-d",
        json.dumps(body),
        f"http://127.0.0.1:{server.port}/{SERVICE}/Generate",
    )
    assert code == 0, err
    assert json.loads(out)["usage"]["completionTokens"] == 3


async def test_grpcurl_describes_the_v1_service_with_v1_types(server: TokenwireServer) -> None:
    finished = await run_tool(
        grpcurl(), "-plaintext", f"127.0.0.1:{server.port}", "describe", "grpc.reflection.v1.ServerReflection"
    )
    assert finished.code == 0, finished.stderr
    assert (
        "rpc ServerReflectionInfo ( stream .grpc.reflection.v1.ServerReflectionRequest )" in finished.stdout
    )
    assert "returns ( stream .grpc.reflection.v1.ServerReflectionResponse )" in finished.stdout
    listed = await run_tool(grpcurl(), "-plaintext", f"127.0.0.1:{server.port}", "list")
    assert {
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
        SERVICE,
    } <= set(listed.stdout.split())


async def test_both_versions_answer_the_same_request_with_the_same_bytes(server: TokenwireServer) -> None:
    # ServerReflectionRequest{file_containing_symbol: "tokenwire.v1.InferenceService"}, written
    # out by hand (field 4, a string) so the test depends on neither version's generated code.
    symbol = SERVICE.encode()
    request = bytes([0x22, len(symbol)]) + symbol
    answers = {}
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        for version in ("v1", "v1alpha"):
            call = channel.stream_stream(f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo")(
                iter([request])
            )
            answers[version] = [response async for response in call]
    assert answers["v1"] == answers["v1alpha"]
    (answer,) = answers["v1"]
    assert b"tokenwire/v1/inference_service.proto" in answer
