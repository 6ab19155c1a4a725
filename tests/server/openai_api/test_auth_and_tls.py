"""The HTTP API takes the gRPC server's bearer tokens (and their callers) and its TLS settings."""

from __future__ import annotations

import io
import json
import ssl
from pathlib import Path

import openai
import pytest

from tests.server.openai_api.conftest import base_url, http_settings
from tests.server.openai_api.raw_http import request
from tests.server.security.certificates import Authority
from tests.support.servers import serving
from tokenwire.server.config import AuthSettings, TlsSettings
from tokenwire.server.engine.types import Caller

CHAT = [{"role": "user", "content": "Hello"}]


async def test_bearer_tokens_guard_every_route_and_name_the_caller(
    tiny_model_dir: Path, access_lines: io.StringIO
) -> None:
    auth = AuthSettings(tokens=("alpha-secret",), callers=(Caller("alpha", weight=2.0),))
    async with serving(http_settings(tiny_model_dir, auth=auth)) as server:
        url = base_url(server)
        async with openai.AsyncOpenAI(base_url=url, api_key="wrong", max_retries=0) as intruder:
            with pytest.raises(openai.AuthenticationError) as wrong:
                await intruder.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2)
            with pytest.raises(openai.AuthenticationError):
                await intruder.models.list()
        async with openai.AsyncOpenAI(base_url=url, api_key="alpha-secret", max_retries=0) as alpha:
            answer = await alpha.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2)
            models = await alpha.models.list()
        assert server.http_port is not None
        # A body never read: the refusal costs a header check, whatever follows.
        missing = await request(server.http_port, "POST", "/v1/completions", {"prompt": "x"})
    assert wrong.value.body["code"] == "token_invalid"  # type: ignore[index]
    assert wrong.value.response.headers["www-authenticate"] == "Bearer"
    assert missing.status == 401 and missing.error()["code"] == "token_missing"
    assert answer.choices[0].message.role == "assistant" and [m.id for m in models.data] == ["tiny"]
    lines = [json.loads(text) for text in access_lines.getvalue().splitlines()]
    outcomes = [(line["method"], line["outcome"], line["caller"]) for line in lines]
    assert ("/v1/chat/completions", "ok", "alpha") in outcomes
    assert ("/v1/chat/completions", "unauthenticated", "anonymous") in outcomes
    assert ("/v1/completions", "unauthenticated", "anonymous") in outcomes


async def test_https_with_the_servers_certificate_and_mutual_tls(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    authority = Authority(tmp_path / "ca", "trusted")
    issued, client_identity = authority.server(), authority.client()
    tls = TlsSettings(cert=issued.cert, key=issued.key, client_ca=authority.cert)
    async with serving(http_settings(tiny_model_dir, tls=tls)) as server:
        trusting = ssl.create_default_context(cafile=str(authority.cert))
        trusting.load_cert_chain(str(client_identity.cert), str(client_identity.key))
        http_client = openai.DefaultAsyncHttpxClient(verify=trusting)
        async with openai.AsyncOpenAI(
            base_url=base_url(server, "https"), api_key="unused", max_retries=0, http_client=http_client
        ) as client:
            answer = await client.completions.create(model="tiny", prompt="Secure", max_tokens=3)
        anonymous = ssl.create_default_context(cafile=str(authority.cert))
        stranger = openai.DefaultAsyncHttpxClient(verify=anonymous)
        async with openai.AsyncOpenAI(
            base_url=base_url(server, "https"), api_key="unused", max_retries=0, http_client=stranger
        ) as client:
            with pytest.raises(openai.APIConnectionError):
                await client.completions.create(model="tiny", prompt="No certificate", max_tokens=3)
    assert answer.usage is not None and answer.usage.completion_tokens >= 1
