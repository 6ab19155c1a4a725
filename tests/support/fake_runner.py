"""A model runner with no model, and a clock that moves only when told: for scheduler tests.

This is the one place the tests fake the model. The scheduler's promises (who is admitted when,
how much prompt work a round does, when deadlines and aborts land) are about the order of runner
calls and the times on a clock, not about what a network computes, so a runner that returns
fixed logits and records every call lets a test drive the engine round by round
(`Engine.run_round`) and check those promises exactly, with no ONNX Runtime and no sleeping.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from tokenwire.server.models.runner import ModelInfo


class ManualClock:
    """Monotonic seconds that advance only when the test says so."""

    def __init__(self, start: float = 100.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass(frozen=True)
class PrefillCall:
    seq_id: int
    start: int
    tokens: int


@dataclass
class FixedLogitsRunner:
    """A deterministic ModelRunner: every step predicts `token`, and every call is recorded.

    `clock` and `step_seconds` make each prefill chunk and decode step take that long on the
    manual clock; `during_decode` runs inside each decode step, as work on the event loop would
    while the engine thread is busy in the model.
    """

    vocab_size: int
    token: int
    slots: int = 8
    context_length: int = 256
    eos_token_ids: frozenset[int] = frozenset()
    clock: ManualClock | None = None
    step_seconds: float = 0.0
    prefill_token_seconds: float = 0.0
    """Added to a prefill call's time per prompt token, so long chunks cost more than short ones."""
    during_decode: Callable[[], None] | None = None
    prefills: list[PrefillCall] = field(default_factory=list)
    decodes: list[tuple[int, ...]] = field(default_factory=list)
    released: list[int] = field(default_factory=list)

    @property
    def info(self) -> ModelInfo:
        return ModelInfo(
            name="fake",
            format="optimum",
            vocab_size=self.vocab_size,
            context_length=self.context_length,
            eos_token_ids=self.eos_token_ids,
            max_batch_size=self.slots,
        )

    def capacity(self) -> int:
        return self.slots

    def prefill(self, seq_id: int, token_ids: Sequence[int], *, start: int) -> np.ndarray:
        self.prefills.append(PrefillCall(seq_id, start, len(token_ids)))
        self._take_time()
        if self.clock is not None:
            self.clock.advance(self.prefill_token_seconds * len(token_ids))
        row: np.ndarray = self._logits(1)[0]
        return row

    def decode(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> np.ndarray:
        self.decodes.append(tuple(seq_ids))
        if self.during_decode is not None:
            self.during_decode()
        self._take_time()
        return self._logits(len(seq_ids))

    def release(self, seq_id: int) -> None:
        self.released.append(seq_id)

    def _logits(self, rows: int) -> np.ndarray:
        logits = np.zeros((rows, self.vocab_size), dtype=np.float32)
        logits[:, self.token] = 1.0
        return logits

    def _take_time(self) -> None:
        if self.clock is not None:
            self.clock.advance(self.step_seconds)


@dataclass
class RowCopyingRunner(FixedLogitsRunner):
    """The fixed-logits runner with KV rows that can be copied out and back in (`KvRowAccess`),
    as a host-memory cache allows: what preemption needs. Each sequence's row count is tracked,
    so a read past what was processed, or a decode of a sequence without a slot, fails as a real
    runner would."""

    lengths: dict[int, int] = field(default_factory=dict)
    reads: list[tuple[int, int, int]] = field(default_factory=list)
    loads: list[tuple[int, int]] = field(default_factory=list)
    copies: list[tuple[int, int, int]] = field(default_factory=list)
    """(sequence, source, positions) of every slot-to-slot copy."""

    def prefill(self, seq_id: int, token_ids: Sequence[int], *, start: int) -> np.ndarray:
        if self.lengths.get(seq_id, 0) != start:
            raise RuntimeError(f"sequence {seq_id} continues a prefill out of order")
        if start == 0 and len(self.lengths) >= self.slots:
            raise RuntimeError("no free KV-cache slot")
        self.lengths[seq_id] = start + len(token_ids)
        return super().prefill(seq_id, token_ids, start=start)

    def decode(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> np.ndarray:
        missing = [s for s in seq_ids if s not in self.lengths]
        if missing:
            raise RuntimeError(f"sequences {missing} hold no slot")
        for seq_id in seq_ids:
            self.lengths[seq_id] += 1
        return super().decode(seq_ids, token_ids)

    def release(self, seq_id: int) -> None:
        self.lengths.pop(seq_id, None)
        super().release(seq_id)

    def kv_bytes_per_token(self) -> int:
        return 4

    def read_kv(self, seq_id: int, start: int, stop: int) -> np.ndarray:
        if not 0 <= start <= stop <= self.lengths.get(seq_id, -1):
            raise RuntimeError(f"sequence {seq_id} has no KV rows [{start}, {stop})")
        self.reads.append((seq_id, start, stop))
        # One position per row, holding its index: a load can be checked for order and count.
        return np.arange(start, stop, dtype=np.float32).reshape(1, 1, stop - start, 1)

    def start_from_kv(self, seq_id: int, blocks: Sequence[np.ndarray]) -> int:
        rows = np.concatenate(blocks, axis=2) if len(blocks) > 1 else blocks[0]
        length = int(rows.shape[2])
        if not np.array_equal(rows.reshape(-1), np.arange(length, dtype=np.float32)):
            raise RuntimeError("rows loaded out of order")
        if seq_id not in self.lengths and len(self.lengths) >= self.slots:
            raise RuntimeError("no free KV-cache slot")
        self.lengths[seq_id] = length
        self.loads.append((seq_id, length))
        return length

    def start_from_sequence(self, seq_id: int, source_id: int, positions: int) -> int:
        if not 0 < positions <= self.lengths.get(source_id, -1) or source_id == seq_id:
            raise RuntimeError(f"sequence {source_id} has no {positions} KV rows to copy")
        if seq_id not in self.lengths and len(self.lengths) >= self.slots:
            raise RuntimeError("no free KV-cache slot")
        self.lengths[seq_id] = positions
        self.copies.append((seq_id, source_id, positions))
        return positions


@dataclass
class FollowingRunner(FixedLogitsRunner):
    """A deterministic model that appends several tokens per row and rolls them back
    (`MultiTokenDecode`): after token t it predicts `follows[t]` (else `token`), with logit 1.0
    and 0 elsewhere. It keeps every sequence's KV contents as the token ids appended, so a test
    can check that rolled-back positions are gone, and records each call's run lengths."""

    follows: dict[int, int] = field(default_factory=dict)
    can_decode_runs: bool = True
    run_call_seconds: float = 0.0
    """Added to a `decode_runs` call's time for each run longer than one token: a real runner
    verifies each such run in a model call of its own."""
    run_position_seconds: float = 0.0
    """Added for each position of those runs."""
    kv: dict[int, list[int]] = field(default_factory=dict)
    runs: list[tuple[int, ...]] = field(default_factory=list)
    """The run length of every row, per `decode_runs` call."""
    rollbacks: list[tuple[int, int]] = field(default_factory=list)

    def prefill(self, seq_id: int, token_ids: Sequence[int], *, start: int) -> np.ndarray:
        self.kv[seq_id] = self.kv.get(seq_id, [])[:start] + list(token_ids)
        super().prefill(seq_id, token_ids, start=start)
        row: np.ndarray = self._predict([token_ids[-1]])[0]
        return row

    def decode(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> np.ndarray:
        super().decode(seq_ids, token_ids)
        for seq_id, token in zip(seq_ids, token_ids, strict=True):
            self._append(seq_id, [token])
        return self._predict(token_ids)

    def decode_runs(self, seq_ids: Sequence[int], runs: Sequence[Sequence[int]]) -> list[np.ndarray]:
        if not self.can_decode_runs and any(len(run) > 1 for run in runs):
            raise RuntimeError("this runner decodes one token a row")
        self.decodes.append(tuple(seq_ids))
        self.runs.append(tuple(len(run) for run in runs))
        self._take_time()
        if self.clock is not None:
            long_runs = [len(run) for run in runs if len(run) > 1]
            self.clock.advance(
                self.run_call_seconds * len(long_runs) + self.run_position_seconds * sum(long_runs)
            )
        for seq_id, run in zip(seq_ids, runs, strict=True):
            self._append(seq_id, run)
        return [self._predict(run) for run in runs]

    def rollback(self, seq_id: int, count: int) -> None:
        self.rollbacks.append((seq_id, count))
        kept = len(self.kv[seq_id]) - count
        if kept < 0:
            raise RuntimeError(f"sequence {seq_id} cannot drop {count} positions")
        del self.kv[seq_id][kept:]

    def release(self, seq_id: int) -> None:
        self.kv.pop(seq_id, None)
        super().release(seq_id)

    def _append(self, seq_id: int, tokens: Sequence[int]) -> None:
        if seq_id not in self.kv:
            raise RuntimeError(f"sequence {seq_id} holds no slot")
        if len(self.kv[seq_id]) + len(tokens) > self.context_length:
            raise RuntimeError(f"sequence {seq_id} would run past the end of its KV cache")
        self.kv[seq_id].extend(tokens)

    def _predict(self, tokens: Sequence[int]) -> np.ndarray:
        logits = np.zeros((len(tokens), self.vocab_size), dtype=np.float32)
        for row, token in enumerate(tokens):
            logits[row, self.follows.get(int(token), self.token)] = 1.0
        return logits
