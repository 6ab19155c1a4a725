"""An Idempotency-Key header makes an HTTP request idempotent for its caller, through the same
admission and generation registry as GenerateRequest.idempotency_key on gRPC."""

from __future__ import annotations

import json

from tests.server.openai_api.raw_http import request
from tokenwire.server.app import TokenwireServer

BODY = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Hi"}],
    "max_tokens": 16,
    "temperature": 1.0,
}


async def test_the_same_key_returns_the_kept_result_and_another_request_under_it_is_409(
    http_server: TokenwireServer,
) -> None:
    assert http_server.http_port is not None
    port = http_server.http_port

    async def ask(body: dict[str, object], key: str) -> tuple[int, dict[str, object]]:
        reply = await request(port, "POST", "/v1/chat/completions", body, headers={"idempotency-key": key})
        return reply.status, json.loads(reply.body)

    first_status, first = await ask(BODY, "key-1")
    again_status, again = await ask(BODY, "key-1")
    other_status, other = await ask(BODY, "key-2")
    reused_status, reused = await ask({**BODY, "max_tokens": 8}, "key-1")
    assert first_status == again_status == other_status == 200
    # Unseeded sampling: only the kept result can repeat the first answer token for token.
    assert again["choices"] == first["choices"]
    assert other["choices"] != first["choices"]
    assert reused_status == 409
    assert reused["error"]["code"] == "idempotency_key_reused"  # type: ignore[index]
    assert reused["error"]["param"] == "idempotency-key"  # type: ignore[index]
