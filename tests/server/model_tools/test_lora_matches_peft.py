"""LoRA adapters made by PEFT give, through tokenwire's graphs, what transformers + PEFT give.

Each layout's tiny model (the Llama in the GenAI layout, the GPT in the Optimum layout, with and
without a position_ids input) is built with LoRA sites and has a transformers twin with the same
weights (hf_twins.py). Three adapters per layout, made and saved by PEFT with different ranks,
alphas, targets, rsLoRA and rank/alpha patterns, are read from their files into one set of slot
stacks. Each adapter's greedy tokens and log-probabilities are held to PEFT's, run alone and in
one batch that mixes the three adapters and the base model, prompts prefilled and then decoded.

Tolerances are the float models' own against their references: 2e-4 for the Llama graph
(test_llama_graph_matches_numpy.py), 1e-4 for the tiny GPT (test_tiny_gpt_matches_numpy.py).

One test (marked `llamacpp`, see conftest.py) has llama.cpp's own convert_lora_to_gguf.py turn
a PEFT adapter into a GGUF adapter and holds tokenwire's reading of that file to PEFT.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from tests.server.model_tools.hf_twins import (
    HfModel,
    greedy,
    hf_tiny_gpt,
    hf_tiny_llama,
    make_peft_adapter,
    peft_model,
)
from tests.server.model_tools.optimum_driver import OptimumDriver
from tests.server.model_tools.shared_buffer_driver import SharedBufferDriver
from tokenwire.server.model_tools.convert.lora_graph import LoraOptions
from tokenwire.server.model_tools.lora import AdapterBase, read_adapter
from tokenwire.server.model_tools.tiny_gpt import TinyGptConfig, create_tiny_gpt
from tokenwire.server.model_tools.tiny_llama import create_tiny_llama, tiny_llama_config
from tokenwire.server.models.adapters import NO_ADAPTER, AdapterStacks, LoraLayout

STEPS = 8
MAX_RANK = 8
GPT = TinyGptConfig()

LLAMA_ADAPTERS = (
    {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    {"r": 8, "lora_alpha": 16, "use_rslora": True, "target_modules": "all-linear"},
    {
        "r": 2,
        "lora_alpha": 4,
        "target_modules": ["k_proj", "o_proj", "gate_proj", "down_proj"],
        "rank_pattern": {"down_proj": 6},
        "alpha_pattern": {"o_proj": 5.0},
    },
)
GPT_ADAPTERS = (
    {"r": 4, "lora_alpha": 8, "target_modules": ["c_attn"], "fan_in_fan_out": True},
    {
        "r": 8,
        "lora_alpha": 16,
        "use_rslora": True,
        "target_modules": ["c_attn", "c_proj", "c_fc"],
        "fan_in_fan_out": True,
    },
    {
        "r": 2,
        "lora_alpha": 4,
        "target_modules": ["c_proj", "c_fc"],
        "rank_pattern": {"mlp.c_proj": 6},
        "alpha_pattern": {"attn.c_proj": 5.0},
        "fan_in_fan_out": True,  # GPT-2's Conv1D weights are [in, out]
    },
)


@dataclass
class Layout:
    name: str
    base: Callable[[], HfModel]
    model_dir: Path
    adapter_dirs: list[Path]
    prompts: list[list[int]]
    tolerance: float
    files: list[Path] | None = None
    """What tokenwire reads for each adapter; None: the PEFT directories themselves."""
    references: dict[tuple[int | None, int], tuple[list[int], np.ndarray]] = field(default_factory=dict)

    def reference(self, adapter: int | None, prompt: int) -> tuple[list[int], np.ndarray]:
        """PEFT's greedy run of `prompt` with adapter `adapter` (None: the base), computed once."""
        key = (adapter, prompt)
        if key not in self.references:
            directory = None if adapter is None else self.adapter_dirs[adapter]
            self.references[key] = greedy(peft_model(self.base, directory), self.prompts[prompt], STEPS)
        return self.references[key]


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, 512, size=n)] for n in lengths]


@pytest.fixture(scope="module", params=["genai", "optimum", "optimum-derived-positions"])
def layout(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Layout:
    work = tmp_path_factory.mktemp(request.param)
    if request.param == "genai":
        base: Callable[[], HfModel] = hf_tiny_llama
        model_dir = create_tiny_llama(work / "model", lora=LoraOptions())
        configs, tolerance, lengths = LLAMA_ADAPTERS, 2e-4, [5, 11, 8, 14]
    else:
        gpt = TinyGptConfig(position_ids=request.param == "optimum")
        model_dir = create_tiny_gpt(work / "model", gpt, lora=LoraOptions())
        configs, tolerance = GPT_ADAPTERS, 1e-4

        def base() -> HfModel:
            return hf_tiny_gpt(gpt)

        # Without position_ids, a padded row's positions would shift: rows of one length.
        lengths = [5, 11, 8, 14] if gpt.position_ids else [9, 9, 9, 9]
    adapter_dirs = [
        make_peft_adapter(base, work / f"adapter-{i}", seed=10 + i, **config)
        for i, config in enumerate(configs)
    ]
    return Layout(request.param, base, model_dir, adapter_dirs, _prompts(1, lengths), tolerance)


def _greedy_in_one_batch(layout: Layout, rows: list[int | None]) -> list[tuple[list[int], np.ndarray]]:
    """tokenwire's greedy runs of prompts 0..n-1, row i with adapter rows[i] (None: the base),
    all in one batch; the adapters are read from PEFT's files into fresh stacks."""
    config = tiny_llama_config()
    if layout.name == "genai":
        genai = SharedBufferDriver(layout.model_dir, slots=len(rows), max_len=64)
        session = genai.session
    else:
        optimum = OptimumDriver(layout.model_dir)
        session = optimum.session
    lora_layout = LoraLayout.from_session(session)
    assert lora_layout is not None
    stacks = AdapterStacks(lora_layout, max_loras=3, max_rank=MAX_RANK)
    base = AdapterBase(architecture=None, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads)
    slot_of = {
        i: stacks.load(read_adapter(path, lora_layout, base=base, max_rank=MAX_RANK, name=f"a{i}"))
        for i, path in enumerate(layout.files or layout.adapter_dirs)
    }
    slots = [NO_ADAPTER if adapter is None else slot_of[adapter] for adapter in rows]
    prompts = layout.prompts[: len(rows)]
    if layout.name == "genai":
        genai.adapters = stacks
        logits = np.stack(
            [
                genai.prefill(row, prompt, adapter=slot)[-1]
                for row, (prompt, slot) in enumerate(zip(prompts, slots, strict=True))
            ]
        )

        def step(tokens: list[int]) -> np.ndarray:
            return genai.decode(tokens, adapters=slots)
    else:
        optimum.adapters = stacks
        logits = optimum.prefill(prompts, slots)
        step = optimum.decode
    tokens: list[list[int]] = [[] for _ in rows]
    logprobs: list[list[np.ndarray]] = [[] for _ in rows]
    for _ in range(STEPS):
        for row in range(len(rows)):
            values = logits[row].astype(np.float64)
            shifted = values - values.max()
            logprobs[row].append(shifted - np.log(np.exp(shifted).sum()))
            tokens[row].append(int(values.argmax()))
        logits = step([t[-1] for t in tokens])
    return [(tokens[row], np.stack(logprobs[row])) for row in range(len(rows))]


def _assert_matches(
    layout: Layout, got: tuple[list[int], np.ndarray], adapter: int | None, prompt: int
) -> None:
    expected_tokens, expected_logprobs = layout.reference(adapter, prompt)
    what = f"{layout.name}, adapter {adapter}, prompt {prompt}"
    assert got[0] == expected_tokens, what
    np.testing.assert_allclose(got[1], expected_logprobs, atol=layout.tolerance, rtol=0, err_msg=what)


@pytest.mark.parametrize("adapter", [0, 1, 2])
def test_each_adapter_alone_gives_peft_s_greedy_tokens_and_logprobs(layout: Layout, adapter: int) -> None:
    (got,) = _greedy_in_one_batch(layout, [adapter])
    _assert_matches(layout, got, adapter, 0)
    # The comparison means something only if the adapter moves the model: its tokens or its
    # log-probabilities differ from the base model's by far more than the tolerance.
    base_tokens, base_logprobs = layout.reference(None, 0)
    assert got[0] != base_tokens or np.abs(got[1] - base_logprobs).max() > 0.05


def test_a_batch_mixing_three_adapters_and_the_base_gives_each_row_peft_s_result(layout: Layout) -> None:
    rows: list[int | None] = [2, None, 0, 1]
    results = _greedy_in_one_batch(layout, rows)
    for prompt, (adapter, got) in enumerate(zip(rows, results, strict=True)):
        _assert_matches(layout, got, adapter, prompt)


REPO = Path(__file__).resolve().parents[3]


@pytest.mark.llamacpp
@pytest.mark.timeout(1800)
def test_llama_cpp_s_converted_adapter_gives_peft_s_results(tmp_path: Path) -> None:
    # convert_lora_to_gguf.py writes one alpha and llama.cpp scales by alpha / r: adapters with
    # rsLoRA or per-module alphas do not survive it, so the plain adapter is the one converted.
    source = subprocess.run(
        ["bash", str(REPO / "scripts" / "llamacpp-tools"), "--source-only"],
        check=True,
        capture_output=True,
        text=True,
        timeout=1200,
    ).stdout.splitlines()[-1]
    base_dir = tmp_path / "hf-base"
    hf_tiny_llama().save_pretrained(str(base_dir))
    adapter = make_peft_adapter(hf_tiny_llama, tmp_path / "adapter", seed=10, **LLAMA_ADAPTERS[0])
    converted = tmp_path / "adapter.gguf"
    subprocess.run(
        [
            sys.executable,
            "convert_lora_to_gguf.py",
            *("--base", str(base_dir), "--outtype", "f32", "--outfile", str(converted)),
            str(adapter),
        ],
        cwd=source,
        check=True,
        capture_output=True,
        timeout=600,
    )
    model_dir = create_tiny_llama(tmp_path / "model", lora=LoraOptions())
    layout = Layout(
        "genai", hf_tiny_llama, model_dir, [adapter], _prompts(1, [5, 11]), 2e-4, files=[converted]
    )
    rows: list[int | None] = [0, None]
    for prompt, (row, got) in enumerate(zip(rows, _greedy_in_one_batch(layout, rows), strict=True)):
        _assert_matches(layout, got, row, prompt)
