"""A tokenwire server in a child process that reports its own engine counters, RSS and descriptors.

Memory and file-descriptor figures only mean something for a process that runs nothing but the
server, so load and soak runs start one of these. The child serves on a free port on 127.0.0.1,
prints one JSON line with its port, then answers each `stats` line on its stdin with one JSON line
(engine counters, live and queued requests, health phase, the prefix cache's size). When its
stdin closes (the parent exits or calls `close()`), it drains and stops, so it never outlives the
run that started it.

The prefix cache is memory the server holds on purpose: with the default bound (256 MiB) it
would grow through a whole run, and its growth would read as drift. So the child runs with a
small bound (PREFIX_CACHE_MB) that a load fills in its first seconds: from then on the cache
evicts as it caches, RSS drift measures only what the server should not have kept, and the
eviction path runs under load too. Its size is in every `stats` answer.

Run as `python -m tests.reliability.server_process --model DIR [--max-batch-size N ...]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from tokenwire.server.app import TokenwireServer
from tokenwire.server.config import ModelSource, ServerSettings
from tokenwire.server.engine.config import EngineConfig

STARTUP_TIMEOUT = 60.0
REPLY_TIMEOUT = 30.0
PREFIX_CACHE_MB = 4


@dataclass(frozen=True)
class ServerStats:
    """One snapshot of the child's engine, as it answered a `stats` line."""

    live: int
    queued: int
    phase: str
    decode_steps: int
    finished: int
    aborted: int
    abort_requests: int
    rejected: int
    max_abort_latency_steps: int
    orphaned_steps: int
    step_failures: int
    prefix_cache_bytes: int
    prefix_cache_capacity_bytes: int
    prefix_cache_evicted_blocks: int


def read_rss_bytes(pid: int) -> int:
    """Resident set size of a process (Linux /proc)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def count_open_fds(pid: int) -> int:
    """Open file descriptors of a process (Linux /proc)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def procfs_available() -> bool:
    return Path(f"/proc/{os.getpid()}/status").is_file() and Path(f"/proc/{os.getpid()}/fd").is_dir()


class ServerProcess:
    """Parent side: start the child, ask it for stats, read its RSS and descriptors, stop it."""

    def __init__(self, process: subprocess.Popen[str], port: int, log_path: Path) -> None:
        self._process = process
        self.port = port
        self.log_path = log_path
        self._lock = threading.Lock()

    @classmethod
    def start(
        cls,
        model_dir: Path,
        log_path: Path,
        *,
        max_batch_size: int = 4,
        max_queue_size: int = 8,
        prefix_cache_mb: int = PREFIX_CACHE_MB,
    ) -> ServerProcess:
        command = [
            sys.executable,
            "-m",
            "tests.reliability.server_process",
            "--model",
            str(model_dir),
            "--max-batch-size",
            str(max_batch_size),
            "--max-queue-size",
            str(max_queue_size),
            "--prefix-cache-mb",
            str(prefix_cache_mb),
        ]
        root = Path(__file__).resolve().parents[2]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
        }
        log = log_path.open("w", encoding="utf-8")
        process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            cwd=root,
            env=env,
        )
        log.close()
        try:
            first = _read_line(process, STARTUP_TIMEOUT)
            port = int(json.loads(first)["port"])
        except BaseException:
            process.kill()
            process.wait()
            raise RuntimeError(f"server process did not start; its log:\n{_tail(log_path)}") from None
        return cls(process, port, log_path)

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self._process.poll() is None

    def stats(self) -> ServerStats:
        """Ask the child for its engine counters (blocking: call through asyncio.to_thread)."""
        with self._lock:
            stdin = self._process.stdin
            assert stdin is not None
            stdin.write("stats\n")
            stdin.flush()
            reply = _read_line(self._process, REPLY_TIMEOUT)
        return ServerStats(**json.loads(reply))

    async def settled_stats(self, timeout: float) -> ServerStats:
        """The child's counters once nothing is live or queued, or the last ones read when
        `timeout` seconds pass first (the caller decides whether a busy server is a failure)."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + timeout
        while True:
            stats = await asyncio.to_thread(self.stats)
            if (stats.live == 0 and stats.queued == 0) or loop.time() > give_up:
                return stats
            await asyncio.sleep(0.05)

    def rss_bytes(self) -> int:
        return read_rss_bytes(self.pid)

    def open_fds(self) -> int:
        return count_open_fds(self.pid)

    def close(self, timeout: float = 30.0) -> int:
        """Close the child's stdin (it drains and exits); kill it if it does not exit in time."""
        if self._process.stdin is not None:
            with contextlib.suppress(OSError):
                self._process.stdin.close()
        try:
            return self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
            raise RuntimeError(f"server process did not exit in {timeout}s; killed") from None

    def log_tail(self) -> str:
        return _tail(self.log_path)


def _read_line(process: subprocess.Popen[str], timeout: float) -> str:
    """One line of the child's stdout, or an error if none comes within `timeout` seconds."""
    stdout = process.stdout
    assert stdout is not None
    result: list[str] = []
    reader = threading.Thread(target=lambda: result.append(stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not result or not result[0]:
        raise RuntimeError(f"server process gave no answer within {timeout}s (exit code {process.poll()})")
    return result[0]


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# -- child side ------------------------------------------------------------------------------------


def _stats_of(server: TokenwireServer) -> dict[str, Any]:
    engine = server.registry.default.engine
    counters = dataclasses.asdict(engine.stats)
    wanted = {f.name for f in dataclasses.fields(ServerStats)}
    cache = engine.prefix_cache_stats
    return {
        "live": engine.live_count,
        "queued": engine.queue_depth,
        "phase": server.lifecycle.phase.value,
        **{name: value for name, value in counters.items() if name in wanted},
        "prefix_cache_bytes": 0 if cache is None else cache.bytes,
        "prefix_cache_capacity_bytes": 0 if cache is None else cache.capacity_bytes,
        "prefix_cache_evicted_blocks": 0 if cache is None else cache.evicted_blocks,
    }


async def _serve(settings: ServerSettings, out: IO[str]) -> None:
    server = TokenwireServer(settings)
    await server.start()
    await server.load()
    print(json.dumps({"port": server.port}), file=out, flush=True)
    loop = asyncio.get_running_loop()
    commands: asyncio.Queue[str | None] = asyncio.Queue()

    def read_commands() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(commands.put_nowait, line.strip())
        loop.call_soon_threadsafe(commands.put_nowait, None)

    threading.Thread(target=read_commands, name="commands", daemon=True).start()
    try:
        while (command := await commands.get()) is not None:
            if command == "stats":
                print(json.dumps(_stats_of(server)), file=out, flush=True)
    finally:
        await server.drain(settings.drain_timeout)
        await server.stop(grace=0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--max-batch-size", type=int, default=4)
    parser.add_argument("--max-queue-size", type=int, default=8)
    parser.add_argument("--prefix-cache-mb", type=int, default=PREFIX_CACHE_MB)
    args = parser.parse_args(argv)
    settings = ServerSettings(
        models=(ModelSource(args.model, "tiny"),),
        host="127.0.0.1",
        port=0,
        engine=EngineConfig(
            max_batch_size=args.max_batch_size,
            max_queue_size=args.max_queue_size,
            prefix_cache_mb=args.prefix_cache_mb,
        ),
        device="cpu",
        intra_op_threads=1,
        drain_timeout=5.0,
    )
    try:
        import uvloop  # the server's own entry point runs on uvloop where it is installed
    except ImportError:
        asyncio.run(_serve(settings, sys.stdout))
    else:
        uvloop.run(_serve(settings, sys.stdout))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
