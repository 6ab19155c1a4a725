"""tokenwire-client installs alone, without the server's weight, and generates against a server.

The distribution is built from client/ and installed into a fresh virtual environment (its
dependencies come from the package index); a child process in that environment talks to a real
server this test starts.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.options import greedy
from tokenwire.client import AsyncClient
from tokenwire.server.app import TokenwireServer

ROOT = Path(__file__).resolve().parents[2]

# Run in the client-only environment: which heavy modules it could import, and one generation.
CLIENT_ONLY_SCRIPT = """
import importlib.util, json, sys
from tokenwire.client import Client, GenerateOptions, Sampling, Stopping

importable = {name: importlib.util.find_spec(name) is not None for name in sys.argv[2:]}
options = GenerateOptions(
    sampling=Sampling(temperature=0.0), stopping=Stopping(max_new_tokens=8, ignore_eos=True)
)
with Client(sys.argv[1]) as client:
    result = client.generate("Hello", options)
print(json.dumps({"importable": importable, "token_ids": list(result.token_ids), "text": result.text}))
"""

SERVER_ONLY_MODULES = ("onnxruntime", "onnx", "gguf", "numpy", "tokenwire.server")


@pytest.fixture(scope="module")
def client_only_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The interpreter of a fresh virtual environment holding tokenwire-client and its dependencies."""
    venv = tmp_path_factory.mktemp("client-only") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    installed = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", str(ROOT / "client")],
        capture_output=True,
        text=True,
    )
    assert installed.returncode == 0, installed.stderr[-4000:]
    return python


@pytest.mark.parametrize("model_layout", ["optimum"])
async def test_client_distribution_alone_generates_without_the_server_dependencies(
    client_only_python: Path, server: TokenwireServer
) -> None:
    address = f"127.0.0.1:{server.port}"
    process = await asyncio.create_subprocess_exec(
        str(client_only_python),
        "-c",
        CLIENT_ONLY_SCRIPT,
        address,
        *SERVER_ONLY_MODULES,
        cwd=client_only_python.parent,  # not the checkout, whose sources would be importable
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=120)
    assert process.returncode == 0, err.decode()
    report = json.loads(out)
    assert report["importable"] == dict.fromkeys(SERVER_ONLY_MODULES, False)

    async with AsyncClient(address, retries=False) as client:
        expected = await client.generate("Hello", greedy(8))
    assert report["token_ids"] == list(expected.token_ids)
    assert report["text"] == expected.text
    assert len(report["token_ids"]) == 8
