"""tokenwire against llama.cpp on the same GGUF file (the one tokenwire converted its model from).

1. One stream: llama.cpp in process (llama-cpp-python) against tokenwire over gRPC.
2. Servers at rising concurrency: llama-cpp-python's own OpenAI-compatible server
   (`python -m llama_cpp.server`, streaming /v1/completions) against tokenwire, both on loopback,
   each level one wave of N streams sent at once.

Both run with 2 threads; tokenwire and llama.cpp take turns (who goes first alternates); figures
are medians over the repetitions.

    python benchmarks/llamacpp.py [--levels 1,2,4,8,16] [--repetitions 3]

llama-cpp-python lives in a separate venv (default /tmp/llama-venv, or
$TOKENWIRE_BENCH_LLAMA_PYTHON); without it everything here is skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import benchkit
from benchkit import LOOPBACK, NEW_TOKENS, THREADS, median

from tokenwire.client.bench import percentile

HERE = Path(__file__).resolve().parent
EOS_TOKEN_IDS = (0, 2)
"""SmolLM2's <|endoftext|> and <|im_end|>: biased away so every stream runs its full length."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def llama_server(python: Path, gguf: Path) -> Iterator[int]:
    port = free_port()
    command = [str(python), "-m", "llama_cpp.server", "--model", str(gguf), "--host", LOOPBACK]
    command += ["--port", str(port), "--n_threads", str(THREADS), "--n_threads_batch", str(THREADS)]
    # Queue concurrent requests instead of interrupting the running one (its default).
    command += ["--n_ctx", "1024", "--interrupt_requests", "False"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://{LOOPBACK}:{port}/v1/models", timeout=2):
                    break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("llama_cpp.server did not start") from None
                time.sleep(0.3)
        yield port
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


async def sse_completion(port: int, body: dict[str, Any]) -> list[float]:
    """POST a streaming completion; the arrival time (seconds from the send) of every token event."""
    reader, writer = await asyncio.open_connection(LOOPBACK, port)
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {LOOPBACK}:{port}\r\nContent-Type: application/json\r\n"
        f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    )
    sent = time.perf_counter()
    writer.write(head.encode() + payload)
    await writer.drain()
    headers = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
    if not headers.startswith("http/1.1 200"):
        raise RuntimeError(f"llama_cpp.server answered {headers.splitlines()[0]}")
    chunked = "transfer-encoding: chunked" in headers
    stamps: list[float] = []
    buffer = b""
    done = False
    while not done:
        if chunked:
            size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                break
            data = await reader.readexactly(size + 2)
        else:
            data = await reader.read(65536)
            if not data:
                break
        now = time.perf_counter() - sent
        buffer = (buffer + data).replace(b"\r\n", b"\n")
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                content = line[5:].strip()
                if content == b"[DONE]":
                    done = True
                else:
                    choices = json.loads(content).get("choices") or [{}]
                    # The stream ends with an empty chunk that only carries the finish reason.
                    if choices[0].get("text") or choices[0].get("finish_reason") is None:
                        stamps.append(now)
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return stamps


def llama_wave(port: int, text: str, streams: int) -> dict[str, Any]:
    body = {
        "prompt": text,
        "max_tokens": NEW_TOKENS,
        "temperature": 0.0,
        "top_k": 1,
        "stream": True,
        "logit_bias": {str(t): -100.0 for t in EOS_TOKEN_IDS},
    }

    async def wave() -> list[list[float]]:
        return list(await asyncio.gather(*(sse_completion(port, body) for _ in range(streams))))

    began = time.perf_counter()
    runs = asyncio.run(wave())
    return _wave_figures(runs, time.perf_counter() - began)


def tokenwire_wave(target: str, ids: list[int], streams: int) -> dict[str, Any]:
    began = time.perf_counter()
    runs = benchkit.run_streams(target, [ids] * streams, NEW_TOKENS)
    return _wave_figures([r.token_times for r in runs], time.perf_counter() - began)


def _wave_figures(runs: list[list[float]], wall: float) -> dict[str, Any]:
    firsts = [r[0] for r in runs]
    return {
        "tokens_per_second": sum(len(r) for r in runs) / wall,
        "ttft_p50": percentile(firsts, 50),
        "ttft_p99": percentile(firsts, 99),
        "tokens": [len(r) for r in runs],
    }


def main() -> None:
    args = benchkit.command_line(__doc__, repetitions=3, levels="1,2,4,8,16")
    levels = args.levels

    python = benchkit.external_python("TOKENWIRE_BENCH_LLAMA_PYTHON", "llama-venv")
    if (
        python is None
        or subprocess.run([str(python), "-c", "import llama_cpp"], capture_output=True).returncode
    ):
        benchkit.skip("llama.cpp", "no venv with llama-cpp-python (set TOKENWIRE_BENCH_LLAMA_PYTHON)")
        return
    directory = benchkit.model_dir()
    gguf = benchkit.gguf_file()
    ids = benchkit.prompt_ids(directory)
    text = benchkit.prompt_text(directory)

    single: dict[str, list[dict[str, float]]] = {"llama": [], "tokenwire": []}
    waves: dict[str, dict[int, list[dict[str, Any]]]] = {
        "llama": {n: [] for n in levels},
        "tokenwire": {n: [] for n in levels},
    }
    with benchkit.ServerProcess(directory, max_batch_size=max(levels)) as server:
        with benchkit.Worker(python, HERE / "llama_worker.py", str(gguf), str(THREADS)) as worker:

            def one_stream(name: str) -> list[float]:
                if name == "llama":
                    times: list[float] = worker.call(op="generate", ids=ids, new_tokens=NEW_TOKENS)[
                        "token_times"
                    ]
                    return times
                return benchkit.run_streams(server.target, [ids], NEW_TOKENS)[0].token_times

            order = ("llama", "tokenwire")
            for name in order:
                one_stream(name)  # warm-up
            for repetition in range(args.repetitions):
                benchkit.wait_for_quiet()
                for name in order if repetition % 2 == 0 else order[::-1]:
                    times = one_stream(name)
                    single[name].append(
                        {
                            "ttft": times[0],
                            "decode_rate": (len(times) - 1) / (times[-1] - times[0]),
                            "total": times[-1],
                        }
                    )
        with llama_server(python, gguf) as port:
            llama_wave(port, text, 1)  # warm-up
            for repetition in range(args.repetitions):
                for n in levels:
                    benchkit.wait_for_quiet()
                    for name in order if repetition % 2 == 0 else order[::-1]:
                        wave = (
                            llama_wave(port, text, n)
                            if name == "llama"
                            else tokenwire_wave(server.target, ids, n)
                        )
                        waves[name][n].append(wave)
    _report(single, waves, levels, args.repetitions)


def _report(
    single: dict[str, list[dict[str, float]]],
    waves: dict[str, dict[int, list[dict[str, Any]]]],
    levels: list[int],
    repetitions: int,
) -> None:
    print(f"\n## One stream, in process vs over gRPC: {NEW_TOKENS} new tokens, median of {repetitions}\n")
    rows = [
        [
            label,
            median([r["ttft"] for r in single[key]]) * 1000,
            median([r["decode_rate"] for r in single[key]]),
            median([r["total"] for r in single[key]]),
        ]
        for key, label in (("llama", "llama.cpp in process"), ("tokenwire", "tokenwire, 1 stream over gRPC"))
    ]
    print(benchkit.markdown_table(["system", "TTFT ms", "decode tok/s", "total s"], rows))

    print(f"\n## Servers on loopback, one wave of N streams, median of {repetitions}\n")
    rows = []
    for n in levels:
        llama, tokenwire = waves["llama"][n], waves["tokenwire"][n]
        rows.append(
            [
                n,
                median([r["tokens_per_second"] for r in tokenwire]),
                median([r["tokens_per_second"] for r in llama]),
                median([r["ttft_p50"] for r in tokenwire]) * 1000,
                median([r["ttft_p50"] for r in llama]) * 1000,
                median([r["ttft_p99"] for r in tokenwire]) * 1000,
                median([r["ttft_p99"] for r in llama]) * 1000,
                min(min(r["tokens"]) for r in llama),
            ]
        )
    columns = [
        "streams",
        "tokenwire tok/s",
        "llama.cpp server tok/s",
        "tokenwire TTFT p50 ms",
        "llama.cpp TTFT p50 ms",
        "tokenwire TTFT p99 ms",
        "llama.cpp TTFT p99 ms",
        "llama.cpp fewest tokens in a stream",
    ]
    print(benchkit.markdown_table(columns, rows))
    if 8 in levels:
        tw, ll = waves["tokenwire"][8], waves["llama"][8]
        throughput = median([r["tokens_per_second"] for r in tw]) / median(
            [r["tokens_per_second"] for r in ll]
        )
        ttft = median([r["ttft_p99"] for r in tw]) / median([r["ttft_p99"] for r in ll])
        print("\n## Targets\n")
        target_rows = [
            [
                "8 streams: higher throughput than llama.cpp's server",
                "met" if throughput > 1 else "missed",
                f"{throughput:.2f}x",
            ],
            [
                "8 streams: lower p99 TTFT than llama.cpp's server",
                "met" if ttft < 1 else "missed",
                f"{ttft:.2f}x",
            ],
        ]
        print(benchkit.markdown_table(["target", "result", "measured"], target_rows))
    path = benchkit.save_results(
        "llamacpp",
        {
            "repetitions": repetitions,
            "single": single,
            "waves": {k: {str(n): v for n, v in w.items()} for k, w in waves.items()},
        },
    )
    print(f"\nwrote {path.relative_to(benchkit.REPO)}")


if __name__ == "__main__":
    main()
