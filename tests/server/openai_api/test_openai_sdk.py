"""OpenAI's official Python SDK, sync and async, against a real server: chat, completions,
streaming with usage, the timing extension and every parameter that maps onto the engine.

Greedy outputs are compared with what the gRPC API returns for the same prompt: both edges
drive one engine, so they must agree token for token.
"""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from tests.server.openai_api.conftest import base_url
from tokenwire.client import AsyncClient, ChatMessage, GenerateOptions, Sampling, Stopping
from tokenwire.server.app import TokenwireServer

CHAT = [{"role": "user", "content": "Name a colour"}]


def async_client(server: TokenwireServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url(server), api_key="unused", max_retries=0)


def sync_client(server: TokenwireServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url(server), api_key="unused", max_retries=0)


async def test_models_lists_the_served_model(http_server: TokenwireServer) -> None:
    async with async_client(http_server) as client:
        models = await client.models.list()
        one = await client.models.retrieve("tiny")
    assert [m.id for m in models.data] == ["tiny"]
    assert one.id == "tiny" and one.owned_by == "tokenwire"


async def test_async_completion_is_the_grpc_generation_token_for_token(http_server: TokenwireServer) -> None:
    async with async_client(http_server) as client:
        completion = await client.completions.create(
            model="tiny", prompt="The capital of France is", max_tokens=12, temperature=0, stop=None
        )
    async with AsyncClient(f"127.0.0.1:{http_server.port}", retries=False) as grpc_client:
        reference = await grpc_client.generate(
            "The capital of France is",
            GenerateOptions(sampling=Sampling(temperature=0.0), stopping=Stopping(max_new_tokens=12)),
        )
    choice = completion.choices[0]
    assert choice.text == reference.text
    assert completion.usage is not None
    assert completion.usage.completion_tokens == reference.completion_tokens
    assert completion.usage.prompt_tokens == reference.prompt_tokens
    assert completion.usage.total_tokens == reference.prompt_tokens + reference.completion_tokens
    assert choice.finish_reason == ("length" if reference.completion_tokens == 12 else "stop")
    assert completion.id.startswith("cmpl-") and completion.object == "text_completion"


async def test_sync_chat_completion_is_the_grpc_chat_generation(http_server: TokenwireServer) -> None:
    def ask() -> openai.types.chat.ChatCompletion:
        # The sync SDK blocks: it runs on a thread while the server's loop serves it.
        with sync_client(http_server) as client:
            return client.chat.completions.create(
                model="tiny", messages=CHAT, max_completion_tokens=10, temperature=0, seed=7
            )

    completion = await asyncio.to_thread(ask)
    async with AsyncClient(f"127.0.0.1:{http_server.port}", retries=False) as grpc_client:
        reference = await grpc_client.generate(
            [ChatMessage("user", "Name a colour")],
            GenerateOptions(sampling=Sampling(temperature=0.0, seed=7), stopping=Stopping(10)),
        )
    message = completion.choices[0].message
    assert message.role == "assistant" and message.content == reference.text
    assert completion.object == "chat.completion" and completion.model == "tiny"


async def test_async_chat_stream_with_usage_joins_to_the_whole_answer_and_ends_with_timing(
    http_server: TokenwireServer,
) -> None:
    async with async_client(http_server) as client:
        whole = await client.chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=16, temperature=0
        )
        stream = await client.chat.completions.create(
            model="tiny",
            messages=CHAT,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert len(finishing) == 1 and finishing[0].choices[0].finish_reason == whole.choices[0].finish_reason
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]
    assert all(c.usage is None for c in chunks[:-1])
    timing = last.model_extra["tokenwire"]["timing"]  # type: ignore[index]
    assert 0 <= timing["queued"] <= timing["time_to_first_token"] <= timing["total"]
    assert timing["prefill"] is not None and timing["prefill"] <= timing["time_to_first_token"]
    assert len({c.id for c in chunks}) == 1


async def test_sync_completion_stream_without_usage_carries_timing_on_its_finishing_chunk(
    http_server: TokenwireServer,
) -> None:
    def ask() -> tuple[openai.types.Completion, list[openai.types.Completion]]:
        with sync_client(http_server) as client:
            whole = client.completions.create(model="tiny", prompt="Once upon", max_tokens=9, temperature=0)
            stream = client.completions.create(
                model="tiny", prompt="Once upon", max_tokens=9, temperature=0, stream=True
            )
            return whole, list(stream)

    whole, chunks = await asyncio.to_thread(ask)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].model_extra["tokenwire"]["timing"]["total"] > 0  # type: ignore[index]
    assert whole.model_extra["tokenwire"]["timing"]["total"] > 0  # type: ignore[index]


async def test_logprobs_and_top_logprobs_in_both_layouts(http_server: TokenwireServer) -> None:
    async with async_client(http_server) as client:
        chat = await client.chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
        )
        legacy = await client.completions.create(
            model="tiny", prompt="Hello", max_tokens=4, temperature=0, logprobs=2
        )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == chat.usage.completion_tokens  # type: ignore[union-attr]
    for item in content:
        assert len(item.top_logprobs) == 3
        # Greedy: the chosen token is the likeliest.
        assert item.logprob == pytest.approx(max(t.logprob for t in item.top_logprobs))
        if "\ufffd" not in item.token:  # a whole character (or several): its own text's bytes
            assert bytes(item.bytes or []) == item.token.encode()
    # A token holding part of a multi-byte character has that part's bytes: joined, they are the text.
    joined = b"".join(bytes(item.bytes or []) for item in content)
    assert (
        joined.decode(errors="replace") == chat.choices[0].message.content
    )  # the tiny model may write invalid UTF-8
    logprobs = legacy.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and logprobs.top_logprobs is not None
    assert "".join(logprobs.tokens) == legacy.choices[0].text
    assert all(len(alternatives) <= 2 for alternatives in logprobs.top_logprobs)
    assert logprobs.text_offset == [
        sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))
    ]


async def test_seeded_sampling_repeats_and_stop_strings_end_the_text(http_server: TokenwireServer) -> None:
    async with async_client(http_server) as client:
        first, second = [
            await client.completions.create(
                model="tiny", prompt="Seeded", max_tokens=12, temperature=1.0, top_p=0.9, seed=1234
            )
            for _ in range(2)
        ]
        free = await client.completions.create(model="tiny", prompt="Stop here", max_tokens=20, temperature=0)
        text = free.choices[0].text
        stop = text[3:5] if len(text) >= 5 else None
        stopped = await client.completions.create(
            model="tiny", prompt="Stop here", max_tokens=20, temperature=0, stop=[stop] if stop else None
        )
    assert first.choices[0].text == second.choices[0].text
    if stop:
        assert stopped.choices[0].finish_reason == "stop"
        assert stop not in stopped.choices[0].text and text.startswith(stopped.choices[0].text)


async def test_json_schema_and_json_object_response_formats_shape_the_output(
    http_server: TokenwireServer,
) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    async with async_client(http_server) as client:
        shaped = await client.chat.completions.create(
            model="tiny",
            messages=CHAT,
            max_tokens=40,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        )
        anything = await client.chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=60, temperature=0, response_format={"type": "json_object"}
        )
    answer = shaped.choices[0].message.content
    assert answer is not None and set(json.loads(answer)) == {"ok"}
    assert isinstance(json.loads(answer)["ok"], bool)
    if anything.choices[0].finish_reason == "stop":  # a complete match; "length" may cut an object short
        assert isinstance(json.loads(anything.choices[0].message.content or ""), dict)
    else:
        assert (anything.choices[0].message.content or "").lstrip().startswith("{")


async def test_logit_bias_and_penalties_steer_tokens_as_on_grpc(http_server: TokenwireServer) -> None:
    bias = {17: 100.0}
    async with async_client(http_server) as client:
        forced = await client.completions.create(
            model="tiny",
            prompt="The capital of France is",
            max_tokens=6,
            temperature=0,
            logit_bias={"17": 100},
        )
        penalized = await client.completions.create(
            model="tiny",
            prompt="The capital of France is",
            max_tokens=12,
            temperature=0,
            presence_penalty=1.5,
            frequency_penalty=0.5,
        )
    async with AsyncClient(f"127.0.0.1:{http_server.port}", retries=False) as grpc_client:
        reference = await grpc_client.generate(
            "The capital of France is",
            GenerateOptions(
                sampling=Sampling(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.5),
                stopping=Stopping(max_new_tokens=12),
            ),
        )
        forced_reference = await grpc_client.generate(
            "The capital of France is",
            GenerateOptions(
                sampling=Sampling(temperature=0.0, logit_bias=bias), stopping=Stopping(max_new_tokens=6)
            ),
        )
    assert forced_reference.token_ids == (17,) * 6  # +100 forces the token at every step
    assert forced.choices[0].text == forced_reference.text
    assert penalized.choices[0].text == reference.text


async def test_n_choices_each_with_its_index_finish_reason_and_the_grpc_completion(
    http_server: TokenwireServer,
) -> None:
    def ask() -> tuple[openai.types.chat.ChatCompletion, openai.types.Completion]:
        with sync_client(http_server) as client:
            chat = client.chat.completions.create(
                model="tiny", messages=CHAT, max_tokens=10, temperature=1.5, seed=40, n=2
            )
            completion = client.completions.create(
                model="tiny", prompt="Once upon", max_tokens=9, temperature=1.5, seed=40, n=2
            )
            return chat, completion

    chat, completion = await asyncio.to_thread(ask)
    options = GenerateOptions(sampling=Sampling(temperature=1.5, seed=40), stopping=Stopping(10), n=2)
    async with AsyncClient(f"127.0.0.1:{http_server.port}", retries=False) as grpc_client:
        reference = await grpc_client.generate([ChatMessage("user", "Name a colour")], options)
        alone = await grpc_client.generate(
            "Once upon",
            GenerateOptions(sampling=Sampling(temperature=1.5, seed=41), stopping=Stopping(9)),
        )
    assert [c.index for c in chat.choices] == [0, 1]
    assert [c.message.content for c in chat.choices] == [c.text for c in reference.choices]
    finish = {"length": "length", "eos": "stop", "stop": "stop"}
    assert [c.finish_reason for c in chat.choices] == [
        finish[c.finish_reason.value] for c in reference.choices
    ]
    assert chat.usage is not None
    assert chat.usage.prompt_tokens == reference.prompt_tokens
    assert chat.usage.completion_tokens == reference.completion_tokens
    assert chat.usage.total_tokens == reference.prompt_tokens + reference.completion_tokens
    assert [c.index for c in completion.choices] == [0, 1]
    # Completion 1 samples with seed + 1.
    assert completion.choices[1].text == alone.text
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == alone.prompt_tokens


async def test_a_streamed_n_interleaves_choices_by_index_and_finishes_each(
    http_server: TokenwireServer,
) -> None:
    async with async_client(http_server) as client:
        whole = await client.chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=12, temperature=1.5, seed=9, n=3
        )
        stream = await client.chat.completions.create(
            model="tiny",
            messages=CHAT,
            max_tokens=12,
            temperature=1.5,
            seed=9,
            n=3,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    with_choices = [c for c in chunks if c.choices]
    assert all(len(c.choices) == 1 for c in with_choices)
    # Each completion opens with its role and ends with its own finish reason.
    roles = [c.choices[0].index for c in with_choices if c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1, 2]
    text: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    for chunk in with_choices:
        choice = chunk.choices[0]
        text[choice.index] = text.get(choice.index, "") + (choice.delta.content or "")
        if choice.finish_reason is not None:
            finishes.setdefault(choice.index, []).append(choice.finish_reason)
    assert text == {c.index: c.message.content for c in whole.choices}
    assert finishes == {c.index: [c.finish_reason] for c in whole.choices}
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None and whole.usage is not None
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
