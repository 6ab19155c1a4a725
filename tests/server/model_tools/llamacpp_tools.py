"""The llama.cpp tools the `llamacpp` tests compare against (scripts/llamacpp-tools)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def llamacpp_tools() -> Path:
    """The tools' home, built on first use (llama-cpp-python, a transformers venv, llama.cpp's
    source): its venv/, hfvenv/ and sdist/ folders."""
    result = subprocess.run(
        ["bash", str(REPO / "scripts" / "llamacpp-tools")],
        check=True,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    return Path(result.stdout.strip().splitlines()[-1])


def llamacpp_source(tools: Path) -> Path:
    """llama.cpp's source tree in the tools' source distribution (its Python converters)."""
    return next((tools / "sdist").glob("llama_cpp_python-*/vendor/llama.cpp"))


def repo_env() -> dict[str, str]:
    """This environment with the checkout's packages first on PYTHONPATH, for the scripts of
    benchmarks/gguf_families that the tests run in a child process."""
    paths = [str(REPO / "server"), str(REPO / "client"), str(REPO)]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
