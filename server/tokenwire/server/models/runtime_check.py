"""What stops ONNX Runtime from running here, found before serving starts, with the command that fixes it.

onnxruntime (the CPU build) and onnxruntime-gpu both install the `onnxruntime` module, so with both
installed the one installed last silently shadows the other. The GPU build loads CUDA, cuBLAS and
cuDNN only when a session asks for them, and a session that cannot load them falls back to the CPU
with a warning in the log. So `--device cuda` checks each piece up front: which distribution
provides the module, whether it has the CUDA provider, whether the provider's libraries and the
NVIDIA driver load, whether the driver is new enough and sees a device.

Only the standard library is imported at module level (onnxruntime inside the checks), so the
checks also run where ONNX Runtime is missing or broken; `Device` lives here for the same reason:
the settings name it without importing ONNX Runtime.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import importlib.metadata
import io
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Device = Literal["auto", "cpu", "cuda"]

CPU_DISTRIBUTION = "onnxruntime"
GPU_DISTRIBUTION = "onnxruntime-gpu"
# The extras bring CUDA's and cuDNN's libraries as nvidia-* wheels of the CUDA version the build needs.
GPU_REQUIREMENT = "onnxruntime-gpu[cuda,cudnn]"
CUDA_PROVIDER = "CUDAExecutionProvider"
DRIVER_LIBRARY = "libcuda.so.1"
CUDNN_LIBRARY = "libcudnn.so.9"  # the cuDNN major version every CUDA 12 and 13 build of ONNX Runtime uses

_CUDA_ERRORS = {
    3: "CUDA_ERROR_NOT_INITIALIZED",
    35: "CUDA_ERROR_INSUFFICIENT_DRIVER",
    100: "CUDA_ERROR_NO_DEVICE",
    101: "CUDA_ERROR_INVALID_DEVICE",
    999: "CUDA_ERROR_UNKNOWN",
}
_MISSING_LIBRARY = re.compile(r"^(\S+): cannot open shared object file")


@dataclass(frozen=True)
class Problem:
    missing: str
    """What is missing or wrong, in one sentence."""
    fix: str
    """The command (or the step, where no command can do it) that fixes it."""


@dataclass(frozen=True)
class RuntimeInstall:
    """The distributions that provide the `onnxruntime` module, and what importing it gives."""

    distributions: dict[str, str]
    """Name to version of every installed distribution that provides the `onnxruntime` module."""
    providers: tuple[str, ...]
    """Execution providers of the module as imported; empty when the import failed."""
    import_error: str | None = None


def pip_command() -> str:
    """pip of the interpreter that runs tokenwire, so the fix lands in the right environment."""
    return f"{shlex.quote(sys.executable)} -m pip"


def installed_runtime() -> RuntimeInstall:
    provided_by = importlib.metadata.packages_distributions().get("onnxruntime", [])
    names = sorted({name.lower().replace("_", "-") for name in provided_by})
    distributions = {name: importlib.metadata.version(name) for name in names}
    try:
        ort = importlib.import_module("onnxruntime")
    except ImportError as error:
        return RuntimeInstall(distributions, (), f"{type(error).__name__}: {error}")
    return RuntimeInstall(distributions, tuple(ort.get_available_providers()))


def install_problem(install: RuntimeInstall, device: Device, pip: str) -> Problem | None:
    """The problem with the installed distributions for `device` ("auto", "cpu" or "cuda"), if any."""
    wanted = GPU_REQUIREMENT if device == "cuda" else CPU_DISTRIBUTION
    if not install.distributions:
        return Problem("ONNX Runtime is not installed", f"{pip} install '{wanted}'")
    listed = ", ".join(f"{name} {version}" for name, version in install.distributions.items())
    if len(install.distributions) > 1:
        # Uninstalling one removes files the other shares, so all go and one returns: the GPU
        # build where there was one (it runs on the CPU too).
        keep = GPU_REQUIREMENT if GPU_DISTRIBUTION in install.distributions else wanted
        return Problem(
            f"{listed} are installed together; they share the `onnxruntime` module, so the one installed "
            "last silently shadows the other",
            f"{pip} uninstall -y {' '.join(install.distributions)} && {pip} install '{keep}'",
        )
    (name,) = install.distributions
    if install.import_error is not None:
        return Problem(
            f"the `onnxruntime` module of {listed} does not import ({install.import_error})",
            f"{pip} install --force-reinstall '{name}=={install.distributions[name]}'",
        )
    if device == "cuda" and CUDA_PROVIDER not in install.providers:
        build = f"the CPU build of ONNX Runtime ({listed})" if name == CPU_DISTRIBUTION else listed
        return Problem(
            f"{build} is installed, which has no CUDA execution provider "
            f"(it has {', '.join(install.providers)}); --device cuda needs {GPU_DISTRIBUTION}",
            f"{pip} uninstall -y {name} && {pip} install '{GPU_REQUIREMENT}'",
        )
    return None


def library_problems(pip: str) -> list[Problem]:
    """The NVIDIA driver, CUDA libraries and cuDNN the installed CUDA provider cannot load.

    The provider library names the CUDA libraries it links against, so loading it reports the first
    one missing exactly (ONNX Runtime loads the nvidia-* wheels' copies first); cuDNN is loaded by
    the provider only when a session starts, so it is loaded here by name.
    """
    ort = importlib.import_module("onnxruntime")
    version = importlib.metadata.version(GPU_DISTRIBUTION)
    problems: list[Problem] = []
    if hasattr(ort, "preload_dlls"):
        with contextlib.redirect_stdout(io.StringIO()):  # it prints each library it fails to find
            ort.preload_dlls(cuda=True, cudnn=True)
    driver_error = _load_error(DRIVER_LIBRARY)
    if driver_error is not None:
        problems.append(
            Problem(
                f"the NVIDIA driver is not installed or not on the library path ({driver_error})",
                "install the NVIDIA driver for this GPU from its vendor or the distribution "
                "(no pip package provides it), then run again",
            )
        )
    unloadable = []  # what the nvidia-* wheels of the [cuda,cudnn] extras provide
    capi = Path(str(ort.__file__)).parent / "capi"
    provider_error = _load_error(str(capi / "libonnxruntime_providers_shared.so"), global_symbols=True)
    if provider_error is None:
        provider_error = _load_error(str(capi / "libonnxruntime_providers_cuda.so"))
    if provider_error is not None:
        missing = _MISSING_LIBRARY.match(provider_error)
        if missing is None:
            unloadable.append(f"its CUDA provider ({provider_error})")
        elif missing.group(1) != DRIVER_LIBRARY:
            unloadable.append(f"{missing.group(1)}, which its CUDA provider links against")
    if _load_error(CUDNN_LIBRARY) is not None:
        unloadable.append(f"cuDNN 9 ({CUDNN_LIBRARY})")
    if unloadable:
        problems.append(
            Problem(
                f"{GPU_DISTRIBUTION} {version} cannot load {' nor '.join(unloadable)}",
                f"{pip} install '{GPU_REQUIREMENT}=={version}'",
            )
        )
    return problems


def device_problem(device_id: int) -> Problem | None:
    """A driver too old for the build's CUDA, or no device to run on (the driver loads)."""
    driver = ctypes.CDLL(DRIVER_LIBRARY)
    build_cuda = _build_cuda_version()
    found = ctypes.c_int(0)
    if build_cuda is not None and driver.cuDriverGetVersion(ctypes.byref(found)) == 0:
        supported = (found.value // 1000, found.value % 1000 // 10)
        if supported[0] < build_cuda[0]:
            needed = f"{build_cuda[0]}.{build_cuda[1]}"
            return Problem(
                f"the NVIDIA driver supports CUDA up to {supported[0]}.{supported[1]}, and the installed "
                f"{GPU_DISTRIBUTION} is built for CUDA {needed}",
                f"install an NVIDIA driver for CUDA {needed} or newer, then run again",
            )
    status = driver.cuInit(0)
    if status != 0:
        error = _CUDA_ERRORS.get(status, f"CUDA error {status}")
        return Problem(
            f"the NVIDIA driver finds no usable GPU (cuInit: {error})",
            "check that `nvidia-smi` lists the GPU and that CUDA_VISIBLE_DEVICES, if set, names it",
        )
    if driver.cuDeviceGetCount(ctypes.byref(found)) == 0 and found.value <= device_id:
        return Problem(
            f"CUDA device {device_id} was asked for and {found.value} are visible",
            "check that `nvidia-smi` lists the GPU and that CUDA_VISIBLE_DEVICES, if set, names it",
        )
    return None


def runtime_problems(device: Device, device_id: int = 0) -> list[Problem]:
    """Everything missing for ONNX Runtime to run on `device`, first things first; empty when nothing is."""
    pip = pip_command()
    problem = install_problem(installed_runtime(), device, pip)
    if problem is not None:
        return [problem]
    if device != "cuda" or sys.platform != "linux":
        return []
    problems = library_problems(pip)
    if problems:
        return problems
    found = device_problem(device_id)
    return [found] if found is not None else []


def _load_error(library: str, *, global_symbols: bool = False) -> str | None:
    """Why the dynamic loader cannot load `library`, or None when it loads."""
    try:
        ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL if global_symbols else ctypes.RTLD_LOCAL)
    except OSError as error:
        return str(error)
    return None


def _build_cuda_version() -> tuple[int, int] | None:
    """The CUDA version the installed onnxruntime-gpu was built for ("13.0" in its build info)."""
    try:
        info = importlib.import_module("onnxruntime.capi.build_and_package_info")
        major, minor = str(info.cuda_version).split(".")[:2]
        return int(major), int(minor)
    except (ImportError, AttributeError, ValueError):
        return None
