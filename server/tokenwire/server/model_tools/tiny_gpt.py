"""A deterministic tiny GPT-style decoder in the Hugging Face Optimum ONNX layout.

The graph follows what `optimum-cli export onnx --task text-generation-with-past` produces:
inputs `input_ids`, `attention_mask`, `position_ids` (unless the config leaves it out),
`past_key_values.{i}.key/value` ([batch, heads, past, head_dim]); outputs `logits` and
`present.{i}.key/value`. Its blocks are GPT-2's (pre-LayerNorm, exact-erf GELU, untied head),
and with LoRA options its projections take per-row adapters under GPT-2's module names
(`attn.c_attn` for Q, K and V together, `attn.c_proj`, `mlp.c_fc`, `mlp.c_proj`). It is built
from standard ONNX operators with numpy weights drawn from a seeded generator, so the project's
tests exercise the same code path as exported Hugging Face models, without any download.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tokenwire.server.model_tools.convert.lora_graph import LoraInputs, LoraOptions
from tokenwire.server.model_tools.tiny_tokenizer import (
    CHATML_TEMPLATE,
    END_OF_TEXT,
    TURN_END,
    build_byte_level_tokenizer,
    write_tokenizer_files,
)

OPSET = 17


@dataclass(frozen=True)
class TinyGptConfig:
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    vocab: int = 512
    context_length: int = 256
    seed: int = 0
    position_ids: bool = True
    """False: no `position_ids` input; the graph derives every row's positions from the cache
    width (past length + offset), as Optimum's exports of Gemma models do."""

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def create_tiny_gpt(
    out_dir: Path, config: TinyGptConfig, *, chat_template: bool = True, lora: LoraOptions | None = None
) -> Path:
    """Write model.onnx, config files and tokenizer files for a tiny GPT into `out_dir`."""
    if config.hidden % config.heads:
        raise ValueError("hidden must be a multiple of heads")
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_byte_level_tokenizer(config.vocab)
    eos_ids = [tokenizer.token_to_id(END_OF_TEXT), tokenizer.token_to_id(TURN_END)]
    model = build_tiny_gpt_graph(config, lora=lora)
    onnx.save_model(model, str(out_dir / "model.onnx"))
    hf_config = {
        "architectures": ["TokenwireTinyGPT"],
        "model_type": "tokenwire-tiny-gpt",
        "vocab_size": config.vocab,
        "max_position_embeddings": config.context_length,
        "num_hidden_layers": config.layers,
        "num_attention_heads": config.heads,
        "hidden_size": config.hidden,
        "bos_token_id": None,
        "eos_token_id": eos_ids,
        "tokenwire_build": asdict(config),
    }
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2))
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}, indent=2))
    write_tokenizer_files(
        out_dir,
        tokenizer,
        bos_token=None,
        eos_token=END_OF_TEXT,
        chat_template=CHATML_TEMPLATE if chat_template else None,
    )
    return out_dir


def tiny_gpt_weights(config: TinyGptConfig) -> dict[str, np.ndarray]:
    """The model's weights, drawn from a generator seeded with `config.seed`.

    Scales are chosen so the logits spread over several units: random models with tiny weights
    produce near-uniform logits, where greedy decoding would hinge on rounding noise.
    """
    rng = np.random.default_rng(config.seed)
    c, v = config.hidden, config.vocab

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    weights: dict[str, np.ndarray] = {
        "wte": normal((v, c), 1.0),
        "wpe": normal((config.context_length, c), 0.5),
    }
    for i in range(config.layers):
        p = f"h{i}."
        weights[p + "ln1.g"] = (1.0 + normal((c,), 0.1)).astype(np.float32)
        weights[p + "ln1.b"] = normal((c,), 0.1)
        for name in ("q", "k", "v", "o"):
            weights[p + f"w{name}"] = normal((c, c), 1.0 / np.sqrt(c))
            weights[p + f"b{name}"] = normal((c,), 0.05)
        weights[p + "ln2.g"] = (1.0 + normal((c,), 0.1)).astype(np.float32)
        weights[p + "ln2.b"] = normal((c,), 0.1)
        weights[p + "w1"] = normal((c, 4 * c), 1.0 / np.sqrt(c))
        weights[p + "b1"] = normal((4 * c,), 0.05)
        weights[p + "w2"] = normal((4 * c, c), 1.0 / np.sqrt(4 * c))
        weights[p + "b2"] = normal((c,), 0.05)
    weights["lnf.g"] = (1.0 + normal((c,), 0.1)).astype(np.float32)
    weights["lnf.b"] = normal((c,), 0.1)
    weights["lm_head"] = normal((c, v), 3.0 / np.sqrt(c))
    return weights


class _GraphBuilder:
    """Accumulates nodes with unique output names."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[TensorProto] = []
        self._count = 0

    def op(self, op_type: str, inputs: list[str], **attrs: Any) -> str:
        self._count += 1
        out = f"{op_type.lower()}_{self._count}"
        self.nodes.append(helper.make_node(op_type, inputs, [out], **attrs))
        return out

    def op_to(self, op_type: str, inputs: list[str], output: str, **attrs: Any) -> str:
        self.nodes.append(helper.make_node(op_type, inputs, [output], **attrs))
        return output

    def const(self, name: str, value: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(value, name))
        return name


# GPT-2's adaptable projections: module path -> (input, output) widths in units of `hidden`.
GPT_LORA_MODULES = {"attn.c_attn": (1, 3), "attn.c_proj": (1, 1), "mlp.c_fc": (1, 4), "mlp.c_proj": (4, 1)}


def build_tiny_gpt_graph(config: TinyGptConfig, *, lora: LoraOptions | None = None) -> onnx.ModelProto:
    weights = tiny_gpt_weights(config)
    g = _GraphBuilder()
    lora_inputs = LoraInputs(TensorProto.FLOAT)

    def adapted(layer: int, module: str, x: str, outputs: list[str]) -> list[str]:
        """`outputs` (the module's output, or Q, K and V for c_attn) plus the module's LoRA delta."""
        if lora is None or not lora.wants(module):
            return outputs
        wide_in, wide_out = GPT_LORA_MODULES[module]
        c = config.hidden
        delta = lora_inputs.delta(
            lambda op, inputs, _name: g.op(op, inputs), x, layer, module, wide_in * c, wide_out * c
        )
        parts = [delta]
        if len(outputs) > 1:
            parts = [f"{delta}/part_{n}" for n in range(len(outputs))]
            # Opset 17's Split without sizes cuts equal parts.
            g.nodes.append(helper.make_node("Split", [delta], parts, axis=-1))
        return [g.op("Add", [out, part]) for out, part in zip(outputs, parts, strict=True)]

    for name, value in weights.items():
        g.const(name, value)
    h, d = config.heads, config.head_dim
    g.const("axes0", np.array([0], dtype=np.int64))
    g.const("axes1", np.array([1], dtype=np.int64))
    g.const("axes12", np.array([1, 2], dtype=np.int64))
    g.const("zero", np.array(0, dtype=np.int64))
    g.const("one", np.array(1, dtype=np.int64))
    g.const("neg_large", np.array(-1e9, dtype=np.float32))
    g.const("inv_sqrt_d", np.array(1.0 / np.sqrt(d), dtype=np.float32))
    g.const("heads_shape", np.array([0, 0, h, d], dtype=np.int64))
    g.const("merge_shape", np.array([0, 0, h * d], dtype=np.int64))
    g.const("half", np.array(0.5, dtype=np.float32))
    g.const("inv_sqrt2", np.array(1.0 / np.sqrt(2.0), dtype=np.float32))

    # Sequence lengths: S new tokens, T = past + S total, P = T - S.
    s_len = g.op("Gather", [g.op("Shape", ["input_ids"]), "one"], axis=0)
    t_len = g.op("Gather", [g.op("Shape", ["attention_mask"]), "one"], axis=0)
    p_len = g.op("Sub", [t_len, s_len])
    # allowed[b, 0, s, t] = mask[b, t] and t <= P + s (causal over the absolute positions).
    key_pos = g.op("Range", ["zero", t_len, "one"])
    query_pos = g.op("Add", [g.op("Range", ["zero", s_len, "one"]), p_len])
    causal = g.op(
        "LessOrEqual", [g.op("Unsqueeze", [key_pos, "axes0"]), g.op("Unsqueeze", [query_pos, "axes1"])]
    )
    padding = g.op("Cast", [g.op("Unsqueeze", ["attention_mask", "axes12"])], to=TensorProto.BOOL)
    allowed = g.op("And", [causal, padding])

    # Without a position_ids input every row's positions are P..T-1 ([1, S], broadcast over the
    # batch): right for a row whose cache holds only its own tokens, shifted for a padded one.
    positions = "position_ids" if config.position_ids else g.op("Unsqueeze", [query_pos, "axes0"])
    x = g.op(
        "Add",
        [
            g.op("Gather", ["wte", "input_ids"], axis=0),
            g.op("Gather", ["wpe", positions], axis=0),
        ],
    )
    for i in range(config.layers):
        p = f"h{i}."
        ln1 = g.op("LayerNormalization", [x, p + "ln1.g", p + "ln1.b"], axis=-1, epsilon=1e-5)

        def project(name: str, source: str, prefix: str = p) -> str:
            return g.op("Add", [g.op("MatMul", [source, prefix + "w" + name]), prefix + "b" + name])

        def split_heads(tensor: str) -> str:
            return g.op("Transpose", [g.op("Reshape", [tensor, "heads_shape"])], perm=[0, 2, 1, 3])

        q, k, v = (
            split_heads(t)
            for t in adapted(i, "attn.c_attn", ln1, [project("q", ln1), project("k", ln1), project("v", ln1)])
        )
        k_all = g.op_to("Concat", [f"past_key_values.{i}.key", k], f"present.{i}.key", axis=2)
        v_all = g.op_to("Concat", [f"past_key_values.{i}.value", v], f"present.{i}.value", axis=2)
        scores = g.op(
            "Mul", [g.op("MatMul", [q, g.op("Transpose", [k_all], perm=[0, 1, 3, 2])]), "inv_sqrt_d"]
        )
        scores = g.op("Where", [allowed, scores, "neg_large"])
        probs = g.op("Softmax", [scores], axis=-1)
        attn = g.op("MatMul", [probs, v_all])
        attn = g.op("Reshape", [g.op("Transpose", [attn], perm=[0, 2, 1, 3]), "merge_shape"])
        (out,) = adapted(i, "attn.c_proj", attn, [project("o", attn)])
        x = g.op("Add", [x, out])
        ln2 = g.op("LayerNormalization", [x, p + "ln2.g", p + "ln2.b"], axis=-1, epsilon=1e-5)
        (up,) = adapted(i, "mlp.c_fc", ln2, [project("1", ln2)])
        # GELU with the exact erf form: 0.5 * x * (1 + erf(x / sqrt(2))).
        gelu = g.op(
            "Mul",
            [
                g.op("Mul", [up, "half"]),
                g.op("Add", [g.op("Erf", [g.op("Mul", [up, "inv_sqrt2"])]), "one_f"]),
            ],
        )
        (down,) = adapted(i, "mlp.c_proj", gelu, [project("2", gelu)])
        x = g.op("Add", [x, down])
    g.const("one_f", np.array(1.0, dtype=np.float32))
    final = g.op("LayerNormalization", [x, "lnf.g", "lnf.b"], axis=-1, epsilon=1e-5)
    g.op_to("MatMul", [final, "lm_head"], "logits")

    def tensor(name: str, elem: int, shape: list[str | int]) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, elem, shape)

    inputs = [
        tensor("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
        tensor("attention_mask", TensorProto.INT64, ["batch_size", "total_sequence_length"]),
    ]
    if config.position_ids:
        inputs.append(tensor("position_ids", TensorProto.INT64, ["batch_size", "sequence_length"]))
    outputs = [tensor("logits", TensorProto.FLOAT, ["batch_size", "sequence_length", config.vocab])]
    for i in range(config.layers):
        for kind in ("key", "value"):
            inputs.append(
                tensor(
                    f"past_key_values.{i}.{kind}",
                    TensorProto.FLOAT,
                    ["batch_size", h, "past_sequence_length", d],
                )
            )
            outputs.append(
                tensor(
                    f"present.{i}.{kind}", TensorProto.FLOAT, ["batch_size", h, "total_sequence_length", d]
                )
            )
    inputs.extend(lora_inputs.graph_inputs())
    graph = helper.make_graph(g.nodes, "tokenwire_tiny_gpt", inputs, outputs, g.initializers)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="tokenwire"
    )
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model
