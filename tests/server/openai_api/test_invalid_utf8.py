"""Text that is not valid UTF-8 in a JSON body is a 400 naming its parameter, with one access-log
line: a lone surrogate spelled as JSON's escape ("\\ud800"), or bytes that are not UTF-8."""

from __future__ import annotations

import io
import json

import pytest

from tests.server.openai_api.raw_http import request
from tests.support.polling import wait_until
from tokenwire.server.app import TokenwireServer

CASES = {
    "escaped surrogate in a message": (
        "/v1/chat/completions",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "hi \\ud800 there"}]}',
        "messages[0].content",
    ),
    "escaped low surrogate in a later message": (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "\\uDC00"}]}',
        "messages[1].content",
    ),
    "escaped surrogate in a prompt": ("/v1/completions", b'{"prompt": "\\ud83d", "max_tokens": 2}', "prompt"),
    "escaped surrogate in a stop string": (
        "/v1/completions",
        b'{"prompt": "hi", "stop": ["ok", "\\ud800"]}',
        "stop[1]",
    ),
    "bytes that are not UTF-8 in a message": (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "caf\xe9"}]}',
        "messages[0].content",
    ),
    "surrogate bytes in a prompt": ("/v1/completions", b'{"prompt": "x\xed\xa0\x80y"}', "prompt"),
}


@pytest.mark.parametrize("case", sorted(CASES))
async def test_text_that_is_not_utf8_is_a_400_naming_its_parameter(
    case: str, http_server: TokenwireServer, access_lines: io.StringIO
) -> None:
    path, body, param = CASES[case]
    assert http_server.http_port is not None
    reply = await request(http_server.http_port, "POST", path, body)
    assert reply.status == 400, reply.body
    error = reply.error()
    assert error["param"] == param
    assert "UTF-8" in error["message"]
    await wait_until(lambda: bool(access_lines.getvalue()))
    (line,) = [json.loads(text) for text in access_lines.getvalue().splitlines()]
    assert (line["method"], line["outcome"]) == (path, "invalid")


async def test_a_paired_surrogate_escape_is_its_character(http_server: TokenwireServer) -> None:
    assert http_server.http_port is not None
    body = b'{"prompt": "smile \\ud83d\\ude00", "max_tokens": 2}'
    reply = await request(http_server.http_port, "POST", "/v1/completions", body)
    assert reply.status == 200, reply.body
