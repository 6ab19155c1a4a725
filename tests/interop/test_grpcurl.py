"""grpcurl, with no local proto files, reads a rich error's details as JSON.

grpcurl resolves the `google.protobuf.Any` details of a status through the server's reflection,
so this holds only because reflection serves `google/rpc/error_details.proto`. (buf curl prints
the same details as base64: its error printer knows only the types compiled into buf.)
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import pytest

from tests.interop.conftest import run_tool
from tokenwire.server.app import TokenwireServer

SERVICE = "tokenwire.v1.InferenceService"


def grpcurl() -> str:
    if platform.machine() != "x86_64" or sys.platform != "linux":
        pytest.skip("the grpcurl package carries an x86-64 Linux binary only")
    found = Path(sys.executable).parent / "grpcurl"
    if not found.is_file():
        pytest.fail("grpcurl is missing: scripts/test installs the dev extra, which carries it")
    return str(found)


async def test_grpcurl_shows_bad_request_details_as_json(server: TokenwireServer) -> None:
    finished = await run_tool(
        grpcurl(),
        "-plaintext",
        "-format-error",
        "-d",
        json.dumps({"prompt": "", "stopping": {"max_new_tokens": 4}}),
        f"127.0.0.1:{server.port}",
        f"{SERVICE}/Generate",
    )
    assert finished.code != 0
    status = json.loads(finished.stderr)
    assert status["code"] == 3  # INVALID_ARGUMENT
    [detail] = [d for d in status["details"] if d["@type"].endswith("google.rpc.BadRequest")]
    assert detail["field_violations"] == [{"field": "prompt", "description": "must not be empty"}]


async def test_grpcurl_shows_error_info_of_an_unknown_model_as_json(server: TokenwireServer) -> None:
    finished = await run_tool(
        grpcurl(),
        "-plaintext",
        "-format-error",
        "-d",
        json.dumps({"prompt": "Hello", "model": "no-such-model"}),
        f"127.0.0.1:{server.port}",
        f"{SERVICE}/Generate",
    )
    status = json.loads(finished.stderr)
    types = {detail["@type"].rsplit("/", 1)[1] for detail in status["details"]}
    # Every detail came back decoded (a field beside "@type"), none as an opaque base64 value.
    assert types, status
    assert all(set(detail) - {"@type", "value"} for detail in status["details"]), status
