"""StreamGenerate on a real server: multiplexing, cancel by id, half-close, exact text deltas."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from tests.support.events import Transcript, read_until
from tests.support.options import greedy
from tests.support.polling import wait_until
from tests.support.stepping import StepGate
from tokenwire.client import (
    AsyncClient,
    Chunk,
    Completed,
    Failed,
    FinishReason,
    GenerateOptions,
    Queued,
    Sampling,
    Started,
    StreamEvent,
    TokenwireError,
)
from tokenwire.server.app import TokenwireServer


async def test_events_of_one_generation_arrive_in_order(client: AsyncClient) -> None:
    events = [e async for e in client.stream("Hello there", greedy(10), request_id="one")]
    assert isinstance(events[0], Queued) and events[0].position == 0
    assert isinstance(events[1], Started) and events[1].prompt_tokens > 0
    assert all(isinstance(e, Chunk) for e in events[2:-1])
    final = events[-1]
    assert isinstance(final, Completed)
    assert final.generation.finish_reason is FinishReason.LENGTH
    chunks = [e for e in events if isinstance(e, Chunk)]
    assert sum(len(c.token_ids) for c in chunks) == final.generation.completion_tokens == 10
    # The summary leaves text and tokens to the chunks.
    assert final.generation.text == "" and final.generation.token_ids == ()


async def test_streamed_tokens_and_text_equal_the_unary_result(client: AsyncClient) -> None:
    unary = await client.generate("The quick brown fox", greedy(40))
    transcript = Transcript()
    async for event in client.stream("The quick brown fox", greedy(40), request_id="s"):
        transcript.add(event)
    assert transcript.tokens("s") == list(unary.token_ids)
    assert transcript.text("s") == unary.text


async def test_multiplexed_generations_with_one_cancelled_midway(
    gated_server: TokenwireServer, gate: StepGate
) -> None:
    engine = gated_server.registry.default.engine
    async with AsyncClient(f"127.0.0.1:{gated_server.port}", retries=False) as client:
        alone = {}
        gate.open()
        for rid, prompt in (("a", "Hello, world!"), ("c", "The capital of France is")):
            alone[rid] = await client.generate(prompt, greedy(30))
        steps_before = engine.stats.decode_steps
        gate.close()

        transcript = Transcript()
        async with client.open_stream() as stream:
            await stream.submit("a", "Hello, world!", greedy(30))
            await stream.submit("b", "Gravity is the force", greedy(30))
            await stream.submit("c", "The capital of France is", greedy(30))
            events: AsyncIterator[StreamEvent] = stream.events()
            # Once all three are queued, one decode step lets the engine reach a step boundary,
            # where it admits and prefills whatever waits; prefill yields each first token.
            await read_until(events, transcript, lambda t: all(t.events[r] for r in "abc"))
            gate.allow(1)
            await read_until(events, transcript, lambda t: all(len(t.tokens(r)) >= 1 for r in "abc"))
            done = {r: len(transcript.tokens(r)) for r in "abc"}
            gate.allow(5)
            await read_until(
                events, transcript, lambda t: all(len(t.tokens(r)) >= done[r] + 5 for r in "abc")
            )
            # The engine now holds the next decode step at the gate, with "b" in its batch.
            streamed_before_cancel = len(transcript.tokens("b"))
            await stream.cancel("b")
            await wait_until(lambda: engine.stats.abort_requests == 1, what="the cancel to reach the engine")
            gate.open()
            await read_until(events, transcript, lambda t: all(t.finished(r) for r in "abc"))
            await stream.close_requests()
            rest = [e async for e in events]
        assert rest == []  # half-close with nothing live ends the stream

    cancelled = transcript.final("b")
    assert isinstance(cancelled, Completed)
    assert cancelled.generation.finish_reason is FinishReason.CANCELLED
    streamed_b = len(transcript.tokens("b"))
    assert cancelled.generation.completion_tokens == streamed_b
    # It stopped early, while the others went on to their full length.
    assert streamed_before_cancel <= streamed_b < 30
    # The exact promise is kept by the engine's own count: once the cancel reached it, "b" took
    # part in at most the one step already under way (the one held at the gate).
    assert engine.stats.max_abort_latency_steps <= 1
    assert engine.stats.orphaned_steps == 0
    for rid in "ac":
        final = transcript.final(rid)
        assert isinstance(final, Completed) and final.generation.finish_reason is FinishReason.LENGTH
        # Sharing the batch with others (and with a cancellation) changes nothing about the tokens.
        assert transcript.tokens(rid) == list(alone[rid].token_ids)
    assert engine.stats.decode_steps > steps_before


async def test_half_close_finishes_every_live_generation_then_ends_ok(client: AsyncClient) -> None:
    transcript = Transcript()
    async with client.open_stream() as stream:
        for index in range(3):
            await stream.submit(f"r{index}", f"Request number {index}", greedy(20 + index))
        await stream.close_requests()
        async for event in stream.events():
            transcript.add(event)
    for index in range(3):
        final = transcript.final(f"r{index}")
        assert isinstance(final, Completed)
        assert final.generation.completion_tokens == 20 + index == len(transcript.tokens(f"r{index}"))


async def test_a_finished_request_id_names_a_new_request_and_only_a_key_brings_back_a_result(
    client: AsyncClient, server: TokenwireServer
) -> None:
    # A request_id is the stream's handle only: once its request ended it may name another one,
    # which runs as a new generation. Only an idempotency key brings back a kept result, and the
    # same key with another request is ALREADY_EXISTS (test_request_ids.py covers keys in full).
    transcript = Transcript()

    def completions() -> list[Completed]:
        return [e for e in transcript.events["same"] if isinstance(e, Completed)]

    async with client.open_stream() as stream:
        events = stream.events()
        await stream.submit("same", "First", greedy(3), idempotency_key="key-1")
        await read_until(events, transcript, lambda t: len(completions()) == 1)
        finished_before = server.registry.default.engine.stats.finished
        await stream.submit("same", "First", greedy(3), idempotency_key="key-1")
        await read_until(events, transcript, lambda t: len(completions()) == 2)
        kept_only = server.registry.default.engine.stats.finished
        await stream.submit("same", "Second", greedy(4), idempotency_key="key-1")
        await read_until(events, transcript, lambda t: isinstance(t.events["same"][-1], Failed))
        await stream.submit("same", "Second", greedy(4))
        await stream.close_requests()
        async for event in events:
            transcript.add(event)
    assert kept_only == finished_before  # the kept result came back without a generation
    assert [c.generation.completion_tokens for c in completions()] == [3, 3, 4]
    failures = [e for e in transcript.events["same"] if isinstance(e, Failed)]
    assert len(failures) == 1
    error = failures[0].error
    assert isinstance(error, TokenwireError) and error.code is grpc.StatusCode.ALREADY_EXISTS
    assert [v.field for v in error.field_violations] == ["idempotency_key"]
    assert server.registry.default.engine.stats.finished == finished_before + 1


async def test_cancel_of_unknown_request_id_is_ignored(client: AsyncClient) -> None:
    transcript = Transcript()
    async with client.open_stream() as stream:
        await stream.cancel("never-started")
        await stream.submit("real", "Hello", greedy(5))
        await stream.close_requests()
        async for event in stream.events():
            transcript.add(event)
    assert set(transcript.events) == {"real"}
    assert isinstance(transcript.final("real"), Completed)


async def test_stop_string_spanning_tokens_never_leaks(client: AsyncClient) -> None:
    full = await client.generate("Hello, world!", greedy(40))
    assert len(full.text) > 12
    # A stop string made of text that the model produces across several tokens.
    stop = full.text[5:12]
    expected = full.text[: full.text.index(stop)]
    unary = await client.generate("Hello, world!", greedy(40, stop=(stop,)))
    assert unary.finish_reason is FinishReason.STOP
    assert unary.text == expected
    transcript = Transcript()
    async for event in client.stream("Hello, world!", greedy(40, stop=(stop,)), request_id="s"):
        transcript.add(event)
    assert transcript.text("s") == expected
    assert all(stop not in c.text for c in transcript.chunks("s"))


async def test_text_deltas_concatenate_to_the_final_text_at_every_point(client: AsyncClient) -> None:
    # Byte-level tokens of a random model include pieces of multi-byte characters. A delta that
    # split a character would show U+FFFD where the whole text has the real character, so every
    # running concatenation of deltas must be a prefix of the final text.
    unary = await client.generate("😀 東京 café", greedy(80))
    transcript = Transcript()
    async for event in client.stream("😀 東京 café", greedy(80), request_id="u"):
        transcript.add(event)
    running = ""
    for chunk in transcript.chunks("u"):
        running += chunk.text
        assert unary.text.startswith(running)
    assert running == unary.text


async def test_per_request_error_keeps_the_stream_open(client: AsyncClient) -> None:
    transcript = Transcript()
    async with client.open_stream() as stream:
        await stream.submit("bad", "Hello", GenerateOptions(sampling=Sampling(temperature=-1.0)))
        await stream.submit("good", "Hello", greedy(5))
        await stream.close_requests()
        async for event in stream.events():
            transcript.add(event)
    bad = transcript.final("bad")
    assert isinstance(bad, Failed)
    assert [v.field for v in bad.error.field_violations] == ["sampling.temperature"]  # type: ignore[attr-defined]
    assert isinstance(transcript.final("good"), Completed)


async def test_a_stream_opened_while_draining_refuses_each_generation_as_retryable_and_ends_ok(
    server: TokenwireServer, client: AsyncClient
) -> None:
    # Many calls at once, each still writing as the server answers it, as under a drain with load:
    # a server that ended such a call with a status let some clients read INTERNAL instead.
    await server.drain(timeout=5)

    async def one_call(number: int) -> list[StreamEvent]:
        async with client.open_stream() as stream:
            for part in range(3):
                await stream.submit(f"c{number}.{part}", "Hi", greedy(4))
            await stream.close_requests()
            return [event async for event in stream.events()]

    calls = await asyncio.gather(*(one_call(number) for number in range(200)))
    for number, events in enumerate(calls):
        assert sorted(event.request_id for event in events) == [f"c{number}.{part}" for part in range(3)]
        for event in events:
            assert isinstance(event, Failed) and isinstance(event.error, TokenwireError)
            assert event.error.code is grpc.StatusCode.UNAVAILABLE
            assert event.error.reason == "DRAINING" and event.error.retryable
