"""Embeddings come from the hidden states transformers computes for the same weights.

Each layout's tiny model (the GPT in the Optimum layout, the Llama in the GenAI layout) has a
transformers twin with its weights (tests/server/model_tools/hf_twins.py). The runner's stateless
pass over a batch of inputs of different lengths (right-padded in one call) gives each input's
last hidden state (after the final norm) as transformers' `hidden_states[-1]`, to 1e-4, and both
poolings (last token, mean) of it match the same pooling of transformers' states.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch

from tests.server.model_tools.hf_twins import hf_tiny_gpt, hf_tiny_llama
from tokenwire.server.model_tools.tiny_gpt import TinyGptConfig, create_tiny_gpt
from tokenwire.server.models.loader import LoadSettings, load_model
from tokenwire.server.models.pooling import POOLING_CONFIG, Pooling, pool, read_pooling
from tokenwire.server.models.runner import HiddenStates, ModelRunnerError

INPUTS = [[5, 6, 7, 8, 9], [10, 11], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [42]]
TOLERANCE = 1e-4

TWINS: dict[str, Callable[[], Any]] = {
    "optimum": lambda: hf_tiny_gpt(TinyGptConfig()),
    "genai": hf_tiny_llama,
}


def reference_states(model: Any, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        output = model(torch.tensor([tokens]), output_hidden_states=True)
    states: np.ndarray = output.hidden_states[-1][0].numpy()
    return states


def test_a_runners_hidden_states_equal_transformers_for_every_input_of_a_batch(
    model_layout: str, default_model_dir: Path
) -> None:
    loaded = load_model(default_model_dir, LoadSettings())
    assert isinstance(loaded.runner, HiddenStates)
    assert loaded.info.embedding_size == 64
    twin = TWINS[model_layout]()
    got = loaded.runner.hidden_states(INPUTS)
    for tokens, states in zip(INPUTS, got, strict=True):
        expected = reference_states(twin, tokens)
        assert states.shape == expected.shape
        np.testing.assert_allclose(states, expected, atol=TOLERANCE, rtol=0)
        for pooling in Pooling:
            np.testing.assert_allclose(pool(states, pooling), pool(expected, pooling), atol=TOLERANCE, rtol=0)


def test_the_stateless_pass_leaves_generation_as_it_was(default_model_dir: Path) -> None:
    loaded = load_model(default_model_dir, LoadSettings())
    runner = loaded.runner
    before = runner.prefill(1, INPUTS[0], start=0)
    runner.release(1)
    assert isinstance(runner, HiddenStates)
    runner.hidden_states(INPUTS)
    after = runner.prefill(1, INPUTS[0], start=0)
    np.testing.assert_array_equal(before, after)


def test_pooling_is_the_last_token_unless_the_model_names_mean_pooling(tmp_path: Path) -> None:
    assert read_pooling(tmp_path) is Pooling.LAST
    (tmp_path / POOLING_CONFIG).parent.mkdir()
    (tmp_path / POOLING_CONFIG).write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    assert read_pooling(tmp_path) is Pooling.MEAN
    (tmp_path / POOLING_CONFIG).write_text(json.dumps({"pooling_mode_lasttoken": True}))
    assert read_pooling(tmp_path) is Pooling.LAST


def test_pooled_vectors_are_of_unit_length_and_pool_as_named() -> None:
    states = np.array([[3.0, 0.0], [0.0, 4.0]], dtype=np.float32)
    np.testing.assert_allclose(pool(states, Pooling.LAST), [0.0, 1.0])
    np.testing.assert_allclose(pool(states, Pooling.MEAN), [0.6, 0.8], rtol=1e-6)


def headless_model(tmp_path: Path) -> Path:
    """The tiny GPT whose logits come from an op no walk back to a head passes through."""
    model_dir = create_tiny_gpt(tmp_path / "headless", TinyGptConfig())
    graph = onnx.load(str(model_dir / "model.onnx"))
    for node in graph.graph.node:
        if "logits" in node.output:
            node.output[0] = "head_out"
            graph.graph.node.append(onnx.helper.make_node("Softmax", ["head_out"], ["logits"], axis=-1))
            break
    onnx.save(graph, str(model_dir / "model.onnx"))
    return model_dir


def test_a_graph_without_a_head_before_its_logits_serves_no_embeddings(tmp_path: Path) -> None:
    loaded = load_model(headless_model(tmp_path), LoadSettings())
    assert loaded.info.embedding_size == 0
    assert isinstance(loaded.runner, HiddenStates)
    with pytest.raises(ModelRunnerError, match="serves no embeddings"):
        loaded.runner.hidden_states(INPUTS)
