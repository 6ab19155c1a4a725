"""Speculative decoding on the real tiny models of both KV layouts: greedy outputs are the tokens
of speculation off, and sampled outputs keep the model's distribution.

The tiny models' weights are float, so a verified position's logits equal a one-token step's to
about 1e-5 (BENCHMARKS.md section 12, "Exactness"): the tokens must be identical and the
log-probabilities equal to that rounding. (The default int4 model is not exact in that sense; it
has its own figures there.) Every test also checks that drafts were accepted, so it proves
something about verified runs and not only about plain decode steps.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np

from tests.support.real_engine import RealEngine
from tests.support.tiny_models import TinyModel
from tokenwire.server.engine.drafting import LookupSettings, propose_drafts
from tokenwire.server.engine.engine import EngineConfig
from tokenwire.server.engine.types import FinishReason, GenerationResult
from tokenwire.server.models.runner import ModelRunner
from tokenwire.server.sampling.params import SamplingParams
from tokenwire.server.sampling.sampler import sampling_distribution

LOGPROB_ROUNDING = 1e-4
PROMPTS = [
    [40, 41, 42, 43, 44, 45] * 5,
    [7, 8, 9] * 8,
    [100 + (i * 37) % 200 for i in range(24)] * 2,
    [300, 301] * 10,
    list(range(50, 70)) * 3,
]
COPYING = {"optimum": [300, 301] * 10, "genai": list(range(50, 70)) * 3}
"""Per layout, a prompt whose greedy output soon repeats itself: drafts are accepted early, so
endings can land inside accepted runs. (The models' weights are random: they do not copy their
prompt, but their outputs fall into loops.)"""


def engine(each_runner: TinyModel, *, speculative_tokens: int, max_batch: int = 4) -> RealEngine:
    return RealEngine(
        each_runner,
        EngineConfig(
            max_batch_size=4,
            prefix_cache_mb=0,
            speculative_tokens=speculative_tokens,
            speculative_max_batch=max_batch,
        ),
    )


def assert_same(got: GenerationResult, expected: GenerationResult) -> None:
    assert got.token_ids == expected.token_ids
    assert got.text == expected.text
    assert got.finish_reason is expected.finish_reason
    assert len(got.logprobs) == len(expected.logprobs) == len(got.token_ids)
    for mine, theirs in zip(got.logprobs, expected.logprobs, strict=True):
        assert mine.token_id == theirs.token_id
        assert math.isclose(mine.logprob, theirs.logprob, abs_tol=LOGPROB_ROUNDING)
        assert [t for t, _, _ in mine.top] == [t for t, _, _ in theirs.top]


def test_greedy_output_alone_is_the_output_of_speculation_off(each_runner: TinyModel) -> None:
    off = engine(each_runner, speculative_tokens=0)
    on = engine(each_runner, speculative_tokens=4)
    for prompt in PROMPTS:
        assert_same(on.generate(prompt, tokens=40), off.generate(prompt, tokens=40))
    assert on.engine.stats.accepted_draft_tokens > 0
    assert on.engine.stats.decode_steps < off.engine.stats.decode_steps


def test_greedy_output_in_a_busy_batch_is_the_output_of_speculation_off_alone(each_runner: TinyModel) -> None:
    off = engine(each_runner, speculative_tokens=0)
    expected = [off.generate(prompt, tokens=12 + 7 * i) for i, prompt in enumerate(PROMPTS)]
    on = engine(each_runner, speculative_tokens=4, max_batch=4)
    ids = [on.submit(prompt, tokens=12 + 7 * i) for i, prompt in enumerate(PROMPTS)]
    results = [on.result(request_id) for request_id in ids]
    for request_id, got, want in zip(ids, results, expected, strict=True):
        assert_same(got, want)
        assert on.streamed(request_id) == list(got.token_ids), "every token streamed once, in order"
    stats = on.engine.stats
    assert stats.accepted_draft_tokens > 0
    assert stats.decoded_rows > stats.decode_steps, "the verified steps held several rows"


def test_max_new_tokens_and_stop_strings_land_where_they_do_without_speculation(
    each_runner: TinyModel,
) -> None:
    off = engine(each_runner, speculative_tokens=0)
    on = engine(each_runner, speculative_tokens=4)
    prompt = COPYING[on.layout]
    for tokens in range(3, 24):
        assert_same(on.generate(prompt, tokens=tokens), off.generate(prompt, tokens=tokens))
    reference = off.generate(prompt, tokens=40)
    stops = 0
    for start in range(2, 20, 3):
        stop = on.tokenizer.decode(list(reference.token_ids[start : start + 2]))
        if not stop.strip():
            continue
        got = on.result(on.submit(prompt, tokens=40, stop=(stop,)))
        want = off.result(off.submit(prompt, tokens=40, stop=(stop,)))
        assert want.finish_reason is FinishReason.STOP
        assert_same(got, want)
        stops += 1
    assert stops >= 3
    assert on.engine.stats.accepted_draft_tokens > 0


def next_tokens(
    runner: ModelRunner, sequence: list[int], params: SamplingParams
) -> tuple[list[int], np.ndarray]:
    """The tokens sampling can pick after `sequence`, and their probabilities."""
    row = runner.prefill(0, sequence, start=0).copy()
    runner.release(0)
    candidates, weights = sampling_distribution(row, params)
    return [int(t) for t in candidates], weights / weights.sum()


def exact_joint(
    runner: ModelRunner, prompt: list[int], params: SamplingParams, length: int
) -> dict[tuple[int, ...], float]:
    """The probability of every sequence of `length` tokens the sampling can produce, from
    the model's logits one position at a time."""
    joint: dict[tuple[int, ...], float] = {}
    frontier: list[tuple[tuple[int, ...], float]] = [((), 1.0)]
    while frontier:
        prefix, mass = frontier.pop()
        candidates, probs = next_tokens(runner, [*prompt, *prefix], params)
        for token, p in zip(candidates, probs.tolist(), strict=True):
            sequence = (*prefix, token)
            if len(sequence) == length:
                joint[sequence] = mass * p
            else:
                frontier.append((sequence, mass * p))
    return joint


def acceptance(runner: ModelRunner, prompt: list[int], params: SamplingParams) -> float:
    """The chance that the second token sampled after `prompt` is an accepted draft."""
    chance = 0.0
    firsts, probs = next_tokens(runner, prompt, params)
    for first, p in zip(firsts, probs.tolist(), strict=True):
        draft = propose_drafts(prompt, [first], LookupSettings(max_tokens=1))
        if draft:
            following, following_probs = next_tokens(runner, [*prompt, first], params)
            if draft[0] in following:
                chance += p * float(following_probs[following.index(draft[0])])
    return chance


def prompt_with_drafts(runner: ModelRunner, params: SamplingParams) -> list[int]:
    """Of the prompts made of a prompt and the start of its greedy continuation (which falls into
    loops: the models' weights are random), the one whose second sampled token is most often an
    accepted draft."""
    candidates: list[list[int]] = []
    for prompt in PROMPTS[:4]:
        continuation = [*prompt]
        for _ in range(16):
            row = runner.prefill(0, continuation, start=0)
            continuation.append(int(row.argmax()))
            runner.release(0)
            if len(continuation) - len(prompt) >= 8:
                candidates.append(list(continuation))
    return max(candidates, key=lambda prompt: acceptance(runner, prompt, params))


def test_sampled_output_keeps_the_model_s_distribution(each_runner: TinyModel) -> None:
    params = SamplingParams(temperature=1.0, top_k=3)
    on = engine(each_runner, speculative_tokens=2, max_batch=4)
    prompt = prompt_with_drafts(on.runner, params)
    samples = 2000
    counts: Counter[tuple[int, ...]] = Counter()
    for batch in range(0, samples, 4):
        ids = [
            on.submit(prompt, tokens=3, sampling=SamplingParams(temperature=1.0, top_k=3, seed=seed))
            for seed in range(batch, batch + 4)
        ]
        for request_id in ids:
            counts[on.result(request_id).token_ids] += 1
    assert on.engine.stats.accepted_draft_tokens > 0
    assert on.engine.stats.draft_tokens > on.engine.stats.accepted_draft_tokens
    joint = exact_joint(on.runner, prompt, params, 3)
    assert set(counts) <= set(joint)
    distance = 0.5 * sum(abs(counts[s] / samples - p) for s, p in joint.items())
    # Bretagnolle-Huber-Carol: P(TV > e) <= 2^k exp(-2 N e^2). With k = 27 outcomes and N = 2000,
    # 0.1 is passed by chance with probability under 1e-8; the seeds are fixed besides.
    assert distance < 0.1, distance
