"""Which real runner a test runs: a tiny model's layout and, on the shared-buffer layout, where the
KV cache lives (`--kv-cache-location`). The fixtures over them are in tests/conftest.py."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenwire.server.models.kv_settings import KvCacheLocation, KvCacheSettings
from tokenwire.server.models.loader import LoadedModel, LoadSettings, load_model
from tokenwire.server.models.runner import ModelRunner
from tokenwire.server.models.session import SessionSettings

KV_CACHE_LOCATIONS: tuple[KvCacheLocation, ...] = ("device", "host")


@dataclass(frozen=True)
class TinyModel:
    """A tiny model directory, its layout ("optimum" or "genai") and where its runner keeps the
    KV cache (the Optimum layout's grows in ONNX Runtime memory wherever it is asked to be)."""

    path: Path
    layout: str
    kv_cache_location: KvCacheLocation = "device"

    @property
    def kv_cache(self) -> KvCacheSettings:
        return KvCacheSettings(location=self.kv_cache_location)

    def load_settings(
        self, *, max_batch_size: int = 4, max_context_length: int = 256, threads: int = 1
    ) -> LoadSettings:
        return LoadSettings(
            max_batch_size=max_batch_size,
            max_context_length=max_context_length,
            session=SessionSettings(device="cpu", intra_op_threads=threads),
            kv_cache=self.kv_cache,
        )

    def load(
        self, *, max_batch_size: int = 4, max_context_length: int = 256, threads: int = 1
    ) -> LoadedModel:
        settings = self.load_settings(
            max_batch_size=max_batch_size, max_context_length=max_context_length, threads=threads
        )
        return load_model(self.path, settings)

    def runner(self, *, max_batch_size: int = 4, max_context_length: int = 256) -> ModelRunner:
        return self.load(max_batch_size=max_batch_size, max_context_length=max_context_length).runner
