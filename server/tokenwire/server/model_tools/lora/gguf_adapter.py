"""Read a GGUF LoRA adapter, as llama.cpp's convert_lora_to_gguf.py writes it.

Such a file has `general.type` "adapter", `adapter.type` "lora", the base model's
`general.architecture` and `adapter.lora.alpha`, and per adapted projection
`blk.N.<tensor>.weight.lora_a` ([r, in] in numpy's order) and `...lora_b` ([out, r]), named as
the base model's own GGUF tensors. llama.cpp scales each pair by alpha / r (1 when alpha is 0),
and so does this reader. The converter sends the pairs through the same tensor changes as the
base weights: for llama (and mistral) the rows of the Q and K projections' B are permuted into
llama.cpp's rotary order, which is undone here with the base model's head counts, as the base
import undoes it; Phi-3's fused attn_qkv and gate-up ffn_up are split by the graph's sites.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from tokenwire.server.model_tools.convert.errors import ConversionError
from tokenwire.server.model_tools.convert.gguf_file import GgufArray, GgufTensor, open_gguf
from tokenwire.server.model_tools.convert.gguf_source import (
    PERMUTED_ROTARY,
    SUPPORTED_ARCHITECTURES,
    rotary_half_order,
)
from tokenwire.server.models.adapters import (
    F32,
    AdapterError,
    LoraAdapter,
    LoraFactor,
    LoraLayout,
    fit_adapter,
)

_TENSOR_NAME = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<tensor>[a-z_]+)\.weight\.lora_(?P<part>[ab])$")
# GGUF tensor -> Hugging Face module path below the layer (Phi-3's ffn_up is its fused gate-up).
_MODULES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_PHI3_MODULES = {**_MODULES, "ffn_up": "mlp.gate_up_proj"}


@dataclass(frozen=True)
class AdapterBase:
    """What reading a GGUF adapter needs to know of the model it is loaded onto."""

    architecture: str | None
    """The base's GGUF architecture, where it came from a GGUF file; None skips that check."""
    num_heads: int
    num_kv_heads: int

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> AdapterBase:
        """From a GenAI-layout directory: genai_config.json, and conversion.json where converted."""
        decoder = json.loads((model_dir / "genai_config.json").read_text())["model"]["decoder"]
        architecture = None
        info_path = model_dir / "conversion.json"
        if info_path.is_file():
            architecture = json.loads(info_path.read_text()).get("architecture")
        return cls(
            architecture=str(architecture) if architecture is not None else None,
            num_heads=int(decoder["num_attention_heads"]),
            num_kv_heads=int(decoder["num_key_value_heads"]),
        )


def read_gguf_adapter(
    path: Path, layout: LoraLayout, *, base: AdapterBase, max_rank: int, name: str | None = None
) -> LoraAdapter:
    """The adapter in GGUF file `path`, fitted to `layout` (see models/adapters.fit_adapter)."""
    name = name or path.stem
    try:
        reader = open_gguf(path)
    except ConversionError as error:
        raise AdapterError(f"adapter {name}: {error}") from None

    def field(key: str) -> Any:
        found = reader.fields.get(key)
        return found.strings() if isinstance(found, GgufArray) and found.holds_strings else found

    if field("general.type") != "adapter" or field("adapter.type") != "lora":
        raise AdapterError(
            f"adapter {name}: {path.name} is not a LoRA adapter (general.type "
            f"{str(field('general.type'))[:40]!r}, adapter.type {str(field('adapter.type'))[:40]!r})"
        )
    arch = str(field("general.architecture"))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise AdapterError(
            f"adapter {name}: is for architecture {arch[:40]!r}, which is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if base.architecture is not None and arch != base.architecture:
        raise AdapterError(
            f"adapter {name}: is for architecture {arch}, but the model is {base.architecture}"
        )
    if field("adapter.alora.invocation_tokens") is not None:
        raise AdapterError(f"adapter {name}: is an activated LoRA (aLoRA), which is not supported")
    alpha = field("adapter.lora.alpha")
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, int | float)):
        raise AdapterError(f"adapter {name}: adapter.lora.alpha is {str(alpha)[:40]!r}, not a number")
    alpha = 0.0 if alpha is None else float(alpha)
    modules = _PHI3_MODULES if arch == "phi3" else _MODULES
    pairs: dict[tuple[int, str], dict[str, GgufTensor]] = {}
    for tensor in reader.tensors:
        match = _TENSOR_NAME.match(tensor.name)
        if match is None or match.group("tensor") not in modules:
            raise AdapterError(
                f"adapter {name}: tensor {tensor.name[:120]} is not a LoRA pair of a decoder layer's "
                "projection (only those take adapters)"
            )
        key = (int(match.group("layer")), match.group("tensor"))
        pairs.setdefault(key, {})[match.group("part")] = tensor
    factors = []
    for (layer, tensor_name), pair in pairs.items():
        label = f"blk.{layer}.{tensor_name}.weight"
        if set(pair) != {"a", "b"}:
            raise AdapterError(f"adapter {name}: {label} has no lora_{'b' if 'a' in pair else 'a'} tensor")
        a, b = pair["a"], pair["b"]
        # GGUF lists the fastest-varying dimension first: lora_a [in, r], lora_b [r, out].
        a_dims, b_dims = [int(n) for n in a.shape], [int(n) for n in b.shape]
        if len(a_dims) != 2 or len(b_dims) != 2 or a_dims[1] != b_dims[0]:
            raise AdapterError(
                f"adapter {name}: {label} has lora_a {a_dims} and lora_b {b_dims}, not [in, r] and [r, out]"
            )
        rank = b_dims[0]
        heads = {"attn_q": base.num_heads, "attn_k": base.num_kv_heads}.get(tensor_name)
        factors.append(
            LoraFactor(
                layer=layer,
                module=modules[tensor_name],
                rank=rank,
                in_features=a_dims[0],
                out_features=b_dims[1],
                scale=alpha / rank if alpha else 1.0,
                label=label,
                read=_reader(a, b, heads if arch in PERMUTED_ROTARY else None),
            )
        )
    return fit_adapter(name, factors, layout, max_rank=max_rank)


def _matrix(tensor: GgufTensor) -> F32:
    cols, rows = (int(n) for n in tensor.shape)
    values = dequantize(np.asarray(tensor.data), GGMLQuantizationType(tensor.tensor_type))
    return np.asarray(values, dtype=np.float32).reshape(rows, cols)


def _reader(a: GgufTensor, b: GgufTensor, permuted_heads: int | None) -> Callable[[], tuple[F32, F32]]:
    def read() -> tuple[F32, F32]:
        b_rows = _matrix(b)
        if permuted_heads is not None:
            b_rows = np.ascontiguousarray(
                b_rows[rotary_half_order(permuted_heads, b_rows.shape[0] // permuted_heads)]
            )
        return _matrix(a), b_rows

    return read
