"""A model directory that names files outside itself or declares impossible sizes refuses to load,
with one line naming the file and the field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.support.serve_process import serve_refused
from tokenwire.server.models.loader import LoadSettings, ModelDirectoryError, load_model
from tokenwire.server.models.session import SessionSettings

SETTINGS = LoadSettings(max_batch_size=1, max_context_length=128, session=SessionSettings(device="cpu"))


def copy_with(
    source: Path, destination: Path, file: str, edit: dict[str, object], *, under: str = ""
) -> Path:
    shutil.copytree(source, destination)
    path = destination / file
    config = json.loads(path.read_text())
    target = config
    for key in filter(None, under.split(".")):
        target = target[key]
    target.update(edit)
    path.write_text(json.dumps(config))
    return destination


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("max_position_embeddings", -5),
        ("vocab_size", 0),
        ("n_positions", "2048"),
        ("num_hidden_layers", 1 << 40),
    ],
)
def test_an_impossible_size_in_config_json_is_refused_naming_file_and_field(
    tiny_model_dir: Path, tmp_path: Path, key: str, value: object
) -> None:
    model = copy_with(tiny_model_dir, tmp_path / "bad", "config.json", {key: value})
    with pytest.raises(ModelDirectoryError) as refused:
        load_model(model, SETTINGS)
    message = str(refused.value)
    assert message.startswith(f"{model.resolve() / 'config.json'}: {key}: must be a whole number")
    assert "\n" not in message


@pytest.mark.parametrize("filename", ["../outside.onnx", "/etc/hostname", "sub/../../outside.onnx"])
def test_a_decoder_file_outside_the_directory_is_never_opened(
    tiny_llama_dir: Path, tmp_path: Path, filename: str
) -> None:
    # A real model sits right outside: loading it would succeed if the path were followed.
    shutil.copy(tiny_llama_dir / "model.onnx", tmp_path / "outside.onnx")
    model = copy_with(
        tiny_llama_dir, tmp_path / "bad", "genai_config.json", {"filename": filename}, under="model.decoder"
    )
    with pytest.raises(ModelDirectoryError) as refused:
        load_model(model, SETTINGS)
    assert "genai_config.json: model.decoder.filename:" in str(refused.value)
    assert "is not a file inside the model directory" in str(refused.value)


def test_a_negative_context_length_in_genai_config_is_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model = copy_with(
        tiny_llama_dir, tmp_path / "bad", "genai_config.json", {"context_length": -1}, under="model"
    )
    with pytest.raises(
        ModelDirectoryError, match=r"genai_config.json: model.context_length: must be a whole"
    ):
        load_model(model, SETTINGS)


def test_serve_exits_with_one_line_naming_file_and_field(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = copy_with(tiny_model_dir, tmp_path / "bad", "config.json", {"max_position_embeddings": -5})
    finished = serve_refused(model)
    assert finished.returncode != 0
    errors = [line for line in finished.stderr.splitlines() if "max_position_embeddings" in line]
    assert len(errors) == 1, finished.stderr
    assert "config.json: max_position_embeddings: must be a whole number from 1 to" in errors[0]
    assert "serving on" not in finished.stdout
