"""convert_gguf turns a Llama GGUF into the GenAI directory layout, computing what llama.cpp would.

The synthetic GGUFs (see synthetic_gguf.py) are small; their reference forward pass reads the
file back with gguf.quants and uses llama.cpp's interleaved rotary embeddings on the file's own
Q/K rows, so it shares nothing with the converter.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from tokenizers import Tokenizer

from tests.server.model_tools.llama_reference import forward, mean_kl
from tests.server.model_tools.shared_buffer_driver import SharedBufferDriver
from tests.server.model_tools.synthetic_gguf import (
    CONTEXT,
    HEAD_DIM,
    HIDDEN,
    KV_HEADS,
    MIXED_FORMATS,
    VOCAB,
    SyntheticGguf,
    write_synthetic_gguf,
)
from tokenwire.server.model_tools.convert import (
    GraphOptions,
    UnsupportedModelError,
    build_llama_graph,
    convert_gguf,
    read_gguf,
)
from tokenwire.server.model_tools.convert.gguf_tokenizer import UnsupportedTokenizerError
from tokenwire.server.model_tools.convert.llama_graph import save_model
from tokenwire.server.model_tools.tiny_tokenizer import CHATML_TEMPLATE, END_OF_TEXT, TURN_END, TURN_START

EXPECTED_FILES = {
    "genai_config.json",
    "model.onnx",
    "model.onnx.data",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "conversion.json",
}


@pytest.fixture(scope="module")
def converted_mixed(mixed_gguf: SyntheticGguf, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return convert_gguf(mixed_gguf.path, tmp_path_factory.mktemp("converted") / "mixed")


def _prompt(seed: int, length: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, VOCAB, size=length)]


def test_directory_layout(converted_mixed: Path) -> None:
    assert {p.name for p in converted_mixed.iterdir()} == EXPECTED_FILES


def test_genai_config(converted_mixed: Path, mixed_gguf: SyntheticGguf) -> None:
    config = json.loads((converted_mixed / "genai_config.json").read_text())
    model, search = config["model"], config["search"]
    tokens = mixed_gguf.tokenizer.get_vocab()
    assert model["type"] == "llama"
    assert model["bos_token_id"] == tokens[TURN_START]
    # The declared EOS first, then the other end markers the vocabulary has.
    assert model["eos_token_id"] == [tokens[TURN_END], tokens[END_OF_TEXT]]
    assert model["pad_token_id"] == tokens[END_OF_TEXT]
    assert model["context_length"] == CONTEXT
    assert model["vocab_size"] == VOCAB
    decoder = model["decoder"]
    assert decoder["filename"] == "model.onnx"
    assert (decoder["head_size"], decoder["hidden_size"]) == (HEAD_DIM, HIDDEN)
    assert (decoder["num_attention_heads"], decoder["num_key_value_heads"], decoder["num_hidden_layers"]) == (
        4,
        2,
        2,
    )
    assert decoder["inputs"] == {
        "input_ids": "input_ids",
        "attention_mask": "attention_mask",
        "past_key_names": "past_key_values.%d.key",
        "past_value_names": "past_key_values.%d.value",
    }
    assert decoder["outputs"] == {
        "logits": "logits",
        "present_key_names": "present.%d.key",
        "present_value_names": "present.%d.value",
    }
    assert search["past_present_share_buffer"] is True
    assert search["max_length"] == CONTEXT
    assert search["do_sample"] is False


def test_graph_inputs_and_outputs(converted_mixed: Path) -> None:
    graph = onnx.load(str(converted_mixed / "model.onnx"), load_external_data=False).graph

    def described(values: list[onnx.ValueInfoProto]) -> dict[str, tuple[int, list[str | int]]]:
        out = {}
        for v in values:
            dims = [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            out[v.name] = (v.type.tensor_type.elem_type, dims)
        return out

    inputs, outputs = described(list(graph.input)), described(list(graph.output))
    f32, i64 = onnx.TensorProto.FLOAT, onnx.TensorProto.INT64
    assert inputs["input_ids"] == (i64, ["batch_size", "sequence_length"])
    assert inputs["attention_mask"] == (i64, ["batch_size", "total_sequence_length"])
    assert inputs["past_key_values.1.value"] == (
        f32,
        ["batch_size", KV_HEADS, "past_sequence_length", HEAD_DIM],
    )
    assert outputs["logits"] == (f32, ["batch_size", "sequence_length", VOCAB])
    assert outputs["present.0.key"] == (f32, ["batch_size", KV_HEADS, "total_sequence_length", HEAD_DIM])
    assert len(inputs) == 2 + 4
    assert len(outputs) == 1 + 4
    used = {node.op_type for node in graph.node}
    assert {
        "GroupQueryAttention",
        "MatMulNBits",
        "SkipSimplifiedLayerNormalization",
        "GatherBlockQuantized",
    } <= used


@pytest.mark.parametrize(
    ("offsets", "atol"),
    [
        ("float", 1e-4),  # float32 against float64 only
        # Plus folded offsets (within ~1/400 of a quantization step, see quantized.fold_offsets):
        # about 1% of the logits' spread; zero points alone (no remainder) miss by twice the spread.
        ("folded", 1e-2),
    ],
)
@pytest.mark.parametrize("which", ["mixed_gguf", "q4_1_gguf"])
def test_float_compute_matches_llama_cpp_semantics(
    which: str, offsets: str, atol: float, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    synthetic: SyntheticGguf = request.getfixturevalue(which)
    source = read_gguf(synthetic.path)
    options = GraphOptions(accuracy_level=0, offsets=offsets)  # type: ignore[arg-type]
    save_model(
        build_llama_graph(source.config, source.weights, options),
        tmp_path / "model.onnx",
        external_data=False,
    )
    converted = convert_gguf(synthetic.path, tmp_path / "converted")
    shutil.copy(converted / "genai_config.json", tmp_path)
    prompt = _prompt(1, 21)
    logits = SharedBufferDriver(tmp_path, slots=1, max_len=32).prefill(0, prompt)
    expected = forward(synthetic.reference, prompt)
    assert expected.std() > 0.5
    np.testing.assert_allclose(logits, expected, atol=atol, rtol=0)


@pytest.mark.parametrize("which", ["mixed_gguf", "q4_1_gguf"])
def test_default_conversion_keeps_the_distribution(
    which: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    synthetic: SyntheticGguf = request.getfixturevalue(which)
    converted = convert_gguf(synthetic.path, tmp_path / "converted")
    driver = SharedBufferDriver(converted, slots=2, max_len=48)
    prompt = _prompt(2, 25)
    logits = driver.prefill(0, prompt)
    expected = forward(synthetic.reference, prompt)
    # int8 activations (MatMulNBits accuracy_level 4) are the only approximation left.
    assert mean_kl(expected, logits) < 0.005
    assert np.mean(expected.argmax(-1) == logits.argmax(-1)) >= 0.9
    # Decoding one more token in the shared buffer continues the same sequence.
    step = driver.decode([7])[0]
    assert mean_kl(forward(synthetic.reference, [*prompt, 7])[-1:], step[None, :]) < 0.005


def test_float16_conversion_runs_and_tracks_float32(mixed_gguf: SyntheticGguf, tmp_path: Path) -> None:
    converted = convert_gguf(mixed_gguf.path, tmp_path / "fp16", dtype="float16")
    config = json.loads((converted / "genai_config.json").read_text())
    assert config["model"]["decoder"]["session_options"]["provider_options"] == [{"cuda": {}}]
    driver = SharedBufferDriver(converted, slots=1, max_len=32)
    prompt = _prompt(3, 12)
    logits = driver.prefill(0, prompt)
    assert logits.dtype == np.float32
    assert driver.buffers["key.0"].dtype == np.float16
    assert mean_kl(forward(mixed_gguf.reference, prompt), logits) < 0.01


def test_tokenizer_files(converted_mixed: Path, mixed_gguf: SyntheticGguf) -> None:
    tokenizer = Tokenizer.from_file(str(converted_mixed / "tokenizer.json"))
    for text in ["The capital of France is Paris.", "x = 42\n\tdone", "<|im_start|>user\nhi<|im_end|>\n"]:
        assert tokenizer.encode(text).ids == mixed_gguf.tokenizer.encode(text).ids
    config = json.loads((converted_mixed / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHATML_TEMPLATE
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == (
        TURN_START,
        TURN_END,
        END_OF_TEXT,
    )
    assert config["add_bos_token"] is False
    special = json.loads((converted_mixed / "special_tokens_map.json").read_text())
    assert special["eos_token"] == TURN_END


def test_converting_again_into_the_same_directory_replaces_the_weights(
    q4_1_gguf: SyntheticGguf, tmp_path: Path
) -> None:
    first = convert_gguf(q4_1_gguf.path, tmp_path / "out")
    size = (first / "model.onnx.data").stat().st_size
    convert_gguf(q4_1_gguf.path, tmp_path / "out")
    assert (first / "model.onnx.data").stat().st_size == size


def test_rejects_other_architectures(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        convert_gguf(path, tmp_path / "out")


def test_rejects_a_vocabulary_it_cannot_rebuild_before_converting_weights(tmp_path: Path) -> None:
    path = tmp_path / "spm.gguf"
    write_synthetic_gguf(path, formats=MIXED_FORMATS, tokenizer_model="llama")
    with pytest.raises(UnsupportedTokenizerError, match="scores"):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out" / "model.onnx").exists()


def test_rejects_unknown_dtype(mixed_gguf: SyntheticGguf, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="dtype"):
        convert_gguf(mixed_gguf.path, tmp_path / "out", dtype="bfloat16")
