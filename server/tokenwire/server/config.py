"""Typed server settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tokenwire.server.engine.validation import RequestLimits
from tokenwire.server.models.session import Device

DEFAULT_PORT = 50051


@dataclass(frozen=True)
class ModelSource:
    path: Path
    name: str | None = None
    """Name clients use; defaults to the directory's name."""


@dataclass(frozen=True)
class ServerSettings:
    models: tuple[ModelSource, ...] = ()
    host: str = "0.0.0.0"
    port: int = DEFAULT_PORT
    max_batch_size: int = 8
    max_queue_size: int = 64
    prefill_chunk_size: int = 256
    max_context_length: int = 2048
    device: Device = "auto"
    intra_op_threads: int = 0
    drain_timeout: float = 30.0
    max_receive_message_bytes: int = 4 * 1024 * 1024
    limits: RequestLimits = field(default_factory=RequestLimits)

    def validate(self) -> list[str]:
        """Problems with these settings, as messages naming the flag."""
        problems: list[str] = []
        if not self.models:
            problems.append("--model: at least one model directory is needed")
        if not 0 <= self.port <= 65535:
            problems.append(f"--port: {self.port} is not a TCP port")
        for flag, value in (
            ("--max-batch-size", self.max_batch_size),
            ("--prefill-chunk-size", self.prefill_chunk_size),
            ("--max-context-length", self.max_context_length),
        ):
            if value < 1:
                problems.append(f"{flag}: must be at least 1, got {value}")
        if self.max_queue_size < 0:
            problems.append(f"--max-queue-size: must be >= 0, got {self.max_queue_size}")
        if self.drain_timeout < 0:
            problems.append(f"--drain-timeout: must be >= 0, got {self.drain_timeout}")
        if self.intra_op_threads < 0:
            problems.append(f"--intra-op-threads: must be >= 0, got {self.intra_op_threads}")
        for source in self.models:
            if not source.path.is_dir():
                problems.append(f"--model: {source.path} is not a directory")
        return problems
