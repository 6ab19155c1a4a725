"""The interface between the scheduler and a model: sequences in, next-token logits out.

The scheduler speaks only of sequence ids and token ids; how a runner lays out its KV cache
(a shared buffer with one slot per sequence, or a padded batch that grows each step) stays
inside the runner. All methods are called from the engine thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from tokenwire.server.models.pooling import Pooling

if TYPE_CHECKING:
    from tokenwire.server.models.adapters import AdapterStacks


@dataclass(frozen=True)
class ModelInfo:
    """What the rest of the server needs to know about a loaded model."""

    name: str
    format: str
    """"optimum" or "genai": the layout of the model's ONNX graph."""
    vocab_size: int
    context_length: int
    eos_token_ids: frozenset[int]
    max_batch_size: int
    default_temperature: float = 0.0
    """Temperature used when a request leaves it unset (from the model's search defaults)."""
    kv_cache_bytes: int = 0
    """Bytes allocated for the KV cache (0 where the cache grows on demand)."""
    kv_cache_placement: str = ""
    """Where the KV cache lives, in words for the start-up log ("ONNX Runtime memory on cpu")."""
    embedding_size: int = 0
    """Floats in one embedding (the hidden size); 0 where the model serves no embeddings."""
    pooling: Pooling = Pooling.LAST
    """How an input's hidden states become its embedding (models/pooling.py)."""


class ModelRunnerError(RuntimeError):
    """Running the model failed; the sequences of that call cannot continue."""


class ModelRunner(Protocol):
    """Runs prefill and batched decode steps for sequences identified by integer ids."""

    @property
    def info(self) -> ModelInfo: ...

    def prefill(self, seq_id: int, token_ids: Sequence[int], *, start: int) -> np.ndarray:
        """Process prompt tokens [start, start + len(token_ids)) of a sequence.

        The first call (start == 0) creates the sequence; later calls continue a prompt that is
        processed in chunks. Returns the logits ([vocab], float32) that predict the token after
        the last one given.
        """
        ...

    def decode(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> np.ndarray:
        """Append one token to each sequence and return next-token logits, shape [n, vocab].

        Rows follow the order of `seq_ids`. The returned array may be reused by the next call:
        consume it before calling the runner again.
        """
        ...

    def release(self, seq_id: int) -> None:
        """Forget a sequence and free its KV cache at once (unknown ids are ignored)."""
        ...

    def capacity(self) -> int:
        """How many sequences can hold KV cache at the same time."""
        ...


@runtime_checkable
class KvRowAccess(Protocol):
    """A runner whose KV rows can be copied out and back in, and from one sequence to another:
    for prefix caching, to swap a preempted sequence out of its slot and back in, and for the
    completions of one prompt.

    Rows copied out are one host array [kv tensors, kv_heads, positions, head_dim] in the model's
    KV dtype, wherever the cache itself lives. A sequence started from copied rows continues with
    `prefill(start=rows)` and decodes exactly as if it had processed those positions itself.
    """

    def kv_bytes_per_token(self) -> int:
        """Bytes of KV one position takes; 0 where rows cannot be copied."""
        ...

    def read_kv(self, seq_id: int, start: int, stop: int) -> np.ndarray:
        """A copy of positions [start, stop) of a sequence's cache, which must be processed
        (prompt positions while it prefills, any cached position while it decodes)."""
        ...

    def start_from_kv(self, seq_id: int, blocks: Sequence[np.ndarray]) -> int:
        """Start a sequence whose first positions are `blocks`, concatenated; returns their count."""
        ...

    def start_from_sequence(self, seq_id: int, source_id: int, positions: int) -> int:
        """Start a sequence whose first positions are a copy of the first `positions` of live
        sequence `source_id`'s, copied where the cache lives (slot to slot, no host copy);
        returns `positions`. Raises ModelRunnerError when the source does not hold them."""
        ...


@runtime_checkable
class MultiTokenDecode(Protocol):
    """A runner that appends several tokens to a sequence in one step and can take them back:
    what verifying speculative drafts needs.

    `decode_runs` appends `runs[i]` (k_i >= 1 tokens) to sequence `seq_ids[i]` and returns the
    logits at every appended position; `rollback` then drops a sequence's last positions so it
    continues exactly as if they had never been appended. The KV cache must hold room for the
    longest run past a sequence's length; running out is a ModelRunnerError before any work.
    """

    @property
    def can_decode_runs(self) -> bool:
        """False where the model's graph cannot append several positions to a decoding row (the
        runner said why in one log line at load); `decode_runs` then refuses runs longer than 1."""
        ...

    def decode_runs(self, seq_ids: Sequence[int], runs: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Append `runs[i]` to sequence `seq_ids[i]`; one float32 array [len(runs[i]), vocab] per
        row, in the order of `seq_ids`, row j predicting the token after `runs[i][j]`.

        The arrays are the caller's (never reused by a later call)."""
        ...

    def rollback(self, seq_id: int, count: int) -> None:
        """Drop the last `count` positions of a decoding sequence's cache (0 <= count <= its
        length); its next decode continues from the positions left."""
        ...


@runtime_checkable
class AdapterRunner(Protocol):
    """A runner over a graph with LoRA sites (models/adapters.py): each row runs with the adapter
    in its slot of the stacks, rows of different adapters and rows without one in one call.

    `prefill` and `decode` take the rows' adapter slots (NO_ADAPTER, 0, for the base model); a
    sequence keeps the slot it was last given, which is what a multi-token run or a later call
    without slots uses.
    """

    @property
    def adapters(self) -> AdapterStacks | None:
        """The stacks the graph reads; None where the graph has no LoRA sites."""
        ...

    def prefill(
        self, seq_id: int, token_ids: Sequence[int], *, start: int, adapter: int = 0
    ) -> np.ndarray: ...

    def decode(
        self, seq_ids: Sequence[int], token_ids: Sequence[int], *, adapters: Sequence[int] | None = None
    ) -> np.ndarray: ...

    def assign_adapters(self, seq_ids: Sequence[int], adapters: Sequence[int]) -> None:
        """Give each sequence its adapter slot for the calls to come (`decode_runs`)."""
        ...


@runtime_checkable
class HiddenStates(Protocol):
    """A runner that can return its model's last hidden states, for embeddings."""

    def hidden_states(self, inputs: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Each input's hidden states after the final norm, [len(input), hidden] float32, from a
        stateless pass (no sequence is created, no KV slot taken). Raises ModelRunnerError where
        the model has none (`ModelInfo.embedding_size` 0)."""
        ...
