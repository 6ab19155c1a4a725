"""GGUF LoRA adapters on every family the converter serves give the family's definition with the
adapter merged in, through the converted graph's LoRA sites.

Each family's synthetic GGUF (synthetic_gguf.py) is built into an exact float graph with LoRA
sites; an adapter in convert_lora_to_gguf's layout (synthetic_gguf_lora.py) is read into a slot.
Prefill and decode with it must equal the numpy reference with `alpha / r * B @ A` added to
each weight, while a row without an adapter in the same batch keeps the base model's logits.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from tests.server.model_tools.llama_reference import ReferenceModel, forward
from tests.server.model_tools.shared_buffer_driver import SharedBufferDriver
from tests.server.model_tools.synthetic_gguf import (
    FAMILY_CASES,
    HEADS,
    KV_HEADS,
    MIXED_FORMATS,
    VOCAB,
    exact_model,
    write_synthetic_gguf,
)
from tests.server.model_tools.synthetic_gguf_lora import PHI3_TENSORS, write_gguf_lora
from tokenwire.server.model_tools.convert.lora_graph import LoraOptions
from tokenwire.server.model_tools.lora import AdapterBase, AdapterError, read_adapter
from tokenwire.server.models.adapters import AdapterStacks, LoraLayout

RANK = 4
ATOL = 2e-4  # the families' own tolerance against the reference (test_gguf_families.py)


def _prompt(seed: int, length: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, VOCAB, size=length)]


@pytest.fixture(scope="module", params=[case for case in sorted(FAMILY_CASES) if case != "gemma3-global"])
def family(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path, Path, ReferenceModel, ReferenceModel]:
    work = tmp_path_factory.mktemp(request.param)
    options = FAMILY_CASES[request.param]
    arch = str(options.get("arch", "llama"))
    base = write_synthetic_gguf(work / "base.gguf", formats=MIXED_FORMATS, seed=3, **options)  # type: ignore[arg-type]
    tensors = {"tensors": PHI3_TENSORS} if arch == "phi3" else {}
    # One family's A in Q8_0, as convert_lora_to_gguf --outtype q8_0 writes where blocks fit.
    a_type = Q.Q8_0 if request.param == "qwen3" else Q.F32
    merged = write_gguf_lora(
        work / "adapter.gguf",
        base.reference,
        arch=arch,
        rank=RANK,
        alpha=6.0,
        seed=7,
        a_type=a_type,
        **tensors,
    )
    model = exact_model(base.path, work, lora=LoraOptions())
    return arch, model, work / "adapter.gguf", base.reference, merged


def _driver(model: Path, arch: str, adapter: Path, *, slots: int) -> tuple[SharedBufferDriver, int]:
    driver = SharedBufferDriver(model, slots=slots, max_len=40)
    layout = LoraLayout.from_session(driver.session)
    assert layout is not None
    stacks = AdapterStacks(layout, max_loras=2, max_rank=RANK)
    base = AdapterBase(architecture=arch, num_heads=HEADS, num_kv_heads=KV_HEADS)
    slot = stacks.load(read_adapter(adapter, layout, base=base, max_rank=RANK))
    driver.adapters = stacks
    return driver, slot


def test_prefill_with_the_adapter_matches_the_merged_definition(family: tuple) -> None:
    arch, model, adapter, base, merged = family
    driver, slot = _driver(model, arch, adapter, slots=1)
    prompt = _prompt(1, 21)
    logits = driver.prefill(0, prompt, adapter=slot)
    expected = forward(merged, prompt)
    np.testing.assert_allclose(logits, expected, atol=ATOL, rtol=0)
    # The adapter changes the model far beyond the tolerance, so matching it means something.
    assert np.abs(expected - forward(base, prompt)).max() > 0.1


def test_decode_rows_with_and_without_the_adapter_share_a_batch(family: tuple) -> None:
    arch, model, adapter, base, merged = family
    driver, slot = _driver(model, arch, adapter, slots=2)
    tokens, other = _prompt(2, 24), _prompt(4, 5)
    driver.prefill(0, tokens[:14], adapter=slot)
    driver.prefill(1, other)
    with_adapter = forward(merged, tokens)
    without = forward(base, [*other, *tokens[14:]])
    for step, token in enumerate(tokens[14:]):
        rows = driver.decode([token, token], adapters=[slot, 0])
        np.testing.assert_allclose(rows[0], with_adapter[14 + step], atol=ATOL, rtol=0)
        np.testing.assert_allclose(rows[1], without[5 + step], atol=ATOL, rtol=0)


def _adapter_file(
    path: Path, arch: str, *, general_type: str = "adapter", tensors: dict | None = None, **fields: object
) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type(general_type)
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", 8.0)
    for key, value in fields.items():
        writer.add_array(key, value) if isinstance(value, list) else writer.add_string(key, str(value))
    for name, array in (tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _pair(out: int, cols: int, rank: int = 2) -> tuple[np.ndarray, np.ndarray]:
    return np.ones((rank, cols), np.float32), np.ones((out, rank), np.float32)


@pytest.fixture(scope="module")
def llama_layout(tmp_path_factory: pytest.TempPathFactory) -> LoraLayout:
    work = tmp_path_factory.mktemp("llama-lora")
    base = write_synthetic_gguf(work / "base.gguf", formats=MIXED_FORMATS, seed=3)
    model = exact_model(base.path, work, lora=LoraOptions())
    layout = LoraLayout.from_session(SharedBufferDriver(model, slots=1, max_len=8).session)
    assert layout is not None
    return layout


def _refusal(tmp_path: Path, layout: LoraLayout, arch: str = "llama", **kwargs: object) -> str:
    path = _adapter_file(tmp_path / "bad.gguf", arch, **kwargs)  # type: ignore[arg-type]
    base = AdapterBase(architecture="llama", num_heads=HEADS, num_kv_heads=KV_HEADS)
    with pytest.raises(AdapterError) as refused:
        read_adapter(path, layout, base=base, max_rank=RANK)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("adapter bad: ")
    return message


def test_an_adapter_for_another_architecture_is_refused(tmp_path: Path, llama_layout: LoraLayout) -> None:
    a, b = _pair(256, 256)
    message = _refusal(
        tmp_path,
        llama_layout,
        "qwen2",
        tensors={"blk.0.attn_q.weight.lora_a": a, "blk.0.attn_q.weight.lora_b": b},
    )
    assert "architecture qwen2, but the model is llama" in message


def test_a_model_file_given_as_an_adapter_is_refused(tmp_path: Path, llama_layout: LoraLayout) -> None:
    assert "is not a LoRA adapter (general.type 'model'" in _refusal(
        tmp_path, llama_layout, general_type="model"
    )


def test_an_adapter_with_half_a_pair_is_refused(tmp_path: Path, llama_layout: LoraLayout) -> None:
    a, _ = _pair(256, 256)
    message = _refusal(tmp_path, llama_layout, tensors={"blk.1.attn_v.weight.lora_a": a})
    assert "blk.1.attn_v.weight has no lora_b tensor" in message


def test_norm_and_embedding_tensors_are_refused(tmp_path: Path, llama_layout: LoraLayout) -> None:
    message = _refusal(tmp_path, llama_layout, tensors={"blk.0.attn_norm.weight": np.ones(256, np.float32)})
    assert "tensor blk.0.attn_norm.weight is not a LoRA pair of a decoder layer's projection" in message
    a, b = _pair(512, 256)
    message = _refusal(
        tmp_path, llama_layout, tensors={"token_embd.weight.lora_a": a, "token_embd.weight.lora_b": b}
    )
    assert "tensor token_embd.weight.lora_a is not a LoRA pair" in message


def test_a_rank_over_the_bound_and_a_wrong_shape_are_refused_before_reading(
    tmp_path: Path, llama_layout: LoraLayout
) -> None:
    a, b = _pair(256, 256, rank=RANK + 1)
    message = _refusal(
        tmp_path, llama_layout, tensors={"blk.0.attn_q.weight.lora_a": a, "blk.0.attn_q.weight.lora_b": b}
    )
    assert f"blk.0.attn_q.weight has rank {RANK + 1}, over the maximum LoRA rank {RANK}" in message
    a, b = _pair(128, 256)  # attn_q of a model with half the heads
    message = _refusal(
        tmp_path, llama_layout, tensors={"blk.0.attn_q.weight.lora_a": a, "blk.0.attn_q.weight.lora_b": b}
    )
    assert "maps 256 to 128 features, but the model's layer 0 self_attn.q_proj maps 256 to 256" in message
    a, b = _pair(256, 256)
    message = _refusal(
        tmp_path, llama_layout, tensors={"blk.5.attn_q.weight.lora_a": a, "blk.5.attn_q.weight.lora_b": b}
    )
    assert "blk.5.attn_q.weight is for layer 5, but the model has 2 layers" in message


def test_an_activated_lora_is_refused(tmp_path: Path, llama_layout: LoraLayout) -> None:
    message = _refusal(tmp_path, llama_layout, **{"adapter.alora.invocation_tokens": [1, 2, 3]})
    assert "activated LoRA (aLoRA)" in message
