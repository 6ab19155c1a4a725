"""Before serving, tokenwire names what keeps ONNX Runtime from the device and the command that fixes it.

This machine has no GPU, NVIDIA driver or CUDA libraries, so the checks run against what is truly
missing here: the CPU build in the test environment, and the GPU build (without its CUDA and cuDNN
wheels, then next to the CPU build) in a fresh virtual environment.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tokenwire.server.models.runtime_check import (
    CUDA_PROVIDER,
    GPU_REQUIREMENT,
    RuntimeInstall,
    install_problem,
    runtime_problems,
)

ROOT = Path(__file__).resolve().parents[3]
PIP = "python -m pip"


def test_serve_with_cuda_on_the_cpu_build_exits_naming_it_and_the_command_that_fixes_it(
    tiny_model_dir: Path,
) -> None:
    serve = [sys.executable, "-m", "tokenwire.server.cli", "serve"]
    result = subprocess.run(
        [*serve, "--device", "cuda", "--model", str(tiny_model_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[0] == "tokenwire serve: ONNX Runtime cannot run with --device cuda here"
    assert "the CPU build of ONNX Runtime (onnxruntime " in lines[1]
    assert "has no CUDA execution provider" in lines[1]
    pip = f"{sys.executable} -m pip"
    assert lines[2] == f"  fix: {pip} uninstall -y onnxruntime && {pip} install '{GPU_REQUIREMENT}'"
    assert len(lines) == 3


def test_the_cpu_build_serves_cpu_and_auto_without_a_problem() -> None:
    assert runtime_problems("cpu") == []
    assert runtime_problems("auto") == []


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda"])
def test_no_onnx_runtime_at_all_is_named_with_the_build_the_device_needs(device: str) -> None:
    problem = install_problem(RuntimeInstall({}, ()), device, PIP)  # type: ignore[arg-type]
    assert problem is not None
    assert problem.missing == "ONNX Runtime is not installed"
    wanted = GPU_REQUIREMENT if device == "cuda" else "onnxruntime"
    assert problem.fix == f"{PIP} install '{wanted}'"


def test_a_build_whose_module_does_not_import_is_reinstalled() -> None:
    install = RuntimeInstall({"onnxruntime-gpu": "1.31.1"}, (), "ImportError: libfoo.so: missing")
    problem = install_problem(install, "cuda", PIP)
    assert problem is not None
    assert "does not import (ImportError: libfoo.so: missing)" in problem.missing
    assert problem.fix == f"{PIP} install --force-reinstall 'onnxruntime-gpu==1.31.1'"


def test_the_gpu_build_with_its_provider_leaves_the_libraries_to_check() -> None:
    install = RuntimeInstall({"onnxruntime-gpu": "1.31.1"}, (CUDA_PROVIDER, "CPUExecutionProvider"))
    assert install_problem(install, "cuda", PIP) is None


# Run in the fresh environment, which holds ONNX Runtime but not tokenwire: the check imports only
# the standard library, so it runs from the source tree.
CHECK_SCRIPT = """
import json
from tokenwire.server.models.runtime_check import runtime_problems
print(json.dumps([[p.missing, p.fix] for p in runtime_problems("cuda")]))
"""


def cuda_problems_in(python: Path) -> list[list[str]]:
    result = subprocess.run(
        [str(python), "-c", CHECK_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT / "server"), "PATH": "/usr/bin:/bin"},
        cwd=python.parent,
    )
    assert result.returncode == 0, result.stderr
    problems: list[list[str]] = json.loads(result.stdout)
    return problems


def pip_install(python: Path, *requirements: str) -> None:
    result = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *requirements],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.slow
def test_the_gpu_build_without_cuda_libraries_then_beside_the_cpu_build_is_diagnosed(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    pip = f"{python} -m pip"
    pip_install(python, "onnxruntime-gpu")  # without the [cuda,cudnn] extras: no CUDA libraries

    (driver, libraries) = cuda_problems_in(python)
    assert driver[0].startswith("the NVIDIA driver is not installed or not on the library path (libcuda.so.1")
    assert "no pip package provides it" in driver[1]
    version = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('onnxruntime-gpu'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert libraries[0].startswith(f"onnxruntime-gpu {version} cannot load libcu")
    assert "which its CUDA provider links against nor cuDNN 9 (libcudnn.so.9)" in libraries[0]
    assert libraries[1] == f"{pip} install '{GPU_REQUIREMENT}=={version}'"

    pip_install(python, "onnxruntime")  # the CPU build now shadows the GPU build's module
    (shadowed,) = cuda_problems_in(python)
    assert shadowed[0].startswith("onnxruntime ")
    assert f", onnxruntime-gpu {version} are installed together" in shadowed[0]
    reinstall = f"{pip} uninstall -y onnxruntime onnxruntime-gpu && {pip} install '{GPU_REQUIREMENT}'"
    assert shadowed[1] == reinstall
