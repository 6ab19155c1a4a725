"""create_tiny_llama writes a small, deterministic GenAI-layout model with a real tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from tokenizers import Tokenizer

from tests.server.model_tools.shared_buffer_driver import SharedBufferDriver
from tokenwire.server.model_tools.tiny_llama import create_tiny_llama
from tokenwire.server.model_tools.tiny_tokenizer import CHATML_TEMPLATE, END_OF_TEXT, TURN_END


def test_directory_holds_model_config_and_tokenizer(tiny_llama_dir: Path) -> None:
    names = {p.name for p in tiny_llama_dir.iterdir()}
    assert {"model.onnx", "genai_config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    assert "model.onnx.data" not in names  # small enough to keep the weights inline


def test_genai_config_names_both_end_tokens(tiny_llama_dir: Path) -> None:
    config = json.loads((tiny_llama_dir / "genai_config.json").read_text())["model"]
    tokenizer = Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json"))
    assert config["eos_token_id"] == [tokenizer.token_to_id(END_OF_TEXT), tokenizer.token_to_id(TURN_END)]
    assert config["pad_token_id"] == tokenizer.token_to_id(END_OF_TEXT)
    assert config["vocab_size"] == tokenizer.get_vocab_size() == 512
    decoder = config["decoder"]
    assert (decoder["num_hidden_layers"], decoder["num_attention_heads"], decoder["num_key_value_heads"]) == (
        2,
        4,
        2,
    )
    assert decoder["head_size"] * decoder["num_attention_heads"] == decoder["hidden_size"] == 64


def test_same_seed_same_model_other_seed_other_weights(tmp_path: Path) -> None:
    first = create_tiny_llama(tmp_path / "a", seed=5)
    again = create_tiny_llama(tmp_path / "b", seed=5)
    other = create_tiny_llama(tmp_path / "c", seed=6)
    read = lambda d: (d / "model.onnx").read_bytes()  # noqa: E731
    assert read(first) == read(again)
    assert read(first) != read(other)


def test_chat_template_is_optional(tmp_path: Path, tiny_llama_dir: Path) -> None:
    with_template = json.loads((tiny_llama_dir / "tokenizer_config.json").read_text())
    assert with_template["chat_template"] == CHATML_TEMPLATE
    plain = create_tiny_llama(tmp_path / "plain", chat_template=False)
    assert "chat_template" not in json.loads((plain / "tokenizer_config.json").read_text())


def test_custom_shape(tmp_path: Path) -> None:
    model_dir = create_tiny_llama(
        tmp_path / "wide", layers=3, hidden=96, heads=6, kv_heads=3, vocab=300, context_length=64
    )
    graph = onnx.load(str(model_dir / "model.onnx")).graph
    assert sum(node.op_type == "GroupQueryAttention" for node in graph.node) == 3
    driver = SharedBufferDriver(model_dir, slots=1, max_len=64)
    assert driver.prefill(0, [1, 2, 3]).shape == (3, 300)
    with pytest.raises(ValueError, match="multiple"):
        create_tiny_llama(tmp_path / "bad", hidden=50, heads=4)


def test_logits_are_spread_for_unambiguous_greedy_decoding(tiny_llama_dir: Path) -> None:
    driver = SharedBufferDriver(tiny_llama_dir, slots=1, max_len=64)
    logits = driver.prefill(0, list(range(10, 40)))
    top_two = np.sort(logits, axis=-1)[:, -2:]
    assert logits.std(axis=-1).min() > 1.0
    # Greedy choices clear the runner-up by far more than float32 noise.
    assert np.median(top_two[:, 1] - top_two[:, 0]) > 0.05
