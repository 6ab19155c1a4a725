"""Both runners: several tokens appended to a row in one call, then rolled back, leave the sequence
decoding as if only the kept tokens had ever been appended.

Verified positions run through other kernels than a one-token step (a several-row product where
decode has one row), so their logits agree with one-token decode to float rounding, not bitwise;
BENCHMARKS.md ("Verifying drafts") gives the figures. The tests hold them to that rounding and to
the same greedy choice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, cast

import numpy as np
import pytest

from tests.support.tiny_models import TinyModel
from tokenwire.server.models.loader import LoadSettings, load_model
from tokenwire.server.models.runner import ModelRunner, ModelRunnerError, MultiTokenDecode

PROMPTS = {1: [5, 6, 7, 8, 9], 2: [100, 200, 300], 3: list(range(20, 61))}
ROUNDING = 1e-4


class VerifyingRunner(ModelRunner, MultiTokenDecode, Protocol):
    """A runner that decodes runs of tokens and rolls them back."""


RunnerFactory = Callable[[], VerifyingRunner]


def settings(model: TinyModel, max_context_length: int = 256) -> LoadSettings:
    return model.load_settings(max_batch_size=4, max_context_length=max_context_length)


@pytest.fixture
def make_runner(each_runner: TinyModel) -> RunnerFactory:
    def factory() -> VerifyingRunner:
        return verifying(load_model(each_runner.path, settings(each_runner)).runner)

    return factory


def plain(runner: ModelRunner, prompt: list[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy one-token decode: the tokens fed (the first is the prefill's pick) and the logits
    after each."""
    tokens = [int(runner.prefill(1, prompt, start=0).argmax())]
    logits: list[np.ndarray] = []
    for _ in range(steps):
        logits.append(runner.decode([1], [tokens[-1]])[0].copy())
        tokens.append(int(logits[-1].argmax()))
    return tokens, logits


def assert_same(got: np.ndarray, expected: np.ndarray, what: str) -> None:
    np.testing.assert_allclose(got, expected, atol=ROUNDING, err_msg=what)
    assert int(got.argmax()) == int(expected.argmax()), what


def verifying(runner: ModelRunner, *, capable: bool = True) -> VerifyingRunner:
    assert isinstance(runner, MultiTokenDecode)
    assert runner.can_decode_runs == capable
    return cast(VerifyingRunner, runner)


def test_a_run_gives_the_logits_of_one_token_steps_at_every_position(make_runner: RunnerFactory) -> None:
    tokens, expected = plain(make_runner(), PROMPTS[3], 6)
    runner = make_runner()
    runner.prefill(1, PROMPTS[3], start=0)
    (logits,) = runner.decode_runs([1], [tokens[:6]])
    assert logits.shape == (6, expected[0].shape[0])
    for position in range(6):
        assert_same(logits[position], expected[position], f"position {position}")


def test_rejected_tokens_rolled_back_leave_no_trace(make_runner: RunnerFactory) -> None:
    tokens, expected = plain(make_runner(), PROMPTS[1], 10)
    runner = make_runner()
    runner.prefill(1, PROMPTS[1], start=0)
    # The right next token, then three wrong drafts: verify all four, keep the first.
    wrong = [(t + 1) % 500 for t in tokens[1:4]]
    (logits,) = runner.decode_runs([1], [[tokens[0], *wrong]])
    assert_same(logits[0], expected[0], "the kept position")
    runner.rollback(1, 3)
    for step in range(1, 10):
        got = runner.decode([1], [tokens[step]])[0]
        assert_same(got, expected[step], f"step {step} after the rollback")


def test_accepted_drafts_continue_and_the_next_run_starts_after_them(make_runner: RunnerFactory) -> None:
    tokens, expected = plain(make_runner(), PROMPTS[3], 12)
    runner = make_runner()
    runner.prefill(1, PROMPTS[3], start=0)
    position = 0
    # Runs of 4: the first three tokens kept, the fourth replaced by a wrong one and rolled back.
    while position + 4 <= 12:
        run = [*tokens[position : position + 3], (tokens[position + 3] + 7) % 500]
        (logits,) = runner.decode_runs([1], [run])
        for offset in range(3):
            assert_same(logits[offset], expected[position + offset], f"position {position + offset}")
        runner.rollback(1, 1)
        position += 3
    got = runner.decode([1], [tokens[position]])[0]
    assert_same(got, expected[position], "the one-token step after the runs")


def test_runs_of_different_lengths_share_a_call_and_each_row_gets_what_it_gets_alone(
    make_runner: RunnerFactory,
) -> None:
    alone = {seq: plain(make_runner(), prompt, 8) for seq, prompt in PROMPTS.items()}
    runner = make_runner()
    for seq, prompt in PROMPTS.items():
        runner.prefill(seq, prompt, start=0)
    done = {seq: 0 for seq in PROMPTS}
    lengths = {1: 1, 2: 3, 3: 5}
    keep = {1: 1, 2: 2, 3: 5}  # sequence 2 rolls one position back, the others none
    order = [3, 1, 2]
    runs = [alone[seq][0][: lengths[seq]] for seq in order]
    runs[order.index(2)] = [*runs[order.index(2)][:2], 499]
    for seq, logits in zip(order, runner.decode_runs(order, runs), strict=True):
        assert logits.shape[0] == lengths[seq]
        for position in range(keep[seq]):
            assert_same(logits[position], alone[seq][1][position], f"sequence {seq} position {position}")
        runner.rollback(seq, lengths[seq] - keep[seq])
        done[seq] = keep[seq]
    # Then one-token steps of the whole batch, each row where its own decode would be.
    for _ in range(3):
        tokens = [alone[seq][0][done[seq]] for seq in order]
        logits = runner.decode(order, tokens)
        for row, seq in enumerate(order):
            assert_same(logits[row], alone[seq][1][done[seq]], f"sequence {seq} step {done[seq]}")
            done[seq] += 1


def test_one_token_runs_are_a_decode_step(each_kv_location: TinyModel) -> None:
    # On the shared buffer, one-token rows take the batched decode call: bit-identical to it.
    decoded = each_kv_location.runner()
    verified = verifying(each_kv_location.runner())
    for target in (decoded, verified):
        for seq in (1, 2):
            target.prefill(seq, PROMPTS[seq], start=0)
    expected = decoded.decode([2, 1], [11, 12])
    got = verified.decode_runs([2, 1], [[11], [12]])
    for row in range(2):
        assert np.array_equal(got[row][0], expected[row])


def test_a_run_past_the_end_of_the_cache_is_refused_before_any_work(each_kv_location: TinyModel) -> None:
    runner = verifying(each_kv_location.runner(max_context_length=16))
    other = each_kv_location.runner(max_context_length=16)
    prompt = list(range(30, 42))  # 12 of 16 positions
    runner.prefill(1, prompt, start=0)
    other.prefill(1, prompt, start=0)
    with pytest.raises(ModelRunnerError, match="past the end"):
        runner.decode_runs([1], [[1, 2, 3, 4, 5]])
    # Nothing was appended: the sequence still decodes where it was.
    assert np.array_equal(runner.decode([1], [3])[0], other.decode([1], [3])[0])


def test_bad_runs_and_rollbacks_are_refused(make_runner: RunnerFactory) -> None:
    runner = make_runner()
    runner.prefill(1, PROMPTS[2], start=0)
    runner.decode([1], [4])
    with pytest.raises(ModelRunnerError):
        runner.decode_runs([1], [[]])
    with pytest.raises(ModelRunnerError):
        runner.decode_runs([1, 2], [[4]])
    with pytest.raises(ModelRunnerError):
        runner.rollback(1, len(PROMPTS[2]) + 2)
    with pytest.raises(ModelRunnerError):
        runner.rollback(7, 1)


def test_a_graph_without_position_ids_cannot_verify_and_says_so_at_load(
    tiny_model_without_position_ids_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="tokenwire.server.models.optimum_runner"):
        runner = verifying(TinyModel(tiny_model_without_position_ids_dir, "optimum").runner(), capable=False)
    lines = [r.getMessage() for r in caplog.records if "speculative decoding" in r.getMessage()]
    assert len(lines) == 1
    runner.prefill(1, PROMPTS[1], start=0)
    with pytest.raises(ModelRunnerError, match="cannot append several tokens"):
        runner.decode_runs([1], [[4, 5]])
    # One-token runs still work, and a rollback still lets the sequence continue exactly.
    fresh = TinyModel(tiny_model_without_position_ids_dir, "optimum").runner()
    tokens, expected = plain(fresh, PROMPTS[1], 4)
    runner.release(1)
    runner.prefill(1, PROMPTS[1], start=0)
    runner.decode_runs([1], [[tokens[0]]])
    runner.decode([1], [123])
    runner.rollback(1, 1)
    for step in range(1, 4):
        assert_same(runner.decode([1], [tokens[step]])[0], expected[step], f"step {step}")
