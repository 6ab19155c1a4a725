"""Each supported GGUF family converts into a graph that computes what its definition says.

The synthetic files (synthetic_gguf.py) carry each family's own tensors and metadata; the numpy
reference (llama_reference.py) is written from the families' Hugging Face definitions and reads
the same numbers back with gguf.quants, so it shares nothing with the importer or the builder.
Sliding windows are shorter than the prompts, in prefill, in chunked prefill and in decode.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.server.model_tools.llama_reference import forward, mean_kl
from tests.server.model_tools.shared_buffer_driver import SharedBufferDriver
from tests.server.model_tools.synthetic_gguf import MIXED_FORMATS, VOCAB, SyntheticGguf, write_synthetic_gguf
from tokenwire.server.model_tools.convert import GraphOptions, build_llama_graph, convert_gguf, read_gguf
from tokenwire.server.model_tools.convert.llama_graph import save_model

WINDOW = 8  # shorter than every prompt below

CASES = {
    "llama": {},
    "mistral": {"arch": "llama", "sliding_window": WINDOW},
    "qwen2": {"arch": "qwen2"},
    "qwen3": {"arch": "qwen3"},
    "gemma2": {"arch": "gemma2", "sliding_window": WINDOW},
    "gemma3": {"arch": "gemma3", "sliding_window": WINDOW},
    "gemma3-global": {"arch": "gemma3"},
    "phi3": {"arch": "phi3"},
}


def _prompt(seed: int, length: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, VOCAB, size=length)]


@pytest.fixture(scope="module", params=sorted(CASES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> SyntheticGguf:
    path = tmp_path_factory.mktemp("families") / f"{request.param}.gguf"
    return write_synthetic_gguf(path, formats=MIXED_FORMATS, seed=3, **CASES[request.param])  # type: ignore[arg-type]


def _exact_model(synthetic: SyntheticGguf, directory: Path) -> Path:
    """float32 compute with exact offsets: only float32 rounding separates it from the reference."""
    source = read_gguf(synthetic.path)
    options = GraphOptions(accuracy_level=0, offsets="float")
    save_model(
        build_llama_graph(source.config, source.weights, options),
        directory / "model.onnx",
        external_data=False,
    )
    converted = convert_gguf(synthetic.path, directory / "converted")
    shutil.copy(converted / "genai_config.json", directory)
    return directory


def test_prefill_matches_the_family_definition(family: SyntheticGguf, tmp_path: Path) -> None:
    prompt = _prompt(1, 21)
    logits = SharedBufferDriver(_exact_model(family, tmp_path), slots=1, max_len=32).prefill(0, prompt)
    expected = forward(family.reference, prompt)
    assert expected.std() > 0.5
    np.testing.assert_allclose(logits, expected, atol=2e-4, rtol=0)


def test_chunked_prefill_and_decode_past_the_window(family: SyntheticGguf, tmp_path: Path) -> None:
    driver = SharedBufferDriver(_exact_model(family, tmp_path), slots=2, max_len=40)
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
