"""Both runners: decoding inside a changing batch gives each sequence what it gets alone."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.support.tiny_models import TinyModel
from tokenwire.server.models.runner import ModelRunner
from tokenwire.server.models.shared_kv_runner import SharedKvRunner

PROMPTS = {1: [5, 6, 7, 8, 9], 2: [100, 200, 300], 3: list(range(20, 61)), 4: [77] * 13}

RunnerFactory = Callable[[], ModelRunner]


@pytest.fixture(params=["optimum", "optimum-without-position-ids", "genai-device", "genai-host"])
def make_runner(
    request: pytest.FixtureRequest,
    tiny_model_dir: Path,
    tiny_model_without_position_ids_dir: Path,
    tiny_llama_dir: Path,
) -> RunnerFactory:
    model = {
        "optimum": TinyModel(tiny_model_dir, "optimum"),
        "optimum-without-position-ids": TinyModel(tiny_model_without_position_ids_dir, "optimum"),
        "genai-device": TinyModel(tiny_llama_dir, "genai", "device"),
        "genai-host": TinyModel(tiny_llama_dir, "genai", "host"),
    }[request.param]
    return model.runner


def decode_alone(make_runner: RunnerFactory, prompt: list[int], steps: int) -> list[np.ndarray]:
    runner = make_runner()
    logits = [runner.prefill(1, prompt, start=0)]
    for _ in range(steps):
        token = int(logits[-1].argmax())
        logits.append(runner.decode([1], [token])[0].copy())
    return logits


def test_joining_and_leaving_sequences_do_not_change_anyone_s_logits(make_runner: RunnerFactory) -> None:
    alone = {seq: decode_alone(make_runner, prompt, 12) for seq, prompt in PROMPTS.items()}
    runner = make_runner()
    seen: dict[int, list[np.ndarray]] = {}
    schedule = {0: [1, 2], 3: [3], 5: [4]}  # which sequences join before which step
    leaves = {6: 2, 9: 1}  # which sequence leaves before which step
    live: list[int] = []
    for step in range(13):
        if step in leaves:
            runner.release(leaves[step])
            live.remove(leaves[step])
        for seq in schedule.get(step, []):
            prompt = PROMPTS[seq]
            # Prefill in two chunks, as the engine does for long prompts.
            runner.prefill(seq, prompt[:2], start=0)
            seen[seq] = [runner.prefill(seq, prompt[2:], start=2)]
            live.append(seq)
        order = list(reversed(live))  # rows in an order unlike the join order
        tokens = [int(seen[s][-1].argmax()) for s in order]
        logits = runner.decode(order, tokens)
        for row, seq in enumerate(order):
            seen[seq].append(logits[row].copy())
    for seq, got in seen.items():
        expected = alone[seq][: len(got)]
        for step, (a, b) in enumerate(zip(got[1:], expected[1:], strict=True), start=1):
            # Decode rows: the shared-buffer layout is bit-exact; left padding agrees to rounding.
            np.testing.assert_allclose(a, b, atol=1e-4, err_msg=f"sequence {seq} step {step}")
            assert int(a.argmax()) == int(b.argmax())


def test_shared_buffer_decode_rows_are_bit_identical_to_decoding_alone(each_kv_location: TinyModel) -> None:
    runner = each_kv_location.runner

    alone = {seq: decode_alone(runner, PROMPTS[seq], 8) for seq in (1, 2, 3)}
    batch = runner()
    logits = {seq: batch.prefill(seq, PROMPTS[seq], start=0) for seq in (1, 2, 3)}
    for step in range(1, 9):
        order = [3, 1, 2]
        out = batch.decode(order, [int(logits[s].argmax()) for s in order])
        for row, seq in enumerate(order):
            logits[seq] = out[row].copy()
            assert np.array_equal(logits[seq], alone[seq][step]), f"sequence {seq} step {step}"


def test_a_freed_slot_is_reused_and_the_cache_compacts(each_kv_location: TinyModel) -> None:
    runner = each_kv_location.runner()
    expected = decode_alone(each_kv_location.runner, PROMPTS[3], 6)
    for seq in (1, 2):
        runner.prefill(seq, PROMPTS[seq], start=0)
    logits = runner.prefill(3, PROMPTS[3], start=0)  # third slot
    runner.release(1)  # frees slot 0: the decode prefix would have a hole
    for step in range(1, 7):
        out = runner.decode([3, 2], [int(logits.argmax()), 7])
        logits = out[0].copy()
        assert np.array_equal(logits, expected[step])


def test_positions_past_a_sequence_s_length_are_never_read(each_kv_location: TinyModel) -> None:
    expected = decode_alone(each_kv_location.runner, PROMPTS[3], 6)
    runner = each_kv_location.runner()
    assert isinstance(runner, SharedKvRunner)
    # Every position of every slot made NaN first, as memory never cleared might hold: a read
    # past a row's length would turn its logits into NaN.
    store = runner.kv_store
    shape = store.geometry
    poison = np.full((shape.tensors, shape.kv_heads, shape.positions, shape.head_dim), np.nan, shape.dtype)
    for slot in range(shape.slots):
        store.write(slot, [poison])
    logits = runner.prefill(3, PROMPTS[3], start=0)
    runner.prefill(4, PROMPTS[4], start=0)  # a neighbour of another length
    assert np.array_equal(logits, expected[0])
    for step in range(1, 7):
        out = runner.decode([3, 4], [int(logits.argmax()), 7])
        logits = out[0].copy()
        assert np.array_equal(logits, expected[step]), f"step {step}"
