"""deploy/haproxy/haproxy.cfg, run by the real HAProxy in front of three real replicas.

Streams, cancellation and health pass through the proxy: generations spread over the replicas,
one per GenerateStream call even when every call shares one client connection, a cancelled call
or generation stops within one decode step on the replica behind the proxy, and a replica that
reports NOT_SERVING is taken out by the proxy's gRPC health check. Behind HAProxy as a plain L4
(TCP) balancer, --max-connection-age moves one client's calls to another replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.events import Transcript, read_until
from tests.support.fleet import fleet, replica_host, replica_name
from tests.support.options import greedy
from tests.support.polling import wait_until
from tests.support.stepping import StepGate
from tokenwire.client import AsyncClient, Chunk, Completed, FinishReason, Queued, collect
from tokenwire.server.api.handlers import SERVICE_NAME
from tokenwire.server.app import TokenwireServer
from tokenwire.server.health import NOT_SERVING, SERVING

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "haproxy" / "haproxy.cfg"
CHECK_BOUND = 15.0
"""Seconds for the proxy's health checks (one a second) to see a change: far more than needed."""


@dataclass
class Proxy:
    port: int
    stats_socket: Path

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def server_states(self) -> dict[str, str]:
        """Each replica's state as the proxy sees it (UP or DOWN), from its stats socket."""
        with socket.socket(socket.AF_UNIX) as connection:
            connection.connect(str(self.stats_socket))
            connection.sendall(b"show stat\n")
            text = connection.makefile(encoding="utf-8").read()
        header, *rows = [line.split(",") for line in text.splitlines() if line]
        columns = {name.lstrip("# "): index for index, name in enumerate(header)}
        return {
            row[columns["svname"]]: row[columns["status"]]
            for row in rows
            if row[columns["pxname"]] == "tokenwire" and row[columns["svname"]] not in ("BACKEND",)
        }

    async def wait_for_states(self, wanted: dict[str, str]) -> None:
        await wait_until(
            lambda: all(self.server_states().get(k) == v for k, v in wanted.items()),
            timeout=CHECK_BOUND,
            what=f"the proxy to see {wanted}",
        )


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def haproxy(servers: list[TokenwireServer], workdir: Path, config: Path = CONFIG) -> Iterator[Proxy]:
    """Run HAProxy with `config` (the shipped one by default), plus a stats socket for the test to
    read states."""
    executable = shutil.which("haproxy")
    if executable is None:
        pytest.skip("`haproxy` is not on PATH: scripts/test installs it (scripts/test-packages.txt)")
    stats_socket = workdir / "haproxy.sock"
    extra = workdir / "stats.cfg"
    extra.write_text(f'global\n    stats socket "{stats_socket}" level user\n', encoding="utf-8")
    port = free_port()
    environment = {
        **os.environ,
        "TOKENWIRE_PROXY_BIND": f"127.0.0.1:{port}",
        **{
            f"TOKENWIRE_REPLICA_{index + 1}": f"{replica_host(index)}:{server.port}"
            for index, server in enumerate(servers)
        },
    }
    log = (workdir / "haproxy.log").open("w", encoding="utf-8")
    process = subprocess.Popen(
        [executable, "-W", "-db", "-f", str(config), "-f", str(extra)],
        env=environment,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    try:
        yield Proxy(port, stats_socket)
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.asynccontextmanager
async def proxied_fleet(
    model_dir: Path, workdir: Path, gate: StepGate | None = None
) -> AsyncIterator[tuple[list[TokenwireServer], Proxy]]:
    async with fleet(model_dir, gate=gate) as servers:
        with haproxy(servers, workdir) as proxy:
            await wait_until(
                lambda: proxy.stats_socket.exists(), timeout=CHECK_BOUND, what="HAProxy to start"
            )
            await proxy.wait_for_states({replica_name(i): "UP" for i in range(len(servers))})
            yield servers, proxy


def total(servers: list[TokenwireServer], counter: str) -> int:
    return sum(getattr(s.registry.default.engine.stats, counter) for s in servers)


async def test_streams_pass_through_the_proxy_to_every_replica(tiny_model_dir: Path, tmp_path: Path) -> None:
    async with (
        proxied_fleet(tiny_model_dir, tmp_path) as (_, proxy),
        AsyncClient(proxy.target, retries=False) as client,
    ):
        served: Counter[str] = Counter()
        for _ in range(9):
            generation = await collect(client.stream("Hi", greedy(6)))
            assert generation.completion_tokens == 6
            served[generation.model] += 1
        unary = await client.generate("Hi", greedy(6))
        # Several generations on one call: the call is one HTTP/2 stream, so one replica.
        async with client.open_stream() as stream:
            for request_id in ("a", "b", "c"):
                await stream.submit(request_id, "Hi", greedy(4))
            await stream.close_requests()
            multiplexed = [
                event.generation async for event in stream.events() if isinstance(event, Completed)
            ]
    assert set(served) == {"r1", "r2", "r3"}, served
    assert unary.completion_tokens == 6
    assert [g.completion_tokens for g in multiplexed] == [4, 4, 4]
    assert len({g.model for g in multiplexed}) == 1


async def test_concurrent_generate_stream_calls_on_one_connection_spread_over_every_replica(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # Nine generations in flight at once, each its own GenerateStream call, all on one client
    # channel (one HTTP/2 connection to the proxy). The gate holds every decode step, so all nine
    # are live together and leastconn sees each replica's count grow as it places them.
    gate = StepGate()
    async with (
        proxied_fleet(tiny_model_dir, tmp_path, gate) as (servers, proxy),
        AsyncClient(proxy.target, retries=False) as client,
    ):
        streams = [client.stream("Hi", greedy(4)) for _ in range(9)]
        for stream in streams:
            assert isinstance(await anext(stream), Queued)
        live = [server.registry.default.engine.live_count for server in servers]
        gate.open()
        generations = await asyncio.gather(*(collect(stream) for stream in streams))
    assert sum(live) == 9
    assert live == [3, 3, 3], live
    assert Counter(g.model for g in generations) == {"r1": 3, "r2": 3, "r3": 3}
    assert all(g.completion_tokens == 4 for g in generations)


async def test_a_generate_stream_call_cancelled_through_the_proxy_stops_within_one_step(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    gate = StepGate()
    async with proxied_fleet(tiny_model_dir, tmp_path, gate) as (servers, proxy):
        async with AsyncClient(proxy.target, retries=False) as client:
            gate.allow(2)
            tokens = 0
            async for event in client.stream("Abandoned", greedy(150)):
                tokens += len(event.token_ids) if isinstance(event, Chunk) else 0
                if tokens >= 2:
                    break  # leaving the loop cancels the call: RST_STREAM through the proxy
        await wait_until(
            lambda: total(servers, "abort_requests") == 1, what="the replica to hear of the cancelled call"
        )
        steps_at_cancel = total(servers, "decode_steps")
        gate.open()
        for server in servers:
            assert await server.registry.default.engine.wait_idle(5)
        assert total(servers, "aborted") == 1
        assert max(s.registry.default.engine.stats.max_abort_latency_steps for s in servers) <= 1
        assert total(servers, "orphaned_steps") == 0
        assert total(servers, "decode_steps") - steps_at_cancel <= 1


async def test_a_call_cancelled_through_the_proxy_stops_within_one_step(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    gate = StepGate()
    async with proxied_fleet(tiny_model_dir, tmp_path, gate) as (servers, proxy):
        transcript = Transcript()
        async with AsyncClient(proxy.target, retries=False) as client, client.open_stream() as stream:
            events = stream.events()
            await stream.submit("x", "Abandoned", greedy(150))
            await read_until(events, transcript, lambda t: bool(t.events["x"]))
            gate.allow(2)
            await read_until(events, transcript, lambda t: len(t.tokens("x")) >= 2)
            stream.cancel_all()  # RST_STREAM to the proxy, which resets its stream to the replica
        await wait_until(
            lambda: total(servers, "abort_requests") == 1, what="the replica to hear of the cancelled call"
        )
        steps_at_cancel = total(servers, "decode_steps")
        gate.open()
        for server in servers:
            assert await server.registry.default.engine.wait_idle(5)
        assert total(servers, "aborted") == 1
        assert max(s.registry.default.engine.stats.max_abort_latency_steps for s in servers) <= 1
        assert total(servers, "orphaned_steps") == 0
        assert total(servers, "decode_steps") - steps_at_cancel <= 1


async def test_a_generation_cancelled_by_message_through_the_proxy_stops_within_one_step(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    gate = StepGate()
    async with proxied_fleet(tiny_model_dir, tmp_path, gate) as (servers, proxy):
        transcript = Transcript()
        async with AsyncClient(proxy.target, retries=False) as client, client.open_stream() as stream:
            events = stream.events()
            await stream.submit("x", "Cancelled", greedy(150))
            await read_until(events, transcript, lambda t: bool(t.events["x"]))
            gate.allow(2)
            await read_until(events, transcript, lambda t: len(t.tokens("x")) >= 2)
            await stream.cancel("x")
            await wait_until(lambda: total(servers, "abort_requests") == 1, what="the cancel to arrive")
            gate.open()
            await read_until(events, transcript, lambda t: t.finished("x"))
            await stream.close_requests()
        final = transcript.final("x")
        assert isinstance(final, Completed) and final.generation.finish_reason is FinishReason.CANCELLED
        assert max(s.registry.default.engine.stats.max_abort_latency_steps for s in servers) <= 1
        assert total(servers, "orphaned_steps") == 0


async def test_the_proxy_health_check_takes_a_not_serving_replica_out_and_back(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    async with proxied_fleet(tiny_model_dir, tmp_path) as (servers, proxy):
        async with grpc.aio.insecure_channel(proxy.target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            answer = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
            assert answer.status == SERVING  # clients can ask health through the proxy too

        # What loading, draining or a queue above the high watermark report.
        await servers[1].health.servicer.set(SERVICE_NAME, NOT_SERVING)
        await proxy.wait_for_states({"r1": "UP", "r2": "DOWN", "r3": "UP"})
        async with AsyncClient(proxy.target, retries=False) as client:
            results = await asyncio.gather(*(client.generate("Hi", greedy(2)) for _ in range(9)))
            served_while_out = Counter(result.model for result in results)
            await servers[1].health.servicer.set(SERVICE_NAME, SERVING)
            await proxy.wait_for_states({"r2": "UP"})
            served_after: Counter[str] = Counter()
            for _ in range(9):
                served_after[(await client.generate("Hi", greedy(2))).model] += 1
    assert served_while_out["r2"] == 0 and sum(served_while_out.values()) == 9, served_while_out
    assert served_after["r2"] >= 1, served_after


L4_CONFIG = """
defaults
    mode tcp
    timeout connect 5s
    timeout client 1h
    timeout server 1h
frontend l4
    bind "${TOKENWIRE_PROXY_BIND}"
    default_backend tokenwire
backend tokenwire
    balance roundrobin
    server r1 "${TOKENWIRE_REPLICA_1}"
    server r2 "${TOKENWIRE_REPLICA_2}"
    server r3 "${TOKENWIRE_REPLICA_3}"
"""
"""HAProxy as an L4 balancer (as kube-proxy is for a ClusterIP Service): it places connections,
never looking inside them, so one client channel's calls all go where its connection went."""


async def test_behind_an_l4_balancer_an_aged_connection_brings_the_client_to_another_replica(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = tmp_path / "l4.cfg"
    config.write_text(L4_CONFIG, encoding="utf-8")
    async with fleet(tiny_model_dir, max_connection_age=1.0) as servers:
        with haproxy(servers, tmp_path, config) as proxy:
            await wait_until(
                lambda: proxy.stats_socket.exists(), timeout=CHECK_BOUND, what="HAProxy to start"
            )
            async with AsyncClient(proxy.target, retries=False) as client:
                served = [(await client.generate("Hi", greedy(2))).model]
                loop = asyncio.get_running_loop()
                give_up = loop.time() + 30
                # One channel, one connection at a time: a second replica is reached only when the
                # first connection aged out and the client opened another.
                while len(set(served)) < 2:
                    assert loop.time() < give_up, f"every call stayed on {served[0]}"
                    await asyncio.sleep(0.1)
                    served.append((await client.generate("Hi", greedy(2))).model)
    assert set(served) <= {"r1", "r2", "r3"}
    assert served[0] != served[-1]
