"""PEFT adapter directories: what is read, and every way a bad one is refused in one line.

The directories are written here byte by byte (safetensors is a length, a JSON header and raw
bytes), so each test breaks exactly one thing; test_lora_matches_peft.py reads what PEFT itself
writes.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tokenwire.server.model_tools.convert.lora_graph import LoraOptions
from tokenwire.server.model_tools.lora import AdapterError, read_peft_adapter
from tokenwire.server.model_tools.lora.safetensors_file import SafetensorsError, SafetensorsFile
from tokenwire.server.model_tools.tiny_llama import create_tiny_llama
from tokenwire.server.models.adapters import LoraLayout

PREFIX = "base_model.model.model.layers"
CODES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.float64): "F64"}


def write_safetensors(path: Path, tensors: dict[str, Any], *, header: dict[str, Any] | None = None) -> Path:
    """Tensors are numpy arrays, or (code, shape, raw bytes) for any dtype code; `header` entries
    replace the computed ones."""
    entries, blobs, offset = {}, [], 0
    for name, tensor in tensors.items():
        if isinstance(tensor, np.ndarray):
            code, shape, raw = (
                CODES[tensor.dtype],
                list(tensor.shape),
                tensor.astype(tensor.dtype.newbyteorder("<")).tobytes(),
            )
        else:
            code, shape, raw = tensor
        entries[name] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    entries.update(header or {})
    text = json.dumps({"__metadata__": {"format": "pt"}, **entries}).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    return path


def _pair(layer: int, module: str, rank: int, cols: int, out: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        f"{PREFIX}.{layer}.{module}.lora_A.weight": rng.standard_normal((rank, cols)).astype(np.float32),
        f"{PREFIX}.{layer}.{module}.lora_B.weight": rng.standard_normal((out, rank)).astype(np.float32),
    }


def write_adapter(directory: Path, tensors: dict[str, Any], **config: Any) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    settings = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "bias": "none", "use_dora": False} | config
    (directory / "adapter_config.json").write_text(json.dumps(settings))
    write_safetensors(directory / "adapter_model.safetensors", tensors)
    return directory


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> LoraLayout:
    import onnxruntime as ort

    model = create_tiny_llama(tmp_path_factory.mktemp("llama") / "m", lora=LoraOptions()) / "model.onnx"
    found = LoraLayout.from_session(ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]))
    assert found is not None
    return found


def test_scales_ranks_and_dtypes_are_read_as_peft_applies_them(tmp_path: Path, layout: LoraLayout) -> None:
    q = _pair(0, "self_attn.q_proj", 2, 64, 64, seed=1)
    down = _pair(1, "mlp.down_proj", 3, 192, 64, seed=2)
    a_name, b_name = list(down)
    tensors: dict[str, Any] = {**q, a_name: down[a_name].astype(np.float16)}
    # bfloat16: the top half of each float32; values chosen to be exact in it.
    b_values = np.round(down[b_name] * 8) / 8
    tensors[b_name] = (
        "BF16",
        list(b_values.shape),
        (b_values.astype("<f4").view("<u4") >> 16).astype("<u2").tobytes(),
    )
    directory = write_adapter(
        tmp_path / "a",
        tensors,
        r=2,
        lora_alpha=4,
        rank_pattern={"down_proj": 3},
        alpha_pattern={"layers.1.mlp.down_proj": 9},
    )
    adapter = read_peft_adapter(directory, layout, max_rank=4)
    assert set(adapter.updates) == {(0, "self_attn.q_proj"), (1, "mlp.down_proj")}
    q_update = adapter.updates[(0, "self_attn.q_proj")]
    np.testing.assert_array_equal(q_update.a, q[f"{PREFIX}.0.self_attn.q_proj.lora_A.weight"].T)
    np.testing.assert_allclose(q_update.b, 2.0 * q[f"{PREFIX}.0.self_attn.q_proj.lora_B.weight"].T, rtol=1e-6)
    down_update = adapter.updates[(1, "mlp.down_proj")]
    np.testing.assert_array_equal(down_update.a, down[a_name].astype(np.float16).astype(np.float32).T)
    np.testing.assert_allclose(down_update.b, 9 / 3 * b_values.T, rtol=1e-6)
    rslora = read_peft_adapter(
        write_adapter(tmp_path / "rs", q, r=2, lora_alpha=4, use_rslora=True), layout, max_rank=4
    )
    np.testing.assert_allclose(
        rslora.updates[(0, "self_attn.q_proj")].b,
        4 / np.sqrt(2) * q[f"{PREFIX}.0.self_attn.q_proj.lora_B.weight"].T,
        rtol=1e-6,
    )


GOOD = _pair(0, "self_attn.v_proj", 2, 64, 32)


@pytest.mark.parametrize(
    ("tensors", "config", "message"),
    [
        (
            GOOD,
            {"peft_type": "IA3"},
            "adapter_config.json: peft_type: is 'IA3'; only LORA adapters are served",
        ),
        (GOOD, {"use_dora": True}, "use_dora: the adapter uses DoRA, which is not supported"),
        (GOOD, {"bias": "lora_only"}, "bias: is 'lora_only'; trained biases are not supported"),
        (GOOD, {"modules_to_save": ["lm_head"]}, "modules_to_save: the adapter uses fully trained modules"),
        (GOOD, {"r": 0}, "r: must be a whole number of at least 1, got 0"),
        (
            GOOD,
            {"rank_pattern": {"q_proj|v_proj": 4}},
            "rank_pattern: key 'q_proj|v_proj' is not a plain module name",
        ),
        (
            GOOD,
            {"r": 4},
            "module model.layers.0.self_attn.v_proj has rank 2, but adapter_config.json gives it r = 4",
        ),
        (
            _pair(0, "self_attn.v_proj", 6, 64, 32),
            {"r": 6},
            "module model.layers.0.self_attn.v_proj has rank 6, over the maximum LoRA rank 4",
        ),
        (
            _pair(0, "self_attn.v_proj", 2, 128, 64),
            {},
            "maps 128 to 64 features, but the model's layer 0 self_attn.v_proj maps 64 to 32: "
            "the adapter was made for another base model",
        ),
        (
            {
                k.replace("model.layers.0.self_attn.v_proj", "transformer.h.0.attn.c_attn"): v
                for k, v in GOOD.items()
            },
            {},
            "adapts module attn.c_attn, which this model's graph takes no adapter for (it adapts mlp.",
        ),
        (
            {
                "base_model.model.lm_head.lora_A.weight": GOOD[f"{PREFIX}.0.self_attn.v_proj.lora_A.weight"],
                "base_model.model.lm_head.lora_B.weight": np.ones((512, 2), np.float32),
            },
            {},
            "adapts lm_head, which is not a projection inside a decoder layer",
        ),
        (
            {"base_model.model.model.embed_tokens.lora_embedding_A": np.ones((2, 512), np.float32)},
            {},
            "tensor base_model.model.model.embed_tokens.lora_embedding_A is not a LoRA A or B weight",
        ),
        (
            {
                f"{PREFIX}.0.self_attn.v_proj.lora_A.weight": GOOD[
                    f"{PREFIX}.0.self_attn.v_proj.lora_A.weight"
                ]
            },
            {},
            "module model.layers.0.self_attn.v_proj has no lora_B weight",
        ),
        (
            {**GOOD, f"{PREFIX}.0.self_attn.v_proj.lora_A.weight": np.ones((1, 2, 64), np.float32)},
            {},
            "has lora_A [1, 2, 64] and lora_B [32, 2], not [r, in] and [out, r]",
        ),
        ({}, {}, "holds no LoRA weights"),
    ],
)
def test_a_bad_adapter_is_refused_in_one_line_naming_the_problem(
    tmp_path: Path, layout: LoraLayout, tensors: dict, config: dict, message: str
) -> None:
    directory = write_adapter(tmp_path / "bad", tensors, **config)
    with pytest.raises(AdapterError) as refused:
        read_peft_adapter(directory, layout, max_rank=4)
    text = str(refused.value)
    assert text.startswith("adapter bad: ") and "\n" not in text
    assert message in text


def test_missing_and_pickled_files_are_refused(tmp_path: Path, layout: LoraLayout) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(AdapterError, match=r"^adapter empty: .* holds no adapter_config.json$"):
        read_peft_adapter(empty, layout, max_rank=4)
    (empty / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match=r"^adapter empty: adapter_config.json cannot be read as JSON"):
        read_peft_adapter(empty, layout, max_rank=4)
    (empty / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2}))
    (empty / "adapter_model.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(
        AdapterError, match=r"^adapter empty: holds adapter_model.bin, a pickle, which is not read"
    ):
        read_peft_adapter(empty, layout, max_rank=4)


A = np.ones((2, 4), np.float32)


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (
            {"a": {"dtype": "I64", "shape": [2, 4], "data_offsets": [0, 64]}},
            "tensor a has dtype I64, which is not supported",
        ),
        (
            {"a": {"dtype": "F32", "shape": [2, 5], "data_offsets": [0, 32]}},
            "tensor a has 32 bytes for shape [2, 5] of F32 (40 bytes)",
        ),
        ({"a": {"dtype": "F32", "shape": [2, 4], "data_offsets": [40, 72]}}, "tensor a needs bytes"),
        (
            {"a": {"dtype": "F32", "shape": [2, -4], "data_offsets": [0, 32]}},
            "tensor a has shape [2, -4], not a list of sizes",
        ),
        ({"b": {"dtype": "F32", "shape": [2, 4], "data_offsets": [16, 48]}}, "tensor a overlaps tensor b"),
        ({"a": [1, 2]}, "tensor a has no header entry object"),
    ],
)
def test_a_safetensors_header_that_lies_is_refused_before_any_tensor_is_read(
    tmp_path: Path, header: dict, message: str
) -> None:
    path = write_safetensors(tmp_path / "x.safetensors", {"a": A, "b": A}, header=header)
    with pytest.raises(SafetensorsError) as refused:
        SafetensorsFile(path)
    assert message in str(refused.value)


def test_a_truncated_or_foreign_file_is_refused(tmp_path: Path) -> None:
    path = write_safetensors(tmp_path / "x.safetensors", {"a": A})
    whole = path.read_bytes()
    path.write_bytes(whole[:-4])
    with pytest.raises(
        SafetensorsError, match=r"truncated or corrupt: tensor a needs bytes \d+-\d+, but the file has"
    ):
        SafetensorsFile(path)
    path.write_bytes(struct.pack("<Q", 1 << 40) + whole[8:])
    with pytest.raises(SafetensorsError, match=r"its header claims 1099511627776 bytes"):
        SafetensorsFile(path)
    path.write_bytes(whole)
    with pytest.raises(SafetensorsError, match=r"the bound is 16\)"):
        SafetensorsFile(path, max_header_bytes=16)
    text = b'{"a": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}, "a": {}}'
    path.write_bytes(struct.pack("<Q", len(text)) + text)
    with pytest.raises(SafetensorsError, match=r"header that is not JSON: key 'a' appears twice"):
        SafetensorsFile(path)
    path.write_bytes(b"PK\x03")
    with pytest.raises(SafetensorsError, match=r"is not a safetensors file: it has 3 bytes"):
        SafetensorsFile(path)
