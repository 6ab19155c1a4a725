"""Reliability suite settings: the CI scale by default, a heavier scale on request.

`pytest -m heavy tests/reliability` (or TOKENWIRE_RELIABILITY_HEAVY=1) runs the tests marked
`heavy`; without either, those are skipped with that hint, so plain `pytest` (and CI) runs the CI
variants only.
"""

from __future__ import annotations

import os

import pytest

HEAVY_ENV = "TOKENWIRE_RELIABILITY_HEAVY"


def heavy_requested(config: pytest.Config) -> bool:
    expression = str(config.getoption("markexpr", default="") or "")
    return os.environ.get(HEAVY_ENV, "") not in ("", "0") or (
        "heavy" in expression and "not heavy" not in expression
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if heavy_requested(config):
        return
    skip = pytest.mark.skip(
        reason=f"heavy variant: run with `pytest -m heavy tests/reliability` or {HEAVY_ENV}=1"
    )
    for item in items:
        if item.get_closest_marker("heavy") is not None:
            item.add_marker(skip)
