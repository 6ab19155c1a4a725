"""GGUF blocks are repacked without changing a single weight, in the layout MatMulNBits reads."""

from __future__ import annotations

import gguf
import numpy as np
import onnxruntime as ort
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from onnx import TensorProto, helper, numpy_helper

from tokenwire.server.model_tools.convert.quantized import (
    QuantizedMatrix,
    block_sum_matrix,
    can_repack,
    concat_rows,
    decode_gguf_blocks,
    fold_offsets,
)

REPACKED = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]

# Offsets of each format's float16 scale fields inside a block: random bytes there could be
# infinities or NaNs, every other byte of a random block is a valid code or sub-block scale.
_SCALE_FIELDS = {
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_0: (0,),
    Q.Q5_1: (0, 2),
    Q.Q8_0: (0,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
}


def random_blocks(kind: Q, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, size=(rows, cols // block_elems, block_bytes), dtype=np.uint8)
    for offset in _SCALE_FIELDS[kind]:
        scales = rng.uniform(-0.05, 0.05, size=(rows, cols // block_elems)).astype("<f2")
        blocks[..., offset : offset + 2] = scales.view(np.uint8).reshape(rows, cols // block_elems, 2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("kind", REPACKED, ids=lambda k: k.name)
def test_repacked_weights_equal_gguf_dequantization(kind: Q) -> None:
    raw = random_blocks(kind, rows=6, cols=512)
    matrix = decode_gguf_blocks(raw, kind, 512)
    expected = dequantize(raw, kind).reshape(6, 512)
    # Equal up to float32 rounding: the offset is recombined with the scale in a different order,
    # which can move a weight by an ulp of the block's largest terms.
    np.testing.assert_allclose(matrix.dequantize(), expected, rtol=0, atol=1e-6 * np.abs(expected).max())
    assert matrix.codes.max() < 2**matrix.bits


def test_formats_without_offsets_need_no_correction() -> None:
    for kind in (Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.Q6_K):
        assert decode_gguf_blocks(random_blocks(kind, 2, 256), kind, 256).offsets is None
    for kind in (Q.Q4_1, Q.Q5_1, Q.Q4_K, Q.Q5_K):
        assert decode_gguf_blocks(random_blocks(kind, 2, 256), kind, 256).offsets is not None


def test_unsupported_formats_are_reported() -> None:
    assert not can_repack(Q.Q2_K)
    with pytest.raises(ValueError, match="no block decoder"):
        decode_gguf_blocks(np.zeros((1, 84), np.uint8), Q.Q2_K, 256)


def _run_matmul_nbits(x: np.ndarray, matrix: QuantizedMatrix) -> np.ndarray:
    initializers = [
        numpy_helper.from_array(matrix.packed_codes(), "B"),
        numpy_helper.from_array(matrix.scales.reshape(-1), "scales"),
    ]
    inputs = ["x", "B", "scales"]
    if matrix.zero_points is not None:
        initializers.append(numpy_helper.from_array(matrix.packed_zero_points(), "zero_points"))
        inputs.append("zero_points")
    node = helper.make_node(
        "MatMulNBits",
        inputs,
        ["y"],
        domain="com.microsoft",
        K=matrix.cols,
        N=matrix.rows,
        bits=matrix.bits,
        block_size=matrix.block_size,
        accuracy_level=0,
    )
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializers,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    result: np.ndarray = session.run(None, {"x": x})[0]
    return result


@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q8_0, Q.Q6_K], ids=lambda k: k.name)
def test_matmul_nbits_reads_the_packed_codes_as_intended(kind: Q) -> None:
    matrix = decode_gguf_blocks(random_blocks(kind, rows=40, cols=256, seed=1), kind, 256)
    x = np.random.default_rng(2).standard_normal((3, 256)).astype(np.float32)
    expected = x.astype(np.float64) @ matrix.dequantize().T.astype(np.float64)
    np.testing.assert_allclose(_run_matmul_nbits(x, matrix), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", [Q.Q4_1, Q.Q5_1], ids=lambda k: k.name)
def test_matmul_nbits_reads_the_packed_zero_points_as_intended(kind: Q) -> None:
    # 18 blocks a row: an even count of 4-bit zero points per row would hide a packing slip.
    matrix = fold_offsets(
        decode_gguf_blocks(random_blocks(kind, rows=24, cols=576, seed=5), kind, 576)
    ).matrix
    assert matrix.zero_points is not None
    assert len(np.unique(matrix.zero_points)) > 4
    x = np.random.default_rng(6).standard_normal((2, matrix.cols)).astype(np.float32)
    expected = x.astype(np.float64) @ matrix.dequantize().T.astype(np.float64)
    np.testing.assert_allclose(_run_matmul_nbits(x, matrix), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", [Q.Q4_1, Q.Q4_K, Q.Q5_1, Q.Q5_K], ids=lambda k: k.name)
def test_folded_offsets_reproduce_the_product(kind: Q) -> None:
    matrix = decode_gguf_blocks(random_blocks(kind, rows=24, cols=512, seed=3), kind, 512)
    folded = fold_offsets(matrix)
    x = np.random.default_rng(4).standard_normal((5, 512))
    sums = x @ block_sum_matrix(512, matrix.block_size, folded.sum_width).dequantize().T
    augmented = np.concatenate([x] + [sums] * folded.levels, axis=1)
    exact = x @ matrix.dequantize().T.astype(np.float64)
    folded_product = augmented @ folded.matrix.dequantize().T.astype(np.float64)
    offsets_part = np.abs(sums[:, : matrix.blocks_per_row] @ matrix.offsets_or_zeros().T).max()
    # Zero points carry whole steps and the levels the rest to within ~1/400 of a step: the
    # error stays far below 2**-8 of the offsets' contribution (dropping the remainder would
    # leave errors of the order of 2**-4).
    assert np.abs(folded_product - exact).max() < offsets_part * 2**-8
    assert folded.matrix.offsets is None
    assert folded.matrix.cols == 512 + folded.levels * folded.sum_width


def test_block_sum_matrix_sums_each_block() -> None:
    x = np.arange(96, dtype=np.float64)[None, :]
    sums = x @ block_sum_matrix(96, 32, 32).dequantize().T
    assert sums[0, :3].tolist() == [x[0, :32].sum(), x[0, 32:64].sum(), x[0, 64:].sum()]
    assert not sums[0, 3:].any()


def test_concat_rows_keeps_offsets_aligned() -> None:
    with_offsets = decode_gguf_blocks(random_blocks(Q.Q4_1, 3, 64), Q.Q4_1, 64)
    without = decode_gguf_blocks(random_blocks(Q.Q4_0, 2, 64), Q.Q4_0, 64)
    stacked = concat_rows([with_offsets, without])
    np.testing.assert_array_equal(
        stacked.dequantize(), np.concatenate([with_offsets.dequantize(), without.dequantize()])
    )
    with pytest.raises(ValueError, match="different layouts"):
        concat_rows([with_offsets, decode_gguf_blocks(random_blocks(Q.Q8_0, 1, 64), Q.Q8_0, 64)])
