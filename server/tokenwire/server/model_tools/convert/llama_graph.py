"""ONNX graph of a Llama-family decoder in ONNX Runtime GenAI's layout.

The family covers Llama, Mistral, Qwen 2 and 3, Gemma 2 and 3 and Phi-3 (see llama_model.py).

Inputs `input_ids [batch, seq]`, `attention_mask [batch, total_seq]` and
`past_key_values.N.key/value [batch, kv_heads, past_seq, head_size]`; outputs `logits
[batch, seq, vocab]` (always float32) and `present.N.key/value`. There is no position_ids input:
GroupQueryAttention reads each row's cached length from `seqlens_k = sum(mask) - 1` and applies
the rotary embedding itself, which is what lets past and present share one preallocated buffer
and lets rows of one decode batch sit at different lengths.

Operators are ONNX Runtime's fused CPU/CUDA kernels where one exists: SimplifiedLayerNormalization
and SkipSimplifiedLayerNormalization (RMSNorm, with the residual add folded in),
GroupQueryAttention, MatMulNBits for block-quantized weights and GatherBlockQuantized for a
quantized embedding table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Literal

import numpy as np
import onnx
from numpy.typing import NDArray
from onnx import TensorProto, external_data_helper, helper, numpy_helper

from tokenwire.server.model_tools.convert.llama_model import (
    LinearWeight,
    LlamaConfig,
    LlamaLayerWeights,
    LlamaWeights,
    linear_shape,
)
from tokenwire.server.model_tools.convert.lora_graph import LoraInputs, LoraOptions
from tokenwire.server.model_tools.convert.quantized import (
    QuantizedMatrix,
    block_sum_matrix,
    concat_rows,
    fold_offsets,
)

ActivationType = Literal["float32", "float16"]

ONNX_OPSET = 21
CONTRIB_DOMAIN = "com.microsoft"

# MatMulNBits accuracy_level 4 quantizes activations to int8 per block and runs integer dot
# products: the fastest CPU path, and what ONNX Runtime GenAI's builder uses for int4 on CPU.
INT8_COMPUTE = 4


@dataclass(frozen=True)
class GraphOptions:
    dtype: ActivationType = "float32"
    accuracy_level: int = INT8_COMPUTE
    # One MatMul for Q, K and V (GroupQueryAttention takes the packed result) and one for the
    # gate and up projections: fewer, larger kernels, which matters most at batch 1.
    fuse_qkv: bool = True
    fuse_gate_up: bool = True
    # How per-block weight offsets (Q4_1, K formats) reach the output: "folded" into integer zero
    # points plus extra quantized input columns of the same MatMulNBits (within ~1/400 of a
    # quantization step; the fast path), or "float": a float32 (block sums @ offsets) correction
    # added after it (exact; two more kernels per projection).
    offsets: Literal["folded", "float"] = "folded"
    offset_levels: int | None = None  # rounds of folding; None: quantized.OFFSET_LEVELS
    # Per-row LoRA adapters on the projections (lora_graph.py); None builds the plain graph.
    lora: LoraOptions | None = None


def rotary_caches(
    config: LlamaConfig,
    freq_factors: NDArray[np.float32] | None,
    *,
    theta: float | None = None,
    linear_scale: float = 1.0,
) -> tuple[NDArray[np.float32], NDArray[np.float32]]:
    """cos/sin tables [context_length, head_size / 2] for rotate-half rotary embeddings."""
    exponents = np.arange(0, config.head_size, 2, dtype=np.float64) / config.head_size
    inv_freq = 1.0 / ((config.rope_theta if theta is None else theta) ** exponents)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.astype(np.float64)
    positions = np.arange(config.context_length, dtype=np.float64) / linear_scale
    angles = np.outer(positions, inv_freq)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


class ExternalData:
    """A weights file written while the graph is built, so tensors never pile up in memory."""

    # Tensors from 1 MiB up start on a page boundary, where ONNX Runtime can map them from the
    # file; aligning every tensor would pad the file by more than the small ones weigh.
    ALIGNMENT = 4096
    ALIGN_FROM_BYTES = 1 << 20
    # Below this size a tensor stays inside model.onnx.
    MIN_BYTES = 1024

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: BinaryIO = path.open("wb")

    def store(self, tensor: TensorProto) -> None:
        data = tensor.raw_data
        if len(data) < self.MIN_BYTES:
            return
        offset = self._file.tell()
        if len(data) >= self.ALIGN_FROM_BYTES:
            padding = -offset % self.ALIGNMENT
            self._file.write(b"\0" * padding)
            offset += padding
        self._file.write(data)
        external_data_helper.set_external_data(tensor, self.path.name, offset=offset, length=len(data))
        tensor.ClearField("raw_data")

    def close(self) -> None:
        self._file.close()


@dataclass
class _Graph:
    """Nodes and initializers under construction, with unique names."""

    float_type: int
    external: ExternalData | None = None
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    initializers: list[TensorProto] = field(default_factory=list)
    _constants: dict[tuple[str, bytes], str] = field(default_factory=dict)
    _names: set[str] = field(default_factory=set)

    def node(
        self,
        op: str,
        inputs: list[str],
        name: str,
        *,
        outputs: int | list[str] = 1,
        domain: str = "",
        **attrs: Any,
    ) -> list[str]:
        """Add a node; `outputs` is a count of auto-named outputs or the list of names ("" = unused)."""
        names = [f"{name}/output_{i}" for i in range(outputs)] if isinstance(outputs, int) else outputs
        self.nodes.append(helper.make_node(op, inputs, names, name=name, domain=domain or None, **attrs))
        return names

    def one(self, op: str, inputs: list[str], name: str, *, domain: str = "", **attrs: Any) -> str:
        return self.node(op, inputs, name, domain=domain, **attrs)[0]

    def initializer(self, array: NDArray[np.generic], name: str) -> str:
        tensor = numpy_helper.from_array(np.ascontiguousarray(array), name)
        if self.external is not None:
            self.external.store(tensor)
        self.initializers.append(tensor)
        self._names.add(name)
        return name

    def has_initializer(self, name: str) -> bool:
        return name in self._names

    @property
    def float_dtype(self) -> type[np.floating[Any]]:
        return np.float16 if self.float_type == TensorProto.FLOAT16 else np.float32

    def float_initializer(self, array: NDArray[np.floating], name: str) -> str:
        return self.initializer(array.astype(self.float_dtype), name)

    def constant(self, array: NDArray[np.generic]) -> str:
        """A small shared initializer, created once per distinct value."""
        key = (str(array.dtype) + str(array.shape), array.tobytes())
        if key not in self._constants:
            name = f"/constants/{array.dtype}/{len(self._constants)}"
            self._constants[key] = self.initializer(array, name)
        return self._constants[key]


class _LlamaGraphBuilder:
    def __init__(
        self, config: LlamaConfig, weights: LlamaWeights, options: GraphOptions, external: ExternalData | None
    ) -> None:
        self.config = config
        self.weights = weights
        self.options = options
        self.float_type = TensorProto.FLOAT16 if options.dtype == "float16" else TensorProto.FLOAT
        self.g = _Graph(self.float_type, external)
        # Per-block sums of an activation, keyed by (activation name, block size): shared by
        # every quantized projection of that activation that needs an offset correction.
        self._block_sums: dict[tuple[str, int], str] = {}
        # Inputs extended with their block sums for folded offsets, shared the same way.
        self._padded_sums: dict[tuple[str, int, int], str] = {}
        self._augmented: dict[tuple[str, int, int, int], str] = {}
        # Sliding layers with a rotary base of their own get cos/sin tables of their own.
        self.local_caches = config.local_rope_theta is not None and any(
            config.is_sliding(i) for i in range(config.num_layers)
        )
        self.lora = LoraInputs(self.float_type) if options.lora is not None else None

    # --- linear layers ---------------------------------------------------------------------

    def linear(self, x: str, weight: LinearWeight, name: str) -> str:
        if isinstance(weight, QuantizedMatrix):
            return self.quantized_linear(x, weight, name)
        w = self.g.float_initializer(np.ascontiguousarray(weight.T), f"{name}.weight")
        return self.g.one("MatMul", [x, w], f"{name}/MatMul")

    def quantized_linear(self, x: str, weight: QuantizedMatrix, name: str) -> str:
        if weight.offsets is not None and self.options.offsets == "folded":
            folded = fold_offsets(weight, self.options.offset_levels)
            x = self.with_block_sums(x, weight.cols, weight.block_size, folded.sum_width, folded.levels)
            weight = folded.matrix
        b = self.g.initializer(weight.packed_codes(), f"{name}.weight_Q{weight.bits}G{weight.block_size}")
        scales = self.g.float_initializer(weight.scales.reshape(-1), f"{name}.weight_scales")
        y = self.matmul_nbits(x, b, scales, weight, name)
        if weight.offsets is None:
            return y
        return self.add_offset_correction(x, y, weight.offsets, weight.block_size, name)

    def with_block_sums(self, x: str, cols: int, block_size: int, sum_width: int, levels: int) -> str:
        """Concat(x, s, ..., s): x followed by `levels` copies of its padded per-block sums."""
        key = (x, block_size, sum_width, levels)
        if key not in self._augmented:
            sums_key = (x, block_size, sum_width)
            if sums_key not in self._padded_sums:
                indicator = block_sum_matrix(cols, block_size, sum_width)
                b = self.g.constant(indicator.packed_codes())
                scales = self.g.constant(indicator.scales.reshape(-1).astype(self.g.float_dtype))
                name = f"{x}/block_sums_{block_size}"
                self._padded_sums[sums_key] = self.matmul_nbits(x, b, scales, indicator, name)
            sums = self._padded_sums[sums_key]
            self._augmented[key] = self.g.one(
                "Concat", [x] + [sums] * levels, f"{x}/with_block_sums_{levels}", axis=-1
            )
        return self._augmented[key]

    def matmul_nbits(self, x: str, b: str, scales: str, weight: QuantizedMatrix, name: str) -> str:
        inputs = [x, b, scales]
        if weight.zero_points is not None:
            inputs.append(self.g.initializer(weight.packed_zero_points(), f"{name}.weight_zero_points"))
        return self.g.one(
            "MatMulNBits",
            inputs,
            f"{name}/MatMulNBits",
            domain=CONTRIB_DOMAIN,
            K=weight.cols,
            N=weight.rows,
            bits=weight.bits,
            block_size=weight.block_size,
            accuracy_level=self.options.accuracy_level,
        )

    def add_offset_correction(
        self, x: str, y: str, offsets: NDArray[np.float32], block_size: int, name: str
    ) -> str:
        """y + (block sums of x) @ offsets.T: the part of each weight the codes don't carry."""
        sums = self.block_sums(x, offsets.shape[1] * block_size, block_size)
        offsets_t = self.g.float_initializer(np.ascontiguousarray(offsets.T), f"{name}.weight_offsets")
        correction = self.g.one("MatMul", [sums, offsets_t], f"{name}/offsets/MatMul")
        return self.g.one("Add", [y, correction], f"{name}/offsets/Add")

    def block_sums(self, x: str, cols: int, block_size: int) -> str:
        key = (x, block_size)
        if key not in self._block_sums:
            # A 0/1 [cols, blocks] matrix: one small MatMul instead of Reshape + ReduceSum.
            indicator = np.repeat(np.eye(cols // block_size, dtype=np.float32), block_size, axis=0)
            ones = self.g.constant(indicator.astype(self.g.float_dtype))
            self._block_sums[key] = self.g.one("MatMul", [x, ones], f"{x}/block_sums/MatMul")
        return self._block_sums[key]

    def fused_linear(self, x: str, weights: list[LinearWeight], name: str, enabled: bool) -> list[str] | str:
        """One MatMul over row-stacked weights when their formats allow, else one per weight."""
        quantized = [w for w in weights if isinstance(w, QuantizedMatrix)]
        if enabled and len(quantized) == len(weights) and len({w.layout for w in quantized}) == 1:
            return self.linear(x, concat_rows(quantized), name)
        if enabled and not quantized:
            stacked = np.concatenate([np.asarray(w) for w in weights])
            return self.linear(x, stacked, name)
        return [self.linear(x, w, f"{name}.{i}") for i, w in enumerate(weights)]

    def adapted(
        self,
        layer_id: int,
        x: str,
        in_features: int,
        outputs: str | list[str],
        modules: tuple[str, ...],
        out_features: tuple[int, ...],
    ) -> str | list[str]:
        """Projection outputs of `x` with their LoRA deltas added (before any bias): one tensor
        holding every module's output side by side (a fused MatMul), or one tensor per module."""
        if isinstance(outputs, str):
            return self.adapted_packed(layer_id, x, in_features, outputs, modules, out_features)
        return [
            self.adapted_packed(layer_id, x, in_features, out, (module,), (size,))
            for out, module, size in zip(outputs, modules, out_features, strict=True)
        ]

    def adapted_packed(
        self,
        layer_id: int,
        x: str,
        in_features: int,
        output: str,
        modules: tuple[str, ...],
        out_features: tuple[int, ...],
    ) -> str:
        """`output` (the modules' outputs side by side) plus their deltas, concatenated alike."""
        lora, options = self.lora, self.options.lora
        if lora is None or options is None or not options.group(modules):
            return output

        def add(op: str, inputs: list[str], name: str) -> str:
            return self.g.one(op, inputs, name)

        deltas = [
            lora.delta(add, x, layer_id, module, in_features, size)
            for module, size in zip(modules, out_features, strict=True)
        ]
        name = f"/lora/{layer_id}/{modules[0]}"
        total = deltas[0] if len(deltas) == 1 else self.g.one("Concat", deltas, f"{name}/Concat", axis=-1)
        return add("Add", [output, total], f"{name}/Add")

    # --- model parts -----------------------------------------------------------------------

    def embedding(self, input_ids: str) -> str:
        table = self.weights.embed_tokens
        name = "model.embed_tokens"
        if not isinstance(table, QuantizedMatrix):
            w = self.g.float_initializer(table, f"{name}.weight")
            return self.g.one("Gather", [w, input_ids], f"/{name}/Gather")
        rows, cols = table.rows, table.cols
        packed, scales = self.quantized_table(table, name)
        flat = self.g.one(
            "Reshape",
            [packed, self.g.constant(np.array([rows, cols * table.bits // 8], np.int64))],
            f"/{name}/Reshape",
        )
        scales_2d = self.g.one(
            "Reshape",
            [scales, self.g.constant(np.array([rows, table.blocks_per_row], np.int64))],
            f"/{name}/Reshape_scales",
        )
        embeds = self.g.one(
            "GatherBlockQuantized",
            [flat, input_ids, scales_2d],
            f"/{name}/GatherBlockQuantized",
            domain=CONTRIB_DOMAIN,
            bits=table.bits,
            block_size=table.block_size,
            gather_axis=0,
            quantize_axis=1,
        )
        if table.offsets is None:
            return embeds
        # GatherBlockQuantized takes only integer zero points: add the float offsets per block.
        offsets = self.g.one(
            "Gather", [self.offsets_table(table, name), input_ids], f"/{name}/offsets/Gather"
        )
        blocked_shape = self.g.constant(np.array([0, 0, table.blocks_per_row, table.block_size], np.int64))
        blocked = self.g.one("Reshape", [embeds, blocked_shape], f"/{name}/offsets/Reshape")
        widened = self.g.one(
            "Unsqueeze", [offsets, self.g.constant(np.array([-1], np.int64))], f"/{name}/offsets/Unsqueeze"
        )
        shifted = self.g.one("Add", [blocked, widened], f"/{name}/offsets/Add")
        hidden_shape = self.g.constant(np.array([0, 0, cols], np.int64))
        return self.g.one("Reshape", [shifted, hidden_shape], f"/{name}/offsets/Reshape_back")

    def quantized_table(self, table: QuantizedMatrix, name: str) -> tuple[str, str]:
        """Initializers of a quantized [vocab, hidden] table, shared by the embedding and a tied head."""
        packed_name = f"{name}.weight_Q{table.bits}G{table.block_size}"
        if not self.g.has_initializer(packed_name):
            self.g.initializer(table.packed_codes(), packed_name)
            self.g.float_initializer(table.scales.reshape(-1), f"{name}.weight_scales")
        return packed_name, f"{name}.weight_scales"

    def offsets_table(self, table: QuantizedMatrix, name: str) -> str:
        offsets_name = f"{name}.weight_offsets_per_row"
        if not self.g.has_initializer(offsets_name):
            self.g.float_initializer(table.offsets_or_zeros(), offsets_name)
        return offsets_name

    def lm_head(self, x: str) -> str:
        head = self.weights.lm_head
        if head is not None:
            return self.linear(x, head, "lm_head")
        table = self.weights.embed_tokens
        if not isinstance(table, QuantizedMatrix):
            # Transposing the shared table in the graph keeps one copy on disk; ONNX Runtime
            # folds the Transpose once at load time.
            transposed = self.g.one(
                "Transpose", ["model.embed_tokens.weight"], "/lm_head/Transpose", perm=[1, 0]
            )
            return self.g.one("MatMul", [x, transposed], "/lm_head/MatMul")
        if table.offsets is not None:
            # The head needs the offsets inside its MatMulNBits; the embedding adds them per row.
            return self.quantized_linear(x, table, "lm_head")
        packed, scales = self.quantized_table(table, "model.embed_tokens")
        return self.matmul_nbits(x, packed, scales, table, "/lm_head")

    def attention(self, layer_id: int, layer: LlamaLayerWeights, x: str, mask_info: tuple[str, str]) -> str:
        cfg = self.config
        name = f"model.layers.{layer_id}.attn"
        projections = self.fused_linear(
            x, [layer.q_proj, layer.k_proj, layer.v_proj], f"{name}.qkv_proj", self.options.fuse_qkv
        )
        projections = self.adapted(
            layer_id,
            x,
            cfg.hidden_size,
            projections,
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            (cfg.q_size, cfg.kv_size, cfg.kv_size),
        )
        q, k, v = (projections, "", "") if isinstance(projections, str) else projections
        biases = (layer.q_bias, layer.k_bias, layer.v_bias)
        if any(b is not None for b in biases):
            sizes = (cfg.q_size, cfg.kv_size, cfg.kv_size)
            full = [np.zeros(n, np.float32) if b is None else b for b, n in zip(biases, sizes, strict=True)]
            if k:
                q, k, v = (
                    self.g.one(
                        "Add",
                        [t, self.g.float_initializer(b, f"{name}.{part}_proj.bias")],
                        f"/{name}/{part}_bias",
                    )
                    for t, b, part in zip((q, k, v), full, "qkv", strict=True)
                )
            else:
                bias = self.g.float_initializer(np.concatenate(full), f"{name}.qkv_proj.bias")
                q = self.g.one("Add", [q, bias], f"/{name}/qkv_bias")
        if layer.q_norm is not None or layer.k_norm is not None:
            if not k:
                split = np.array([cfg.q_size, cfg.kv_size, cfg.kv_size], np.int64)
                q, k, v = self.g.node(
                    "Split", [q, self.g.constant(split)], f"/{name}/qkv_split", outputs=3, axis=-1
                )
            if layer.q_norm is not None:
                q = self.head_rms_norm(q, layer.q_norm, f"{name}.q_norm")
            if layer.k_norm is not None:
                k = self.head_rms_norm(k, layer.k_norm, f"{name}.k_norm")
        seqlens_k, total_seq_len = mask_info
        sliding = cfg.is_sliding(layer_id)
        caches = (
            ("cos_cache_local", "sin_cache_local")
            if sliding and self.local_caches
            else ("cos_cache", "sin_cache")
        )
        scale = (
            cfg.attention_scale if cfg.attention_scale is not None else 1.0 / float(np.sqrt(cfg.head_size))
        )
        extra: dict[str, Any] = {}
        if cfg.attention_softcap:
            extra["softcap"] = float(cfg.attention_softcap)
        attn, _, _ = self.g.node(
            "GroupQueryAttention",
            [
                q,
                k,
                v,
                f"past_key_values.{layer_id}.key",
                f"past_key_values.{layer_id}.value",
                seqlens_k,
                total_seq_len,
                *caches,
            ],
            f"/{name}/GroupQueryAttention",
            outputs=[
                f"/{name}/GroupQueryAttention/output_0",
                f"present.{layer_id}.key",
                f"present.{layer_id}.value",
            ],
            domain=CONTRIB_DOMAIN,
            num_heads=cfg.num_heads,
            kv_num_heads=cfg.num_kv_heads,
            scale=scale,
            do_rotary=1,
            rotary_interleaved=0,
            # Both count the query's own key: position p sees keys p - window + 1 .. p.
            local_window_size=cfg.sliding_window if sliding else -1,
            **extra,
        )
        out = self.linear(attn, layer.o_proj, f"{name}.o_proj")
        return self.adapted_packed(layer_id, attn, cfg.q_size, out, ("self_attn.o_proj",), (cfg.hidden_size,))

    def head_rms_norm(self, x: str, gamma: NDArray[np.float32], name: str) -> str:
        """RMSNorm over each head of a [batch, seq, heads * head_size] projection."""
        per_head = self.g.one(
            "Reshape",
            [x, self.g.constant(np.array([0, 0, -1, self.config.head_size], np.int64))],
            f"/{name}/Reshape",
        )
        normed = self.rms_norm(per_head, gamma, name)
        return self.g.one(
            "Reshape", [normed, self.g.constant(np.array([0, 0, -1], np.int64))], f"/{name}/Reshape_back"
        )

    def mlp(self, layer_id: int, layer: LlamaLayerWeights, x: str) -> str:
        name = f"model.layers.{layer_id}.mlp"
        projections = self.fused_linear(
            x, [layer.gate_proj, layer.up_proj], f"{name}.gate_up_proj", self.options.fuse_gate_up
        )
        cfg = self.config
        size = cfg.intermediate_size
        projections = self.adapted(
            layer_id, x, cfg.hidden_size, projections, ("mlp.gate_proj", "mlp.up_proj"), (size, size)
        )
        if isinstance(projections, str):
            gate, up = self.g.node(
                "Split",
                [projections, self.g.constant(np.array([self.config.intermediate_size] * 2, np.int64))],
                f"/{name}/Split",
                outputs=2,
                axis=-1,
            )
        else:
            gate, up = projections
        if self.config.activation == "gelu_tanh":
            activated = self.g.one("Gelu", [gate], f"/{name}/act/Gelu", approximate="tanh")
        else:
            sigmoid = self.g.one("Sigmoid", [gate], f"/{name}/act/Sigmoid")
            activated = self.g.one("Mul", [gate, sigmoid], f"/{name}/act/Mul")
        hidden = self.g.one("Mul", [activated, up], f"/{name}/Mul")
        out = self.linear(hidden, layer.down_proj, f"{name}.down_proj")
        return self.adapted_packed(
            layer_id, hidden, cfg.intermediate_size, out, ("mlp.down_proj",), (cfg.hidden_size,)
        )

    def rms_norm(self, x: str, gamma: NDArray[np.float32], name: str) -> str:
        g = self.g.float_initializer(gamma, f"{name}.weight")
        return self.g.one(
            "SimplifiedLayerNormalization",
            [x, g],
            f"/{name}/SimplifiedLayerNorm",
            axis=-1,
            epsilon=self.config.rms_norm_eps,
        )

    def skip_rms_norm(self, x: str, residual: str, gamma: NDArray[np.float32], name: str) -> tuple[str, str]:
        """RMSNorm(x + residual) and the sum itself, in one kernel."""
        g = self.g.float_initializer(gamma, f"{name}.weight")
        node = f"/{name}/SkipLayerNorm"
        out, _, _, total = self.g.node(
            "SkipSimplifiedLayerNormalization",
            [x, residual, g],
            node,
            outputs=[f"{node}/output_0", "", "", f"{node}/output_3"],
            domain=CONTRIB_DOMAIN,
            epsilon=self.config.rms_norm_eps,
        )
        return out, total

    def mask_info(self) -> tuple[str, str]:
        """seqlens_k (each row's total length - 1, int32) and total_sequence_length (int32 scalar)."""
        name = "/model/attn_mask_reformat"
        one = self.g.constant(np.array([1], np.int64))
        total = self.g.one("ReduceSum", ["attention_mask", one], f"{name}/ReduceSum", keepdims=0)
        last = self.g.one("Sub", [total, one], f"{name}/Sub")
        seqlens_k = self.g.one("Cast", [last], f"{name}/Sub/Cast", to=TensorProto.INT32)
        shape = self.g.one("Shape", ["attention_mask"], f"{name}/Shape")
        width = self.g.one(
            "Gather", [shape, self.g.constant(np.array(1, np.int64))], f"{name}/Gather", axis=0
        )
        total_seq_len = self.g.one("Cast", [width], f"{name}/Gather/Cast", to=TensorProto.INT32)
        return seqlens_k, total_seq_len

    def build(self) -> onnx.ModelProto:
        cfg, w = self.config, self.weights
        if len(w.layers) != cfg.num_layers:
            raise ValueError(f"config has {cfg.num_layers} layers, weights have {len(w.layers)}")
        self.check_table_shapes()
        cos, sin = rotary_caches(cfg, w.rope_freq_factors, linear_scale=cfg.rope_linear_scale)
        self.g.float_initializer(cos, "cos_cache")
        self.g.float_initializer(sin, "sin_cache")
        if self.local_caches:
            cos, sin = rotary_caches(cfg, w.rope_freq_factors, theta=cfg.local_rope_theta)
            self.g.float_initializer(cos, "cos_cache_local")
            self.g.float_initializer(sin, "sin_cache_local")
        mask_info = self.mask_info()

        residual = self.embedding("input_ids")
        if cfg.embedding_scale != 1.0:
            scale = self.g.constant(np.array(cfg.embedding_scale, self.g.float_dtype))
            residual = self.g.one("Mul", [residual, scale], "/model/embed_scale/Mul")
        # Each layer is fetched once: GGUF weights are decoded on access, one layer at a time.
        layer = w.layers[0]
        x = self.rms_norm(residual, layer.attn_norm, "model.layers.0.input_layernorm")
        for i in range(cfg.num_layers):
            self.check_layer_shapes(i, layer)
            attn = self.attention(i, layer, x, mask_info)
            if layer.post_attn_norm is not None:
                attn = self.rms_norm(attn, layer.post_attn_norm, f"model.layers.{i}.post_attn_norm")
            x, residual = self.skip_rms_norm(
                attn, residual, layer.ffn_norm, f"model.layers.{i}.post_attention_layernorm"
            )
            mlp = self.mlp(i, layer, x)
            if layer.post_ffn_norm is not None:
                mlp = self.rms_norm(mlp, layer.post_ffn_norm, f"model.layers.{i}.post_ffn_norm")
            if i + 1 < cfg.num_layers:
                layer = w.layers[i + 1]
                gamma, norm_name = layer.attn_norm, f"model.layers.{i + 1}.input_layernorm"
            else:
                gamma, norm_name = w.final_norm, "model.norm"
            x, residual = self.skip_rms_norm(mlp, residual, gamma, norm_name)
        logits = self.lm_head(x)
        if self.float_type != TensorProto.FLOAT:
            logits = self.g.one("Cast", [logits], "/lm_head/Cast", to=TensorProto.FLOAT)
        if cfg.final_logit_softcap:
            cap = self.g.constant(np.array(cfg.final_logit_softcap, np.float32))
            scaled = self.g.one("Div", [logits, cap], "/lm_head/softcap/Div")
            capped = self.g.one("Tanh", [scaled], "/lm_head/softcap/Tanh")
            logits = self.g.one("Mul", [capped, cap], "/lm_head/softcap/Mul")
        self.g.nodes.append(helper.make_node("Identity", [logits], ["logits"], name="/logits/Identity"))
        return self.model()

    def check_layer_shapes(self, layer_id: int, layer: LlamaLayerWeights) -> None:
        cfg = self.config
        h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
        expected = {
            "q_proj": (q, h),
            "k_proj": (kv, h),
            "v_proj": (kv, h),
            "o_proj": (h, q),
            "gate_proj": (i, h),
            "up_proj": (i, h),
            "down_proj": (h, i),
        }
        for attr, shape in expected.items():
            got = linear_shape(getattr(layer, attr))
            if got != shape:
                raise ValueError(f"layer {layer_id} {attr} has shape {got}, expected {shape}")

    def check_table_shapes(self) -> None:
        cfg, w = self.config, self.weights
        if linear_shape(w.embed_tokens) != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(f"embedding has shape {linear_shape(w.embed_tokens)}")
        if w.lm_head is not None and linear_shape(w.lm_head) != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(f"lm_head has shape {linear_shape(w.lm_head)}")

    def model(self) -> onnx.ModelProto:
        cfg = self.config
        ft = self.float_type
        kv_in: list[str | int] = ["batch_size", cfg.num_kv_heads, "past_sequence_length", cfg.head_size]
        kv_out: list[str | int] = ["batch_size", cfg.num_kv_heads, "total_sequence_length", cfg.head_size]
        inputs = [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
            helper.make_tensor_value_info(
                "attention_mask", TensorProto.INT64, ["batch_size", "total_sequence_length"]
            ),
        ]
        outputs = [
            helper.make_tensor_value_info(
                "logits", TensorProto.FLOAT, ["batch_size", "sequence_length", cfg.vocab_size]
            )
        ]
        for layer in range(cfg.num_layers):
            for kind in ("key", "value"):
                inputs.append(helper.make_tensor_value_info(f"past_key_values.{layer}.{kind}", ft, kv_in))
                outputs.append(helper.make_tensor_value_info(f"present.{layer}.{kind}", ft, kv_out))
        if self.lora is not None:
            inputs.extend(self.lora.graph_inputs())
        graph = helper.make_graph(self.g.nodes, "llama", inputs, outputs, self.g.initializers)
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", ONNX_OPSET), helper.make_opsetid(CONTRIB_DOMAIN, 1)],
            producer_name="tokenwire",
        )
        model.ir_version = 10
        return model


def build_llama_graph(
    config: LlamaConfig,
    weights: LlamaWeights,
    options: GraphOptions | None = None,
    *,
    external_data: Path | None = None,
) -> onnx.ModelProto:
    """The decoder graph for `weights`.

    With `external_data`, tensor bytes are written to that file as the graph is built and the
    returned model refers to it by name: save the model beside it with `save_model(...,
    external_data=False)`. Otherwise every initializer is embedded in the returned model.
    """
    sink = ExternalData(external_data) if external_data is not None else None
    try:
        return _LlamaGraphBuilder(config, weights, options or GraphOptions(), sink).build()
    finally:
        if sink is not None:
            sink.close()


def save_model(model: onnx.ModelProto, path: Path, *, external_data: bool) -> None:
    """Write the model; with `external_data`, weights go to `<name>.data` beside it (needed past 2 GB)."""
    if external_data:
        # onnx appends to an existing data file: start from an empty one.
        path.with_name(path.name + ".data").unlink(missing_ok=True)
        onnx.save_model(
            model,
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=path.name + ".data",
            size_threshold=1024,
        )
        # onnx creates the data file owner-only; give it the same permissions as model.onnx.
        path.with_name(path.name + ".data").chmod(path.stat().st_mode & 0o777)
    else:
        onnx.save_model(model, str(path))
