"""The model's last hidden states, for embeddings: found in its graph, run, pooled.

A causal LM's graph computes the hidden state its head reads (after the final norm, what
transformers returns as the last of `hidden_states`) but only outputs logits. At load the graph is
read without its weights, the tensor feeding the head is found by walking back from `logits`
through the ops that only reshape or rescale it (Identity, Cast, the soft cap's Div/Tanh/Mul) to
the head's MatMul, and that tensor is made one more graph output. The runner's one session then
serves both: generation binds `logits` only, so nothing changes for it; an embedding binds the
hidden state only, so the head's MatMul (the vocabulary-wide one) does not run at all.

An embedding pass is stateless: every input starts from an empty cache, so it takes no KV slot.
Inputs of a batch are right-padded to the longest: attention is causal, so a real position never
reads the padding after it, and each row's real positions equal the row run alone (to the graph's
own batch rounding).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import onnx
import onnxruntime as ort

from tokenwire.server.models.adapters import LORA_INDEX, NO_ADAPTER, AdapterStacks
from tokenwire.server.models.runner import ModelRunnerError
from tokenwire.server.models.session import run_bound

log = logging.getLogger(__name__)

HEAD_OPS = frozenset({"MatMul", "MatMulNBits", "Gemm", "FusedMatMul"})
"""Ops that can be the LM head: their first input is the hidden state."""
PASS_THROUGH_OPS = frozenset({"Identity", "Cast", "Div", "Tanh", "Mul"})
"""Ops between the head and `logits` that keep the head's value as their first input."""
MAX_WALK = 8


@dataclass(frozen=True)
class ExposedGraph:
    """A graph with its head's input made an output, ready for ONNX Runtime."""

    model: bytes
    """The serialized graph without its external weights (they stay in their files)."""
    hidden_output: str


def expose_hidden_states(model_path: Path) -> ExposedGraph | None:
    """The graph at `model_path` with the hidden state its head reads as one more output; None
    (said in one log line) where no head is found, and the model then serves no embeddings."""
    model = onnx.load(str(model_path), load_external_data=False)
    graph = model.graph
    producer = {output: node for node in graph.node for output in node.output}
    name = "logits"
    for _ in range(MAX_WALK):
        node = producer.get(name)
        if node is None or not node.input:
            break
        if node.op_type in HEAD_OPS:
            hidden = node.input[0]
            if hidden not in {output.name for output in graph.output}:
                exposed = onnx.ValueInfoProto()
                exposed.name = hidden
                graph.output.append(exposed)
            return ExposedGraph(model.SerializeToString(), hidden)
        if node.op_type not in PASS_THROUGH_OPS:
            break
        name = node.input[0]
    log.warning("%s: no LM head found before `logits`: this model serves no embeddings", model_path.name)
    return None


class KvGeometry(Protocol):
    """What an empty cache needs of a layout: its heads, head size and dtype."""

    @property
    def kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def kv_dtype(self) -> np.dtype[np.floating]: ...


@dataclass(frozen=True)
class HiddenStatePass:
    """How to run a stateless embedding pass over one runner's session."""

    session: ort.InferenceSession
    output: str
    past_names: Sequence[str]
    kv_heads: int
    head_dim: int
    kv_dtype: np.dtype[np.floating]
    adapters: AdapterStacks | None = None
    """The stacks of a graph with LoRA sites: an embedding runs every row with the base model."""

    @classmethod
    def over(
        cls,
        session: ort.InferenceSession,
        output: str | None,
        past_names: Sequence[str],
        kv: KvGeometry,
        adapters: AdapterStacks | None = None,
    ) -> HiddenStatePass | None:
        """The pass over `session`'s `output`; None where the graph exposes none."""
        if output is None:
            return None
        return cls(session, output, past_names, kv.kv_heads, kv.head_dim, kv.kv_dtype, adapters)

    def size(self) -> int:
        """Floats in one position's hidden state: the output's static last dimension, or what a
        one-token pass returns where the graph leaves it symbolic."""
        shape = next((o.shape for o in self.session.get_outputs() if o.name == self.output), None)
        last = shape[-1] if shape else None
        return last if isinstance(last, int) else int(self.run([[0]])[0].shape[-1])

    def run(self, inputs: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Each input's hidden states, [len(input), hidden] float32, from one model call over all
        of them right-padded to the longest."""
        if not inputs or any(not tokens for tokens in inputs):
            raise ModelRunnerError("an embedding pass needs at least one token per input")
        rows, width = len(inputs), max(len(tokens) for tokens in inputs)
        ids = np.zeros((rows, width), dtype=np.int64)
        for row, tokens in enumerate(inputs):
            ids[row, : len(tokens)] = tokens
        binding = self.session.io_binding()
        binding.bind_cpu_input("input_ids", ids)
        # All ones: the causal mask alone keeps each real position from reading the padding.
        binding.bind_cpu_input("attention_mask", np.ones((rows, width), dtype=np.int64))
        if any(i.name == "position_ids" for i in self.session.get_inputs()):
            binding.bind_cpu_input("position_ids", np.tile(np.arange(width, dtype=np.int64), (rows, 1)))
        empty = np.zeros((rows, self.kv_heads, 0, self.head_dim), dtype=self.kv_dtype)
        for name in self.past_names:
            binding.bind_cpu_input(name, empty)
        if self.adapters is not None:
            self.adapters.bind(binding)
            binding.bind_cpu_input(LORA_INDEX, np.full(rows, NO_ADAPTER, dtype=np.int64))
        binding.bind_output(self.output, "cpu")
        run_bound(self.session, binding)
        states = binding.get_outputs()[0].numpy()
        return [np.array(states[row, : len(tokens)], dtype=np.float32) for row, tokens in enumerate(inputs)]
