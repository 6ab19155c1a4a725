"""Warm-up runs the model and leaves no trace: its slot is free and later outputs are unchanged."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tokenwire.server.models.loader import LoadSettings, load_model
from tokenwire.server.models.session import SessionSettings
from tokenwire.server.models.warmup import warm_up

SETTINGS = LoadSettings(max_batch_size=1, max_context_length=128, session=SessionSettings(device="cpu"))


@pytest.mark.parametrize("layout", ["optimum", "genai"])
def test_warm_up_frees_its_slot_and_changes_nothing(
    layout: str, tiny_model_dir: Path, tiny_llama_dir: Path
) -> None:
    model_dir = tiny_model_dir if layout == "optimum" else tiny_llama_dir
    cold = load_model(model_dir, SETTINGS).runner
    expected = cold.prefill(1, [5, 6, 7], start=0)
    warmed = load_model(model_dir, SETTINGS).runner
    assert warm_up(warmed) > 0
    # With a single slot, a prefill would fail if warm-up had kept it.
    assert np.array_equal(warmed.prefill(1, [5, 6, 7], start=0), expected)
