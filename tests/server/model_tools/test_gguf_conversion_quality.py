"""The converted default model keeps the GGUF's quality (needs the real model: run with -m slow).

The reference is a float64 numpy forward pass over the GGUF's own weights dequantized by the gguf
package, with llama.cpp's rotary convention: what the file means, computed without the converter.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from tests.server.model_tools.llama_reference import forward, mean_kl, perplexity, reference_from_gguf
from tests.server.model_tools.shared_buffer_driver import SharedBufferDriver
from tokenwire.server.model_tools.pull import DEFAULT_MODEL, pull_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def passage_ids(real_model_dir: Path, passage: str) -> list[int]:
    ids: list[int] = Tokenizer.from_file(str(real_model_dir / "tokenizer.json")).encode(passage).ids
    assert 300 < len(ids) < 600
    return ids


@pytest.fixture(scope="module")
def reference_logits(real_gguf: Path, passage_ids: list[int]) -> np.ndarray:
    return forward(reference_from_gguf(real_gguf), passage_ids)


def _converted_logits(model_dir: Path, ids: list[int]) -> np.ndarray:
    return SharedBufferDriver(model_dir, slots=1, max_len=len(ids), threads=2).prefill(0, ids)


def test_perplexity_within_one_percent_of_the_float_reference(
    real_model_dir: Path, passage_ids: list[int], reference_logits: np.ndarray
) -> None:
    reference = perplexity(reference_logits, passage_ids)
    converted = perplexity(_converted_logits(real_model_dir, passage_ids), passage_ids)
    assert abs(converted - reference) / reference < 0.01, (converted, reference)


def test_next_token_distributions_stay_close(
    real_model_dir: Path, passage_ids: list[int], reference_logits: np.ndarray
) -> None:
    logits = _converted_logits(real_model_dir, passage_ids)
    # Measured: KL ~0.003 nats and ~97% top-1 agreement, all of it from int8 activations
    # (the same graph in float32 compute agrees with the reference to 1e-4 logits).
    assert mean_kl(reference_logits, logits) < 0.01
    assert np.mean(reference_logits.argmax(-1) == logits.argmax(-1)) > 0.93


def _greedy(model_dir: Path, prompt: str, new_tokens: int) -> str:
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = tokenizer.encode(prompt).ids
    driver = SharedBufferDriver(model_dir, slots=1, max_len=len(ids) + new_tokens, threads=2)
    generated = [int(driver.prefill(0, ids)[-1].argmax())]
    for _ in range(new_tokens - 1):
        generated.append(int(driver.decode([generated[-1]])[0].argmax()))
    text: str = tokenizer.decode(generated)
    return text


def test_greedy_completion_knows_the_capital_of_france(real_model_dir: Path) -> None:
    assert _greedy(real_model_dir, "The capital of France is", 4).lstrip().startswith("Paris")


def test_chat_template_answer(real_model_dir: Path) -> None:
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    assert "Paris" in _greedy(real_model_dir, prompt, 12)


def test_float16_export_tracks_the_reference(
    real_model_home: Path, real_gguf: Path, passage_ids: list[int], reference_logits: np.ndarray
) -> None:
    model_dir = pull_model(DEFAULT_MODEL, home=real_model_home, progress=False, dtype="float16")
    logits = _converted_logits(model_dir, passage_ids)
    reference = perplexity(reference_logits, passage_ids)
    assert abs(perplexity(logits, passage_ids) - reference) / reference < 0.02
