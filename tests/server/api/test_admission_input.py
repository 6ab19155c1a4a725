"""One admission for both edges: each edge hands over one plain input, admission imports no
protobuf, and a bound refuses a request in the same words whichever edge it came by."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import grpc
import pytest

from tests.server.openai_api.conftest import http_settings
from tests.server.openai_api.raw_http import request
from tests.support.servers import serving
from tokenwire.client import AsyncClient, ChatMessage, GenerateOptions, Sampling, Stopping, TokenwireError
from tokenwire.server.api import admission
from tokenwire.server.api.convert import admission_input
from tokenwire.server.openai_api.parsing import parse_chat
from tokenwire.v1 import inference_service_pb2 as pb


def test_admission_imports_no_protobuf() -> None:
    tree = ast.parse(Path(admission.__file__).read_text())
    imported = {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)} | {
        alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    }
    assert not {name for name in imported if name.startswith(("tokenwire.v1", "google.protobuf", "grpc"))}


def test_both_edges_leave_an_unset_priority_unset() -> None:
    grpc_spec = admission_input(
        pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="Hi")])
    ).convert()
    body = json.dumps({"messages": [{"role": "user", "content": "Hi"}]}).encode()
    http_spec = parse_chat(body, {}, "chatcmpl-1").admission_input().convert()
    assert grpc_spec.priority is None and http_spec.priority is None


async def test_a_bound_refuses_in_the_same_words_on_both_edges(tiny_model_dir: Path) -> None:
    too_many = 1025  # --max-messages is 1024
    async with serving(http_settings(tiny_model_dir)) as server:
        assert server.http_port is not None
        messages = [{"role": "user", "content": "x"}] * too_many
        over_http = await request(
            server.http_port, "POST", "/v1/chat/completions", {"model": "tiny", "messages": messages}
        )
        async with AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client:
            with pytest.raises(TokenwireError) as over_grpc:
                await client.generate(
                    [ChatMessage("user", "x")] * too_many,
                    GenerateOptions(sampling=Sampling(temperature=0.0), stopping=Stopping(max_new_tokens=1)),
                )
    assert over_grpc.value.code is grpc.StatusCode.INVALID_ARGUMENT
    [violation] = over_grpc.value.field_violations
    assert (violation.field, violation.description) == ("messages", "1025 messages, more than 1024")
    assert over_http.status == 400
    assert over_http.error()["param"] == "messages"
    assert over_http.error()["message"].endswith("1025 messages, more than 1024")
