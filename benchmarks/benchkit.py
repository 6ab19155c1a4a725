"""Helpers shared by the side-by-side benchmarks: the model, the prompt, a tokenwire server in a
subprocess, /proc readings, workers in other interpreters, medians and markdown tables.

Only loopback addresses are ever used.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parent.parent
T = TypeVar("T")
LOOPBACK = "127.0.0.1"
PROMPT_TOKENS = 100
NEW_TOKENS = 128
THREADS = 2

# A plain-prose passage: a model continues it for many tokens before it would end the text.
PASSAGE = (
    "The old lighthouse stood at the edge of the cliff, its white paint peeling after a hundred "
    "winters of salt and wind. Every evening the keeper climbed the spiral stairs, counted the "
    "steps out of habit, and lit the great lamp that warned the fishing boats away from the rocks. "
    "The villagers below said he had not missed a single night in forty years, not during the "
    "storm that took the harbour wall, and not during the long fever that kept half the town in "
    "bed. One autumn a young woman arrived on the morning ferry with a letter from the coastal "
    "authority, a small suitcase, and a notebook full of questions about the light, the tides and "
    "the ships that had passed the point in the years before the war."
)


@dataclass(frozen=True)
class Options:
    repetitions: int
    levels: list[int]
    """Concurrency levels; empty for a script without --levels."""


def command_line(description: str | None, *, repetitions: int, levels: str | None = None) -> Options:
    """The options every benchmark script shares: `--repetitions N`, and `--levels 1,2,...` for
    those that sweep concurrency (`levels` is then the default)."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    if levels is not None:
        parser.add_argument("--levels", default=levels)
    parser.add_argument("--repetitions", type=int, default=repetitions)
    args = parser.parse_args()
    swept = [int(v) for v in args.levels.split(",")] if levels is not None else []
    return Options(repetitions=args.repetitions, levels=swept)


def model_dir() -> Path:
    """The default model, converted and cached by `tokenwire pull` (fetched on first use)."""
    configured = os.environ.get("TOKENWIRE_BENCH_MODEL")
    if configured:
        return Path(configured)
    from tokenwire.server.model_tools.pull import pull_model

    return pull_model(progress=False)


def gguf_file() -> Path:
    from tokenwire.server.model_tools.pull import fetch_gguf

    return fetch_gguf(progress=False)


def prompt_ids(directory: Path, count: int = PROMPT_TOKENS, *, offset: int = 0) -> list[int]:
    """`count` token ids of the passage (repeated as needed), so every system gets the same prompt."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    ids = tokenizer.encode(PASSAGE, add_special_tokens=False).ids
    while len(ids) < offset + count:
        ids = ids + ids
    return list(ids[offset : offset + count])


def prompt_text(directory: Path, count: int = PROMPT_TOKENS) -> str:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    return str(tokenizer.decode(prompt_ids(directory, count)))


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def cell(value: object) -> str:
        if isinstance(value, float):
            return "-" if value != value else f"{value:.1f}" if abs(value) >= 10 else f"{value:.3g}"
        return str(value)

    text_rows = [[cell(v) for v in row] for row in rows]
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in text_rows]
    return "\n".join(lines)


def save_results(name: str, data: dict[str, Any]) -> Path:
    out = REPO / "benchmarks" / "results" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {"machine": machine_summary(), **data}
    out.write_text(json.dumps(data, indent=2) + "\n")
    return out


def machine_summary() -> dict[str, Any]:
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    memory_kib = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        memory_kib = int(Path("/proc/meminfo").read_text().split()[1])
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(memory_kib / 2**20, 1)}


# --- /proc readings ---------------------------------------------------------------------------------

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads together."""
    return _stat_cpu_seconds(Path(f"/proc/{pid}/stat"))


def thread_cpu_seconds(pid: int) -> dict[int, tuple[str, float]]:
    """Per thread id of a process: its kernel name and CPU seconds."""
    threads: dict[int, tuple[str, float]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            threads[int(task.name)] = ((task / "comm").read_text().strip(), _stat_cpu_seconds(task / "stat"))
        except OSError:  # the thread ended while being read
            continue
    return threads


def _stat_cpu_seconds(stat: Path) -> float:
    # Fields after the parenthesised command name; utime and stime are the 14th and 15th overall.
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def _cpu_idle_and_total() -> tuple[int, int]:
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return fields[3] + fields[4], sum(fields[:8])  # idle + iowait, all but guest time


def wait_for_quiet(
    *, idle_fraction: float = 0.85, window: float = 1.0, max_wait: float | None = None
) -> bool:
    """Wait until the machine's CPUs were at least `idle_fraction` idle over `window` seconds.

    On a shared 2-core machine another process's burst can halve a measurement; starting each
    repetition on a quiet machine keeps the A/B pairs comparable. False if it never got quiet.
    `max_wait` defaults to $TOKENWIRE_BENCH_QUIET_WAIT seconds, else 60.
    """
    if max_wait is None:
        max_wait = float(os.environ.get("TOKENWIRE_BENCH_QUIET_WAIT", "60"))
    deadline = time.monotonic() + max_wait
    while True:
        idle_before, total_before = _cpu_idle_and_total()
        time.sleep(window)
        idle_after, total_after = _cpu_idle_and_total()
        busy_share = 1 - (idle_after - idle_before) / max(1, total_after - total_before)
        if 1 - busy_share >= idle_fraction:
            return True
        if time.monotonic() > deadline:
            print(
                f"machine still {busy_share:.0%} busy after {max_wait:.0f}s; measuring anyway",
                file=sys.stderr,
            )
            return False


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class PeakRss:
    """Samples a process's resident memory every few milliseconds while in use."""

    def __init__(self, pid: int, interval: float = 0.02) -> None:
        self._pid = pid
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self.peak = 0

    def __enter__(self) -> PeakRss:
        self.peak = rss_bytes(self._pid)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes(self._pid))

    def _sample(self) -> None:
        while not self._stop.wait(self._interval):
            self.peak = max(self.peak, rss_bytes(self._pid))


# --- a tokenwire server in a subprocess ---------------------------------------------------------


@dataclass
class ServerProcess:
    """`tokenwire serve` on a loopback port; the log is kept for the KV-cache line."""

    model: Path
    max_batch_size: int = 16
    max_queue_size: int = 64
    threads: int = THREADS
    extra: Sequence[str] = ()
    host: str = LOOPBACK
    model_name: str | None = None
    """Serve the model under this name instead of its directory's."""
    device: str = "cpu"
    code: Path | None = None
    """A checkout of another tokenwire version to serve instead of this one (its server/ and
    client/ go first on PYTHONPATH): the "before" side of a before/after benchmark."""
    process: subprocess.Popen[str] | None = None
    port: int = 0
    log: list[str] = field(default_factory=list)

    def __enter__(self) -> ServerProcess:
        command = [
            sys.executable,
            "-c",
            "import sys; from tokenwire.server.cli import main; sys.exit(main())",
            "serve",
            "--model",
            f"{self.model_name}={self.model}" if self.model_name else str(self.model),
            "--host",
            self.host,
            "--port",
            "0",
            "--device",
            self.device,
            "--max-batch-size",
            str(self.max_batch_size),
            "--max-queue-size",
            str(self.max_queue_size),
            "--intra-op-threads",
            str(self.threads),
            *self.extra,
        ]
        env = None
        if self.code is not None:
            paths = [str(self.code / "server"), str(self.code / "client"), os.environ.get("PYTHONPATH", "")]
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env
        )
        assert self.process.stdout is not None
        deadline = time.monotonic() + 300
        for line in self.process.stdout:
            self.log.append(line.rstrip())
            found = re.search(r"tokenwire: serving on [^:]+:(\d+)", line)
            if found:
                self.port = int(found.group(1))
                break
            if time.monotonic() > deadline:
                break
        if not self.port:
            self.__exit__()
            raise RuntimeError("tokenwire serve did not start:\n" + "\n".join(self.log[-20:]))
        # Keep draining the log so the server never blocks on a full pipe.
        threading.Thread(target=self._drain, daemon=True).start()
        return self

    def _drain(self) -> None:
        assert self.process is not None
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.log.append(line.rstrip())

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    def kv_cache_line(self) -> str:
        return next((line.split(": ", 1)[-1] for line in self.log if "KV cache" in line), "")

    def __exit__(self, *exc: object) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


# --- workers in other interpreters (onnxruntime-genai, llama-cpp-python) ----------------------------


def external_python(env_name: str, default_venv: str) -> Path | None:
    """An interpreter of a separate benchmark venv: $env_name, else /tmp/<default_venv>/bin/python."""
    configured = os.environ.get(env_name)
    candidate = (
        Path(configured) if configured else Path(tempfile.gettempdir()) / default_venv / "bin" / "python"
    )
    return candidate if candidate.exists() else None


class Worker:
    """A benchmark worker in another interpreter, driven by one JSON line per command."""

    def __init__(self, python: Path, script: Path, *args: str) -> None:
        self._process = subprocess.Popen(
            [str(python), str(script), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,
            text=True,
            bufsize=1,
        )

    @property
    def pid(self) -> int:
        return self._process.pid

    def call(self, **command: Any) -> dict[str, Any]:
        assert self._process.stdin is not None
        assert self._process.stdout is not None
        self._process.stdin.write(json.dumps(command) + "\n")
        self._process.stdin.flush()
        line = self._process.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited (code {self._process.wait()})")
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"worker failed: {answer['error']}")
        return answer

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self._process.stdin is not None:
                self._process.stdin.close()
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def genai_model_copy(directory: Path, threads: int = THREADS) -> Path:
    """The model directory as ONNX Runtime GenAI should see it, with its intra-op thread count set.

    Files are linked, only genai_config.json is rewritten, so nothing in the cache changes.
    """
    target = Path(tempfile.mkdtemp(prefix="tokenwire-genai-"))
    for item in directory.iterdir():
        if item.name != "genai_config.json":
            (target / item.name).symlink_to(item)
    config = json.loads((directory / "genai_config.json").read_text())
    options = config["model"]["decoder"].setdefault("session_options", {})
    options["intra_op_num_threads"] = threads
    options["inter_op_num_threads"] = 1
    (target / "genai_config.json").write_text(json.dumps(config, indent=2))
    return target


@contextlib.contextmanager
def temporary_dir(path: Path) -> Iterator[Path]:
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def skip(what: str, why: str) -> None:
    print(f"SKIPPED {what}: {why}", file=sys.stderr)


# --- tokenwire through its own client ---------------------------------------------------------------


@dataclass
class StreamedRun:
    """One streamed generation as the client saw it; times in seconds from the send."""

    token_times: list[float]
    server_queued: float
    server_first_token: float
    server_prefill: float

    @property
    def first_token(self) -> float:
        return self.token_times[0]

    @property
    def total(self) -> float:
        return self.token_times[-1]

    @property
    def decode_rate(self) -> float:
        """Tokens per second after the first (the decode phase alone)."""
        return (len(self.token_times) - 1) / (self.token_times[-1] - self.token_times[0])


_event_loop: asyncio.Runner | None = None
_clients: dict[str, Any] = {}


async def tokenwire_streams(
    target: str, prompts: Sequence[Sequence[int]], new_tokens: int
) -> list[StreamedRun]:
    """Send every prompt at once, each as its own greedy stream; wait for all of them."""
    from tokenwire.client import AsyncClient, Chunk, Completed, GenerateOptions, Sampling, Stopping

    options = GenerateOptions(
        sampling=Sampling(temperature=0.0), stopping=Stopping(max_new_tokens=new_tokens, ignore_eos=True)
    )
    # One client per server for the whole script: measurements after the warm-up run on a
    # connected channel, as a long-lived client's would, instead of paying a connection each.
    client = _clients.get(target)
    if client is None:
        client = _clients[target] = AsyncClient(target, retries=False)

    async def one(ids: Sequence[int]) -> StreamedRun:
        sent = time.perf_counter()
        stamps: list[float] = []
        async for event in client.stream(list(ids), options, deadline=600):
            if isinstance(event, Chunk) and event.token_ids:
                now = time.perf_counter() - sent
                stamps.extend(now for _ in event.token_ids)
            elif isinstance(event, Completed):
                timing = event.generation.timing
                return StreamedRun(
                    stamps, timing.queued, timing.time_to_first_token or 0.0, timing.prefill or 0.0
                )
        raise RuntimeError("stream ended without completing")

    return list(await asyncio.gather(*(one(ids) for ids in prompts)))


def run_streams(target: str, prompts: Sequence[Sequence[int]], new_tokens: int) -> list[StreamedRun]:
    return _run(tokenwire_streams(target, prompts, new_tokens))


def run_unary(target: str, ids: Sequence[int], new_tokens: int) -> dict[str, float]:
    """One greedy unary Generate: the server's own timing (no per-token messages on the wire)."""
    return _run(_unary(target, ids, new_tokens))


async def _unary(target: str, ids: Sequence[int], new_tokens: int) -> dict[str, float]:
    from tokenwire.client import AsyncClient, GenerateOptions, Sampling, Stopping

    options = GenerateOptions(
        sampling=Sampling(temperature=0.0), stopping=Stopping(max_new_tokens=new_tokens, ignore_eos=True)
    )
    client = _clients.get(target)
    if client is None:
        client = _clients[target] = AsyncClient(target, retries=False)
    sent = time.perf_counter()
    generation = await client.generate(list(ids), options, deadline=600)
    total = time.perf_counter() - sent
    timing = generation.timing
    return {
        "ttft": timing.time_to_first_token or 0.0,
        "decode_rate": timing.decode_tokens_per_second,
        "total": total,
    }


def _run(coroutine: Coroutine[Any, Any, T]) -> T:
    global _event_loop
    if _event_loop is None:  # one event loop for the script, so the channels stay connected
        _event_loop = asyncio.Runner()
    return _event_loop.run(coroutine)
