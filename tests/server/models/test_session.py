"""Running a model step: ONNX Runtime's own failures reach the engine as ModelRunnerError."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenwire.server.models.runner import ModelRunnerError
from tokenwire.server.models.session import SessionSettings, create_session, run_bound


def test_a_step_onnx_runtime_refuses_fails_as_a_model_runner_error(tiny_model_dir: Path) -> None:
    session = create_session(tiny_model_dir / "model.onnx", SessionSettings(device="cpu"))
    binding = session.io_binding()
    binding.bind_output("logits", "cpu")  # and no inputs at all: ONNX Runtime refuses the run

    with pytest.raises(ModelRunnerError, match="model step failed") as failed:
        run_bound(session, binding)
    assert failed.value.__cause__ is not None  # ONNX Runtime's own error stays attached
