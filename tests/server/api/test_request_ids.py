"""Idempotency keys on a real server: a retry joins the first attempt or gets its result; a
request_id alone is a label and never makes a request idempotent.

Every test counts the engine's work (prefill chunks, decode steps, finished requests) to show
that a retry did no second generation, or that a reused request_id did one. A step gate holds
decode steps so "the first attempt is still running" is a state the test controls. Unset seeds
make each generation's tokens random, so equal tokens also mean one generation.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from tests.conftest import ServerFactory, tiny_settings
from tests.support.polling import wait_until
from tests.support.servers import serving
from tests.support.stepping import StepGate, gated
from tokenwire.client import (
    AsyncClient,
    Chunk,
    Completed,
    Failed,
    GenerateOptions,
    Generation,
    Sampling,
    Started,
    Stopping,
    TokenwireError,
)
from tokenwire.server.app import TokenwireServer
from tokenwire.server.config import AuthSettings

TOKENS = 24
RANDOM = GenerateOptions(sampling=Sampling(temperature=1.0), stopping=Stopping(TOKENS, ignore_eos=True))


def work(server: TokenwireServer) -> tuple[int, int, int]:
    stats = server.registry.default.engine.stats
    return stats.prefill_chunks, stats.decode_steps, stats.finished


async def test_a_unary_retry_while_the_first_runs_gets_the_same_result_from_one_generation(
    start_server: ServerFactory,
) -> None:
    gate = StepGate()
    gate.allow(5)
    server = await start_server(wrap_model=gated(gate))
    async with AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client:
        first = asyncio.ensure_future(client.generate("Hi", RANDOM, request_id="a", idempotency_key="job-1"))
        await wait_until(lambda: server.registry.default.engine.stats.decode_steps == 5, what="5 steps")
        # The retry's request_id differs: only the key says it is the same request.
        retry = asyncio.ensure_future(client.generate("Hi", RANDOM, request_id="b", idempotency_key="job-1"))
        await wait_until(
            lambda: server.generations.listeners("anonymous", "job-1") == 2, what="the retry to join"
        )
        gate.open()
        results: list[Generation] = await asyncio.gather(first, retry)
    assert results[0].token_ids == results[1].token_ids and len(results[0].token_ids) == TOKENS
    assert results[0].text == results[1].text
    assert results[1].request_id == "a"  # the first attempt's response, whole
    assert work(server) == (1, TOKENS - 1, 1)


async def test_a_streamed_retry_gets_the_tokens_so_far_then_the_rest_without_a_second_generation(
    start_server: ServerFactory,
) -> None:
    gate = StepGate()
    gate.allow(7)
    server = await start_server(wrap_model=gated(gate))
    async with AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client:
        first = asyncio.ensure_future(client.generate("Hi", RANDOM, idempotency_key="job-2"))
        # Seven steps run and the eighth held at the gate: the seventh step's round has delivered
        # its tokens (a round delivers before the next begins), so the catch-up holds all eight.
        await wait_until(
            lambda: server.registry.default.engine.stats.decode_steps == 7 and gate.waiting == 1,
            what="7 steps delivered",
        )
        chunks: list[tuple[int, ...]] = []
        kinds: list[str] = []
        completed = None
        async with client.open_stream() as stream:
            await stream.submit("retry", "Hi", RANDOM, idempotency_key="job-2")
            await stream.close_requests()
            async for event in stream.events():
                kinds.append(type(event).__name__)
                if isinstance(event, Chunk):
                    chunks.append(event.token_ids)
                    if len(chunks) == 1:
                        gate.open()  # the rest arrives after the catch-up
                elif isinstance(event, Completed):
                    completed = event.generation
        reference = await first
    assert kinds[:2] == ["Queued", "Started"] and kinds[-1] == "Completed"
    assert len(chunks[0]) == 8  # the prefill's token and 7 decode steps, as one catch-up chunk
    assert tuple(t for chunk in chunks for t in chunk) == reference.token_ids
    assert completed is not None and completed.completion_tokens == TOKENS
    assert work(server) == (1, TOKENS - 1, 1)


async def test_a_retry_after_completion_gets_the_kept_result_on_generate_and_on_a_stream(
    client: AsyncClient, server: TokenwireServer
) -> None:
    original = await client.generate("Hi", RANDOM, idempotency_key="job-3")
    before = work(server)
    again = await client.generate("Hi", RANDOM, idempotency_key="job-3")
    assert (again.token_ids, again.text, again.finish_reason) == (
        original.token_ids,
        original.text,
        original.finish_reason,
    )
    assert again.timing == original.timing  # the first attempt's own timing, not a new one
    streamed: list[int] = []
    text = ""
    async for event in client.stream("Hi", RANDOM, idempotency_key="job-3"):
        if isinstance(event, Chunk):
            streamed.extend(event.token_ids)
            text += event.text
        elif isinstance(event, Started):
            assert event.prompt_tokens == original.prompt_tokens
    assert tuple(streamed) == original.token_ids and text == original.text
    assert work(server) == before


async def test_the_same_key_with_a_different_request_is_already_exists_naming_idempotency_key(
    client: AsyncClient, server: TokenwireServer
) -> None:
    await client.generate("Hi", RANDOM, idempotency_key="job-4")
    before = work(server)
    with pytest.raises(TokenwireError) as refused:
        await client.generate("Hello there", RANDOM, idempotency_key="job-4")
    assert refused.value.code is grpc.StatusCode.ALREADY_EXISTS
    assert refused.value.reason == "IDEMPOTENCY_KEY_REUSED"
    assert [v.field for v in refused.value.field_violations] == ["idempotency_key"]
    assert work(server) == before


async def test_keys_are_scoped_per_caller(tiny_model_dir: Path) -> None:
    settings = tiny_settings(tiny_model_dir, auth=AuthSettings(tokens=("token-of-a", "token-of-b")))
    async with serving(settings) as server:
        target = f"127.0.0.1:{server.port}"
        async with (
            AsyncClient(target, token="token-of-a", retries=False) as a,
            AsyncClient(target, token="token-of-b", retries=False) as b,
        ):
            first = await a.generate("Hi", RANDOM, idempotency_key="shared-key")
            other = await b.generate("Hi", RANDOM, idempotency_key="shared-key")
            again = await a.generate("Hi", RANDOM, idempotency_key="shared-key")
            # b's different request under the same key is its own business, not a conflict with a's.
            await b.generate("Something else", RANDOM, idempotency_key="other-key")
            await a.generate("Something different", RANDOM, idempotency_key="other-key")
        assert again.token_ids == first.token_ids
        assert other.token_ids != first.token_ids  # b got a generation of its own
        assert work(server)[2] == 4


async def test_without_retention_a_finished_request_runs_again_and_a_cancelled_one_is_never_kept(
    start_server: ServerFactory,
) -> None:
    server = await start_server(result_retention=0.0)
    async with AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client:
        first = await client.generate("Hi", RANDOM, idempotency_key="job-5")
        second = await client.generate("Hi", RANDOM, idempotency_key="job-5")
    assert first.token_ids != second.token_ids
    assert work(server)[2] == 2
    assert server.generations.kept_count == 0


async def test_a_request_without_a_key_is_never_registered_whatever_its_request_id(
    client: AsyncClient, server: TokenwireServer
) -> None:
    await client.generate("Hi", RANDOM)
    await client.generate("Hi", RANDOM, request_id="job-6")
    async for _ in client.stream("Hi", RANDOM, request_id="job-6"):
        pass
    assert server.generations.kept_count == 0 and server.generations.live_count == 0


async def test_a_reused_request_id_without_a_key_is_a_new_generation_never_a_refusal_or_a_replay(
    client: AsyncClient, server: TokenwireServer
) -> None:
    # Two unrelated clients numbering their requests 1, 2, 3, on Generate and on streams.
    unary = [await client.generate(f"Question {n}", RANDOM, request_id=str(n)) for n in (1, 2, 3)]
    again = [await client.generate(f"Other question {n}", RANDOM, request_id=str(n)) for n in (1, 2, 3)]
    same_body = await client.generate("Question 1", RANDOM, request_id="1")
    streamed: dict[str, list[Generation]] = {}
    for name in ("one", "other"):
        async with client.open_stream() as stream:
            for n in (1, 2, 3):
                await stream.submit(str(n), f"{name} asks {n}", RANDOM)
            await stream.close_requests()
            streamed[name] = [e.generation async for e in stream.events() if isinstance(e, Completed)]
    assert all(g.completion_tokens == TOKENS for g in [*unary, *again, same_body])
    assert [g.request_id for g in again] == ["1", "2", "3"]
    # A new generation each time (unseeded sampling): not the stored result of the first "1".
    assert same_body.token_ids != unary[0].token_ids
    assert [len(streamed[name]) for name in streamed] == [3, 3]
    assert work(server)[2] == 7 + 6


@pytest.mark.parametrize(
    ("key", "description"),
    [
        ("k" * 129, "129 characters, more than 128"),
        ("has space", "use only printable ASCII other than space"),
        ("caf\u00e9", "use only printable ASCII other than space"),
    ],
)
async def test_a_bad_idempotency_key_is_invalid_argument_naming_it(
    client: AsyncClient, server: TokenwireServer, key: str, description: str
) -> None:
    with pytest.raises(TokenwireError) as refused:
        await client.generate("Hi", RANDOM, idempotency_key=key)
    assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
    violations = refused.value.field_violations
    assert [v.field for v in violations] == ["idempotency_key"]
    assert description in violations[0].description
    async with client.open_stream() as stream:
        await stream.submit("s", "Hi", RANDOM, idempotency_key=key)
        await stream.close_requests()
        (failed,) = [e async for e in stream.events()]
    assert isinstance(failed, Failed) and isinstance(failed.error, TokenwireError)
    assert [v.field for v in failed.error.field_violations] == ["idempotency_key"]
    assert work(server) == (0, 0, 0)
