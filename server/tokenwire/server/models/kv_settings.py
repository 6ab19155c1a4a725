"""The KV cache's settings: where a shared-buffer runner keeps it, and how much memory it may take.

Declared next to their owner (models/kv_store.py) but in a module of their own that imports no
ONNX Runtime or NumPy, so the settings parse where ONNX Runtime is missing or broken; the
server's settings (config.py) hold them as a group, which names their help group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tokenwire.server.settings_schema import setting

KvCacheLocation = Literal["host", "device"]

DEFAULT_KV_CACHE_LOCATION: KvCacheLocation = "device"
"""BENCHMARKS.md section 18, "KV cache location on the CPU": on the CPU the two locations decode at the same
speed (the model reads memory of the same kind either way, bound by pointer), and ONNX Runtime's
row moves cost the same order as NumPy's, so the default is the one path every device runs."""


@dataclass(frozen=True)
class KvCacheSettings:
    location: KvCacheLocation = setting(
        DEFAULT_KV_CACHE_LOCATION,
        "where the genai layout keeps its KV cache: device = ONNX Runtime memory on the model's device "
        "(the CPU provider's with --device cpu), every row move (prefix-cache hits, swaps, forks, "
        "compaction) done by ONNX Runtime there; host = NumPy memory moved by NumPy, --device cpu only",
    )
    mb: int = setting(
        0,
        "most memory the KV cache may take, in MiB: --max-batch-size slots of --max-context-length "
        "positions must fit, or the server refuses to start and says what would (0: no bound)",
        minimum=0,
    )

    @property
    def limit_bytes(self) -> int | None:
        """The bound in bytes; None where there is none."""
        return self.mb * 2**20 if self.mb > 0 else None
