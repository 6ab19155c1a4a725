"""`tokenwire serve --model FILE.gguf`: the file is converted once into the user cache and served
under its own name; a file the converter refuses is one line and exit status 2, before any
server starts, with nothing left in the cache."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.server.model_tools.llama_reference import forward
from tests.server.model_tools.synthetic_gguf import SyntheticGguf
from tests.support.serve_process import start_serve
from tokenwire.client import AsyncClient, GenerateOptions, Sampling, Stopping
from tokenwire.server import cli
from tokenwire.server.model_tools.convert import ConversionError
from tokenwire.server.model_tools.pull import HOME_ENV, converted_gguf


@pytest.fixture(autouse=True)
def _root_logging_restored() -> Iterator[None]:
    """`cli.main(["serve", ...])` in this process points the root logger at the sys.stderr of
    the moment, this test's capture, which is closed after it: the handlers go back as they
    were, so no later test's log line is written to a closed stream."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_a_gguf_file_is_converted_once_and_again_when_it_changes(
    tmp_path: Path, mixed_gguf: SyntheticGguf
) -> None:
    home = tmp_path / "home"
    own = tmp_path / "mine.gguf"
    shutil.copyfile(mixed_gguf.path, own)
    first = converted_gguf(own, home=home, progress=False)
    assert first.parent == home / "models" / "gguf" and first.name.startswith("mine-")
    assert (first / "genai_config.json").is_file()
    converted_at = (first / "genai_config.json").stat().st_mtime_ns
    assert converted_gguf(own, home=home, progress=False) == first
    assert (first / "genai_config.json").stat().st_mtime_ns == converted_at  # reused, not redone
    # The same path with other contents (a newer download in its place) is another conversion.
    os.utime(own, ns=(converted_at + 10**9, converted_at + 10**9))
    second = converted_gguf(own, home=home, progress=False)
    assert second != first and (second / "genai_config.json").is_file()
    assert sorted(p.name for p in (home / "models" / "gguf").iterdir()) == sorted([first.name, second.name])


def test_a_refused_gguf_file_leaves_nothing_in_the_cache(tmp_path: Path, mixed_gguf: SyntheticGguf) -> None:
    home = tmp_path / "home"
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(mixed_gguf.path.read_bytes()[:4096])
    with pytest.raises(ConversionError):
        converted_gguf(truncated, home=home, progress=False)
    assert list((home / "models" / "gguf").iterdir()) == []


def test_serve_refuses_a_broken_gguf_file_in_one_line_with_status_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(HOME_ENV, str(tmp_path / "home"))
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"NOPE" + bytes(64))
    status = cli.main(["serve", "--model", str(broken), "--port", "0", "--device", "cpu"])
    err = capsys.readouterr().err
    assert status == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert (
        lines[0]
        == "tokenwire serve: --model: broken.gguf is not a GGUF file: it starts with b'NOPE', not b'GGUF'"
    )
    assert list((tmp_path / "home" / "models" / "gguf").iterdir()) == []


def test_serve_names_a_model_that_is_neither_a_directory_nor_a_gguf_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0")
    assert cli.main(["serve", "--model", str(other), "--port", "0"]) == 2
    assert f"--model: {other} is neither a model directory nor a .gguf file" in capsys.readouterr().err


async def test_serve_converts_a_gguf_file_and_serves_it_under_the_files_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mixed_gguf: SyntheticGguf
) -> None:
    monkeypatch.setenv(HOME_ENV, str(tmp_path / "home"))
    own = tmp_path / "my-model.gguf"
    shutil.copyfile(mixed_gguf.path, own)
    served = await asyncio.to_thread(start_serve, "--model", str(own), "--no-metrics")
    try:
        async with AsyncClient(f"127.0.0.1:{served.port}", retries=False) as client:
            models = await client.list_models()
            options = GenerateOptions(
                model="my-model", sampling=Sampling(temperature=0.0), stopping=Stopping(4, ignore_eos=True)
            )
            result = await client.generate([1, 2, 3], options)
    finally:
        served.process.terminate()
        await asyncio.to_thread(served.process.wait, 60)
    assert [model.name for model in models] == ["my-model"]
    assert result.completion_tokens == 4
    # The tokens are the file's own: greedy decoding of its weights in numpy agrees.
    assert list(result.token_ids) == _reference_greedy(mixed_gguf, [1, 2, 3], 4)


def _reference_greedy(synthetic: SyntheticGguf, prompt: list[int], new_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(new_tokens):
        tokens.append(int(np.argmax(forward(synthetic.reference, tokens)[-1])))
    return tokens[len(prompt) :]
