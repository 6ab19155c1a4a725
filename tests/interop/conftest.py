"""Interop tests drive clients no one here wrote (Node's grpc-js, buf curl) against a real server."""

from __future__ import annotations

import asyncio
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Finished:
    code: int
    stdout: str
    stderr: str


def require_tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"`{name}` is not on PATH: scripts/test installs Node.js and npm")
    return found


def require_node_module(module: str) -> None:
    if not (ROOT / "node_modules" / module / "package.json").is_file():
        pytest.fail(f"node_modules/{module} is missing: scripts/test runs `npm ci` first")


async def run_tool(*command: str, stdin: str | None = None, timeout: float = 60.0) -> Finished:
    """Run a command to its end (killed after `timeout` seconds) from the repository root."""
    process = await asyncio.create_subprocess_exec(
        *command,
        cwd=ROOT,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(
            process.communicate(stdin.encode() if stdin is not None else None), timeout
        )
    except TimeoutError:
        process.kill()
        await process.wait()
        raise AssertionError(f"{command[:3]} did not finish within {timeout}s") from None
    assert process.returncode is not None
    return Finished(process.returncode, out.decode(), err.decode())
