"""Both runners: a sequence started from another's copied KV rows continues as if it had prefilled them."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.tiny_models import TinyModel
from tokenwire.server.models.runner import KvRowAccess, ModelRunner, ModelRunnerError

PROMPT = [(i * 37 + 11) % 500 for i in range(45)]
SHARED = 32  # the copied prefix; the rest (13 tokens) is prefilled
STEPS = 8


def load(model: TinyModel) -> ModelRunner:
    return model.runner(max_batch_size=4, max_context_length=128)


def rows_of(runner: ModelRunner) -> KvRowAccess:
    assert isinstance(runner, KvRowAccess)
    return runner


def greedy(runner: ModelRunner, seq: int, first: np.ndarray, steps: int) -> list[np.ndarray]:
    logits = [first.copy()]
    for _ in range(steps):
        logits.append(runner.decode([seq], [int(logits[-1].argmax())])[0].copy())
    return logits


def assert_same_logits(
    runner: ModelRunner, got: list[np.ndarray], expected: list[np.ndarray], label: str = ""
) -> None:
    """The shared-buffer layout is bit-exact; left padding (Optimum) agrees to rounding."""
    exact = runner.info.format == "genai"
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert int(a.argmax()) == int(b.argmax()), f"{label}step {step}"
        if exact:
            assert np.array_equal(a, b), f"{label}step {step}"
        else:
            np.testing.assert_allclose(a, b, atol=1e-4, err_msg=f"{label}step {step}")


def test_copied_prefix_rows_give_the_same_logits_as_prefilling_them(each_runner: TinyModel) -> None:
    alone = load(each_runner)
    expected = greedy(alone, 1, alone.prefill(1, PROMPT, start=0), STEPS)

    runner = load(each_runner)
    runner.prefill(1, PROMPT[:SHARED], start=0)
    # Two blocks, as the prefix cache hands them over.
    blocks = [rows_of(runner).read_kv(1, 0, 16), rows_of(runner).read_kv(1, 16, SHARED)]
    runner.release(1)
    assert rows_of(runner).start_from_kv(2, blocks) == SHARED
    got = greedy(runner, 2, runner.prefill(2, PROMPT[SHARED:], start=SHARED), STEPS)

    assert_same_logits(runner, got, expected)


def test_shared_buffer_rows_are_bit_exact_in_a_busy_batch(each_kv_location: TinyModel) -> None:
    alone = load(each_kv_location)
    expected = greedy(alone, 1, alone.prefill(1, PROMPT, start=0), STEPS)

    runner = load(each_kv_location)
    others = {
        7: runner.prefill(7, [3, 4, 5, 6, 7], start=0),
        8: runner.prefill(8, list(range(40, 90)), start=0),
    }
    runner.prefill(1, PROMPT, start=0)
    rows = rows_of(runner).read_kv(1, 0, SHARED)
    rows_of(runner).start_from_kv(2, [rows])
    logits = runner.prefill(2, PROMPT[SHARED:], start=SHARED)
    runner.release(1)  # the source goes away; its slot is compacted over
    got = [logits.copy()]
    for _ in range(STEPS):
        order = [8, 2, 7]
        tokens = [int(others[8].argmax()), int(got[-1].argmax()), int(others[7].argmax())]
        out = runner.decode(order, tokens)
        others = {8: out[0].copy(), 7: out[2].copy()}
        got.append(out[1].copy())
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert np.array_equal(a, b), f"step {step}"


def test_rows_past_what_a_sequence_processed_cannot_be_read(each_runner: TinyModel) -> None:
    runner = load(each_runner)
    runner.prefill(1, PROMPT[:10], start=0)
    with pytest.raises(ModelRunnerError, match=r"no .*KV rows"):
        rows_of(runner).read_kv(1, 0, 11)
    with pytest.raises(ModelRunnerError, match=r"no .*KV rows"):
        rows_of(runner).read_kv(5, 0, 1)


def test_kv_bytes_per_token_matches_the_rows_read(each_runner: TinyModel) -> None:
    runner = load(each_runner)
    runner.prefill(1, PROMPT[:10], start=0)
    rows = rows_of(runner).read_kv(1, 2, 9)
    assert rows.nbytes == 7 * rows_of(runner).kv_bytes_per_token()


def test_a_decoding_sequence_swapped_out_and_back_in_decodes_on_as_if_it_had_stayed(
    each_runner: TinyModel,
) -> None:
    alone = load(each_runner)
    expected = greedy(alone, 1, alone.prefill(1, PROMPT, start=0), 2 * STEPS)

    runner = load(each_runner)
    first = runner.prefill(1, PROMPT, start=0)
    runner.prefill(2, PROMPT[:20], start=0)  # a neighbour in the batch throughout
    got = [first.copy()]
    neighbour = 5
    for _ in range(STEPS):
        logits = runner.decode([1, 2], [int(got[-1].argmax()), neighbour])
        got.append(logits[0].copy())
    # Swapped out mid-decode: the prompt's rows and every decoded position's.
    rows = rows_of(runner).read_kv(1, 0, len(PROMPT) + STEPS)
    runner.release(1)
    runner.decode([2], [neighbour])
    # The runner's copy of the rows must outlive the caller's, which it drops at once.
    assert rows_of(runner).start_from_kv(1, [rows.copy()]) == len(PROMPT) + STEPS
    del rows
    for _ in range(STEPS):
        logits = runner.decode([2, 1], [neighbour, int(got[-1].argmax())])
        got.append(logits[1].copy())

    assert_same_logits(runner, got, expected)


def test_a_sequence_copied_slot_to_slot_continues_as_if_it_had_prefilled_the_rows(
    each_runner: TinyModel,
) -> None:
    alone = load(each_runner)
    expected = {
        1: greedy(alone, 1, alone.prefill(1, PROMPT[:SHARED], start=0), STEPS),
        2: greedy(alone, 2, alone.prefill(2, PROMPT, start=0), STEPS),
    }

    runner = load(each_runner)
    runner.prefill(7, [3, 4, 5, 6, 7], start=0)  # another slot in use
    logits = {1: runner.prefill(1, PROMPT[:SHARED], start=0).copy()}
    assert rows_of(runner).start_from_sequence(2, 1, SHARED) == SHARED
    logits[2] = runner.prefill(2, PROMPT[SHARED:], start=SHARED).copy()
    got = {seq: [logits[seq]] for seq in (1, 2)}
    # The source and its copy decode side by side: each as it would alone.
    for _ in range(STEPS):
        out = runner.decode([1, 2], [int(got[1][-1].argmax()), int(got[2][-1].argmax())])
        got[1].append(out[0].copy())
        got[2].append(out[1].copy())

    for seq in (1, 2):
        assert_same_logits(runner, got[seq], expected[seq], f"sequence {seq} ")


def test_a_slot_copy_of_rows_the_source_does_not_hold_is_refused(each_runner: TinyModel) -> None:
    runner = load(each_runner)
    runner.prefill(1, PROMPT[:10], start=0)
    with pytest.raises(ModelRunnerError, match=r"no .*KV rows"):
        rows_of(runner).start_from_sequence(2, 1, 11)
    with pytest.raises(ModelRunnerError, match=r"no .*KV rows"):
        rows_of(runner).start_from_sequence(2, 5, 1)
