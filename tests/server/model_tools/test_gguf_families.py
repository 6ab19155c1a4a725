"""Each supported GGUF family converts into a graph that computes what its definition says.

The synthetic files (synthetic_gguf.py) carry each family's own tensors and metadata; the numpy
reference (llama_reference.py) is written from the families' Hugging Face definitions and reads
the same numbers back with gguf.quants, so it shares nothing with the importer or the builder.
Sliding windows are shorter than the prompts, in prefill, in chunked prefill and in decode.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.server.model_tools.llama_reference import forward, mean_kl
from tests.server.model_tools.shared_buffer_driver import SharedBufferDriver
from tests.server.model_tools.synthetic_gguf import (
    FAMILY_CASES,
    MIXED_FORMATS,
    VOCAB,
    WINDOW,
    SyntheticGguf,
    exact_model,
    write_synthetic_gguf,
)
from tokenwire.server.model_tools.convert import convert_gguf


def _prompt(seed: int, length: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, VOCAB, size=length)]


@pytest.fixture(scope="module", params=sorted(FAMILY_CASES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> SyntheticGguf:
    path = tmp_path_factory.mktemp("families") / f"{request.param}.gguf"
    return write_synthetic_gguf(path, formats=MIXED_FORMATS, seed=3, **FAMILY_CASES[request.param])  # type: ignore[arg-type]


def test_prefill_matches_the_family_definition(family: SyntheticGguf, tmp_path: Path) -> None:
    prompt = _prompt(1, 21)
    logits = SharedBufferDriver(exact_model(family.path, tmp_path), slots=1, max_len=32).prefill(0, prompt)
    expected = forward(family.reference, prompt)
    assert expected.std() > 0.5
    np.testing.assert_allclose(logits, expected, atol=2e-4, rtol=0)


def test_chunked_prefill_and_decode_past_the_window(family: SyntheticGguf, tmp_path: Path) -> None:
    driver = SharedBufferDriver(exact_model(family.path, tmp_path), slots=2, max_len=40)
    tokens = _prompt(2, 30)
    expected = forward(family.reference, tokens)
    # Slot 1 holds a shorter sequence, so the decode batch has rows at different lengths.
    other = _prompt(4, 5)
    driver.prefill(1, other)
    first = driver.prefill(0, tokens[:13])
    second = driver.prefill(0, tokens[13:20])
    np.testing.assert_allclose(np.concatenate([first, second]), expected[:20], atol=2e-4, rtol=0)
    other_expected = forward(family.reference, [*other, *tokens[20:]])
    for step, token in enumerate(tokens[20:]):
        rows = driver.decode([token, token])
        np.testing.assert_allclose(rows[0], expected[20 + step], atol=2e-4, rtol=0)
        np.testing.assert_allclose(rows[1], other_expected[5 + step], atol=2e-4, rtol=0)


def test_default_conversion_keeps_the_distribution(family: SyntheticGguf, tmp_path: Path) -> None:
    converted = convert_gguf(family.path, tmp_path / "converted")
    prompt = _prompt(5, 25)
    logits = SharedBufferDriver(converted, slots=1, max_len=32).prefill(0, prompt)
    expected = forward(family.reference, prompt)
    # int8 activations (MatMulNBits accuracy_level 4) are the only approximation left.
    assert mean_kl(expected, logits) < 0.005


def test_the_window_changes_the_result(tmp_path: Path) -> None:
    """A window shorter than the prompt is not a no-op: the same weights without it differ."""
    windowed = write_synthetic_gguf(tmp_path / "w.gguf", formats=MIXED_FORMATS, seed=3, sliding_window=WINDOW)
    full = write_synthetic_gguf(tmp_path / "f.gguf", formats=MIXED_FORMATS, seed=3)
    prompt = _prompt(1, 21)
    a, b = forward(windowed.reference, prompt), forward(full.reference, prompt)
    np.testing.assert_allclose(a[:WINDOW], b[:WINDOW], atol=1e-9)
    assert np.abs(a[WINDOW:] - b[WINDOW:]).max() > 0.05
