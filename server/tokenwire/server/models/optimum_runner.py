"""Runner for the Hugging Face Optimum layout: a KV cache that the graph grows every step.

Every step the graph takes the whole past cache ([batch, heads, past, head_dim] per layer) and
returns it one position longer. Sequences of different lengths share a batch through left
padding: each row's attention mask zeroes its padding and `position_ids` count only its real
tokens, which keeps each row's logits equal (to float rounding) to decoding it alone.

A graph without a `position_ids` input (Optimum's Gemma exports) derives every row's positions
from the cache width, so left padding would shift a padded row's rotary positions and silently
change its tokens. For such graphs sequences are decoded in cohorts of equal length, one model
call per cohort, never padded: a cohort stays aligned because all its rows grow by one a step.

Between steps the cache stays where the model produced it (on the GPU under CUDA) because the
outputs of one step are bound as the inputs of the next. Only a change of membership, a
sequence joining after its prefill or leaving, brings the cache to the host to be re-padded.

Several tokens can be appended to each row in one call (`decode_runs`, for verifying drafts):
rows with fewer tokens than the longest run are padded at the end with masked positions, and
`rollback` masks a row's last positions out. Such gaps inside a row are read past by the mask;
the next call re-pads the batch without them, so they never accumulate. A graph without
`position_ids` cannot do this (a gap would shift every later position), and says so at load.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import onnxruntime as ort

from tokenwire.server.models.adapters import NO_ADAPTER, AdapterStacks, RowAdapters
from tokenwire.server.models.hidden_states import HiddenStatePass
from tokenwire.server.models.runner import ModelInfo, ModelRunnerError
from tokenwire.server.models.session import FLOAT_TENSOR_TYPES, run_bound

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OptimumLayout:
    """Names and shapes read from an Optimum graph's inputs."""

    layers: int
    kv_heads: int
    head_dim: int
    kv_dtype: np.dtype[np.floating]
    has_position_ids: bool

    @classmethod
    def from_session(cls, session: ort.InferenceSession) -> OptimumLayout:
        inputs = {i.name: i for i in session.get_inputs()}
        layers = sum(1 for name in inputs if name.startswith("past_key_values.") and name.endswith(".key"))
        if layers == 0 or "input_ids" not in inputs or "attention_mask" not in inputs:
            raise ValueError(
                "not an Optimum decoder with KV cache: missing input_ids/attention_mask/past_key_values"
            )
        first = inputs["past_key_values.0.key"]
        _, kv_heads, _, head_dim = first.shape
        if not isinstance(kv_heads, int) or not isinstance(head_dim, int):
            raise ValueError("past_key_values must have static head and head_dim dimensions")
        kv_dtype = FLOAT_TENSOR_TYPES.get(first.type)
        if kv_dtype is None:
            raise ValueError(f"unsupported KV cache type {first.type}")
        return cls(layers, kv_heads, head_dim, kv_dtype, "position_ids" in inputs)

    def kv_names(self, prefix: str) -> list[str]:
        return [f"{prefix}.{i}.{kind}" for i in range(self.layers) for kind in ("key", "value")]


@dataclass
class _Prefilling:
    """A sequence whose prompt is being processed alone, before it joins the batch."""

    kv: list[ort.OrtValue]
    length: int


@dataclass
class _Batch:
    """Sequences decoded by one model call: row order, cache per layer ([rows, heads, width,
    head_dim]), mask [rows, width] (0 = left padding) and each row's next position."""

    rows: list[int]
    kv: list[ort.OrtValue]
    mask: np.ndarray
    positions: np.ndarray
    gaps: bool = False
    """Whether some row has masked positions after its first cached one (padding of a shorter
    run, or rolled-back positions): its cache is then found through its mask, not its length."""

    def cached_columns(self, row: int) -> slice | np.ndarray:
        """The cache columns holding `row`'s positions, in order."""
        if self.gaps:
            return np.flatnonzero(self.mask[row])
        width = self.mask.shape[1]
        return slice(width - int(self.positions[row]), width)


class OptimumRunner:
    """ModelRunner over an Optimum-layout session with a left-padded, growing batch cache."""

    def __init__(
        self,
        session: ort.InferenceSession,
        info: ModelInfo,
        device: str,
        *,
        hidden_output: str | None = None,
        adapters: AdapterStacks | None = None,
    ) -> None:
        """`hidden_output`: the graph output holding the head's input (models/hidden_states.py),
        for embeddings; None where the graph has none. `adapters`: the stacks of a graph with
        LoRA sites."""
        self._session = session
        self._row_adapters = RowAdapters(adapters, info.name)
        self._device = device
        self._layout = OptimumLayout.from_session(session)
        self._past_names = self._layout.kv_names("past_key_values")
        self._hidden = HiddenStatePass.over(session, hidden_output, self._past_names, self._layout, adapters)
        self._info = replace(info, embedding_size=self._hidden.size() if self._hidden else 0)
        self._present_names = self._layout.kv_names("present")
        self._prefilling: dict[int, _Prefilling] = {}
        # One batch when the graph takes position_ids; otherwise one per sequence length.
        self._batches: list[_Batch] = []
        if not self._layout.has_position_ids:
            log.warning(
                "%s has no position_ids input: sequences of different lengths decode in separate "
                "model calls, since padding would shift their positions",
                info.name,
            )
            log.warning(
                "%s has no position_ids input: it cannot append several tokens to a decoding "
                "sequence in one call, so drafts cannot be verified (no speculative decoding)",
                info.name,
            )

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def adapters(self) -> AdapterStacks | None:
        return self._row_adapters.stacks

    def capacity(self) -> int:
        return self._info.max_batch_size

    def hidden_states(self, inputs: Sequence[Sequence[int]]) -> list[np.ndarray]:
        if self._hidden is None:
            raise ModelRunnerError(f"{self._info.name} serves no embeddings")
        return self._hidden.run(inputs)

    # -- prefill ---------------------------------------------------------------------------------

    def prefill(
        self, seq_id: int, token_ids: Sequence[int], *, start: int, adapter: int = NO_ADAPTER
    ) -> np.ndarray:
        self._row_adapters.assign([seq_id], [adapter])
        state = self._prefilling.get(seq_id)
        if start == 0 or state is None:
            if start != 0:
                raise ModelRunnerError(f"sequence {seq_id} continues a prefill that never started")
            state = _Prefilling(kv=self._empty_kv(), length=0)
            self._prefilling[seq_id] = state
        elif state.length != start:
            raise ModelRunnerError(f"sequence {seq_id} continues a prefill out of order")
        n_new = len(token_ids)
        total = state.length + n_new
        feeds = {
            "input_ids": np.asarray(token_ids, dtype=np.int64).reshape(1, n_new),
            "attention_mask": np.ones((1, total), dtype=np.int64),
        }
        if self._layout.has_position_ids:
            feeds["position_ids"] = np.arange(state.length, total, dtype=np.int64).reshape(1, n_new)
        logits, kv = self._run(feeds, state.kv, [seq_id])
        state.kv = kv
        state.length = total
        return np.array(logits[0, -1], dtype=np.float32)

    # -- decode ----------------------------------------------------------------------------------

    def decode(
        self, seq_ids: Sequence[int], token_ids: Sequence[int], *, adapters: Sequence[int] | None = None
    ) -> np.ndarray:
        self._row_adapters.assign(seq_ids, adapters)
        wanted = list(seq_ids)
        if set(wanted) != self._decoding() or any(batch.gaps for batch in self._batches):
            self._regroup(wanted)
        if len(self._batches) == 1:
            return self._step(self._batches[0], wanted, token_ids)
        token_of = dict(zip(wanted, token_ids, strict=True))
        logits_of: dict[int, np.ndarray] = {}
        for batch in self._batches:
            logits = self._step(batch, batch.rows, [token_of[seq] for seq in batch.rows])
            logits_of.update(zip(batch.rows, logits, strict=True))
        return np.stack([logits_of[seq] for seq in wanted])

    def _step(self, batch: _Batch, seq_ids: Sequence[int], token_ids: Sequence[int]) -> np.ndarray:
        """One decode step of `batch`; the logits of `seq_ids` (all its rows), in that order."""
        row_of = {seq: row for row, seq in enumerate(batch.rows)}
        order = np.fromiter((row_of[s] for s in seq_ids), dtype=np.int64, count=len(seq_ids))
        tokens = np.empty(len(batch.rows), dtype=np.int64)
        tokens[order] = np.asarray(token_ids, dtype=np.int64)
        mask = np.concatenate([batch.mask, np.ones((len(batch.rows), 1), dtype=np.int64)], axis=1)
        feeds = {"input_ids": tokens.reshape(-1, 1), "attention_mask": mask}
        if self._layout.has_position_ids:
            feeds["position_ids"] = batch.positions.reshape(-1, 1)
        logits, kv = self._run(feeds, batch.kv, batch.rows)
        batch.kv = kv
        batch.mask = mask
        batch.positions = batch.positions + 1
        return np.ascontiguousarray(logits[order, -1], dtype=np.float32)

    # -- several positions per row ---------------------------------------------------------------

    @property
    def can_decode_runs(self) -> bool:
        return self._layout.has_position_ids

    def decode_runs(
        self,
        seq_ids: Sequence[int],
        runs: Sequence[Sequence[int]],
    ) -> list[np.ndarray]:
        if len(seq_ids) != len(runs):
            raise ModelRunnerError(f"{len(seq_ids)} sequences but {len(runs)} runs of tokens")
        if any(not run for run in runs):
            raise ModelRunnerError("every sequence must be given at least one token to append")
        longest = max((len(run) for run in runs), default=0)
        if longest <= 1:
            logits = self.decode(seq_ids, [run[0] for run in runs])
            return [logits[i : i + 1].copy() for i in range(len(runs))]
        if not self._layout.has_position_ids:
            raise ModelRunnerError(f"{self._info.name} cannot append several tokens to a decoding sequence")
        wanted = list(seq_ids)
        if set(wanted) != self._decoding() or any(batch.gaps for batch in self._batches):
            self._regroup(wanted)
        batch = self._batches[0]  # a graph with position_ids decodes every sequence in one batch
        row_of = {seq: row for row, seq in enumerate(batch.rows)}
        count = np.zeros(len(batch.rows), dtype=np.int64)
        tokens = np.zeros((len(batch.rows), longest), dtype=np.int64)
        for seq, run in zip(wanted, runs, strict=True):
            count[row_of[seq]] = len(run)
            tokens[row_of[seq], : len(run)] = run
        # A shorter run is padded at its end: masked, those positions are read by no query of a
        # real token, now or later, and their position ids only keep counting.
        offsets = np.arange(longest, dtype=np.int64)
        appended = (offsets[np.newaxis, :] < count[:, np.newaxis]).astype(np.int64)
        mask = np.concatenate([batch.mask, appended], axis=1)
        feeds = {
            "input_ids": tokens,
            "attention_mask": mask,
            "position_ids": batch.positions[:, np.newaxis] + offsets[np.newaxis, :],
        }
        logits, kv = self._run(feeds, batch.kv, batch.rows)
        batch.kv = kv
        batch.mask = mask
        batch.positions = batch.positions + count
        batch.gaps = batch.gaps or bool(np.any(count < longest))
        return [
            np.array(logits[row_of[seq], : len(run)], dtype=np.float32)
            for seq, run in zip(wanted, runs, strict=True)
        ]

    def rollback(self, seq_id: int, count: int) -> None:
        for batch in self._batches:
            if seq_id not in batch.rows:
                continue
            row = batch.rows.index(seq_id)
            length = int(batch.positions[row])
            if not 0 <= count <= length:
                break
            if count:
                # Masked out, the positions are invisible to every later query; the next call
                # re-pads the batch without them.
                columns = np.flatnonzero(batch.mask[row])[length - count :]
                batch.mask[row, columns] = 0
                batch.positions[row] = length - count
                batch.gaps = True
            return
        raise ModelRunnerError(f"sequence {seq_id} cannot drop {count} positions")

    # -- prefix reuse ----------------------------------------------------------------------------

    def kv_bytes_per_token(self) -> int:
        layout = self._layout
        return len(self._past_names) * layout.kv_heads * layout.head_dim * layout.kv_dtype.itemsize

    def read_kv(self, seq_id: int, start: int, stop: int) -> np.ndarray:
        state = self._prefilling.get(seq_id)
        if state is not None:
            # A prompt's rows, read while it is still prefilling, before it joins the padded batch.
            if not 0 <= start <= stop <= state.length:
                raise ModelRunnerError(f"sequence {seq_id} has no KV rows [{start}, {stop})")
            return np.stack([value.numpy()[0, :, start:stop] for value in state.kv])
        for batch in self._batches:
            if seq_id not in batch.rows:
                continue
            # A decoding sequence's rows (a preemption swapping it out): its row of the batch,
            # past the left padding.
            row = batch.rows.index(seq_id)
            length = int(batch.positions[row])
            if not 0 <= start <= stop <= length:
                break
            columns = batch.cached_columns(row)
            return np.stack([value.numpy()[row][:, columns][:, start:stop] for value in batch.kv])
        raise ModelRunnerError(f"sequence {seq_id} has no KV rows [{start}, {stop})")

    def start_from_kv(self, seq_id: int, blocks: Sequence[np.ndarray]) -> int:
        self.release(seq_id)
        rows = np.concatenate(blocks, axis=2) if len(blocks) > 1 else blocks[0]
        kv = [
            ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(rows[tensor][np.newaxis]), self._device)
            for tensor in range(len(self._past_names))
        ]
        self._prefilling[seq_id] = _Prefilling(kv=kv, length=int(rows.shape[2]))
        return int(rows.shape[2])

    def start_from_sequence(self, seq_id: int, source_id: int, positions: int) -> int:
        if source_id == seq_id or positions < 1:
            raise ModelRunnerError(f"sequence {source_id} has no {positions} KV rows to copy")
        # The source's rows sit in a padded batch (or its own prefill cache) that the next step
        # replaces: a copy through the host, as a join re-pads through it anyway.
        return self.start_from_kv(seq_id, [self.read_kv(source_id, 0, positions)])

    def release(self, seq_id: int) -> None:
        self._row_adapters.forget(seq_id)
        self._prefilling.pop(seq_id, None)
        decoding = self._decoding()
        if seq_id in decoding:
            self._regroup([s for batch in self._batches for s in batch.rows if s != seq_id])

    # -- internals -------------------------------------------------------------------------------

    def _empty_kv(self) -> list[ort.OrtValue]:
        layout = self._layout
        empty = np.zeros((1, layout.kv_heads, 0, layout.head_dim), dtype=layout.kv_dtype)
        return [ort.OrtValue.ortvalue_from_numpy(empty, self._device) for _ in self._past_names]

    def assign_adapters(self, seq_ids: Sequence[int], adapters: Sequence[int]) -> None:
        self._row_adapters.assign(seq_ids, adapters)

    def _run(
        self, feeds: dict[str, np.ndarray], past: list[ort.OrtValue], rows: Sequence[int]
    ) -> tuple[np.ndarray, list[ort.OrtValue]]:
        """One call over the sequences `rows`, in batch order."""
        binding = self._session.io_binding()
        for name, value in feeds.items():
            binding.bind_cpu_input(name, value)
        self._row_adapters.bind(binding, rows)
        for name, value in zip(self._past_names, past, strict=True):
            binding.bind_ortvalue_input(name, value)
        # Logits come back to the host for sampling; the cache stays on the model's device.
        binding.bind_output("logits", "cpu")
        for name in self._present_names:
            binding.bind_output(name, self._device)
        run_bound(self._session, binding)
        outputs = binding.get_outputs()
        return outputs[0].numpy(), list(outputs[1:])

    def _decoding(self) -> set[int]:
        return {seq for batch in self._batches for seq in batch.rows}

    def _regroup(self, wanted: list[int]) -> None:
        """Rebuild the batches for a new membership: drop leavers, left-pad and add joiners."""
        decoding = self._decoding()
        unknown = [s for s in wanted if s not in decoding and s not in self._prefilling]
        if unknown:
            raise ModelRunnerError(f"sequences {unknown} were never prefilled")
        # Each wanted sequence's own cache rows ([layers][heads, length, head_dim], no padding).
        caches: dict[int, list[np.ndarray]] = {}
        for batch in self._batches:
            kept = [(row, seq) for row, seq in enumerate(batch.rows) if seq in wanted]
            if not kept:
                continue
            arrays = [value.numpy() for value in batch.kv]
            for row, seq in kept:
                columns = batch.cached_columns(row)
                caches[seq] = [array[row][:, columns] for array in arrays]
        # A numpy view of an OrtValue does not keep the OrtValue's memory alive, and the cache of
        # a sequence started from copied rows is numpy memory that its OrtValue alone holds: the
        # joiners' states stay referenced here until their rows are copied into the new batches.
        joining = [seq for seq in wanted if seq not in caches]
        joiners = [self._prefilling.pop(seq) for seq in joining]
        for seq, state in zip(joining, joiners, strict=True):
            caches[seq] = [value.numpy()[0] for value in state.kv]
        cohorts: dict[int, list[int]] = {}
        for seq in wanted:
            # Positions fed per row let rows of any length share one padded batch; positions
            # derived from the cache width need rows of one length, unpadded.
            key = 0 if self._layout.has_position_ids else caches[seq][0].shape[1]
            cohorts.setdefault(key, []).append(seq)
        self._batches = [self._padded(rows, caches) for rows in cohorts.values()]
        del joiners  # only now may their memory go

    def _padded(self, rows: list[int], caches: dict[int, list[np.ndarray]]) -> _Batch:
        """One batch of `rows`, each left-padded to the longest."""
        lengths = [caches[seq][0].shape[1] for seq in rows]
        width = max(lengths)
        layout = self._layout
        kv = [
            np.zeros((len(rows), layout.kv_heads, width, layout.head_dim), dtype=layout.kv_dtype)
            for _ in self._past_names
        ]
        mask = np.zeros((len(rows), width), dtype=np.int64)
        for row, (seq, length) in enumerate(zip(rows, lengths, strict=True)):
            for layer, array in enumerate(caches[seq]):
                kv[layer][row, :, width - length :] = array
            mask[row, width - length :] = 1
        return _Batch(
            rows=rows,
            kv=[ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a), self._device) for a in kv],
            mask=mask,
            positions=np.asarray(lengths, dtype=np.int64),
        )
