"""Both runners: decoding inside a changing batch gives each sequence what it gets alone."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tokenwire.server.models.loader import LoadSettings, load_model
from tokenwire.server.models.runner import ModelRunner
from tokenwire.server.models.session import SessionSettings

PROMPTS = {1: [5, 6, 7, 8, 9], 2: [100, 200, 300], 3: list(range(20, 61)), 4: [77] * 13}

RunnerFactory = Callable[[], ModelRunner]


def settings() -> LoadSettings:
    return LoadSettings(
        max_batch_size=4, max_context_length=256, session=SessionSettings(device="cpu", intra_op_threads=1)
    )


@pytest.fixture(params=["optimum", "optimum-without-position-ids", "genai"])
def make_runner(
    request: pytest.FixtureRequest,
    tiny_model_dir: Path,
    tiny_model_without_position_ids_dir: Path,
    tiny_llama_dir: Path,
) -> RunnerFactory:
    model_dir = {
        "optimum": tiny_model_dir,
        "optimum-without-position-ids": tiny_model_without_position_ids_dir,
        "genai": tiny_llama_dir,
    }[request.param]

    def factory() -> ModelRunner:
        return load_model(model_dir, settings()).runner

    return factory


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


def test_shared_buffer_decode_rows_are_bit_identical_to_decoding_alone(tiny_llama_dir: Path) -> None:
    def runner() -> ModelRunner:
        return load_model(tiny_llama_dir, settings()).runner

    alone = {seq: decode_alone(runner, PROMPTS[seq], 8) for seq in (1, 2, 3)}
    batch = runner()
    logits = {seq: batch.prefill(seq, PROMPTS[seq], start=0) for seq in (1, 2, 3)}
    for step in range(1, 9):
        order = [3, 1, 2]
        out = batch.decode(order, [int(logits[s].argmax()) for s in order])
        for row, seq in enumerate(order):
            logits[seq] = out[row].copy()
            assert np.array_equal(logits[seq], alone[seq][step]), f"sequence {seq} step {step}"


def test_a_freed_slot_is_reused_and_the_cache_compacts(tiny_llama_dir: Path) -> None:
    runner = load_model(tiny_llama_dir, settings()).runner
    expected = decode_alone(lambda: load_model(tiny_llama_dir, settings()).runner, PROMPTS[3], 6)
    for seq in (1, 2):
        runner.prefill(seq, PROMPTS[seq], start=0)
    logits = runner.prefill(3, PROMPTS[3], start=0)  # third slot
    runner.release(1)  # frees slot 0: the decode prefix would have a hole
    for step in range(1, 7):
        out = runner.decode([3, 2], [int(logits.argmax()), 7])
        logits = out[0].copy()
        assert np.array_equal(logits, expected[step])
