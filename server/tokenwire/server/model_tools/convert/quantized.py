"""GGUF block-quantized matrices, decoded into the affine form MatMulNBits can run without requantizing.

Every GGUF format handled here stores, per block of consecutive weights along a row, small
integer codes `q` and a float `scale` (plus, for the "_1" and K formats, a float `offset`), so
that `w = scale * q + offset`. MatMulNBits computes `scale * (c - zero_point)` with a fixed zero
point of `2**(bits-1)` when none is given (the fast int8 path needs integer zero points, and a
float zero point sends the kernel to a slow dequantize-then-GEMM path). So the codes are copied
bit-exactly into MatMulNBits blocks and whatever the fixed zero point cannot express is kept as
one float per block, `offset + scale * (zero_point - shift)`. Its contribution to the output is
`(per-block sums of the input) @ offsets.T`; `fold_offsets` moves the whole steps of each offset
into the block's integer zero point and turns the rest into extra quantized input columns of
the same matrix (within about 1/400 of a step), or the graph adds it in float32. Codes and
scales are never requantized.

Formats without a decoder here (2- and 3-bit K formats, the IQ family) are dequantized to
float by the caller instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType
from numpy.typing import NDArray

U8 = NDArray[np.uint8]
F32 = NDArray[np.float32]


@dataclass(frozen=True)
class QuantizedMatrix:
    """A [rows, cols] weight matrix: `w = scales * (codes - 2**(bits-1)) + offsets`, per block.

    Rows are output features, columns input features; blocks run along columns. `offsets` is
    None when the fixed zero point already expresses the format exactly (Q4_0, Q8_0, Q6_K...).
    """

    codes: U8  # [rows, cols], each in [0, 2**bits)
    scales: F32  # [rows, cols // block_size]
    offsets: F32 | None  # [rows, cols // block_size] or None
    bits: int
    block_size: int
    # Integer zero point per block ([rows, cols // block_size]); None means 2**(bits-1) everywhere.
    zero_points: U8 | None = None

    def __post_init__(self) -> None:
        rows, cols = self.codes.shape
        if self.bits not in (4, 8):
            raise ValueError(f"unsupported bit width {self.bits}")
        if cols % self.block_size:
            raise ValueError(f"{cols} columns are not a whole number of {self.block_size}-blocks")
        blocks = (rows, cols // self.block_size)
        if self.scales.shape != blocks:
            raise ValueError(f"scales have shape {self.scales.shape}, expected {blocks}")
        if self.offsets is not None and self.offsets.shape != blocks:
            raise ValueError(f"offsets have shape {self.offsets.shape}, expected {blocks}")
        if self.zero_points is not None and self.zero_points.shape != blocks:
            raise ValueError(f"zero points have shape {self.zero_points.shape}, expected {blocks}")

    @property
    def rows(self) -> int:
        return int(self.codes.shape[0])

    @property
    def cols(self) -> int:
        return int(self.codes.shape[1])

    @property
    def blocks_per_row(self) -> int:
        return self.cols // self.block_size

    @property
    def zero_point(self) -> int:
        return 1 << (self.bits - 1)

    @property
    def layout(self) -> tuple[int, int]:
        """(bits, block_size): matrices with the same layout can share one MatMulNBits."""
        return (self.bits, self.block_size)

    def block_zero_points(self) -> U8:
        if self.zero_points is not None:
            return self.zero_points
        return np.full(self.scales.shape, self.zero_point, dtype=np.uint8)

    def dequantize(self) -> F32:
        blocks = self.codes.reshape(self.rows, self.blocks_per_row, self.block_size).astype(np.float32)
        weights = (blocks - self.block_zero_points()[:, :, None].astype(np.float32)) * self.scales[:, :, None]
        if self.offsets is not None:
            weights += self.offsets[:, :, None]
        return weights.reshape(self.rows, self.cols)

    def take_rows(self, index: NDArray[np.intp]) -> QuantizedMatrix:
        return QuantizedMatrix(
            codes=self.codes[index],
            scales=self.scales[index],
            offsets=None if self.offsets is None else self.offsets[index],
            bits=self.bits,
            block_size=self.block_size,
            zero_points=None if self.zero_points is None else self.zero_points[index],
        )

    def packed_codes(self) -> U8:
        """Codes in MatMulNBits' B layout: [rows, blocks, block_size * bits / 8], low nibble first."""
        blocks = self.codes.reshape(self.rows, self.blocks_per_row, self.block_size)
        if self.bits == 8:
            return np.ascontiguousarray(blocks)
        pairs = blocks.reshape(self.rows, self.blocks_per_row, self.block_size // 2, 2)
        return (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8)

    def packed_zero_points(self) -> U8:
        """Zero points in MatMulNBits' layout: per row, blocks in order, two 4-bit values a byte."""
        points = self.block_zero_points()
        if self.bits == 8:
            return points.reshape(-1)
        if points.shape[1] % 2:
            points = np.concatenate([points, np.zeros((self.rows, 1), dtype=np.uint8)], axis=1)
        return (points[:, 0::2] | (points[:, 1::2] << 4)).astype(np.uint8).reshape(-1)

    def offsets_or_zeros(self) -> F32:
        if self.offsets is None:
            return np.zeros_like(self.scales)
        return self.offsets


def concat_rows(matrices: Sequence[QuantizedMatrix]) -> QuantizedMatrix:
    """Stack matrices of one layout along rows (e.g. Q, K and V into one projection)."""
    layouts = {m.layout for m in matrices}
    if len(layouts) != 1:
        raise ValueError(f"cannot stack matrices of different layouts {sorted(layouts)}")
    any_offsets = any(m.offsets is not None for m in matrices)
    any_zero_points = any(m.zero_points is not None for m in matrices)
    return QuantizedMatrix(
        codes=np.concatenate([m.codes for m in matrices]),
        scales=np.concatenate([m.scales for m in matrices]),
        offsets=np.concatenate([m.offsets_or_zeros() for m in matrices]) if any_offsets else None,
        bits=matrices[0].bits,
        block_size=matrices[0].block_size,
        zero_points=np.concatenate([m.block_zero_points() for m in matrices]) if any_zero_points else None,
    )


# Rounds of quantization that fold_offsets spends on what the integer zero points leave of the
# offsets (at most half a quantization step per block): each 4-bit round leaves at most 1/14 of
# the previous residual, an 8-bit round 1/254, so about 1/400 of a step remains. Measured on
# SmolLM2 (Q4_1), the next-token distributions are then as close to the float32 reference as
# with an exact float32 correction; one 4-bit round is measurably worse.
OFFSET_LEVELS = {4: 2, 8: 1}


@dataclass(frozen=True)
class FoldedOffsets:
    """A matrix with its per-block offsets moved into extra input columns.

    Each block's offset is split into a whole number of quantization steps, which becomes the
    block's integer zero point, and a remainder. `matrix` multiplies `Concat(x, s, s, ...)`,
    with `levels` copies of `s`: the per-block sums of `x`, zero-padded to `sum_width`; copy `i`
    meets the remainder's `i`-th rounding residual, quantized like the rest of the matrix. So
    one MatMulNBits computes `x @ W.T` including the offsets, where a separate float correction
    would cost two more kernels and a full-precision read of the offsets on every step.
    """

    matrix: QuantizedMatrix
    sum_width: int
    levels: int


def fold_offsets(weight: QuantizedMatrix, levels: int | None = None) -> FoldedOffsets:
    if weight.offsets is None:
        raise ValueError("matrix has no offsets to fold")
    levels = OFFSET_LEVELS[weight.bits] if levels is None else levels
    rows, blocks = weight.offsets.shape
    sum_width = -(-blocks // weight.block_size) * weight.block_size
    default_zero_point = weight.zero_point
    largest_code = default_zero_point - 1
    # First the whole multiples of each block's scale, into the block's integer zero point
    # (applied inside the kernel for free); what remains is at most half a step per block.
    base = weight.block_zero_points().astype(np.float64)
    scales = weight.scales.astype(np.float64)
    safe = np.where(scales == 0, 1.0, scales)
    wanted = np.where(scales == 0, base, base - weight.offsets / safe)
    zero_points = np.clip(np.rint(wanted), 0, (1 << weight.bits) - 1)
    remainder = weight.offsets - scales * (base - zero_points)
    # [rows, level blocks, block_size]: each block of a level gets its own scale.
    residual = np.zeros((rows, sum_width), dtype=np.float64)
    residual[:, :blocks] = remainder
    residual = residual.reshape(rows, -1, weight.block_size)
    all_codes, all_scales = [weight.codes], [weight.scales]
    for _ in range(levels):
        scale = np.abs(residual).max(axis=2, keepdims=True) / largest_code
        scale[scale == 0] = 1.0  # an all-zero block: any scale encodes it exactly
        level = np.clip(np.rint(residual / scale), -default_zero_point, largest_code)
        residual -= level * scale
        all_codes.append((level + default_zero_point).astype(np.uint8).reshape(rows, sum_width))
        all_scales.append(scale[:, :, 0].astype(np.float32))
    level_zero_points = np.full((rows, levels * sum_width // weight.block_size), default_zero_point)
    matrix = QuantizedMatrix(
        codes=np.concatenate(all_codes, axis=1),
        scales=np.concatenate(all_scales, axis=1),
        offsets=None,
        bits=weight.bits,
        block_size=weight.block_size,
        zero_points=np.concatenate([zero_points, level_zero_points], axis=1).astype(np.uint8),
    )
    return FoldedOffsets(matrix=matrix, sum_width=sum_width, levels=levels)


def block_sum_matrix(cols: int, block_size: int, sum_width: int) -> QuantizedMatrix:
    """[sum_width, cols] 0/1 weights whose product with x gives x's per-block sums, zero-padded."""
    codes = np.full((sum_width, cols), 8, dtype=np.uint8)
    codes[np.arange(cols) // block_size, np.arange(cols)] = 9  # 1 * (9 - 8) = 1
    return QuantizedMatrix(
        codes=codes,
        scales=np.ones((sum_width, cols // block_size), dtype=np.float32),
        offsets=None,
        bits=4,
        block_size=block_size,
    )


# --- GGUF block decoders -----------------------------------------------------------------------
# Each takes the tensor's raw bytes as [rows, bytes_per_row] and the number of columns.


def _blocks(raw: U8, cols: int, block_elems: int, block_bytes: int) -> U8:
    rows = raw.shape[0]
    if raw.shape[1] != cols // block_elems * block_bytes:
        raise ValueError(f"row of {raw.shape[1]} bytes does not hold {cols} weights")
    return raw.reshape(rows, cols // block_elems, block_bytes)


def _f16(raw: U8) -> F32:
    """Read consecutive pairs of bytes as little-endian float16 (the last axis must be 2 long)."""
    return np.ascontiguousarray(raw).view("<f2")[..., 0].astype(np.float32)


def _low_high_nibbles(qs: U8) -> U8:
    """The ggml layout of 32 4-bit codes in 16 bytes: low nibbles are 0..15, high 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: U8, count: int) -> U8:
    """Bit i of a little-endian bit field of `count` bits, for i in range(count), as 0/1."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")
    return bits[..., :count]


def _quantized(
    codes: NDArray[np.integer],
    scales: F32,
    offsets: F32 | None,
    *,
    bits: int,
    block_size: int,
    shift: int,
    rows: int,
) -> QuantizedMatrix:
    """Build the matrix for `w = scales * q + offsets` (q may be signed), storing `c = q + shift`.

    Then `w = scales * (c - zp) + scales * (zp - shift) + offsets`; the last two terms become
    the per-block offset (None when they cancel for every block).
    """
    zero_point = 1 << (bits - 1)
    stored_offsets: F32 | None
    if offsets is None and shift == zero_point:
        stored_offsets = None
    else:
        stored_offsets = (scales * np.float32(zero_point - shift)).astype(np.float32)
        if offsets is not None:
            stored_offsets += offsets
    return QuantizedMatrix(
        codes=(codes.astype(np.int16) + shift).astype(np.uint8).reshape(rows, -1),
        scales=scales.reshape(rows, -1).astype(np.float32),
        offsets=None if stored_offsets is None else stored_offsets.reshape(rows, -1),
        bits=bits,
        block_size=block_size,
    )


def _decode_q4_0(raw: U8, cols: int) -> QuantizedMatrix:
    b = _blocks(raw, cols, 32, 18)
    d = _f16(b[..., 0:2])
    q = _low_high_nibbles(b[..., 2:18])
    # w = d * (q - 8): the fixed zero point 8 is exact.
    return _quantized(q.astype(np.int16) - 8, d, None, bits=4, block_size=32, shift=8, rows=raw.shape[0])


def _decode_q4_1(raw: U8, cols: int) -> QuantizedMatrix:
    b = _blocks(raw, cols, 32, 20)
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    q = _low_high_nibbles(b[..., 4:20])
    return _quantized(q, d, m, bits=4, block_size=32, shift=0, rows=raw.shape[0])


def _decode_q5_0(raw: U8, cols: int) -> QuantizedMatrix:
    b = _blocks(raw, cols, 32, 22)
    d = _f16(b[..., 0:2])
    q = _low_high_nibbles(b[..., 6:22]) | (_high_bits(b[..., 2:6], 32) << 4)
    # w = d * (q - 16) with q in [0, 32): stored as 8-bit codes q + 112, zero point 128.
    return _quantized(q.astype(np.int16) - 16, d, None, bits=8, block_size=32, shift=128, rows=raw.shape[0])


def _decode_q5_1(raw: U8, cols: int) -> QuantizedMatrix:
    b = _blocks(raw, cols, 32, 24)
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    q = _low_high_nibbles(b[..., 8:24]) | (_high_bits(b[..., 4:8], 32) << 4)
    return _quantized(q, d, m, bits=8, block_size=32, shift=112, rows=raw.shape[0])


def _decode_q8_0(raw: U8, cols: int) -> QuantizedMatrix:
    b = _blocks(raw, cols, 32, 34)
    d = _f16(b[..., 0:2])
    q = np.ascontiguousarray(b[..., 2:34]).view(np.int8)
    # w = d * q with signed q: codes q + 128 under zero point 128 are exact.
    return _quantized(q.astype(np.int16), d, None, bits=8, block_size=32, shift=128, rows=raw.shape[0])


def _k_scales_mins(packed: U8) -> tuple[U8, U8]:
    """Unpack the 8 six-bit scales and mins of a Q4_K/Q5_K super-block (12 bytes)."""
    s = packed.astype(np.uint8)
    low_sc = s[..., 0:4] & 63
    low_mn = s[..., 4:8] & 63
    high_sc = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    high_mn = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return np.concatenate([low_sc, high_sc], -1), np.concatenate([low_mn, high_mn], -1)


def _k_nibbles(qs: U8) -> U8:
    """Q4_K/Q5_K code order: each 32-byte chunk holds two 32-weight sub-blocks (low, then high)."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 32)
    return np.stack([chunks & 0x0F, chunks >> 4], axis=-2).reshape(*qs.shape[:-1], 256)


def _decode_q4_k(raw: U8, cols: int) -> QuantizedMatrix:
    b = _blocks(raw, cols, 256, 144)
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _k_scales_mins(b[..., 4:16])
    q = _k_nibbles(b[..., 16:144]).reshape(*b.shape[:2], 8, 32)
    scales = d[..., None] * sc.astype(np.float32)
    offsets = -(dmin[..., None] * mn.astype(np.float32))
    return _quantized(q, scales, offsets, bits=4, block_size=32, shift=0, rows=raw.shape[0])


def _decode_q5_k(raw: U8, cols: int) -> QuantizedMatrix:
    b = _blocks(raw, cols, 256, 176)
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _k_scales_mins(b[..., 4:16])
    low = _k_nibbles(b[..., 48:176]).reshape(*b.shape[:2], 8, 32)
    # Bit j of qh[l] is the fifth bit of weight l of sub-block j.
    high = np.unpackbits(b[..., 16:48, None], axis=-1, bitorder="little")  # [..., 32 l, 8 j]
    q = low | (np.swapaxes(high, -1, -2) << 4)
    scales = d[..., None] * sc.astype(np.float32)
    offsets = -(dmin[..., None] * mn.astype(np.float32))
    return _quantized(q, scales, offsets, bits=8, block_size=32, shift=112, rows=raw.shape[0])


def _decode_q6_k(raw: U8, cols: int) -> QuantizedMatrix:
    b = _blocks(raw, cols, 256, 210)
    ql = b[..., 0:128].reshape(*b.shape[:2], 2, 64)
    qh = b[..., 128:192].reshape(*b.shape[:2], 2, 32)
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)
    d = _f16(b[..., 208:210])
    # Per 128-weight half: four runs of 32 weights take their low nibbles from ql and two high
    # bits from successive bit pairs of qh.
    low = np.concatenate(
        [ql[..., 0:32] & 0x0F, ql[..., 32:64] & 0x0F, ql[..., 0:32] >> 4, ql[..., 32:64] >> 4], -1
    )
    high = np.concatenate([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], -1)
    q = (low | (high << 4)).reshape(*b.shape[:2], 16, 16)
    # w = d * scale * (q - 32) with q in [0, 64): 8-bit codes q + 96 under zero point 128.
    scales = d[..., None] * sc
    return _quantized(
        q.astype(np.int16) - 32, scales, None, bits=8, block_size=16, shift=128, rows=raw.shape[0]
    )


_DECODERS = {
    GGMLQuantizationType.Q4_0: _decode_q4_0,
    GGMLQuantizationType.Q4_1: _decode_q4_1,
    GGMLQuantizationType.Q5_0: _decode_q5_0,
    GGMLQuantizationType.Q5_1: _decode_q5_1,
    GGMLQuantizationType.Q8_0: _decode_q8_0,
    GGMLQuantizationType.Q4_K: _decode_q4_k,
    GGMLQuantizationType.Q5_K: _decode_q5_k,
    GGMLQuantizationType.Q6_K: _decode_q6_k,
}


def can_repack(tensor_type: GGMLQuantizationType) -> bool:
    return tensor_type in _DECODERS


def decode_gguf_blocks(raw: U8, tensor_type: GGMLQuantizationType, cols: int) -> QuantizedMatrix:
    """Decode a GGUF tensor's raw bytes ([rows, bytes_per_row]) into a QuantizedMatrix."""
    decoder = _DECODERS.get(tensor_type)
    if decoder is None:
        raise ValueError(f"no block decoder for {tensor_type.name}")
    return decoder(np.asarray(raw, dtype=np.uint8), cols)
