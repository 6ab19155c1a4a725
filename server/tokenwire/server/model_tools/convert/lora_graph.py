"""The LoRA part of a decoder graph: per-row adapter deltas from stacked A and B inputs.

For each adapted projection ("site") the graph takes `lora.{layer}.{module}.A` [slots, in, rank]
and `.B` [slots, rank, out] and adds, per row b, `(x[b] @ A[lora_index[b]]) @ B[lora_index[b]]`
to the projection's output: two Gathers on the stacks by the row's slot and two batched MatMuls,
standard ONNX operators that CPU and CUDA both run. Slot count and rank are free dimensions,
chosen by the runner when it allocates the stacks (see models/adapters.py, which reads these
inputs back). A graph built without LoRA options has none of this.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import onnx
from onnx import TensorProto, helper

from tokenwire.server.models.adapters import LORA_INDEX, lora_input_name

# Adds one node: (op type, inputs, node name) -> its output's name.
AddNode = Callable[[str, list[str], str], str]


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
