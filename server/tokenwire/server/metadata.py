"""gRPC call metadata as the server's layers pass it around: (key, value) pairs.

A home of its own, importing nothing of the server, so the wire, security and telemetry can
all speak of metadata without importing each other.
"""

from __future__ import annotations

from collections.abc import Sequence

Metadata = Sequence[tuple[str, str | bytes]]
