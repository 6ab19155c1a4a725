"""Test-only wrappers around a real model runner (the real ONNX Runtime work still happens)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tokenwire.server.models.adapters import NO_ADAPTER, AdapterStacks
from tokenwire.server.models.runner import (
    AdapterRunner,
    KvRowAccess,
    ModelInfo,
    ModelRunner,
    ModelRunnerError,
)


class DelegatingRunner:
    """Passes every call to the wrapped runner; subclasses intercept the calls they test."""

    def __init__(self, inner: ModelRunner) -> None:
        self.inner = inner

    @property
    def info(self) -> ModelInfo:
        return self.inner.info

    def capacity(self) -> int:
        return self.inner.capacity()

    # Adapters pass through too: a wrapper over a runner with LoRA sites is told each row's slot.
    @property
    def adapters(self) -> AdapterStacks | None:
        return self.inner.adapters if isinstance(self.inner, AdapterRunner) else None

    def prefill(
        self, seq_id: int, token_ids: Sequence[int], *, start: int, adapter: int = NO_ADAPTER
    ) -> np.ndarray:
        if adapter != NO_ADAPTER and isinstance(self.inner, AdapterRunner):
            return self.inner.prefill(seq_id, token_ids, start=start, adapter=adapter)
        return self.inner.prefill(seq_id, token_ids, start=start)

    def decode(
        self, seq_ids: Sequence[int], token_ids: Sequence[int], *, adapters: Sequence[int] | None = None
    ) -> np.ndarray:
        # Slots only when given: a wrapped wrapper may predate adapters (decode without them).
        if adapters is not None and isinstance(self.inner, AdapterRunner):
            return self.inner.decode(seq_ids, token_ids, adapters=adapters)
        return self.inner.decode(seq_ids, token_ids)

    def assign_adapters(self, seq_ids: Sequence[int], adapters: Sequence[int]) -> None:
        if isinstance(self.inner, AdapterRunner):
            self.inner.assign_adapters(seq_ids, adapters)

    def release(self, seq_id: int) -> None:
        self.inner.release(seq_id)

    # Prefix caching works through a wrapper as it does on the runner itself.
    def kv_bytes_per_token(self) -> int:
        return self.inner.kv_bytes_per_token() if isinstance(self.inner, KvRowAccess) else 0

    def read_kv(self, seq_id: int, start: int, stop: int) -> np.ndarray:
        return self._rows().read_kv(seq_id, start, stop)

    def start_from_kv(self, seq_id: int, blocks: Sequence[np.ndarray]) -> int:
        return self._rows().start_from_kv(seq_id, blocks)

    def start_from_sequence(self, seq_id: int, source_id: int, positions: int) -> int:
        return self._rows().start_from_sequence(seq_id, source_id, positions)

    def _rows(self) -> KvRowAccess:
        if not isinstance(self.inner, KvRowAccess):
            raise ModelRunnerError("the wrapped runner cannot copy KV rows")
        return self.inner
