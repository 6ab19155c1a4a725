"""`tokenwire serve` as a child process, for tests that need real signals and a real exit code."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc

from tokenwire.v1 import inference_service_pb2 as pb
from tokenwire.v1 import inference_service_pb2_grpc as pb_grpc


@dataclass(frozen=True)
class ServeProcess:
    process: subprocess.Popen[str]
    port: int
    metrics_port: int
    """0 when the server exports no Prometheus endpoint."""
    http_port: int = 0
    """0 when the server serves no OpenAI-compatible HTTP API."""


def start_serve(*flags: str, log: Path | None = None) -> ServeProcess:
    """Start `tokenwire serve FLAGS...` on a free loopback port (CPU, one thread) and wait until it
    serves; its stdout is read up to the "serving on" line for the ports. Its log (stderr) goes to
    `log`, or nowhere."""
    log_file = log.open("w", encoding="utf-8") if log is not None else None
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tokenwire.server.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--device",
            "cpu",
            "--intra-op-threads",
            "1",
            *flags,
        ],
        stdout=subprocess.PIPE,
        stderr=log_file if log_file is not None else subprocess.DEVNULL,
        text=True,
    )
    if log_file is not None:
        log_file.close()  # the child holds its own descriptor
    assert process.stdout is not None
    metrics_port = http_port = 0
    for line in process.stdout:
        if "metrics on" in line:
            metrics_port = int(line.rsplit(":", 1)[1].split("/", 1)[0])
        if "OpenAI-compatible API on" in line:
            http_port = int(line.rsplit(":", 1)[1].split("/", 1)[0])
        if "serving on" in line:
            return ServeProcess(process, int(line.rsplit(":", 1)[1]), metrics_port, http_port)
    raise AssertionError(f"server exited with {process.wait()} before serving")


def serve_refused(model: Path, *flags: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`tokenwire serve --model MODEL [FLAGS...]` run to its end, for a model or flags it must
    refuse to load."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenwire.server.cli",
            "serve",
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--no-metrics",
            "--device",
            "cpu",
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@dataclass(frozen=True)
class Ports:
    grpc: int
    metrics: int = 0
    http: int = 0


def announced_ports(process: subprocess.Popen[str]) -> Ports:
    """The ports `tokenwire serve` printed on its stdout, read up to its "serving on" line (all 0
    when it exited before serving)."""
    assert process.stdout is not None
    metrics = http = 0
    for line in process.stdout:
        if "metrics on" in line:
            metrics = int(line.rsplit(":", 1)[1].split("/", 1)[0])
        if "OpenAI-compatible API on" in line:
            http = int(line.rsplit(":", 1)[1].split("/", 1)[0])
        if "serving on" in line:
            return Ports(int(line.rsplit(":", 1)[1]), metrics, http)
    return Ports(0)


def ended(process: subprocess.Popen[str], timeout: float = 30) -> None:
    """Stop a server process: SIGTERM (it drains), then SIGKILL if it is still there after `timeout`."""
    process.terminate()
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def greedy_token_ids(port: int, prompt: list[int], *, new_tokens: int, adapter: str = "") -> list[int]:
    """The served model's greedy tokens after the token ids `prompt` (end-of-sequence ignored, so
    exactly `new_tokens`), with `adapter` or the base model, through a plain Generate call."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        response = pb_grpc.InferenceServiceStub(channel).Generate(
            pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prompt),
                sampling=pb.SamplingParams(temperature=0.0),
                stopping=pb.StoppingCriteria(max_new_tokens=new_tokens, ignore_eos=True),
                adapter=adapter,
            ),
            timeout=120,
        )
    return list(response.token_ids)
