"""The LoRA part of a decoder graph: per-row adapter deltas from stacked A and B inputs.

For each adapted projection ("site") the graph takes `lora.{layer}.{module}.A` [slots, in, rank]
and `.B` [slots, rank, out] and adds, per row b, `(x[b] @ A[lora_index[b]]) @ B[lora_index[b]]`
to the projection's output: two Gathers on the stacks by the row's slot and two batched MatMuls,
standard ONNX operators that CPU and CUDA both run. Slot count and rank are free dimensions,
chosen by the runner when it allocates the stacks (see models/adapters.py, which reads these
inputs back). A graph built without LoRA options has none of this.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import onnx
from onnx import TensorProto, helper

from tokenwire.server.model_tools.convert.gguf_source import FAMILIES
from tokenwire.server.models.adapters import FUSED_MODULES, LORA_INDEX, lora_input_name

# Adds one node: (op type, inputs, node name) -> its output's name.
AddNode = Callable[[str, list[str], str], str]

PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
"""The projections of a decoder layer that can take a site, in layer order, as the graph names
them for every family the converter serves."""


@dataclass(frozen=True)
class LoraOptions:
    """Which projections take adapters: module paths below a layer in Hugging Face's names.

    None is every projection of the family. A module fused with others in the graph (Q, K and V
    in one MatMul) brings the rest of its group along, since their outputs are added as one.
    """

    modules: tuple[str, ...] | None = None

    def wants(self, module: str) -> bool:
        return self.modules is None or module in self.modules

    def group(self, modules: Iterable[str]) -> tuple[str, ...]:
        """The modules of a fused group that get sites: all of them if any is wanted."""
        group = tuple(modules)
        return group if any(self.wants(m) for m in group) else ()

    @property
    def label(self) -> str:
        """The module set in a cache directory's name: `all`, or the projections' own names in
        layer order joined by '-' (`q_proj-v_proj`). Only sets of PROJECTIONS have a label: the
        short names are unique among them, not among arbitrary paths."""
        if self.modules is None:
            return "all"
        unknown = sorted(set(self.modules) - set(PROJECTIONS))
        if unknown:
            raise ValueError(f"{unknown[0]!r} is not one of the projections {', '.join(PROJECTIONS)}")
        return "-".join(short_names(self.modules))


def module_names(architecture: str) -> dict[str, tuple[str, ...]]:
    """The names `--lora-modules` takes for a family, each to the graph's modules it stands for.

    These are the names PEFT's target_modules uses: a module's own name (`q_proj`) or its path
    below the layer (`self_attn.q_proj`). Phi-3's checkpoints fuse Q, K and V (and gate and up)
    into one module each, so its fused names stand for their parts too.
    """
    family = FAMILIES.get(architecture)
    if family is None:
        raise ValueError(f"architecture {architecture!r} has no LoRA sites")
    fused = FUSED_MODULES if family.fused_projections else {}
    names: dict[str, tuple[str, ...]] = {}
    for path in PROJECTIONS:
        for whole, parts in fused.items():
            if parts[0] == path:
                names[short_name(whole)] = names[whole] = parts
        names[short_name(path)] = names[path] = (path,)
    return names


def lora_options_for(architecture: str, names: Sequence[str] | None) -> LoraOptions:
    """The options that give a family's graph sites on the modules `names` (None: every projection).

    A set naming every projection is LoraOptions() itself, so its graph is the all-projection
    one (and shares its cache). Raises ValueError naming an unknown name and the family's names.
    """
    if names is None:
        return LoraOptions()
    if not names:
        raise ValueError("names no module")
    known = module_names(architecture)
    chosen: set[str] = set()
    for name in names:
        if name not in known:
            shown = ", ".join(n for n in known if "." not in n)
            raise ValueError(
                f"{name[:80]!r} is not a projection of {architecture} models: name some of {shown} "
                "(or their paths below a layer, such as self_attn.q_proj)"
            )
        chosen.update(known[name])
    if chosen == set(PROJECTIONS):
        return LoraOptions()
    return LoraOptions(modules=tuple(m for m in PROJECTIONS if m in chosen))


def short_name(path: str) -> str:
    """A module's own name, as PEFT's target_modules gives it: `q_proj` for `self_attn.q_proj`."""
    return path.rpartition(".")[2]


def short_names(modules: Iterable[str]) -> tuple[str, ...]:
    """`modules`' own names, the projections in layer order, then any others in name order."""
    chosen = set(modules)
    ordered = [m for m in PROJECTIONS if m in chosen] + sorted(chosen - set(PROJECTIONS))
    return tuple(short_name(m) for m in ordered)


class LoraInputs:
    """Collects a graph's LoRA sites while it is built, and declares their inputs."""

    def __init__(self, float_type: int) -> None:
        self.float_type = float_type
        self._inputs: list[onnx.ValueInfoProto] = []

    def delta(
        self, add: AddNode, x: str, layer: int, module: str, in_features: int, out_features: int
    ) -> str:
        """The site's per-row update of `x` ([batch, seq, in_features] -> [batch, seq, out_features])."""
        a_name = lora_input_name(layer, module, "A")
        b_name = lora_input_name(layer, module, "B")
        self._inputs.append(
            helper.make_tensor_value_info(a_name, self.float_type, ["lora_slots", in_features, "lora_rank"])
        )
        self._inputs.append(
            helper.make_tensor_value_info(b_name, self.float_type, ["lora_slots", "lora_rank", out_features])
        )
        prefix = f"/lora/{layer}/{module}"
        a = add("Gather", [a_name, LORA_INDEX], f"{prefix}/A/Gather")
        down = add("MatMul", [x, a], f"{prefix}/A/MatMul")
        b = add("Gather", [b_name, LORA_INDEX], f"{prefix}/B/Gather")
        return add("MatMul", [down, b], f"{prefix}/B/MatMul")

    def graph_inputs(self) -> list[onnx.ValueInfoProto]:
        """`lora_index` and every site's stacks; empty when no site was added."""
        if not self._inputs:
            return []
        index = helper.make_tensor_value_info(LORA_INDEX, TensorProto.INT64, ["batch_size"])
        return [index, *self._inputs]
