"""logit_bias, presence and frequency penalties: exact changes to the logits, applied in the
documented order, to generated tokens only, and never dependent on the rest of the batch."""

from __future__ import annotations

import numpy as np

from tokenwire.server.model_tools.tiny_tokenizer import build_byte_level_tokenizer
from tokenwire.server.sampling.constraint import FormatCompiler, MaskWorkspace
from tokenwire.server.sampling.params import FormatKind, ResponseFormat, SamplingParams
from tokenwire.server.sampling.sampler import OutputCounts, SequenceSampler, pick_tokens
from tokenwire.server.text.tokenizer import Tokenizer

VOCAB = 1000


def logits_with_ranked_tokens(ranked: list[int], seed: int = 0) -> np.ndarray:
    """Random logits in [-5, 0) with `ranked` tokens on top, best first, 1.0 apart."""
    rng = np.random.default_rng(seed)
    logits = rng.uniform(-5.0, 0.0, VOCAB).astype(np.float32)
    for rank, token in enumerate(ranked):
        logits[token] = 10.0 - rank
    return logits


def test_a_bias_of_plus_100_forces_a_token_greedy_or_sampled() -> None:
    logits = logits_with_ranked_tokens([3, 4, 5])
    forced = 700  # one of the least likely tokens: about 15 below the best
    greedy = SequenceSampler(SamplingParams(logit_bias=((forced, 100.0),)))
    assert pick_tokens(logits[np.newaxis].copy(), [greedy]) == [forced]
    sampled = SequenceSampler(SamplingParams(temperature=1.5, seed=7, logit_bias=((forced, 100.0),)))
    assert {sampled.pick(logits.copy()) for _ in range(300)} == {forced}


def test_a_bias_of_minus_100_bans_a_token_greedy_or_sampled() -> None:
    logits = logits_with_ranked_tokens([3, 4])
    greedy = SequenceSampler(SamplingParams(logit_bias=((3, -100.0),)))
    assert pick_tokens(logits[np.newaxis].copy(), [greedy]) == [4]
    # Token 3 alone would carry ~73% of the mass between 3 and 4: without the ban it is drawn.
    params = SamplingParams(temperature=1.0, top_k=2, seed=11)
    assert 3 in {SequenceSampler(params).pick(logits.copy()) for _ in range(50)}
    banned = SequenceSampler(SamplingParams(temperature=1.0, top_k=2, seed=11, logit_bias=((3, -100.0),)))
    assert 3 not in {banned.pick(logits.copy()) for _ in range(300)}


def test_bias_adds_exactly_its_value_and_leaves_other_tokens_alone() -> None:
    logits = logits_with_ranked_tokens([1, 2])
    sampler = SequenceSampler(SamplingParams(logit_bias=((2, 0.75), (9, -3.5))))
    adjusted = logits.copy()
    sampler.adjust(adjusted)
    expected = logits.copy()
    expected[2] += np.float32(0.75)
    expected[9] += np.float32(-3.5)
    assert np.array_equal(adjusted, expected)


def test_penalties_subtract_presence_once_and_frequency_per_occurrence() -> None:
    logits = logits_with_ranked_tokens([5, 6, 7])
    sampler = SequenceSampler(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25))
    for token in (5, 7, 5, 5):
        sampler.observe(token)
    adjusted = logits.copy()
    sampler.adjust(adjusted)
    expected = logits.copy()
    expected[5] -= np.float32(0.5 + 3 * 0.25)
    expected[7] -= np.float32(0.5 + 1 * 0.25)
    assert np.array_equal(adjusted, expected)


def test_negative_penalties_raise_the_generated_tokens() -> None:
    logits = logits_with_ranked_tokens([5, 6])
    sampler = SequenceSampler(SamplingParams(presence_penalty=-1.5, frequency_penalty=-2.0))
    sampler.observe(6)
    adjusted = logits.copy()
    sampler.adjust(adjusted)
    assert adjusted[6] == logits[6] + np.float32(3.5)
    assert sampler.pick(logits.copy()) == 6  # 9 + 3.5 beats 10


def test_penalties_count_generated_tokens_only_not_the_prompt() -> None:
    logits = logits_with_ranked_tokens([5, 6])
    # The engine passes the prompt as history only for the repetition penalty; presence and
    # frequency look at what observe() reports, which is the output alone.
    prompt = [5, 6, 40]
    sampler = SequenceSampler(SamplingParams(presence_penalty=2.0, frequency_penalty=2.0), history=prompt)
    adjusted = logits.copy()
    sampler.adjust(adjusted)
    assert np.array_equal(adjusted, logits)
    assert sampler.pick(logits.copy()) == 5
    sampler.observe(5)
    assert sampler.pick(logits.copy()) == 6  # 10 - 4 < 9


def test_bias_and_penalties_apply_before_the_repetition_penalty() -> None:
    logits = np.zeros(VOCAB, dtype=np.float32)
    logits[8] = 4.0
    sampler = SequenceSampler(
        SamplingParams(repetition_penalty=2.0, presence_penalty=1.0, logit_bias=((8, 3.0),)), history=[8]
    )
    sampler.observe(8)
    sampler.adjust(logits)
    # (4 + 3 - 1) / 2 = 3; the other order, 4 / 2 + 3 - 1, would give 4.
    assert logits[8] == np.float32(3.0)


def test_bias_and_penalties_apply_before_temperature() -> None:
    # With temperature 0.01 a lead of 0.5 is decisive: the bias must shift the raw logit by 1.0,
    # not the scaled one by 1.0 (which would leave 3 ahead by 49).
    logits = logits_with_ranked_tokens([3])
    logits[4] = logits[3] - np.float32(0.5)
    sampler = SequenceSampler(SamplingParams(temperature=0.01, seed=3, logit_bias=((4, 1.0),)))
    assert {sampler.pick(logits.copy()) for _ in range(100)} == {4}


def test_a_format_mask_wins_over_a_plus_100_bias() -> None:
    tokenizer = Tokenizer(build_byte_level_tokenizer(300))
    eos = tokenizer.token_to_id("<|endoftext|>")
    assert eos is not None
    vocab = tokenizer.vocab_size
    compiler = FormatCompiler(tokenizer.to_json(), vocab_size=vocab, eos_token_ids={eos})
    allowed = tokenizer.encode("y", add_special_tokens=False)[0]
    other = tokenizer.encode("n", add_special_tokens=False)[0]
    constraint = compiler.compile(ResponseFormat(FormatKind.CHOICE, choices=("yes",))).constraint()
    logits = np.zeros((1, vocab), dtype=np.float32)
    sampler = SequenceSampler(SamplingParams(logit_bias=((other, 100.0),)), constraint=constraint)
    assert pick_tokens(logits, [sampler], MaskWorkspace(vocab, 1)) == [allowed]


def test_counts_keep_every_token_past_the_first_buffer() -> None:
    counts = OutputCounts()
    for token in [*range(40), *range(0, 40, 2)]:
        counts.add(token)
    assert counts.ids.tolist() == list(range(40))
    assert counts.counts.tolist() == [2.0 if t % 2 == 0 else 1.0 for t in range(40)]


def test_same_seed_same_tokens_alone_and_among_rows_with_other_controls() -> None:
    params = SamplingParams(
        temperature=1.0,
        top_k=50,
        seed=123,
        logit_bias=((3, 1.5), (20, -100.0)),
        presence_penalty=0.4,
        frequency_penalty=0.3,
    )
    base = logits_with_ranked_tokens(list(range(50)), seed=9)

    def run(samplers: list[SequenceSampler], row: int, steps: int = 40) -> list[int]:
        chosen = []
        for step in range(steps):
            rows = np.stack(
                [logits_with_ranked_tokens([r + step % 5], seed=step) for r in range(len(samplers))]
            )
            rows[row] = base
            tokens = pick_tokens(rows, samplers)
            for sampler, token in zip(samplers, tokens, strict=True):
                sampler.observe(token)
            chosen.append(tokens[row])
        return chosen

    alone = run([SequenceSampler(params)], 0)
    neighbours = [
        SequenceSampler(SamplingParams()),
        SequenceSampler(SamplingParams(logit_bias=((7, 100.0),))),
        SequenceSampler(SamplingParams(temperature=0.7, seed=5, frequency_penalty=2.0)),
        SequenceSampler(
            SamplingParams(temperature=1.3, seed=6, presence_penalty=-2.0, repetition_penalty=1.3)
        ),
    ]
    crowded = run([neighbours[0], neighbours[1], SequenceSampler(params), neighbours[2], neighbours[3]], 2)
    assert crowded == alone
    assert len(set(alone)) > 5  # it really sampled
    assert 20 not in alone  # and the ban held
