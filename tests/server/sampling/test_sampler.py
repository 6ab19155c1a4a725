"""Sampling transforms keep only the tokens they should, and seeds make draws reproducible."""

from __future__ import annotations

import numpy as np
import pytest

from tokenwire.server.sampling.logprobs import token_logprob
from tokenwire.server.sampling.params import SamplingParams
from tokenwire.server.sampling.sampler import SequenceSampler, pick_tokens

VOCAB = 1000


def logits_with_ranked_tokens(ranked: list[int], seed: int = 0) -> np.ndarray:
    """Random logits in [-5, 0) with `ranked` tokens on top, best first, 1.0 apart."""
    rng = np.random.default_rng(seed)
    logits = rng.uniform(-5.0, 0.0, VOCAB).astype(np.float32)
    for rank, token in enumerate(ranked):
        logits[token] = 10.0 - rank
    return logits


def draws(params: SamplingParams, logits: np.ndarray, n: int = 400) -> set[int]:
    sampler = SequenceSampler(params)
    return {sampler.pick(logits.copy()) for _ in range(n)}


def test_greedy_picks_the_argmax_for_every_row() -> None:
    rows = np.stack([logits_with_ranked_tokens([3]), logits_with_ranked_tokens([900])])
    samplers = [SequenceSampler(SamplingParams()), SequenceSampler(SamplingParams())]
    assert pick_tokens(rows, samplers) == [3, 900]


def test_top_k_keeps_only_the_k_most_likely() -> None:
    logits = logits_with_ranked_tokens([10, 20, 30, 40])
    assert draws(SamplingParams(temperature=5.0, top_k=3, seed=1), logits) == {10, 20, 30}


def test_top_p_keeps_the_smallest_set_reaching_the_mass() -> None:
    logits = np.full(VOCAB, -30.0, dtype=np.float32)
    logits[[1, 2, 3]] = np.log([0.5, 0.3, 0.2])
    assert draws(SamplingParams(temperature=1.0, top_p=0.75, seed=2), logits) == {1, 2}
    assert draws(SamplingParams(temperature=1.0, top_p=0.85, seed=2), logits) == {1, 2, 3}


def test_top_p_over_a_flat_distribution_falls_back_to_the_whole_vocabulary() -> None:
    logits = np.zeros(VOCAB, dtype=np.float32)
    # 256 candidates carry only ~26% of a flat distribution: top_p=0.9 needs ~900 tokens.
    assert len(draws(SamplingParams(temperature=1.0, top_p=0.9, seed=3), logits, n=3000)) > 400


def test_min_p_drops_tokens_far_below_the_best() -> None:
    logits = np.full(VOCAB, -30.0, dtype=np.float32)
    logits[[1, 2, 3]] = np.log([0.6, 0.3, 0.01])
    assert draws(SamplingParams(temperature=1.0, min_p=0.1, seed=4), logits) == {1, 2}


def test_repetition_penalty_demotes_seen_tokens() -> None:
    logits = logits_with_ranked_tokens([5, 6])
    sampler = SequenceSampler(SamplingParams(repetition_penalty=1.5), history=[5])
    assert sampler.pick(logits.copy()) == 6  # 10/1.5 < 9
    assert SequenceSampler(SamplingParams()).pick(logits.copy()) == 5


def test_same_seed_same_draws_whatever_else_is_in_the_batch() -> None:
    params = SamplingParams(temperature=1.0, top_k=50, seed=123)
    logits = logits_with_ranked_tokens(list(range(50)), seed=9)
    alone = SequenceSampler(params)
    expected = [pick_tokens(logits[np.newaxis].copy(), [alone])[0] for _ in range(30)]
    in_batch = SequenceSampler(params)
    neighbours = [SequenceSampler(SamplingParams(temperature=2.0, seed=s)) for s in range(3)]
    got = []
    for _ in range(30):
        rows = np.stack(
            [logits_with_ranked_tokens([7], seed=1), logits, logits, logits_with_ranked_tokens([8])]
        )
        got.append(pick_tokens(rows, [neighbours[0], in_batch, neighbours[1], neighbours[2]])[1])
    assert got == expected
    assert len(set(got)) > 1  # it really sampled


@pytest.mark.parametrize("top_n", [0, 1, 5])
def test_logprob_matches_log_softmax(top_n: int) -> None:
    logits = logits_with_ranked_tokens([4, 8, 15, 16, 23, 42])
    shifted = logits.astype(np.float64) - logits.max()
    log_softmax = shifted - np.log(np.exp(shifted).sum())
    found = token_logprob(logits, 15, top_n)
    assert found.logprob == pytest.approx(log_softmax[15], abs=1e-9)
    assert [t for t, _ in found.top] == [4, 8, 15, 16, 23][:top_n]
    assert [lp for _, lp in found.top] == pytest.approx([log_softmax[t] for t in [4, 8, 15, 16, 23][:top_n]])
