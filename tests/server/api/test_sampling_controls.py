"""logit_bias, presence_penalty and frequency_penalty on a real server, through the Python client.

Where a test needs to know what the model itself would have chosen, it asks the server for the
model's log-probabilities (which describe the model's distribution, before any of these controls)
and replays the documented arithmetic on them.
"""

from __future__ import annotations

from collections import Counter

import grpc
import pytest

from tests.support.events import Transcript, read_until
from tests.support.stepping import StepGate
from tokenwire.client import AsyncClient, Completed, GenerateOptions, Sampling, Stopping, TokenwireError
from tokenwire.server.app import TokenwireServer

PROMPT = "The capital of France is"


def options(
    tokens: int, *, logprobs: bool = False, top_logprobs: int = 0, **sampling: object
) -> GenerateOptions:
    chosen = Sampling(**{"temperature": 0.0, **sampling})  # type: ignore[arg-type]
    return GenerateOptions(
        sampling=chosen,
        stopping=Stopping(max_new_tokens=tokens, ignore_eos=True),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )


async def test_a_plus_100_bias_forces_a_token_and_logprobs_stay_the_models_own(client: AsyncClient) -> None:
    reference = await client.generate(PROMPT, options(1, logprobs=True, top_logprobs=5))
    (first,) = reference.logprobs
    runner_up, _, runner_up_logprob = first.top[1]
    assert runner_up != reference.token_ids[0]

    for sampling in ({}, {"temperature": 1.0, "seed": 7}):
        forced = await client.generate(
            PROMPT, options(6, logprobs=True, top_logprobs=5, logit_bias={runner_up: 100.0}, **sampling)
        )
        assert forced.token_ids == (runner_up,) * 6
        # The reported distribution is the model's: the forced token keeps its own log-probability
        # and the model's favourite stays on top.
        assert forced.logprobs[0].logprob == pytest.approx(runner_up_logprob, abs=1e-4)
        assert forced.logprobs[0].top[0][0] == reference.token_ids[0]


async def test_a_minus_100_bias_bans_tokens(client: AsyncClient) -> None:
    reference = await client.generate(PROMPT, options(8))
    banned = set(reference.token_ids)
    avoided = await client.generate(PROMPT, options(8, logit_bias=dict.fromkeys(banned, -100.0)))
    assert avoided.completion_tokens == 8
    assert not banned & set(avoided.token_ids)


async def prompt_ending_in_its_own_next_token(client: AsyncClient) -> tuple[list[int], int]:
    """Token ids whose greedy continuation starts with their own last token, and that token."""
    for start in ([5, 6, 7], *([t, t + 1] for t in range(10, 400, 3))):
        first, second = (await client.generate(start, options(2))).token_ids
        if first == second:
            return [*start, first], first
    raise AssertionError("no start prompt repeats its first token on this model")


@pytest.mark.parametrize(("presence", "frequency"), [(2.0, 0.0), (0.0, 2.0), (0.5, 1.5), (-2.0, -1.0)])
async def test_each_greedy_token_is_the_best_after_subtracting_the_penalties_of_generated_tokens(
    client: AsyncClient, presence: float, frequency: float
) -> None:
    prompt, next_token = await prompt_ending_in_its_own_next_token(client)
    penalised = await client.generate(
        prompt,
        options(16, logprobs=True, top_logprobs=20, presence_penalty=presence, frequency_penalty=frequency),
    )
    # The model's favourite first token is already in the prompt: the prompt is not penalised.
    assert penalised.token_ids[0] == next_token
    counts: Counter[int] = Counter()
    left_the_models_favourite = 0
    for token, item in zip(penalised.token_ids, penalised.logprobs, strict=True):

        def adjusted(token_id: int, logprob: float) -> float:
            seen = counts[token_id]
            return logprob - (presence if seen else 0.0) - frequency * seen

        best = max(adjusted(t, lp) for t, _, lp in item.top)
        assert adjusted(token, item.logprob) >= best - 1e-3
        left_the_models_favourite += token != item.top[0][0]
        counts[token] += 1
    # The penalties did change what was chosen, so the check above was not vacuous.
    assert left_the_models_favourite > 0
    unpenalised = await client.generate(prompt, options(16))
    assert penalised.token_ids != unpenalised.token_ids


BAD_CONTROLS = [
    ("bias id at the vocabulary size", Sampling(logit_bias={512: 1.0}), ["sampling.logit_bias[512]"]),
    ("negative bias id", Sampling(logit_bias={-3: 1.0}), ["sampling.logit_bias[-3]"]),
    ("bias above 100", Sampling(logit_bias={9: 150.0}), ["sampling.logit_bias[9]"]),
    ("NaN bias", Sampling(logit_bias={9: float("nan")}), ["sampling.logit_bias[9]"]),
    ("301 biases", Sampling(logit_bias=dict.fromkeys(range(301), 1.0)), ["sampling.logit_bias"]),
    ("presence penalty above 2", Sampling(presence_penalty=2.5), ["sampling.presence_penalty"]),
    ("frequency penalty below -2", Sampling(frequency_penalty=-4.0), ["sampling.frequency_penalty"]),
    ("infinite frequency penalty", Sampling(frequency_penalty=float("inf")), ["sampling.frequency_penalty"]),
]


@pytest.mark.parametrize(
    ("sampling", "fields"), [c[1:] for c in BAD_CONTROLS], ids=[c[0] for c in BAD_CONTROLS]
)
async def test_a_bad_bias_or_penalty_is_invalid_argument_naming_its_field(
    client: AsyncClient, sampling: Sampling, fields: list[str]
) -> None:
    with pytest.raises(TokenwireError) as raised:
        await client.generate(PROMPT, GenerateOptions(sampling=sampling))
    assert raised.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in raised.value.field_violations] == fields
    assert all(v.description for v in raised.value.field_violations)


async def test_a_seeded_request_gets_the_same_tokens_alone_and_in_a_batch_with_other_controls(
    gated_server: TokenwireServer, gate: StepGate
) -> None:
    target = options(
        24,
        temperature=0.9,
        top_k=40,
        seed=1234,
        logit_bias={11: 4.0, 12: -100.0, 300: 2.5},
        presence_penalty=0.6,
        frequency_penalty=0.8,
    )
    neighbours = {
        "greedy": options(30),
        "forced": options(20, logit_bias={40: 100.0}),
        "repeats": options(28, temperature=1.2, seed=5, presence_penalty=-2.0, frequency_penalty=-2.0),
    }
    engine = gated_server.registry.default.engine
    async with AsyncClient(f"127.0.0.1:{gated_server.port}", retries=False) as client:
        gate.open()
        alone = await client.generate(PROMPT, target)
        gate.close()
        steps_before, rows_before = engine.stats.decode_steps, engine.stats.decoded_rows
        transcript = Transcript()
        async with client.open_stream() as stream:
            for name, neighbour in neighbours.items():
                await stream.submit(name, "Hello, world!", neighbour)
            await stream.submit("target", PROMPT, target)
            events = stream.events()
            names = [*neighbours, "target"]
            # All four queued; one step lets the engine admit and prefill them together, so every
            # later step decodes them in one batch.
            await read_until(events, transcript, lambda t: all(t.events[n] for n in names))
            gate.allow(1)
            await read_until(events, transcript, lambda t: all(t.tokens(n) for n in names))
            gate.open()
            await read_until(events, transcript, lambda t: all(t.finished(n) for n in names))
            await stream.close_requests()
    assert all(isinstance(transcript.final(n), Completed) for n in names)
    assert transcript.tokens("target") == list(alone.token_ids)
    assert 12 not in alone.token_ids
    assert set(transcript.tokens("forced")) == {40}
    # More than two rows a step on average: they were decoded together, not one after another.
    assert engine.stats.decoded_rows - rows_before > 2 * (engine.stats.decode_steps - steps_before)
