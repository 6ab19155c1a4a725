"""Warm-up runs the model and leaves no trace: its slot is free and later outputs are unchanged."""

from __future__ import annotations

import numpy as np

from tests.support.tiny_models import TinyModel
from tokenwire.server.models.warmup import warm_up


def test_warm_up_frees_its_slot_and_changes_nothing(each_runner: TinyModel) -> None:
    cold = each_runner.runner(max_batch_size=1, max_context_length=128)
    expected = cold.prefill(1, [5, 6, 7], start=0)
    warmed = each_runner.runner(max_batch_size=1, max_context_length=128)
    assert warm_up(warmed) > 0
    # With a single slot, a prefill would fail if warm-up had kept it.
    assert np.array_equal(warmed.prefill(1, [5, 6, 7], start=0), expected)
