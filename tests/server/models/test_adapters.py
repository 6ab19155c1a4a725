"""The adapter stacks a LoRA graph binds: slot 0 is no adapter, exactly; slots are rewritten in place.

Runs the tiny models built with LoRA sites straight through ONNX Runtime, with adapters made of
seeded random factors (the file readers are tested in tests/server/model_tools).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from tokenwire.server.model_tools.convert.llama_graph import GraphOptions, build_llama_graph, save_model
from tokenwire.server.model_tools.convert.lora_graph import LoraOptions
from tokenwire.server.model_tools.tiny_gpt import TinyGptConfig, create_tiny_gpt
from tokenwire.server.model_tools.tiny_llama import create_tiny_llama, tiny_llama_config, tiny_llama_weights
from tokenwire.server.models.adapters import (
    LORA_INDEX,
    NO_ADAPTER,
    AdapterError,
    AdapterStacks,
    LoraAdapter,
    LoraFactor,
    LoraLayout,
    fit_adapter,
)

PROMPT = [5, 77, 300, 12, 9, 400, 31]


def _session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Per layout: the plain model.onnx and the same weights with LoRA sites on every projection."""
    work = tmp_path_factory.mktemp("adapters")
    return {
        "genai": (
            create_tiny_llama(work / "llama") / "model.onnx",
            create_tiny_llama(work / "llama-lora", lora=LoraOptions()) / "model.onnx",
        ),
        "optimum": (
            create_tiny_gpt(work / "gpt", TinyGptConfig()) / "model.onnx",
            create_tiny_gpt(work / "gpt-lora", TinyGptConfig(), lora=LoraOptions()) / "model.onnx",
        ),
    }


def _feeds(session: ort.InferenceSession, tokens: list[int], rows: int = 1) -> dict[str, np.ndarray]:
    """A whole-prompt call for `rows` copies of `tokens`, with an empty cache."""
    feeds = {
        "input_ids": np.tile(np.asarray(tokens, dtype=np.int64), (rows, 1)),
        "attention_mask": np.ones((rows, len(tokens)), dtype=np.int64),
    }
    names = {i.name for i in session.get_inputs()}
    if "position_ids" in names:
        feeds["position_ids"] = np.tile(np.arange(len(tokens), dtype=np.int64), (rows, 1))
    for graph_input in session.get_inputs():
        if graph_input.name.startswith("past_key_values."):
            _, heads, _, head_dim = graph_input.shape
            dtype = np.float16 if graph_input.type == "tensor(float16)" else np.float32
            feeds[graph_input.name] = np.zeros((rows, heads, 0, head_dim), dtype=dtype)
    return feeds


def _run(
    session: ort.InferenceSession, tokens: list[int], stacks: AdapterStacks | None, slots: list[int]
) -> np.ndarray:
    binding = session.io_binding()
    for name, value in _feeds(session, tokens, len(slots)).items():
        binding.bind_cpu_input(name, value)
    for output in session.get_outputs():
        binding.bind_output(output.name)
    if stacks is not None:
        stacks.bind(binding)
        binding.bind_cpu_input(LORA_INDEX, np.asarray(slots, dtype=np.int64))
    session.run_with_iobinding(binding)
    logits: np.ndarray = binding.get_outputs()[0].numpy()
    return logits


def _random_adapter(
    layout: LoraLayout, name: str, *, rank: int, seed: int, modules: Callable[[str], bool] = lambda _: True
) -> LoraAdapter:
    rng = np.random.default_rng(seed)
    factors = []
    for site in layout.sites.values():
        if not modules(site.module):
            continue
        a = (rng.standard_normal((rank, site.in_features)) * 0.3).astype(np.float32)
        b = (rng.standard_normal((site.out_features, rank)) * 0.3).astype(np.float32)
        factors.append(
            LoraFactor(
                layer=site.layer,
                module=site.module,
                rank=rank,
                in_features=site.in_features,
                out_features=site.out_features,
                scale=2.0,
                label=f"{site.layer}.{site.module}",
                read=lambda a=a, b=b: (a, b),
            )
        )
    return fit_adapter(name, factors, layout, max_rank=8)


@pytest.mark.parametrize("kind", ["genai", "optimum"])
def test_a_row_without_an_adapter_gets_the_plain_graph_s_logits_exactly(models: dict, kind: str) -> None:
    plain_path, lora_path = models[kind]
    plain, lora = _session(plain_path), _session(lora_path)
    layout = LoraLayout.from_session(lora)
    assert layout is not None and LoraLayout.from_session(plain) is None
    stacks = AdapterStacks(layout, max_loras=2, max_rank=8)
    slot = stacks.load(_random_adapter(layout, "a", rank=4, seed=1))
    expected = _run(plain, PROMPT, None, [0])
    rows = _run(lora, PROMPT, stacks, [NO_ADAPTER, slot]) if kind == "optimum" else None
    alone = _run(lora, PROMPT, stacks, [NO_ADAPTER])
    np.testing.assert_array_equal(alone, expected)
    adapted = _run(lora, PROMPT, stacks, [slot])
    assert np.abs(adapted - expected).max() > 0.1
    if rows is not None:
        # Beside a row with an adapter, in one call (the Optimum layout batches prompts).
        np.testing.assert_array_equal(rows[0], expected[0])
        np.testing.assert_allclose(rows[1], adapted[0], atol=1e-5, rtol=0)


def test_loading_and_unloading_rewrite_a_slot_that_stays_bound(models: dict) -> None:
    plain_path, lora_path = models["optimum"]
    session = _session(lora_path)
    layout = LoraLayout.from_session(session)
    assert layout is not None
    stacks = AdapterStacks(layout, max_loras=1, max_rank=8)
    first, second = (_random_adapter(layout, name, rank=3, seed=seed) for name, seed in (("a", 2), ("b", 3)))
    binding = session.io_binding()
    for name, value in _feeds(session, PROMPT).items():
        binding.bind_cpu_input(name, value)
    for output in session.get_outputs():
        binding.bind_output(output.name)
    stacks.bind(binding)  # once: every later load and unload is seen through this binding
    binding.bind_cpu_input(LORA_INDEX, np.asarray([stacks.load(first)], dtype=np.int64))

    def run() -> np.ndarray:
        session.run_with_iobinding(binding)
        # A copy: the binding's outputs may reuse their memory on the next run.
        logits: np.ndarray = binding.get_outputs()[0].numpy().copy()
        return logits

    with_first = run()
    stacks.unload("a")
    np.testing.assert_array_equal(run(), _run(_session(plain_path), PROMPT, None, [0]))
    assert stacks.load(second) == 1  # the freed slot, rewritten in place
    with_second = run()
    fresh = AdapterStacks(layout, max_loras=1, max_rank=8)
    np.testing.assert_array_equal(with_second, _run(session, PROMPT, fresh, [fresh.load(second)]))
    assert np.abs(with_second - with_first).max() > 0.1


def test_the_stacks_hold_at_most_their_slots_and_rank(models: dict) -> None:
    layout = LoraLayout.from_session(_session(models["genai"][1]))
    assert layout is not None
    stacks = AdapterStacks(layout, max_loras=2, max_rank=4)
    assert stacks.nbytes == 3 * layout.slot_bytes(4)
    assert [stacks.load(_random_adapter(layout, name, rank=2, seed=5)) for name in ("a", "b")] == [1, 2]
    with pytest.raises(AdapterError, match=r"^adapter c: all 2 adapter slots are in use"):
        stacks.load(_random_adapter(layout, "c", rank=2, seed=6))
    with pytest.raises(AdapterError, match=r"^adapter a: is already loaded$"):
        stacks.load(_random_adapter(layout, "a", rank=2, seed=6))
    stacks.unload("a")
    with pytest.raises(AdapterError, match=r"^adapter d: has rank 5, over the maximum LoRA rank 4$"):
        stacks.load(_random_adapter(layout, "d", rank=5, seed=7))
    assert stacks.names == ("b",) and stacks.slot("b") == 2
    assert stacks.load(_random_adapter(layout, "e", rank=4, seed=8)) == 1


def _factor(module: str, rank: int, cols: int, out: int, layer: int = 0, scale: float = 1.0) -> LoraFactor:
    rng = np.random.default_rng(rank * 100 + out)
    a = rng.standard_normal((rank, cols)).astype(np.float32)
    b = rng.standard_normal((out, rank)).astype(np.float32)
    return LoraFactor(layer, module, rank, cols, out, scale, f"module {module}", lambda: (a, b))


def test_a_fused_module_s_update_is_split_across_the_graph_s_sites(models: dict) -> None:
    layout = LoraLayout.from_session(_session(models["genai"][1]))
    assert layout is not None
    fused = _factor("self_attn.qkv_proj", 3, 64, 64 + 32 + 32, scale=0.5)
    fitted = fit_adapter("phi", [fused], layout, max_rank=8)
    a, b = fused.read()
    parts = {m: fitted.updates[(0, f"self_attn.{m}_proj")] for m in "qkv"}
    np.testing.assert_array_equal(parts["q"].a, a.T)
    np.testing.assert_array_equal(np.concatenate([parts[m].b for m in "qkv"], axis=1), 0.5 * b.T)
    assert [parts[m].b.shape for m in "qkv"] == [(3, 64), (3, 32), (3, 32)]


@pytest.mark.parametrize(
    ("factors", "message"),
    [
        ([], r"^adapter x: holds no LoRA weights$"),
        (
            [_factor("self_attn.rotary", 2, 64, 64)],
            r"^adapter x: module self_attn.rotary adapts module self_attn.rotary, which this model's graph "
            r"takes no adapter for \(it adapts mlp.down_proj, .*self_attn.v_proj\)$",
        ),
        (
            [_factor("self_attn.q_proj", 2, 64, 64, layer=2)],
            r"^adapter x: module self_attn.q_proj is for layer 2, but the model has 2 layers",
        ),
        (
            [_factor("mlp.up_proj", 2, 96, 192)],
            r"maps 96 to 192 features, but the model's layer 0 mlp.up_proj maps 64 to 192: the adapter "
            r"was made for another base model$",
        ),
        ([_factor("self_attn.q_proj", 9, 64, 64)], r"has rank 9, over the maximum LoRA rank 8$"),
        (
            [_factor("self_attn.qkv_proj", 2, 64, 128), _factor("self_attn.k_proj", 2, 64, 32)],
            r"^adapter x: module self_attn.qkv_proj and module self_attn.k_proj both adapt layer 0 "
            r"self_attn.k_proj$",
        ),
        (
            [
                LoraFactor(
                    0,
                    "self_attn.q_proj",
                    1,
                    64,
                    64,
                    1.0,
                    "q",
                    lambda: (np.full((1, 64), np.nan, np.float32), np.ones((64, 1), np.float32)),
                )
            ],
            r"^adapter x: q holds values that are not finite$",
        ),
    ],
)
def test_an_adapter_that_does_not_fit_is_refused_in_one_line(
    models: dict, factors: list, message: str
) -> None:
    layout = LoraLayout.from_session(_session(models["genai"][1]))
    assert layout is not None
    with pytest.raises(AdapterError, match=message) as refused:
        fit_adapter("x", factors, layout, max_rank=8)
    assert "\n" not in str(refused.value)


def test_a_float16_graph_takes_float16_stacks(models: dict, tmp_path: Path) -> None:
    config = tiny_llama_config()
    options = GraphOptions(dtype="float16", lora=LoraOptions(("self_attn.q_proj", "mlp.down_proj")))
    path = tmp_path / "fp16.onnx"
    save_model(build_llama_graph(config, tiny_llama_weights(config), options), path, external_data=False)
    half, full = _session(path), _session(models["genai"][1])
    half_layout, full_layout = LoraLayout.from_session(half), LoraLayout.from_session(full)
    assert half_layout is not None and full_layout is not None
    # Q comes with K and V: the graph computes the three in one fused MatMul.
    assert half_layout.dtype == np.float16
    assert half_layout.modules == (
        "mlp.down_proj",
        "self_attn.k_proj",
        "self_attn.q_proj",
        "self_attn.v_proj",
    )
    wanted = set(half_layout.modules)
    half_stacks = AdapterStacks(half_layout, max_loras=1, max_rank=4)
    full_stacks = AdapterStacks(full_layout, max_loras=1, max_rank=4)
    for stacks, layout in ((half_stacks, half_layout), (full_stacks, full_layout)):
        stacks.load(_random_adapter(layout, "a", rank=4, seed=9, modules=wanted.__contains__))
    adapted = _run(half, PROMPT, half_stacks, [1])
    # float16 keeps about 3 digits (test_llama_graph_matches_numpy.py allows 0.1 on these logits).
    np.testing.assert_allclose(adapted, _run(full, PROMPT, full_stacks, [1]), atol=0.1, rtol=0)
    assert np.abs(adapted - _run(half, PROMPT, half_stacks, [0])).max() > 0.5
