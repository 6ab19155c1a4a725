"""A GGUF LoRA adapter made by llama.cpp's convert_lora_to_gguf.py, served by `tokenwire serve` on
a base GGUF file, gives the greedy tokens llama.cpp gives with that adapter on the same file.

The base is the llama family's tiny random model of benchmarks/gguf_families (transformers,
exported to F32 by llama.cpp's convert_hf_to_gguf.py); the adapters are PEFT's, made on that
model and converted by llama.cpp. tokenwire converts the base file with LoRA sites (every
projection, or `--lora-modules q_proj,v_proj` for an adapter on those) and reads the adapter
file itself; llama.cpp loads both files with its own code. Marked `llamacpp` (conftest.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import transformers

from tests.server.model_tools.hf_twins import make_peft_adapter
from tests.server.model_tools.llamacpp_tools import REPO, llamacpp_source, llamacpp_tools, repo_env
from tests.support.serve_process import ended, greedy_token_ids, start_serve
from tokenwire.server.model_tools.pull import HOME_ENV

pytestmark = [pytest.mark.llamacpp, pytest.mark.timeout(3600)]

STEPS = 32
FAMILIES = REPO / "benchmarks" / "gguf_families"
ADAPTERS = {
    # PEFT's default targets for this family, served on a graph with sites there only.
    "q_proj,v_proj": (
        {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        ("--lora-modules", "q_proj,v_proj"),
    ),
    # Every linear layer, on the default graph with sites on every projection.
    "all-linear": ({"r": 8, "lora_alpha": 16, "target_modules": "all-linear"}, ()),
}


@pytest.fixture(scope="module")
def tools() -> Path:
    return llamacpp_tools()


@pytest.fixture(scope="module")
def base(tools: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    """The llama family's tiny model directory (transformers' files and model-f32.gguf beside
    them) and the prompt, as benchmarks/gguf_families/run.py builds them."""
    work = tmp_path_factory.mktemp("families")
    subprocess.run(
        [
            sys.executable,
            str(FAMILIES / "run.py"),
            *("--hf-python", str(tools / "hfvenv" / "bin" / "python")),
            *("--llamacpp-python", str(tools / "venv" / "bin" / "python")),
            *("--llamacpp-source", str(llamacpp_source(tools))),
            *("--work", str(work), "--families", "llama", "--types", "F32", "--out", str(work / "rows.json")),
        ],
        check=True,
        env=repo_env(),
        timeout=1800,
    )
    model_dir = work / "llama"
    prompt: list[int] = json.loads((model_dir / "hf_result.json").read_text())["prompt"]
    return model_dir, prompt


def _gguf_adapter(tools: Path, model_dir: Path, work: Path, config: dict[str, Any]) -> Path:
    """A PEFT adapter with seeded random factors on `model_dir`'s model, converted by llama.cpp."""
    adapter = make_peft_adapter(
        lambda: transformers.AutoModelForCausalLM.from_pretrained(str(model_dir)),
        work / "peft",
        seed=10,
        **config,
    )
    converted = work / "adapter.gguf"
    subprocess.run(
        [
            sys.executable,
            "convert_lora_to_gguf.py",
            *("--base", str(model_dir), "--outtype", "f32", "--outfile", str(converted)),
            str(adapter),
        ],
        cwd=llamacpp_source(tools),
        check=True,
        capture_output=True,
        timeout=600,
    )
    return converted


def _llamacpp_greedy(
    tools: Path, gguf: Path, adapter: Path, prompt: list[int]
) -> dict[str, dict[str, list[Any]]]:
    result = subprocess.run(
        [
            str(tools / "venv" / "bin" / "python"),
            str(FAMILIES / "llamacpp_lora_side.py"),
            *(str(gguf), str(adapter), json.dumps(prompt), str(STEPS)),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    answer: dict[str, dict[str, list[Any]]] = json.loads(result.stdout.strip().splitlines()[-1])
    return answer


@pytest.mark.parametrize("targets", list(ADAPTERS))
def test_a_gguf_adapter_gives_llama_cpp_s_tokens_on_the_same_base_file(
    targets: str,
    tools: Path,
    base: tuple[Path, list[int]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model_dir, prompt = base
    config, flags = ADAPTERS[targets]
    adapter = _gguf_adapter(tools, model_dir, tmp_path, config)
    gguf = model_dir / "model-f32.gguf"
    theirs = _llamacpp_greedy(tools, gguf, adapter, prompt)
    # The adapter matters: without it llama.cpp generates something else, so equal tokens below
    # are the adapter's, not the base model's.
    assert theirs["adapter"]["tokens"] != theirs["base"]["tokens"]

    monkeypatch.setenv(HOME_ENV, str(tmp_path / "home"))  # the served child converts into it
    served = start_serve("--model", str(gguf), "--lora", f"a={adapter}", "--no-metrics", *flags)
    try:
        ours = {
            "adapter": greedy_token_ids(served.port, prompt, new_tokens=STEPS, adapter="a"),
            "base": greedy_token_ids(served.port, prompt, new_tokens=STEPS),
        }
    finally:
        ended(served.process)
    assert ours["base"] == theirs["base"]["tokens"]
    assert ours["adapter"] == theirs["adapter"]["tokens"]
