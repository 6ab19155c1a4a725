"""`--lora-modules`: which projections a graph converted for `--lora` gets LoRA sites on.

Names are PEFT's (`q_proj`, or `self_attn.q_proj`), checked against the model's family before any
conversion; the synthetic GGUF converted with some of them has sites there only (and on the rest
of a fused group); each module set is its own cached conversion; and through `tokenwire serve`
an adapter on the chosen modules gives the all-projection graph's tokens, while one on a module
left out is refused naming --lora-modules.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import onnxruntime as ort
import pytest

from tests.server.model_tools.synthetic_gguf import SyntheticGguf
from tests.server.model_tools.synthetic_gguf_lora import write_gguf_lora
from tests.support.serve_process import ended, greedy_token_ids, serve_refused, start_serve
from tokenwire.server import cli
from tokenwire.server.config import ModelSource
from tokenwire.server.model_tools.convert import convert_gguf
from tokenwire.server.model_tools.convert.lora_graph import (
    PROJECTIONS,
    LoraOptions,
    lora_options_for,
    module_names,
)
from tokenwire.server.model_tools.pull import HOME_ENV, converted_gguf
from tokenwire.server.models.adapters import LoraLayout

Q_V = ("self_attn.q_proj", "self_attn.v_proj")
LLAMA_NAMES = "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"


def _sites(model_dir: Path) -> set[tuple[int, str]]:
    session = ort.InferenceSession(str(model_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    layout = LoraLayout.from_session(session)
    assert layout is not None, f"{model_dir} has no LoRA sites"
    return set(layout.sites)


def test_short_names_and_paths_below_a_layer_choose_the_same_modules() -> None:
    assert lora_options_for("llama", ["q_proj", "v_proj"]) == LoraOptions(Q_V)
    assert lora_options_for("llama", ["self_attn.v_proj", "q_proj", "v_proj"]) == LoraOptions(Q_V)
    assert lora_options_for("qwen3", ["down_proj"]) == LoraOptions(("mlp.down_proj",))
    # Naming every projection is the all-projection graph itself (and its cache).
    assert lora_options_for("llama", [p.rpartition(".")[2] for p in PROJECTIONS]) == LoraOptions()
    assert lora_options_for("llama", None) == LoraOptions()


def test_phi3_s_fused_checkpoint_names_stand_for_their_parts() -> None:
    assert lora_options_for("phi3", ["qkv_proj", "mlp.gate_up_proj"]) == LoraOptions(
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
    )
    assert "qkv_proj" not in module_names("llama")
    assert "gate_up_proj" in module_names("phi3")


@pytest.mark.parametrize(
    ("architecture", "name", "valid"),
    [
        ("llama", "qkv_proj", LLAMA_NAMES),
        ("qwen2", "self_attn.c_attn", LLAMA_NAMES),
        (
            "phi3",
            "attn_q",
            "qkv_proj, q_proj, k_proj, v_proj, o_proj, gate_up_proj, gate_proj, up_proj, down_proj",
        ),
    ],
)
def test_an_unknown_module_name_is_refused_with_the_family_s_names(
    architecture: str, name: str, valid: str
) -> None:
    with pytest.raises(ValueError, match="is not a projection") as refused:
        lora_options_for(architecture, ["q_proj", name])
    assert str(refused.value) == (
        f"{name!r} is not a projection of {architecture} models: name some of {valid} "
        "(or their paths below a layer, such as self_attn.q_proj)"
    )
    with pytest.raises(ValueError, match="names no module"):
        lora_options_for(architecture, [])


def test_a_gguf_converted_for_some_modules_has_sites_only_there(
    tmp_path: Path, mixed_gguf: SyntheticGguf
) -> None:
    model = convert_gguf(
        mixed_gguf.path, tmp_path / "qv", lora=lora_options_for("llama", ["q_proj", "v_proj"])
    )
    # Layer 0 mixes formats, so Q, K and V are separate MatMuls and only Q and V get sites; layer
    # 1 fuses them into one MatMul, whose group takes K's site along (it carries no adapter's delta).
    assert _sites(model) == {
        (0, "self_attn.q_proj"),
        (0, "self_attn.v_proj"),
        (1, "self_attn.q_proj"),
        (1, "self_attn.k_proj"),
        (1, "self_attn.v_proj"),
    }
    assert json.loads((model / "conversion.json").read_text())["lora_modules"] == list(Q_V)
    only_down = convert_gguf(
        mixed_gguf.path, tmp_path / "down", lora=lora_options_for("llama", ["down_proj"])
    )
    assert _sites(only_down) == {(0, "mlp.down_proj"), (1, "mlp.down_proj")}


def test_each_module_set_is_its_own_cached_conversion(tmp_path: Path, mixed_gguf: SyntheticGguf) -> None:
    home = tmp_path / "home"
    own = tmp_path / "mine.gguf"
    shutil.copyfile(mixed_gguf.path, own)
    plain = converted_gguf(own, home=home, progress=False)
    every = converted_gguf(own, home=home, progress=False, lora=LoraOptions())
    some = converted_gguf(own, home=home, progress=False, lora=LoraOptions(Q_V))
    assert len({plain, every, some}) == 3
    assert converted_gguf(own, home=home, progress=False, lora=LoraOptions(Q_V[::-1])) == some
    assert json.loads((every / "conversion.json").read_text())["lora_modules"] == "all"
    assert json.loads((some / "conversion.json").read_text())["lora_modules"] == list(Q_V)
    # The all-projection key is the one it was before modules could be chosen: old caches stay.
    found = own.resolve().stat()
    identity = f"{own.resolve()}\0{found.st_size}\0{found.st_mtime_ns}\0float32\0lora"
    assert every.name == f"mine-{hashlib.sha256(identity.encode()).hexdigest()[:16]}"


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache for the serving tests, so each module set is converted once."""
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, mixed_gguf: SyntheticGguf) -> dict[str, Path]:
    """GGUF adapters of the synthetic model: on Q and V only, and on Q and the FFN's down projection."""
    work = tmp_path_factory.mktemp("adapters")
    files = {"qv": ("attn_q", "attn_v"), "down": ("attn_q", "ffn_down")}
    for name, tensors in files.items():
        write_gguf_lora(
            work / f"{name}.gguf",
            mixed_gguf.reference,
            arch="llama",
            rank=4,
            alpha=8.0,
            seed=5,
            tensors=tensors,
        )
    return {name: work / f"{name}.gguf" for name in files}


@pytest.fixture
def in_home(home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(HOME_ENV, str(home))  # the served child processes inherit it
    return home


def test_an_adapter_on_the_chosen_modules_gives_the_all_projection_graph_s_tokens(
    in_home: Path, mixed_gguf: SyntheticGguf, adapters: dict[str, Path]
) -> None:
    prompts = [[5, 17, 99, 3], [200, 201, 7, 7, 31, 60]]
    tokens: dict[str, list[list[int]]] = {}
    for name, flags in (("qv", ("--lora-modules", "q_proj,v_proj")), ("all", ())):
        served = start_serve(
            "--model", str(mixed_gguf.path), "--lora", f"a={adapters['qv']}", "--no-metrics", *flags
        )
        try:
            tokens[name] = [
                greedy_token_ids(served.port, prompt, new_tokens=8, adapter="a") for prompt in prompts
            ]
            tokens[f"{name} base"] = [
                greedy_token_ids(served.port, prompt, new_tokens=8) for prompt in prompts
            ]
        finally:
            ended(served.process)
    # The extra sites of the all-projection graph carry a zero delta: the same greedy tokens.
    assert tokens["qv"] == tokens["all"]
    assert tokens["qv base"] == tokens["all base"]
    assert tokens["qv"] != tokens["qv base"]  # the adapter did change what was generated
    converted = sorted(p.name for p in (in_home / "models" / "gguf").iterdir())
    assert len(converted) == 2, converted  # one conversion per module set


def test_an_unknown_module_name_stops_serve_before_any_conversion(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mixed_gguf: SyntheticGguf, adapters: dict[str, Path]
) -> None:
    monkeypatch.setenv(HOME_ENV, str(tmp_path / "home"))
    finished = serve_refused(
        mixed_gguf.path, "--lora", f"a={adapters['qv']}", "--lora-modules", "q_proj,qproj"
    )
    assert finished.returncode == 2
    assert finished.stderr.splitlines() == [
        f"tokenwire serve: --lora-modules: 'qproj' is not a projection of llama models: name some of "
        f"{LLAMA_NAMES} (or their paths below a layer, such as self_attn.q_proj)"
    ]
    assert not (tmp_path / "home").exists()  # nothing was converted, nor even a cache made


def test_lora_modules_cannot_change_a_built_model_directory(
    tmp_path: Path, mixed_gguf: SyntheticGguf, adapters: dict[str, Path]
) -> None:
    every = convert_gguf(mixed_gguf.path, tmp_path / "every", lora=LoraOptions())
    finished = serve_refused(every, "--lora", f"a={adapters['qv']}", "--lora-modules", "q_proj,v_proj")
    assert finished.returncode == 2
    assert finished.stderr.splitlines() == [
        f"tokenwire serve: --lora-modules: {every} is a model directory, whose LoRA sites were chosen "
        "when it was built (sites: every projection); --lora-modules chooses them only for a GGUF "
        "--model or the default model: leave it out, or serve the GGUF file"
    ]
    # A directory converted for the very same modules is served as it is.
    some = convert_gguf(mixed_gguf.path, tmp_path / "some", lora=LoraOptions(Q_V))
    models = (ModelSource(some),)
    assert cli._servable(models, "float32", lora=True, modules=("v_proj", "self_attn.q_proj")) == models


def test_an_adapter_on_a_module_left_out_is_refused_naming_lora_modules(
    in_home: Path, mixed_gguf: SyntheticGguf, adapters: dict[str, Path]
) -> None:
    finished = serve_refused(
        mixed_gguf.path, "--lora", f"a={adapters['down']}", "--lora-modules", "q_proj,v_proj"
    )
    assert finished.returncode == 1, finished.stderr[-2000:]
    failures = [line for line in finished.stderr.splitlines() if "failed to load" in line]
    assert len(failures) == 1, finished.stderr[-2000:]
    assert failures[0].endswith(
        "adapter a: blk.0.ffn_down.weight adapts module mlp.down_proj, which this model's graph takes "
        "no adapter for (it adapts self_attn.k_proj, self_attn.q_proj, self_attn.v_proj); the model "
        "was converted with LoRA sites only for --lora-modules q_proj,v_proj: add down_proj to "
        "--lora-modules to serve this adapter"
    ), failures[0]
