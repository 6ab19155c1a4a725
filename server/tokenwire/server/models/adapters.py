"""LoRA adapters as a graph with adapter inputs consumes them: per-row indices into stacked weights.

A graph built with LoRA sites (model_tools/convert/lora_graph.py) takes, besides its usual
inputs:
- `lora_index`, int64 [batch]: each row's adapter slot. Slot 0 holds zeros and is never
  written, so a row without an adapter gets a delta of exactly zero.
- per adapted projection ("site": a layer and a module path below it, as Hugging Face names
  it, e.g. layer 3 `self_attn.q_proj`), `lora.{layer}.{module}.A` [slots, in, rank] and
  `lora.{layer}.{module}.B` [slots, rank, out], in the graph's float type. Slot i of A is the
  adapter's lora_A transposed, slot i of B its lora_B transposed times its scale (alpha / r);
  a rank below the stack's is zero-padded, which adds exact zeros.

The graph computes `(x @ A[index]) @ B[index]` per row with Gather and MatMul and adds it to the
projection, so CPU and CUDA run the same graph. Slot count and rank are free dimensions: the
runner sizes the stacks (max adapters + 1, max rank) when it loads the model, binds them once
through IO binding, and loading or unloading an adapter rewrites one slot in place.

`fit_adapter` checks an adapter read from a file (model_tools/lora) against the graph's sites
before its tensors are read; `AdapterStacks` holds the stacks and the slot of each loaded adapter.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np
import onnxruntime as ort
from numpy.typing import NDArray

from tokenwire.server.models.runner import ModelRunnerError
from tokenwire.server.models.session import FLOAT_TENSOR_TYPES

F32 = NDArray[np.float32]

LORA_INDEX = "lora_index"
"""The graph input naming each row's adapter slot, int64 [batch]."""
NO_ADAPTER = 0
"""The slot of rows without an adapter: all zeros, never written."""

_INPUT_NAME = re.compile(r"^lora\.(\d+)\.([A-Za-z0-9_.]+)\.(A|B)$")

FUSED_MODULES: Mapping[str, tuple[str, ...]] = {
    # Phi-3 fuses these projections in its checkpoints (and llama.cpp in its GGUF files); the
    # graph adapts each part, so a fused module's update is split along its outputs.
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def lora_input_name(layer: int, module: str, part: Literal["A", "B"]) -> str:
    return f"lora.{layer}.{module}.{part}"


class AdapterError(ValueError):
    """An adapter that cannot be used with this model; the message is one line naming the adapter
    and what is wrong."""


class UnsitedModuleError(AdapterError):
    """An adapter that adapts a module the graph has no LoRA site for."""

    def __init__(self, message: str, module: str) -> None:
        super().__init__(message)
        self.module = module
        """The module's path below the layer, as the adapter names it."""


@dataclass(frozen=True)
class LoraSite:
    """One adapted projection of the graph: y = x @ W (+ bias) + (x @ A) @ B."""

    layer: int
    module: str
    in_features: int
    out_features: int

    @property
    def key(self) -> tuple[int, str]:
        return (self.layer, self.module)


class _GraphInput(Protocol):
    """What ONNX Runtime's NodeArg tells about a graph input."""

    @property
    def name(self) -> str: ...

    @property
    def shape(self) -> Sequence[int | str | None]: ...

    @property
    def type(self) -> str: ...


@dataclass(frozen=True)
class LoraLayout:
    """The LoRA sites of a graph and the float type of its stacks, read from its inputs."""

    sites: Mapping[tuple[int, str], LoraSite]
    dtype: np.dtype[np.floating]
    layers: int

    @classmethod
    def from_session(cls, session: ort.InferenceSession) -> LoraLayout | None:
        """The session's layout; None when the graph takes no adapters."""
        return cls.from_inputs(session.get_inputs())

    @classmethod
    def from_inputs(cls, inputs: Sequence[_GraphInput]) -> LoraLayout | None:
        parts: dict[tuple[int, str], dict[str, _GraphInput]] = {}
        has_index = False
        for graph_input in inputs:
            if graph_input.name == LORA_INDEX:
                has_index = True
                continue
            match = _INPUT_NAME.match(graph_input.name)
            if match:
                key = (int(match.group(1)), match.group(2))
                parts.setdefault(key, {})[match.group(3)] = graph_input
        if not parts and not has_index:
            return None
        if not parts or not has_index:
            raise ValueError(f"a LoRA graph needs both {LORA_INDEX} and lora.N.MODULE.A/B inputs")
        sites: dict[tuple[int, str], LoraSite] = {}
        dtypes: set[str] = set()
        for (layer, module), pair in sorted(parts.items()):
            a, b = pair.get("A"), pair.get("B")
            if a is None or b is None:
                raise ValueError(f"LoRA site {layer} {module} lacks its A or B input")
            if len(a.shape) != 3 or len(b.shape) != 3:
                raise ValueError(
                    f"LoRA inputs of {layer} {module} must be 3-D: [slots, in, rank], [slots, rank, out]"
                )
            in_features, out_features = a.shape[1], b.shape[2]
            if not isinstance(in_features, int) or not isinstance(out_features, int):
                raise ValueError(f"LoRA inputs of {layer} {module} need static feature dimensions")
            dtypes.update((a.type, b.type))
            sites[(layer, module)] = LoraSite(layer, module, in_features, out_features)
        if len(dtypes) != 1 or next(iter(dtypes)) not in FLOAT_TENSOR_TYPES:
            raise ValueError(f"LoRA inputs must share one float type, got {', '.join(sorted(dtypes))}")
        return cls(
            sites=sites,
            dtype=FLOAT_TENSOR_TYPES[dtypes.pop()],
            layers=max(layer for layer, _ in sites) + 1,
        )

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(sorted({module for _, module in self.sites}))

    def slot_bytes(self, rank: int) -> int:
        """Bytes one adapter slot of rank `rank` takes over all stacks."""
        features = sum(site.in_features + site.out_features for site in self.sites.values())
        return features * rank * self.dtype.itemsize


@dataclass(frozen=True)
class LoraFactor:
    """One module's pair as an adapter file stores it, not read yet: A [rank, in], B [out, rank].

    `module` is the path below the layer in Hugging Face's names (possibly a fused module such
    as `self_attn.qkv_proj`); `read` returns both as float32 in Hugging Face's row order.
    """

    layer: int
    module: str
    rank: int
    in_features: int
    out_features: int
    scale: float
    label: str
    """How the file names this pair, for messages."""
    read: Callable[[], tuple[F32, F32]]


@dataclass(frozen=True)
class LoraUpdate:
    """One site's share of an adapter, as the stacks hold it: a [in, rank], b [rank, out] (scaled)."""

    a: F32
    b: F32

    @property
    def rank(self) -> int:
        return int(self.a.shape[1])


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter fitted to a graph's sites, ready to be written into a slot."""

    name: str
    updates: Mapping[tuple[int, str], LoraUpdate]

    @property
    def rank(self) -> int:
        return max(update.rank for update in self.updates.values())

    @property
    def nbytes(self) -> int:
        return sum(update.a.nbytes + update.b.nbytes for update in self.updates.values())


def fit_adapter(
    name: str, factors: Sequence[LoraFactor], layout: LoraLayout, *, max_rank: int
) -> LoraAdapter:
    """Check `factors` against the graph's sites and the rank bound, then read them.

    Every check runs on the factors' declared shapes, before any tensor is read; each refusal
    is an AdapterError of one line naming the adapter, the tensor and the problem.
    """
    if not factors:
        raise AdapterError(f"adapter {name}: holds no LoRA weights")
    targets: list[tuple[LoraFactor, tuple[LoraSite, ...]]] = []
    claimed: dict[tuple[int, str], str] = {}
    for factor in factors:
        sites = _sites_of(name, factor, layout)
        if factor.rank > max_rank:
            raise AdapterError(
                f"adapter {name}: {factor.label} has rank {factor.rank}, "
                f"over the maximum LoRA rank {max_rank}"
            )
        if factor.rank < 1:
            raise AdapterError(f"adapter {name}: {factor.label} has rank {factor.rank}")
        if not math.isfinite(factor.scale):
            raise AdapterError(f"adapter {name}: {factor.label} has a scale of {factor.scale}")
        for site in sites:
            if site.key in claimed:
                raise AdapterError(
                    f"adapter {name}: {claimed[site.key]} and {factor.label} both adapt layer "
                    f"{site.layer} {site.module}"
                )
            claimed[site.key] = factor.label
        targets.append((factor, sites))
    updates: dict[tuple[int, str], LoraUpdate] = {}
    for factor, sites in targets:
        a, b = factor.read()
        expected_a, expected_b = (factor.rank, factor.in_features), (factor.out_features, factor.rank)
        if a.shape != expected_a or b.shape != expected_b:
            raise AdapterError(
                f"adapter {name}: {factor.label} reads as {list(a.shape)} and {list(b.shape)}, "
                f"not {list(expected_a)} and {list(expected_b)}"
            )
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            raise AdapterError(f"adapter {name}: {factor.label} holds values that are not finite")
        a_t = np.ascontiguousarray(a.T, dtype=np.float32)
        b_t = np.asarray(b.T, dtype=np.float32) * np.float32(factor.scale)
        start = 0
        for site in sites:
            stop = start + site.out_features
            updates[site.key] = LoraUpdate(a=a_t, b=np.ascontiguousarray(b_t[:, start:stop]))
            start = stop
    return LoraAdapter(name=name, updates=updates)


def _sites_of(name: str, factor: LoraFactor, layout: LoraLayout) -> tuple[LoraSite, ...]:
    """The graph sites a factor adapts: its own, or the parts of a fused module."""
    if not 0 <= factor.layer < layout.layers:
        raise AdapterError(
            f"adapter {name}: {factor.label} is for layer {factor.layer}, but the model has "
            f"{layout.layers} layers: the adapter was made for another base model"
        )
    own = layout.sites.get((factor.layer, factor.module))
    parts = FUSED_MODULES.get(factor.module, ())
    if own is not None:
        sites: tuple[LoraSite, ...] = (own,)
    elif parts and all((factor.layer, part) in layout.sites for part in parts):
        sites = tuple(layout.sites[(factor.layer, part)] for part in parts)
    else:
        raise UnsitedModuleError(
            f"adapter {name}: {factor.label} adapts module {factor.module}, which this model's graph "
            f"takes no adapter for (it adapts {', '.join(layout.modules)})",
            factor.module,
        )
    in_features = {site.in_features for site in sites}
    out_features = sum(site.out_features for site in sites)
    if in_features != {factor.in_features} or out_features != factor.out_features:
        raise AdapterError(
            f"adapter {name}: {factor.label} maps {factor.in_features} to {factor.out_features} "
            f"features, but the model's layer {factor.layer} {factor.module} maps "
            f"{sites[0].in_features} to {out_features}: the adapter was made for another base model"
        )
    return sites


class AdapterStacks:
    """The stacked A and B inputs of a LoRA graph, and which adapter holds which slot.

    Stacks are [max_loras + 1, features, max_rank] arrays; slot 0 stays zero. On the CPU the
    arrays are the bound memory itself, so writing a slot updates what the next run reads. On a
    device each stack is an OrtValue there with a host copy, and writing a slot copies its whole
    stack across (ONNX Runtime's Python API copies whole tensors only).
    """

    def __init__(
        self, layout: LoraLayout, *, max_loras: int, max_rank: int, device: str = "cpu", device_id: int = 0
    ) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError("max_loras and max_rank must be at least 1")
        self.layout = layout
        self.max_loras = max_loras
        self.max_rank = max_rank
        self._device = device
        self._device_id = device_id
        slots = max_loras + 1
        self._host: dict[str, np.ndarray] = {}
        self._device_values: dict[str, ort.OrtValue] = {}
        for site in layout.sites.values():
            for part, shape in (
                ("A", (slots, site.in_features, max_rank)),
                ("B", (slots, max_rank, site.out_features)),
            ):
                name = lora_input_name(site.layer, site.module, part)  # type: ignore[arg-type]
                self._host[name] = np.zeros(shape, dtype=layout.dtype)
                if device != "cpu":
                    value = ort.OrtValue.ortvalue_from_shape_and_type(
                        list(shape), layout.dtype, device, device_id
                    )
                    value.update_inplace(self._host[name])
                    self._device_values[name] = value
        self._slot_of: dict[str, int] = {}

    @property
    def nbytes(self) -> int:
        """Bytes the stacks take (on the device, plus as much on the host there)."""
        return sum(array.nbytes for array in self._host.values())

    @property
    def names(self) -> tuple[str, ...]:
        """The loaded adapters, in slot order."""
        return tuple(sorted(self._slot_of, key=self._slot_of.__getitem__))

    def slot(self, name: str) -> int:
        """The slot of a loaded adapter: what its rows' `lora_index` holds."""
        if name not in self._slot_of:
            raise KeyError(name)
        return self._slot_of[name]

    def bind(self, binding: ort.IOBinding) -> None:
        """Bind every stack as an input; once per binding, since loads rewrite them in place."""
        for name, array in self._host.items():
            value = self._device_values.get(name)
            if value is not None:
                binding.bind_ortvalue_input(name, value)
            else:
                binding.bind_input(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)

    def load(self, adapter: LoraAdapter) -> int:
        """Write `adapter` into the lowest free slot and return it; its name must be new."""
        if adapter.name in self._slot_of:
            raise AdapterError(f"adapter {adapter.name}: is already loaded")
        if adapter.rank > self.max_rank:
            raise AdapterError(
                f"adapter {adapter.name}: has rank {adapter.rank}, over the maximum LoRA rank {self.max_rank}"
            )
        unknown = [key for key in adapter.updates if key not in self.layout.sites]
        if unknown:
            layer, module = unknown[0]
            raise AdapterError(
                f"adapter {adapter.name}: adapts layer {layer} {module}, which the graph lacks"
            )
        free = sorted(set(range(1, self.max_loras + 1)) - set(self._slot_of.values()))
        if not free:
            raise AdapterError(
                f"adapter {adapter.name}: all {self.max_loras} adapter slots are in use (the most "
                "adapters loaded at once)"
            )
        slot = free[0]
        self._write(slot, adapter.updates)
        self._slot_of[adapter.name] = slot
        return slot

    def unload(self, name: str) -> None:
        """Zero the adapter's slot and free it; rows still pointing there get no delta."""
        slot = self._slot_of.pop(name, None)
        if slot is None:
            raise KeyError(name)
        self._write(slot, {})

    def _write(self, slot: int, updates: Mapping[tuple[int, str], LoraUpdate]) -> None:
        for key, site in self.layout.sites.items():
            a_name = lora_input_name(site.layer, site.module, "A")
            b_name = lora_input_name(site.layer, site.module, "B")
            a, b = self._host[a_name][slot], self._host[b_name][slot]
            update = updates.get(key)
            rank = 0 if update is None else update.rank
            if update is not None:
                a[:, :rank] = update.a
                b[:rank] = update.b
            # Columns past the adapter's rank are zeros: they add exact zeros to every row.
            a[:, rank:] = 0
            b[rank:] = 0
            for name in (a_name, b_name):
                value = self._device_values.get(name)
                if value is not None:
                    value.update_inplace(self._host[name])


class RowAdapters:
    """Which adapter slot each sequence of a runner runs with, for its graph's `lora_index`.

    A sequence keeps the slot it was last given; one never given a slot runs the base model.
    Without stacks (a graph with no LoRA sites) only NO_ADAPTER is accepted.
    """

    def __init__(self, stacks: AdapterStacks | None, model: str) -> None:
        self.stacks = stacks
        self._model = model
        self._slot_of: dict[int, int] = {}

    def assign(self, seq_ids: Sequence[int], slots: Sequence[int] | None) -> None:
        """Give `seq_ids[i]` slot `slots[i]`; None leaves every sequence its own."""
        if slots is None:
            return
        if len(slots) != len(seq_ids):
            raise ModelRunnerError(f"{len(seq_ids)} sequences but {len(slots)} adapter slots")
        limit = 0 if self.stacks is None else self.stacks.max_loras
        for seq_id, slot in zip(seq_ids, slots, strict=True):
            if not 0 <= slot <= limit:
                if self.stacks is None:
                    raise ModelRunnerError(f"{self._model}'s graph takes no LoRA adapters")
                raise ModelRunnerError(f"adapter slot {slot} is outside the stacks (0 to {limit})")
            if self.stacks is not None:
                self._slot_of[seq_id] = slot

    def of(self, seq_id: int) -> int:
        return self._slot_of.get(seq_id, NO_ADAPTER)

    def forget(self, seq_id: int) -> None:
        self._slot_of.pop(seq_id, None)

    def bind(self, binding: ort.IOBinding, seq_ids: Sequence[int]) -> None:
        """Bind the stacks and `lora_index` for a call whose rows are `seq_ids`, in order."""
        if self.stacks is not None:
            self.stacks.bind(binding)
            binding.bind_cpu_input(LORA_INDEX, np.asarray([self.of(s) for s in seq_ids], dtype=np.int64))
