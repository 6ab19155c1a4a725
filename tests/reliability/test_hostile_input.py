"""Under the review's attacks on request heads (attack 1) and on chat templates (attack 4), another
caller's time to first token and the server's memory stay where they were.

A `tokenwire serve` process serves the tiny model with a trapdoor chat template
(tests/support/templates.py: ChatML unless a message names an attack), gRPC and HTTP, bearer
tokens on. A victim in a process of its own (ttft_client.py) asks for short generations one after
another and records each one's time to first token. Windows with no attack and windows with one
alternate, a few of each, so that whatever else loads the machine weighs on both alike; then

- the victim's p99 time to first token during the attacks is within twice its p99 without them
  (twice at least 10 ms: below that, a loaded two-core machine's scheduling alone moves it), and
  it saw no failure;
- the server's resident memory never rose more than 64 MiB above its level before the attacks;
- every attack got its documented refusal.

Attack 1 is what the review sent before any authentication: endless tiny headers on one
connection (40 MiB), a 24 MiB URL on two, 20 MiB of chunked trailers, a 150 MiB Content-Length,
and 50 connections trickling a head a byte at a time. Attack 4 is an authenticated caller whose
conversations spring the template's printf width, integer power, doubling and tower of powers,
over gRPC and HTTP. Attackers pause briefly between attempts: these are attacks of size, not
floods of connections.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from tests.reliability.measuring_process import MeasuringProcess
from tests.reliability.server_process import procfs_available, read_rss_bytes
from tests.server.openai_api.raw_http import exchange, request_now
from tests.support.serve_process import announced_ports, ended
from tests.support.templates import ATTACKS, TRAPDOOR, with_template
from tokenwire.v1 import inference_service_pb2 as pb
from tokenwire.v1 import inference_service_pb2_grpc as pb_grpc

pytestmark = pytest.mark.skipif(not procfs_available(), reason="reads RSS from /proc (Linux)")

VICTIM_TOKEN = "hostile-victim-Zr8"
ATTACKER_TOKEN = "hostile-attacker-Q2x"
MIB = 1 << 20
ROUNDS = 6
SLICE_SECONDS = 1.5
TTFT_FACTOR = 2.0
TTFT_FLOOR_SECONDS = 0.010
RSS_BOUND = 64 * MIB
PAUSE_SECONDS = 0.1
"""Between two attempts of one attacker."""


@dataclass
class Server:
    process: subprocess.Popen[str]
    port: int
    http_port: int

    def rss(self) -> int:
        return read_rss_bytes(self.process.pid)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("hostile")
    model = with_template(tiny_model_dir, root / "tiny", TRAPDOOR)
    log = (root / "server.log").open("w", encoding="utf-8")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tokenwire.server.cli",
            "serve",
            "--model",
            f"tiny={model}",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--http-port",
            "0",
            "--no-metrics",
            "--device",
            "cpu",
            "--intra-op-threads",
            "1",
            "--max-batch-size",
            "4",
            "--drain-timeout",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env={**os.environ, "TOKENWIRE_AUTH_TOKENS": f"{VICTIM_TOKEN},{ATTACKER_TOKEN}"},
    )
    log.close()
    ports = announced_ports(process)
    assert ports.grpc and ports.http, f"server exited with {process.poll()}"
    yield Server(process, ports.grpc, ports.http)
    ended(process)


class Victim(MeasuringProcess):
    """The victim's process (ttft_client.py): `start` and `stop` open and close its windows."""

    def __init__(self, target: str) -> None:
        super().__init__("tests.reliability.ttft_client", target, VICTIM_TOKEN)


@pytest.fixture(scope="module")
def victim(server: Server) -> Iterator[Victim]:
    client = Victim(f"127.0.0.1:{server.port}")
    yield client
    client.close()


def p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


@dataclass
class Outcomes:
    """What the attackers were answered: a count per answer."""

    counts: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, answer: str) -> None:
        with self.lock:
            self.counts[answer] = self.counts.get(answer, 0) + 1


Attacker = Callable[[Server, Outcomes], None]


def measured(
    server: Server, victim: Victim, attackers: list[Attacker]
) -> tuple[list[float], list[float], int, Outcomes]:
    """(first-token times without attacks, with them, the most RSS rose, what attackers got)."""
    outcomes = Outcomes()
    alone: list[float] = []
    attacked: list[float] = []
    failures: list[str] = []
    before = server.rss()
    peak = before
    for _ in range(ROUNDS):
        victim.command("start")
        time.sleep(SLICE_SECONDS)
        window = victim.command("stop")
        alone += window["ttfts"]
        failures += window["failures"]
        stop = threading.Event()

        def run(attacker: Attacker, stop: threading.Event = stop) -> None:
            while not stop.is_set():
                attacker(server, outcomes)
                stop.wait(PAUSE_SECONDS)

        threads = [threading.Thread(target=run, args=(attacker,), daemon=True) for attacker in attackers]
        victim.command("start")
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + SLICE_SECONDS
        while time.monotonic() < deadline:
            peak = max(peak, server.rss())
            time.sleep(0.02)
        window = victim.command("stop")
        stop.set()
        for thread in threads:
            thread.join(60)
            peak = max(peak, server.rss())
        attacked += window["ttfts"]
        failures += window["failures"]
    assert not failures, failures
    return alone, attacked, peak - before, outcomes


def check(name: str, alone: list[float], attacked: list[float], growth: int) -> None:
    print(
        f"\n{name}: victim p99 TTFT alone {p99(alone) * 1000:.1f} ms ({len(alone)} requests), "
        f"attacked {p99(attacked) * 1000:.1f} ms ({len(attacked)} requests); "
        f"server RSS +{growth / MIB:.1f} MiB"
    )
    assert alone and attacked, "the victim got no answer in a window"
    bound = TTFT_FACTOR * max(p99(alone), TTFT_FLOOR_SECONDS)
    assert p99(attacked) <= bound, (
        f"victim p99 TTFT {p99(attacked) * 1000:.1f} ms (bound {bound * 1000:.1f} ms)"
    )
    assert growth < RSS_BOUND, f"server RSS +{growth / MIB:.1f} MiB"


# -- attack 1: request heads -----------------------------------------------------------------------


def _answer(outcomes: Outcomes, port: int, chunks: Iterator[bytes]) -> None:
    # A small send buffer: the attacker offers its megabytes no faster than the server takes them,
    # so what it costs is what the server reads, not the copies into a buffer nobody reads.
    reply = exchange(port, chunks, read_timeout=15.0, send_buffer=64 * 1024)
    outcomes.add(str(reply.status))


def endless_headers(server: Server, outcomes: Outcomes) -> None:
    def chunks() -> Iterator[bytes]:
        yield b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
        for _ in range(40 * MIB // 65536):
            yield b"a: b\r\n" * 10922

    _answer(outcomes, server.http_port, chunks())


def long_url(server: Server, outcomes: Outcomes) -> None:
    def chunks() -> Iterator[bytes]:
        yield b"GET /v1/models?q="
        for _ in range(24 * MIB // 65536):
            yield b"u" * 65536

    _answer(outcomes, server.http_port, chunks())


AUTHORIZED = b"authorization: Bearer " + ATTACKER_TOKEN.encode() + b"\r\n"
"""Trailers and bodies come after the headers: an attacker with a token reaches them (one
without is refused with 401 from its headers, and its body is never read)."""


def endless_trailers(server: Server, outcomes: Outcomes) -> None:
    body = b'{"prompt": "hi", "max_tokens": 1}'

    def chunks() -> Iterator[bytes]:
        yield (
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + AUTHORIZED
            + b"transfer-encoding: chunked\r\n\r\n%x\r\n" % len(body)
            + body
            + b"\r\n0\r\n"
        )
        for _ in range(20 * MIB // 65536):
            yield b"t: v\r\n" * 10922

    _answer(outcomes, server.http_port, chunks())


def huge_declared_body(server: Server, outcomes: Outcomes, *, token: bool = True) -> None:
    def chunks() -> Iterator[bytes]:
        yield (
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + (AUTHORIZED if token else b"")
            + b"content-length: %d\r\n\r\n" % (150 * MIB)
        )
        for _ in range(150 * MIB // 65536):
            yield b" " * 65536

    _answer(outcomes, server.http_port, chunks())


def trickled_heads(server: Server, outcomes: Outcomes) -> None:
    """50 connections sending a head a byte each 0.1 s, for about one slice; then they close."""
    connections = [socket.create_connection(("127.0.0.1", server.http_port)) for _ in range(50)]
    try:
        for connection in connections:
            connection.sendall(b"POST /v1/completions HTTP/1.1\r\n")
        for _ in range(int(SLICE_SECONDS / 0.1)):
            for connection in connections:
                with contextlib.suppress(OSError):
                    connection.sendall(b"x")
            time.sleep(0.1)
        outcomes.add("trickled")
    finally:
        for connection in connections:
            connection.close()


def unauthenticated_huge_body(server: Server, outcomes: Outcomes) -> None:
    huge_declared_body(server, outcomes, token=False)


HEAD_ATTACKS: list[Attacker] = [
    endless_headers,
    long_url,
    long_url,
    endless_trailers,
    huge_declared_body,
    unauthenticated_huge_body,
    trickled_heads,
]


def test_attacks_on_request_heads_leave_the_victim_and_memory_alone(server: Server, victim: Victim) -> None:
    alone, attacked, growth, outcomes = measured(server, victim, HEAD_ATTACKS)
    check("attack 1 (request heads)", alone, attacked, growth)
    answers = outcomes.counts
    assert set(answers) == {"431", "414", "413", "401", "trickled"}, answers


# -- attack 4: chat templates ----------------------------------------------------------------------

_SPRUNG = itertools.cycle(sorted(ATTACKS))
"""Which attack each attacker's next conversation springs (one at a time: no attacker floods)."""


def template_attack_over_grpc(server: Server, outcomes: Outcomes) -> None:
    message = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=next(_SPRUNG))])
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        try:
            pb_grpc.InferenceServiceStub(channel).Generate(
                message, metadata=(("authorization", f"Bearer {ATTACKER_TOKEN}"),), timeout=30
            )
            outcomes.add("served")
        except grpc.RpcError as error:
            outcomes.add(error.code().name)


def template_attack_over_http(server: Server, outcomes: Outcomes) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": next(_SPRUNG)}], "max_tokens": 2}).encode()
    reply = request_now(
        server.http_port,
        "POST",
        "/v1/chat/completions",
        body,
        {"authorization": f"Bearer {ATTACKER_TOKEN}"},
        timeout=30,
    )
    outcomes.add(f"http {reply.status}")


def test_attacks_in_a_chat_template_leave_the_victim_and_memory_alone(server: Server, victim: Victim) -> None:
    attackers: list[Attacker] = [template_attack_over_grpc, template_attack_over_http]
    alone, attacked, growth, outcomes = measured(server, victim, attackers)
    check("attack 4 (chat templates)", alone, attacked, growth)
    assert set(outcomes.counts) == {"INVALID_ARGUMENT", "http 400"}, outcomes.counts
