"""/v1/embeddings and the Embed RPC on a real server: the official SDK (float and base64), the
gRPC edge, every refusal a 400 naming its field on both edges, a model without hidden states, and
embeddings that run beside a generation without changing its tokens. (The response shapes are
checked against the vendored OpenAPI document in test_openapi_schema.py.)

The vectors are held to the engine's own pass (the runner's hidden states, pooled), which
tests/server/models/test_hidden_states.py holds to transformers.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import openai
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from tests.server.models.test_hidden_states import headless_model
from tests.server.openai_api.conftest import base_url, http_settings
from tests.server.openai_api.raw_http import request
from tests.support.servers import serving
from tokenwire.server.app import TokenwireServer
from tokenwire.server.engine.validation import RequestLimits
from tokenwire.server.models.pooling import pool
from tokenwire.server.models.runner import HiddenStates
from tokenwire.v1 import inference_service_pb2 as pb
from tokenwire.v1 import inference_service_pb2_grpc as pb_grpc

TEXTS = ["The quick brown fox", "jumps", "over the lazy dog, twice over"]


@pytest.fixture
async def embedding_server(default_model_dir: Path) -> AsyncIterator[TokenwireServer]:
    limits = RequestLimits(max_embedding_inputs=4)
    async with serving(http_settings(default_model_dir, limits=limits)) as server:
        yield server


def expected_vectors(server: TokenwireServer, texts: list[str]) -> np.ndarray:
    """The engine's pass, one input at a time: what a client must get back, whatever the batch."""
    served = server.registry.default
    runner = served.model.runner
    assert isinstance(runner, HiddenStates)
    tokenizer = served.model.tokenizer
    return np.stack(
        [
            pool(runner.hidden_states([tokenizer.encode_as_text(text)])[0], served.model.info.pooling)
            for text in texts
        ]
    )


async def test_the_sdk_gets_the_same_vectors_as_floats_and_as_base64(
    embedding_server: TokenwireServer,
) -> None:
    client = openai.AsyncOpenAI(base_url=base_url(embedding_server), api_key="unused", max_retries=0)
    model = embedding_server.registry.default.name
    as_floats = await client.embeddings.create(model=model, input=TEXTS, encoding_format="float")
    as_base64 = await client.embeddings.create(model=model, input=TEXTS)  # the SDK asks for base64
    expected = await asyncio.to_thread(expected_vectors, embedding_server, TEXTS)
    for response in (as_floats, as_base64):
        assert [item.index for item in response.data] == [0, 1, 2]
        got = np.array([item.embedding for item in response.data])
        np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
        assert response.model == model
        assert response.usage.prompt_tokens == response.usage.total_tokens > len(TEXTS)
    single = await client.embeddings.create(model=model, input=TEXTS[1], encoding_format="float")
    np.testing.assert_allclose(single.data[0].embedding, expected[1], atol=1e-5, rtol=0)


async def test_token_id_inputs_embed_as_their_text_does(embedding_server: TokenwireServer) -> None:
    client = openai.AsyncOpenAI(base_url=base_url(embedding_server), api_key="unused", max_retries=0)
    model = embedding_server.registry.default.name
    tokens = embedding_server.registry.default.model.tokenizer.encode_as_text(TEXTS[0])
    by_ids = await client.embeddings.create(model=model, input=[tokens, tokens[:1]], encoding_format="float")
    by_text = await client.embeddings.create(model=model, input=TEXTS[0], encoding_format="float")
    np.testing.assert_allclose(by_ids.data[0].embedding, by_text.data[0].embedding, atol=1e-5, rtol=0)
    assert by_ids.usage.prompt_tokens == len(tokens) + 1


REFUSALS: list[tuple[dict[str, Any], int, str]] = [
    ({"input": []}, 400, "input"),
    ({"input": ""}, 400, "input[0]"),
    ({"input": ["a", "b", "c", "d", "e"]}, 400, "input"),
    ({"input": ["fine", "x " * 5000]}, 400, "input[1]"),
    ({"input": [[1, 2], [999999]]}, 400, "input[1]"),
    ({"input": "hi", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "hi", "dimensions": 8}, 400, "dimensions"),
    ({"input": "hi", "model": "no-such-model"}, 404, "model"),
    ({"input": "hi", "temperature": 1}, 400, "temperature"),
]


@pytest.mark.parametrize(
    ("body", "status", "param"), REFUSALS, ids=[r[2] + str(i) for i, r in enumerate(REFUSALS)]
)
async def test_bad_embedding_requests_are_refused_naming_the_field(
    embedding_server: TokenwireServer, body: dict[str, Any], status: int, param: str
) -> None:
    assert embedding_server.http_port is not None
    sent = {"model": embedding_server.registry.default.name, **body}
    reply = await request(embedding_server.http_port, "POST", "/v1/embeddings", sent)
    assert reply.status == status, reply.body
    assert json.loads(reply.body)["error"]["param"] == param


async def test_dimensions_equal_to_the_models_size_are_served(embedding_server: TokenwireServer) -> None:
    assert embedding_server.http_port is not None
    size = embedding_server.registry.default.engine.embedding_size
    body = {"model": embedding_server.registry.default.name, "input": "hi", "dimensions": size}
    reply = await request(embedding_server.http_port, "POST", "/v1/embeddings", body)
    assert reply.status == 200
    assert len(json.loads(reply.body)["data"][0]["embedding"]) == size


def grpc_violation(error: grpc.aio.AioRpcError) -> list[str]:
    status = rpc_status.from_call(error)
    assert status is not None
    bad_request = error_details_pb2.BadRequest()
    assert any(detail.Unpack(bad_request) for detail in status.details)
    return [v.field for v in bad_request.field_violations]


async def test_the_embed_rpc_returns_the_http_vectors_and_refuses_naming_the_field(
    embedding_server: TokenwireServer,
) -> None:
    expected = await asyncio.to_thread(expected_vectors, embedding_server, TEXTS)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{embedding_server.port}") as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        reply = await stub.Embed(pb.EmbedRequest(inputs=[pb.EmbedInput(text=t) for t in TEXTS]))
        got = np.array([list(e.values) for e in reply.embeddings])
        np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
        assert reply.pooling == "last" and reply.request_id.startswith("emb-")
        refusals = [
            (pb.EmbedRequest(), "inputs"),
            (pb.EmbedRequest(inputs=[pb.EmbedInput(text="a")] * 5), "inputs"),
            (pb.EmbedRequest(inputs=[pb.EmbedInput(text="a"), pb.EmbedInput(text="")]), "inputs[1]"),
            (pb.EmbedRequest(inputs=[pb.EmbedInput(text="a")], dimensions=3), "dimensions"),
        ]
        for bad, field in refusals:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stub.Embed(bad)
            assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert grpc_violation(raised.value) == [field]
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.Embed(pb.EmbedRequest(model="no-such-model", inputs=[pb.EmbedInput(text="a")]))
        assert raised.value.code() is grpc.StatusCode.NOT_FOUND


async def test_a_model_without_hidden_states_refuses_embeddings_naming_the_model(tmp_path: Path) -> None:
    async with serving(http_settings(headless_model(tmp_path))) as server:
        assert server.http_port is not None
        body = {"model": server.registry.default.name, "input": "hi"}
        reply = await request(server.http_port, "POST", "/v1/embeddings", body)
        assert reply.status == 400
        error = json.loads(reply.body)["error"]
        assert error["param"] == "model" and "serves no embeddings" in error["message"]


async def test_embeddings_beside_a_generation_leave_its_tokens_as_they_were(
    embedding_server: TokenwireServer,
) -> None:
    client = openai.AsyncOpenAI(base_url=base_url(embedding_server), api_key="unused", max_retries=0)
    model = embedding_server.registry.default.name

    async def generate() -> str:
        answer = await client.completions.create(
            model=model, prompt="Once upon", max_tokens=24, temperature=0
        )
        return answer.choices[0].text

    alone = await generate()
    embeddings = [client.embeddings.create(model=model, input=TEXTS) for _ in range(6)]
    beside, *embedded = await asyncio.gather(generate(), *embeddings)
    assert beside == alone
    assert all(len(response.data) == len(TEXTS) for response in embedded)
