"""The Llama graph computes what a plain numpy forward pass computes, in every way the server runs it.

Tolerances: the graph runs in float32 and the reference in float64. Over the tiny model's two
64-wide layers, float32 rounding moves logits (spread of several units) by about 1e-5; ATOL =
2e-4 leaves room for that while any real mistake (a wrong rotary pair, a mask off by one, a
missing offset) moves logits by 1e-2 or more.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from tests.server.model_tools.llama_reference import ReferenceModel, forward, mean_kl, reference_from_weights
from tests.server.model_tools.shared_buffer_driver import SharedBufferDriver
from tokenwire.server.model_tools.convert.genai_config import TokenIds, write_genai_config
from tokenwire.server.model_tools.convert.llama_graph import GraphOptions, build_llama_graph, save_model
from tokenwire.server.model_tools.convert.llama_model import LlamaWeights
from tokenwire.server.model_tools.convert.quantized import decode_gguf_blocks
from tokenwire.server.model_tools.tiny_llama import tiny_llama_config, tiny_llama_weights

ATOL = 2e-4


def _prompt(seed: int, length: int, vocab: int = 512) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, size=length)]


def test_prefill_logits_match_reference(tiny_llama_dir: Path, tiny_llama_reference: ReferenceModel) -> None:
    prompt = _prompt(1, 23)
    driver = SharedBufferDriver(tiny_llama_dir, slots=1, max_len=64)
    logits = driver.prefill(0, prompt)
    expected = forward(tiny_llama_reference, prompt)
    np.testing.assert_allclose(logits, expected, atol=ATOL, rtol=0)
    # The comparison is meaningful only if the logits are spread out, not near-uniform.
    assert expected.std() > 1.0


def test_chunked_prefill_continues_from_the_cached_prefix(
    tiny_llama_dir: Path, tiny_llama_reference: ReferenceModel
) -> None:
    prompt = _prompt(2, 19)
    driver = SharedBufferDriver(tiny_llama_dir, slots=1, max_len=64)
    driver.prefill(0, prompt[:7])
    second = driver.prefill(0, prompt[7:])
    np.testing.assert_allclose(second, forward(tiny_llama_reference, prompt)[7:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("mask_width", ["tight", "max_len"])
def test_decode_batch_with_different_lengths_per_row(
    tiny_llama_dir: Path, tiny_llama_reference: ReferenceModel, mask_width: str
) -> None:
    max_len = 48
    prompts = [_prompt(10, 5), _prompt(11, 17), _prompt(12, 9)]
    continuations = [_prompt(20 + row, 4) for row in range(3)]
    driver = SharedBufferDriver(tiny_llama_dir, slots=4, max_len=max_len)
    for slot, prompt in enumerate(prompts):
        driver.prefill(slot, prompt)
    for step in range(4):
        tokens = [continuations[row][step] for row in range(3)]
        logits = driver.decode(tokens, mask_width=max_len if mask_width == "max_len" else None)
        for row in range(3):
            sequence = prompts[row] + continuations[row][: step + 1]
            expected = forward(tiny_llama_reference, sequence)[-1]
            np.testing.assert_allclose(
                logits[row], expected, atol=ATOL, rtol=0, err_msg=f"row {row} step {step}"
            )
    assert driver.lengths[:3] == [9, 21, 13]


def test_decode_row_does_not_depend_on_its_batch(tiny_llama_dir: Path) -> None:
    prompts = [_prompt(30, 6), _prompt(31, 14)]
    batched = SharedBufferDriver(tiny_llama_dir, slots=2, max_len=32)
    alone = SharedBufferDriver(tiny_llama_dir, slots=1, max_len=32)
    for slot, prompt in enumerate(prompts):
        batched.prefill(slot, prompt)
    alone.prefill(0, prompts[0])
    for token in (5, 77, 300):
        together = batched.decode([token, token])
        by_itself = alone.decode([token])
        np.testing.assert_allclose(together[0], by_itself[0], atol=1e-5, rtol=0)


def test_decode_writes_only_its_own_positions(tiny_llama_dir: Path) -> None:
    driver = SharedBufferDriver(tiny_llama_dir, slots=2, max_len=16)
    for buffer in driver.buffers.values():
        buffer.fill(7.0)  # stale data from an earlier occupant must be ignored and kept out of bounds
    driver.prefill(0, _prompt(40, 3))
    driver.prefill(1, _prompt(41, 5))
    driver.decode([1, 2])
    key = driver.buffers["key.0"]
    assert np.all(key[0, :, 4:] == 7.0)
    assert not np.any(key[0, :, :4] == 7.0)
    assert np.all(key[1, :, 6:] == 7.0)
    assert not np.any(key[1, :, :6] == 7.0)


def _write_model(out_dir: Path, weights: LlamaWeights, options: GraphOptions) -> Path:
    config = tiny_llama_config()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_model(build_llama_graph(config, weights, options), out_dir / "model.onnx", external_data=False)
    write_genai_config(out_dir, config, TokenIds(bos=0, eos=[0], pad=0), dtype=options.dtype)
    return out_dir


def test_float16_graph_tracks_float32(tmp_path: Path, tiny_llama_reference: ReferenceModel) -> None:
    model = _write_model(
        tmp_path / "fp16", tiny_llama_weights(tiny_llama_config()), GraphOptions(dtype="float16")
    )
    driver = SharedBufferDriver(model, slots=1, max_len=32)
    prompt = _prompt(50, 12)
    logits = driver.prefill(0, prompt)
    assert logits.dtype == np.float32  # logits are cast back to float32
    # float16 keeps ~3 decimal digits: logits of magnitude ~10 move by up to a few hundredths.
    np.testing.assert_allclose(logits, forward(tiny_llama_reference, prompt), atol=0.1, rtol=0)
    assert driver.buffers["key.0"].dtype == np.float16


def _quantized_tiny_weights() -> LlamaWeights:
    """The tiny model's weights stored in GGUF block formats (and back), tied to a Q4_1 embedding."""
    base = tiny_llama_weights(tiny_llama_config(), seed=3)

    def q(matrix: np.ndarray, kind: Q) -> object:
        return decode_gguf_blocks(quantize(matrix, kind), kind, matrix.shape[1])

    layers = tuple(
        replace(
            layer,
            q_proj=q(layer.q_proj, Q.Q4_1),
            k_proj=q(layer.k_proj, Q.Q4_1),
            v_proj=q(layer.v_proj, Q.Q4_1),
            o_proj=q(layer.o_proj, Q.Q8_0),
            gate_proj=q(layer.gate_proj, Q.Q5_1),
            up_proj=q(layer.up_proj, Q.Q5_1),
            down_proj=q(layer.down_proj, Q.Q4_0),
        )
        for layer in base.layers
    )
    embed = np.asarray(base.lm_head) * 2.0  # larger rows: the tied head then spreads the logits
    return replace(base, layers=layers, embed_tokens=q(embed, Q.Q4_1), lm_head=None)


@pytest.fixture(scope="module")
def quantized_reference() -> ReferenceModel:
    config = tiny_llama_config()
    return reference_from_weights(
        _quantized_tiny_weights(),
        heads=config.num_heads,
        kv_heads=config.num_kv_heads,
        theta=config.rope_theta,
        eps=config.rms_norm_eps,
    )


@pytest.mark.parametrize(
    ("offsets", "atol"),
    [
        ("float", ATOL),
        # Folded offsets are kept to within ~1/400 of a quantization step: measured errors of
        # ~3e-3 on logits spread over ~6 units; zero points alone (no remainder) miss by ~5.
        ("folded", 5e-3),
    ],
)
def test_quantized_weights_match_their_dequantized_values(
    tmp_path: Path, quantized_reference: ReferenceModel, offsets: str, atol: float
) -> None:
    # accuracy_level 0 computes in float32, isolating the weight packing from int8 activations.
    options = GraphOptions(accuracy_level=0, offsets=offsets)  # type: ignore[arg-type]
    driver = SharedBufferDriver(
        _write_model(tmp_path / offsets, _quantized_tiny_weights(), options), slots=1, max_len=32
    )
    prompt = _prompt(60, 15)
    np.testing.assert_allclose(
        driver.prefill(0, prompt), forward(quantized_reference, prompt), atol=atol, rtol=0
    )


def test_int8_compute_stays_close_to_the_reference(
    tmp_path: Path, quantized_reference: ReferenceModel
) -> None:
    driver = SharedBufferDriver(
        _write_model(tmp_path / "int8", _quantized_tiny_weights(), GraphOptions()), slots=1, max_len=32
    )
    prompt = _prompt(61, 20)
    logits = driver.prefill(0, prompt)
    expected = forward(quantized_reference, prompt)
    # int8 activations (accuracy_level 4) perturb logits slightly; the distributions stay close.
    assert mean_kl(expected, logits) < 0.01
    assert np.mean(expected.argmax(-1) == logits.argmax(-1)) >= 0.9
