"""n completions of one request on a real server, through the gRPC edge and the Python client.

Generate returns every completion in `choices`; StreamGenerate and GenerateStream tag each chunk
with its completion's index, and their `completed` event lists each completion's index and
finish reason. With a seed, completion i is the one completion of the same request with seed + i,
which is what the seeded tests compare against. A cancel of the request id ends all n.
"""

from __future__ import annotations

import asyncio
import io
import json

import grpc
import pytest

from tests.conftest import tiny_settings
from tests.support.events import Transcript, read_until
from tests.support.options import greedy
from tests.support.polling import wait_until
from tests.support.prometheus import scrape
from tests.support.servers import serving
from tests.support.stepping import StepGate
from tests.support.tiny_models import TinyModel
from tokenwire.client import (
    AsyncClient,
    Chunk,
    Client,
    Completed,
    CompletionChoice,
    FinishReason,
    GenerateOptions,
    Generation,
    Sampling,
    Stopping,
    TokenwireError,
    collect,
)
from tokenwire.server.app import TokenwireServer
from tokenwire.server.config import TelemetrySettings
from tokenwire.v1 import inference_service_pb2 as pb
from tokenwire.v1 import inference_service_pb2_grpc as pb_grpc

BY_MODEL = {"gen_ai_request_model": "tiny"}
PROMPT = "Streaming lets users"
TOKENS = 12


def sampled(seed: int | None, *, n: int = 1, tokens: int = TOKENS) -> GenerateOptions:
    return GenerateOptions(
        sampling=Sampling(temperature=1.5, top_k=50, seed=seed),
        stopping=Stopping(max_new_tokens=tokens, ignore_eos=True),
        n=n,
    )


def with_n(options: GenerateOptions, n: int) -> GenerateOptions:
    return GenerateOptions(sampling=options.sampling, stopping=options.stopping, n=n)


def by_index(chunks: list[Chunk]) -> dict[int, list[int]]:
    """Each completion's streamed tokens, in order."""
    tokens: dict[int, list[int]] = {}
    for chunk in chunks:
        tokens.setdefault(chunk.index, []).extend(chunk.token_ids)
    return tokens


def text_by_index(chunks: list[Chunk]) -> dict[int, str]:
    text: dict[int, str] = {}
    for chunk in chunks:
        text[chunk.index] = text.get(chunk.index, "") + chunk.text
    return text


def assert_summary_of(completed: Generation, unary: Generation) -> None:
    """A streamed `completed` event: each choice's index and finish reason, no outputs (the
    chunks carried them), and the unary result's counts."""
    assert [(c.index, c.finish_reason) for c in completed.choices] == [
        (c.index, c.finish_reason) for c in unary.choices
    ]
    assert all(c.text == "" and c.token_ids == () for c in completed.choices)
    assert completed.text == "" and completed.token_ids == ()
    assert completed.completion_tokens == unary.completion_tokens
    assert completed.prompt_tokens == unary.prompt_tokens


async def test_unary_n_returns_every_completion_and_counts_the_prompt_once(client: AsyncClient) -> None:
    one = await client.generate(PROMPT, greedy(TOKENS))
    three = await client.generate(PROMPT, with_n(greedy(TOKENS), 3))

    assert [c.index for c in three.choices] == [0, 1, 2]
    assert all(c.finish_reason is FinishReason.LENGTH for c in three.choices)
    assert three.finish_reason is FinishReason.LENGTH
    # The completions are in `choices`; the top-level outputs are left empty.
    assert three.text == "" and three.token_ids == () and three.logprobs == ()
    assert three.prompt_tokens == one.prompt_tokens
    assert three.completion_tokens == sum(len(c.token_ids) for c in three.choices) == 3 * TOKENS
    # Greedy completions all take the model's most likely token: each is the one of n = 1.
    for choice in three.choices:
        assert choice.token_ids == one.token_ids
        assert choice.text == one.text
    # n = 1 keeps its shape: the completion is the top level, no choices.
    assert one.choices == () and len(one.token_ids) == TOKENS


async def test_four_completions_prefill_their_prompt_once_wherever_the_kv_cache_lives(
    each_runner: TinyModel, every_log_line: io.StringIO
) -> None:
    telemetry = TelemetrySettings(metrics_port=0, metrics_cache_seconds=0)
    # The prefix cache off: the prompt is prefilled once because the completions copy it.
    settings = tiny_settings(
        each_runner.path, telemetry=telemetry, prefix_cache_mb=0, kv_cache=each_runner.kv_cache
    )
    async with serving(settings) as server, AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client:
        assert server.metrics_port
        one = await client.generate(PROMPT, greedy(TOKENS))
        before = (await scrape(server.metrics_port)).value(
            "tokenwire_engine_prefilled_tokens_total", **BY_MODEL
        )
        four = await client.generate(PROMPT, with_n(greedy(TOKENS), 4))
        after = (await scrape(server.metrics_port)).value(
            "tokenwire_engine_prefilled_tokens_total", **BY_MODEL
        )
        stats = server.registry.default.engine.stats

    assert before == one.prompt_tokens
    assert after - before == four.prompt_tokens == one.prompt_tokens
    assert stats.forked_prompt_tokens == 3 * one.prompt_tokens
    assert [choice.token_ids for choice in four.choices] == [one.token_ids] * 4
    assert "failed" not in every_log_line.getvalue(), "every copy of the prompt worked as it should"


async def test_with_a_seed_completion_i_equals_one_completion_with_seed_plus_i(client: AsyncClient) -> None:
    seed = 7
    three = await client.generate(PROMPT, sampled(seed, n=3))
    alone = [await client.generate(PROMPT, sampled(seed + i)) for i in range(3)]
    assert [c.token_ids for c in three.choices] == [a.token_ids for a in alone]
    assert [c.text for c in three.choices] == [a.text for a in alone]
    # Different seeds sample different completions (the same seed would give equal ones).
    assert len({c.token_ids for c in three.choices}) > 1


async def test_the_completion_seed_wraps_modulo_2_to_the_64(client: AsyncClient) -> None:
    top = 2**64 - 1
    two = await client.generate(PROMPT, sampled(top, n=2))
    assert two.choices[0].token_ids == (await client.generate(PROMPT, sampled(top))).token_ids
    assert two.choices[1].token_ids == (await client.generate(PROMPT, sampled(0))).token_ids


async def test_logprobs_come_with_each_completion(client: AsyncClient) -> None:
    options = GenerateOptions(
        sampling=Sampling(temperature=1.5, seed=3),
        stopping=Stopping(max_new_tokens=6, ignore_eos=True),
        logprobs=True,
        n=2,
    )
    two = await client.generate(PROMPT, options)
    for choice in two.choices:
        assert [lp.token_id for lp in choice.logprobs] == list(choice.token_ids)


async def test_stream_generate_chunks_carry_their_completion_s_index(client: AsyncClient) -> None:
    unary = await client.generate(PROMPT, sampled(11, n=3))
    transcript = Transcript()
    async with client.open_stream() as stream:
        await stream.submit("many", PROMPT, sampled(11, n=3))
        await stream.submit("single", PROMPT, sampled(11))
        await stream.close_requests()
        async for event in stream.events():
            transcript.add(event)

    chunks = transcript.chunks("many")
    assert {c.index for c in chunks} == {0, 1, 2}
    tokens = by_index(chunks)
    text = text_by_index(chunks)
    for choice in unary.choices:
        assert tokens[choice.index] == list(choice.token_ids)
        assert text[choice.index] == choice.text
    final = transcript.final("many")
    assert isinstance(final, Completed)
    assert_summary_of(final.generation, unary)
    # The request beside it, with n = 1, streams under index 0 and equals completion 0.
    assert {c.index for c in transcript.chunks("single")} == {0}
    assert transcript.tokens("single") == list(unary.choices[0].token_ids)


async def test_generate_stream_tags_chunks_and_collect_rebuilds_each_choice(client: AsyncClient) -> None:
    unary = await client.generate(PROMPT, sampled(5, n=2))
    events = [event async for event in client.stream(PROMPT, sampled(5, n=2), request_id="gs")]
    chunks = [e for e in events if isinstance(e, Chunk)]
    assert by_index(chunks) == {c.index: list(c.token_ids) for c in unary.choices}
    final = events[-1]
    assert isinstance(final, Completed)
    assert_summary_of(final.generation, unary)

    collected = await collect(client.stream(PROMPT, sampled(5, n=2)))
    assert collected.choices == unary.choices


async def test_the_sync_client_asks_for_n(server: TokenwireServer) -> None:
    def generate() -> tuple[Generation, Generation]:
        with Client(f"127.0.0.1:{server.port}", retries=False) as client:
            return client.generate(PROMPT, sampled(21, n=2)), client.generate(PROMPT, sampled(22))

    # The server runs on this event loop: the blocking client waits in a thread of its own.
    two, one = await asyncio.to_thread(generate)
    assert [c.index for c in two.choices] == [0, 1]
    assert all(isinstance(c, CompletionChoice) for c in two.choices)
    assert two.choices[1].token_ids == one.token_ids


@pytest.mark.parametrize("n", [-1, 17])
async def test_n_outside_1_to_16_is_invalid_argument_naming_n(client: AsyncClient, n: int) -> None:
    with pytest.raises(TokenwireError) as refused:
        await client.generate(PROMPT, with_n(greedy(4), n))
    assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in refused.value.field_violations] == ["n"]
    assert "16" in refused.value.field_violations[0].description


async def test_n_unset_or_zero_on_the_wire_is_one_completion(server: TokenwireServer) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        request = pb.GenerateRequest(
            prompt=PROMPT,
            sampling=pb.SamplingParams(temperature=0.0),
            stopping=pb.StoppingCriteria(max_new_tokens=5, ignore_eos=True),
        )
        unset = await stub.Generate(request)
        request.n = 1
        one = await stub.Generate(request)
    assert len(unset.token_ids) == 5 and not unset.choices
    assert list(one.token_ids) == list(unset.token_ids) and not one.choices


async def test_cancelling_the_request_id_ends_all_n_as_cancelled(
    gated_server: TokenwireServer, gate: StepGate
) -> None:
    engine = gated_server.registry.default.engine
    async with AsyncClient(f"127.0.0.1:{gated_server.port}", retries=False) as client:
        transcript = Transcript()
        async with client.open_stream() as stream:
            await stream.submit("r", PROMPT, with_n(greedy(50), 3))
            events = stream.events()
            gate.allow(3)
            await read_until(events, transcript, lambda t: len(t.tokens("r")) >= 3)
            await stream.cancel("r")
            await wait_until(lambda: engine.stats.abort_requests == 1, what="the cancel to reach the engine")
            gate.open()
            await read_until(events, transcript, lambda t: t.finished("r"))
            await stream.close_requests()
            assert [e async for e in events] == []

    final = transcript.final("r")
    assert isinstance(final, Completed)
    generation = final.generation
    assert generation.finish_reason is FinishReason.CANCELLED
    assert [c.index for c in generation.choices] == [0, 1, 2]
    assert all(c.finish_reason is FinishReason.CANCELLED for c in generation.choices)
    streamed = by_index(transcript.chunks("r"))
    assert all(len(tokens) < 50 for tokens in streamed.values())
    assert generation.completion_tokens == len(transcript.tokens("r"))
    await wait_until(lambda: engine.live_count == 0, what="every completion to leave the engine")


async def test_a_retry_with_the_idempotency_key_hears_each_completion_under_its_index(
    gated_server: TokenwireServer, gate: StepGate
) -> None:
    engine = gated_server.registry.default.engine
    options = sampled(None, n=2, tokens=20)  # no seed: equal tokens mean one generation
    async with AsyncClient(f"127.0.0.1:{gated_server.port}", retries=False) as client:
        seen = Transcript()
        async with client.open_stream() as stream:
            await stream.submit("first", PROMPT, options, idempotency_key="job-n")
            events = stream.events()
            gate.allow(4)
            await read_until(events, seen, lambda t: {c.index for c in t.chunks("first")} == {0, 1})
            # The retry joins while both completions are part way: its catch-up is one chunk per
            # completion, under that completion's index.
            await stream.submit("retry", PROMPT, options, idempotency_key="job-n")
            await wait_until(
                lambda: gated_server.generations.listeners("anonymous", "job-n") == 2,
                what="the retry to join",
            )
            gate.open()
            await read_until(events, seen, lambda t: t.finished("first") and t.finished("retry"))
            await stream.close_requests()

        whole = by_index(seen.chunks("first"))
        assert sorted(whole) == [0, 1] and all(len(tokens) == 20 for tokens in whole.values())
        assert whole[0] != whole[1]  # sampled apart, so the join below is told from a copy
        assert by_index(seen.chunks("retry")) == whole
        for rid in ("first", "retry"):
            final = seen.final(rid)
            assert isinstance(final, Completed) and [c.index for c in final.generation.choices] == [0, 1]

        # Once it has ended, its kept result comes back the same way, choices and all, without
        # another generation.
        finished = engine.stats.finished
        kept = await client.generate(PROMPT, options, idempotency_key="job-n")
        replayed = [e async for e in client.stream(PROMPT, options, idempotency_key="job-n")]
    assert {c.index: list(c.token_ids) for c in kept.choices} == whole
    assert by_index([e for e in replayed if isinstance(e, Chunk)]) == whole
    assert engine.stats.finished == finished


async def test_the_access_log_counts_the_prompt_once_and_every_completion(
    client: AsyncClient, access_lines: io.StringIO
) -> None:
    three = await client.generate(PROMPT, with_n(greedy(TOKENS), 3), request_id="logged-n")
    (line,) = [json.loads(text) for text in access_lines.getvalue().splitlines()]
    assert line["request_id"] == "logged-n"
    assert line["prompt_tokens"] == three.prompt_tokens
    assert line["completion_tokens"] == three.completion_tokens == 3 * TOKENS
