"""A measuring client in a process of its own, driven by one-line commands on its stdin.

The clients (innocent_client.py, ttft_client.py) print one JSON line when ready, then answer each
command (`start` opens a measuring window, `stop` closes it with its figures) with one JSON line.
In a process of its own, a client's measurements are not slowed by an attack the test runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


class MeasuringProcess:
    def __init__(self, module: str, *args: str) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        ready = json.loads(self._reply())
        assert ready.get("ready"), f"{module} never got going: {ready}"

    def _reply(self) -> str:
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        assert line, f"the measuring client exited with {self._process.poll()}"
        return line

    def command(self, name: str) -> dict[str, Any]:
        """Send `name` and return the client's one-line answer."""
        assert self._process.stdin is not None
        self._process.stdin.write(name + "\n")
        self._process.stdin.flush()
        reply: dict[str, Any] = json.loads(self._reply())
        return reply

    def close(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        self._process.terminate()
        self._process.wait(10)
