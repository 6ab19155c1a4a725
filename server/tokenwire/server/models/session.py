"""ONNX Runtime sessions: execution provider choice and session options."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from tokenwire.server.models.runner import ModelRunnerError
from tokenwire.server.models.runtime_check import CUDA_PROVIDER, Device

log = logging.getLogger(__name__)


CPU_PROVIDER = "CPUExecutionProvider"

FLOAT_TENSOR_TYPES: dict[str, np.dtype[np.floating]] = {
    "tensor(float)": np.dtype(np.float32),
    "tensor(float16)": np.dtype(np.float16),
}
"""The NumPy dtype of each ONNX float tensor type a runner can hold its KV cache and logits in."""


@dataclass(frozen=True)
class SessionSettings:
    device: Device = "auto"
    intra_op_threads: int = 0
    """Threads for one operator; 0 lets ONNX Runtime use one per physical core."""
    device_id: int = 0


def choose_provider(device: Device) -> str:
    available = ort.get_available_providers()
    if device == "cpu":
        return CPU_PROVIDER
    if device == "cuda":
        if CUDA_PROVIDER not in available:
            raise RuntimeError(
                "--device cuda was asked for, but this ONNX Runtime has no CUDA execution provider "
                f"(available: {', '.join(available)}); install onnxruntime-gpu"
            )
        return CUDA_PROVIDER
    return CUDA_PROVIDER if CUDA_PROVIDER in available else CPU_PROVIDER


def ort_device_name(provider: str) -> str:
    """The device name ONNX Runtime's IO binding uses for a provider's memory."""
    return "cuda" if provider == CUDA_PROVIDER else "cpu"


def run_bound(session: ort.InferenceSession, binding: ort.IOBinding) -> None:
    """Run one model step on bound inputs and outputs; a failure is a ModelRunnerError."""
    try:
        session.run_with_iobinding(binding)
    except Exception as error:  # ONNX Runtime raises plain RuntimeError and its Fail subclasses
        raise ModelRunnerError(f"model step failed: {error}") from error


def create_session(
    model_path: Path, settings: SessionSettings, *, graph: bytes | None = None
) -> ort.InferenceSession:
    """A session over `model_path`, or over `graph` (that file's graph, rewritten) whose external
    weights are read from the file's directory."""
    provider = choose_provider(settings.device)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if settings.intra_op_threads > 0:
        options.intra_op_num_threads = settings.intra_op_threads
    # One model call at a time runs in the engine thread, so inter-op parallelism only adds threads.
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    providers: list[str | tuple[str, dict[str, object]]]
    if provider == CUDA_PROVIDER:
        # onnxruntime-gpu finds CUDA and cuDNN from the nvidia-* Python packages only when asked to.
        if hasattr(ort, "preload_dlls"):
            ort.preload_dlls()
        providers = [(CUDA_PROVIDER, {"device_id": settings.device_id}), CPU_PROVIDER]
    else:
        providers = [CPU_PROVIDER]
    model: str | bytes = str(model_path)
    if graph is not None:
        model = graph
        options.add_session_config_entry(
            "session.model_external_initializers_file_folder_path", str(model_path.parent)
        )
    session = ort.InferenceSession(model, sess_options=options, providers=providers)
    log.info("loaded %s on %s", model_path.name, session.get_providers()[0])
    return session


def companion_session(model: bytes, beside: ort.InferenceSession) -> ort.InferenceSession:
    """A session for a small helper graph (`model`, serialized) on exactly the execution
    providers and provider options of `beside`, so it runs on the same device.

    Graph optimizations are off: a helper graph is a few nodes whose inputs and outputs are bound
    to memory the caller owns, and it must run as written. It runs on the calling thread alone
    (one intra-op thread): a pool of its own would only compete with the model's threads for the
    cores, for copies that memory bandwidth, not arithmetic, bounds."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    providers = beside.get_providers()
    provider_options = beside.get_provider_options()
    return ort.InferenceSession(
        model,
        sess_options=options,
        providers=providers,
        provider_options=[provider_options.get(provider, {}) for provider in providers],
    )
