"""n completions on the real tiny models: a completion that copied its prompt's KV rows and
logits from the completion that prefilled it generates what a request of its own would have.

Greedy, every completion equals the n = 1 request (on the shared-buffer layout to the bit of its
log-probabilities); sampled, completion i equals an n = 1 request with the seed plus i, which is
the documented seed of completion i.
"""

from __future__ import annotations

from dataclasses import replace

from tests.support.real_engine import RealEngine, assert_same_output
from tests.support.tiny_models import TinyModel
from tokenwire.server.engine.engine import EngineConfig
from tokenwire.server.engine.types import GenerationResult, completion_seed
from tokenwire.server.sampling.params import SamplingParams

PROMPT = [(i * 37 + 11) % 400 + 40 for i in range(48)]
SAMPLED = SamplingParams(temperature=0.9, top_k=40, seed=2**64 - 2)


def engine(each_runner: TinyModel) -> RealEngine:
    return RealEngine(each_runner, EngineConfig(max_batch_size=4, prefix_cache_mb=0))


def as_choice(result: GenerationResult, index: int) -> GenerationResult:
    choice = result.choices[index]
    return replace(result, token_ids=choice.token_ids, logprobs=choice.logprobs, text=choice.text, choices=())


def test_greedy_completions_copied_from_one_prefill_equal_a_request_of_their_own(
    each_runner: TinyModel,
) -> None:
    alone = engine(each_runner)
    expected = alone.result(alone.submit(PROMPT, tokens=16))

    forked = engine(each_runner)
    result = forked.result(forked.submit(PROMPT, tokens=16, n=3))

    assert forked.engine.stats.prefill_tokens == len(PROMPT)
    assert forked.engine.stats.forked_prompt_tokens == 2 * len(PROMPT)
    for index in range(3):
        assert_same_output(as_choice(result, index), expected, forked.layout)
        assert result.choices[index].text == expected.text


def test_sampled_completion_i_equals_a_request_seeded_with_the_seed_plus_i(each_runner: TinyModel) -> None:
    forked = engine(each_runner)
    result = forked.result(forked.submit(PROMPT, tokens=16, n=3, sampling=SAMPLED))

    alone = engine(each_runner)
    for index in range(3):
        seeded = replace(SAMPLED, seed=completion_seed(SAMPLED.seed, index))
        expected = alone.result(alone.submit(PROMPT, tokens=16, sampling=seeded))
        assert_same_output(as_choice(result, index), expected, forked.layout)
    # The seeds differ, so (on this prompt) the completions do too: they are not copies.
    assert len({choice.token_ids for choice in result.choices}) > 1
