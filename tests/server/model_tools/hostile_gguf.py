"""GGUF files that lie: headers written byte by byte, and good files rewritten with one value changed.

A hostile header costs the test nothing to write (49 bytes claim 2^62 items); a rewritten file is
a valid synthetic GGUF (synthetic_gguf.py) whose metadata says something else, so the converter
meets the lie only where the lie is.
"""

from __future__ import annotations

import os
import resource
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
from gguf import GGUFValueType as V

MIB = 1 << 20


def string(text: str | bytes) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(data)) + data


def entry(key: str, kind: V, payload: bytes) -> bytes:
    """One metadata entry: key, value type, then the value's bytes as given."""
    return string(key) + struct.pack("<I", kind) + payload


def array(item: V, count: int, items: bytes = b"") -> bytes:
    """An array value's bytes: item type, count, then `items` (which may hold fewer than claimed)."""
    return struct.pack("<IQ", item, count) + items


def raw_gguf(path: Path, *entries: bytes, tensors: int = 0) -> Path:
    """A GGUF header with these metadata entries and a claimed tensor count, and nothing after it."""
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, tensors, len(entries)) + b"".join(entries))
    return path


_FORMATS = {
    V.UINT8: "<B",
    V.INT8: "<b",
    V.UINT16: "<H",
    V.INT16: "<h",
    V.UINT32: "<I",
    V.INT32: "<i",
    V.FLOAT32: "<f",
    V.BOOL: "<?",
    V.UINT64: "<Q",
    V.INT64: "<q",
    V.FLOAT64: "<d",
}


def value(value: Any, kind: V, item: V | None = None) -> bytes:
    """A metadata value's bytes (its type first): a scalar, a string, or an array of `item`s."""
    head = struct.pack("<I", kind)
    if kind is V.STRING:
        return head + string(value)
    if kind is not V.ARRAY:
        return head + struct.pack(_FORMATS[kind], value)
    assert item is not None
    if isinstance(value, bytes) and item is V.UINT8:
        items = value
    elif item is V.STRING:
        items = b"".join(string(v) for v in value)
    else:
        items = b"".join(struct.pack(_FORMATS[item], v) for v in value)
    return head + array(item, len(value), items)


def rewritten(source: Path, target: Path, changes: Mapping[str, tuple[Any, V, V | None] | None]) -> Path:
    """`source` with metadata entries replaced ((value, type, item type)) or removed (None), its
    tensor descriptions and data copied byte for byte (their offsets are relative to the data)."""
    reader = gguf.GGUFReader(source)
    entries = [
        b"".join(part.tobytes() for part in field.parts)
        for name, field in reader.fields.items()
        if not name.startswith("GGUF.") and name not in changes
    ]
    entries += [string(name) + value(*change) for name, change in changes.items() if change is not None]
    descriptions = b"".join(part.tobytes() for tensor in reader.tensors for part in tensor.field.parts)
    header = (
        b"GGUF" + struct.pack("<IQQ", 3, len(reader.tensors), len(entries)) + b"".join(entries) + descriptions
    )
    header += bytes(-len(header) % reader.alignment)
    with source.open("rb") as file:
        file.seek(reader.data_offset)
        target.write_bytes(header + file.read())
    return target


@dataclass(frozen=True)
class Run:
    status: int
    stderr: str
    peak_rss: int
    """The command's most resident memory, in bytes."""


_REPORTS_ITS_PEAK = (
    "import atexit, os, sys\n"
    "def report():\n"
    "    with open('/proc/self/status') as status:\n"
    "        peak = next(line for line in status if line.startswith('VmHWM:'))\n"
    "    with open(os.environ['TOKENWIRE_TEST_PEAK_FILE'], 'w') as out:\n"
    "        out.write(peak)\n"
    "atexit.register(report)\n"
    "from tokenwire.server.cli import main\n"
    "sys.exit(main())\n"
)
"""The CLI, writing its own peak resident memory (VmHWM) when it exits. The child's rusage is no
measure: a forked child's maxrss starts at its parent's resident size (the test process, which
may have grown to hundreds of MiB by then), and only the memory the command itself used counts."""


def run_bounded(
    *args: str, memory_bytes: int = 1024 * MIB, timeout: float = 300, env: Mapping[str, str] | None = None
) -> Run:
    """The CLI with ARGS with its heap capped at `memory_bytes` (RLIMIT_DATA), so a reader that
    believes a lie fails there (a MemoryError) instead of taking the machine; a run past `timeout`
    seconds is killed."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_DATA, (memory_bytes, memory_bytes))

    with (
        tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as stderr,
        tempfile.TemporaryDirectory() as scratch,
    ):
        peak_file = Path(scratch) / "peak"
        process = subprocess.Popen(
            [sys.executable, "-c", _REPORTS_ITS_PEAK, *args],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            preexec_fn=cap,
            env={**os.environ, **(env or {}), "TOKENWIRE_TEST_PEAK_FILE": str(peak_file)},
        )
        killer = threading.Timer(timeout, process.kill)
        killer.start()
        try:
            status = process.wait()
        finally:
            killer.cancel()
        stderr.seek(0)
        reported = peak_file.read_text().split() if peak_file.exists() else []
        assert reported[-1:] == ["kB"], (
            f"the command reported no peak (exit {status}): {stderr.read()[-2000:]}"
        )
        stderr.seek(0)
        return Run(status, stderr.read(), int(reported[1]) * 1024)
