"""Generate (unary) on a real server: results, timing fields, chat, token ids, logprobs."""

from __future__ import annotations

from tokenwire.client import (
    AsyncClient,
    ChatMessage,
    FinishReason,
    GenerateOptions,
    Sampling,
    Stopping,
)
from tokenwire.server.app import TokenwireServer

GREEDY = Sampling(temperature=0.0)


async def test_generate_returns_text_tokens_usage_and_timing(client: AsyncClient) -> None:
    result = await client.generate(
        "The capital of France is",
        GenerateOptions(sampling=GREEDY, stopping=Stopping(max_new_tokens=12, ignore_eos=True)),
    )
    assert result.finish_reason is FinishReason.LENGTH
    assert result.completion_tokens == 12 == len(result.token_ids)
    assert result.prompt_tokens > 0
    assert result.text  # byte-level tokens always decode to something
    assert result.request_id.startswith("gen-")
    timing = result.timing
    assert timing.time_to_first_token is not None and timing.prefill is not None
    assert 0 <= timing.queued <= timing.time_to_first_token <= timing.total
    assert timing.prefill <= timing.time_to_first_token
    assert timing.decode_tokens_per_second > 0
    assert timing.time_per_output_token is not None
    # Rate and inter-token time describe the same decode phase.
    assert abs(timing.decode_tokens_per_second * timing.time_per_output_token - 1.0) < 1e-4  # ns rounding


async def test_greedy_generation_is_repeatable(client: AsyncClient) -> None:
    options = GenerateOptions(sampling=GREEDY, stopping=Stopping(max_new_tokens=16, ignore_eos=True))
    first = await client.generate("Hello, world!", options)
    second = await client.generate("Hello, world!", options)
    assert first.token_ids == second.token_ids
    assert first.text == second.text


async def test_seeded_sampling_is_repeatable_and_seed_dependent(client: AsyncClient) -> None:
    def options(seed: int) -> GenerateOptions:
        return GenerateOptions(
            sampling=Sampling(temperature=1.5, top_k=50, top_p=0.95, seed=seed),
            stopping=Stopping(max_new_tokens=24, ignore_eos=True),
        )

    first = await client.generate("Streaming lets users", options(7))
    again = await client.generate("Streaming lets users", options(7))
    other = await client.generate("Streaming lets users", options(8))
    assert first.token_ids == again.token_ids
    assert first.token_ids != other.token_ids


async def test_token_ids_input_equals_prompt_input(client: AsyncClient, server: TokenwireServer) -> None:
    tokenizer = server.registry.default.model.tokenizer
    ids = tokenizer.encode("Gravity is the force")
    options = GenerateOptions(sampling=GREEDY, stopping=Stopping(max_new_tokens=8, ignore_eos=True))
    by_text = await client.generate("Gravity is the force", options)
    by_ids = await client.generate(ids, options)
    assert by_ids.prompt_tokens == len(ids)
    assert by_text.token_ids == by_ids.token_ids


async def test_chat_messages_render_through_the_template(
    client: AsyncClient, server: TokenwireServer
) -> None:
    messages = [ChatMessage("system", "Be brief."), ChatMessage("user", "What is gravity?")]
    options = GenerateOptions(sampling=GREEDY, stopping=Stopping(max_new_tokens=4, ignore_eos=True))
    chat = await client.generate(messages, options)
    rendered = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is gravity?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    tokenizer = server.registry.default.model.tokenizer
    assert chat.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    same = await client.generate(rendered, options)
    assert chat.token_ids == same.token_ids


async def test_logprobs_are_log_probabilities_of_the_chosen_tokens(client: AsyncClient) -> None:
    result = await client.generate(
        "Hello",
        GenerateOptions(
            sampling=GREEDY,
            stopping=Stopping(max_new_tokens=5, ignore_eos=True),
            logprobs=True,
            top_logprobs=3,
        ),
    )
    assert [lp.token_id for lp in result.logprobs] == list(result.token_ids)
    for item in result.logprobs:
        assert item.logprob <= 0
        assert len(item.top) == 3
        # Greedy picks the most likely token, so it heads the top list with the same logprob.
        assert item.top[0][0] == item.token_id
        assert abs(item.top[0][2] - item.logprob) < 1e-5
        assert item.top[0][2] >= item.top[1][2] >= item.top[2][2]


async def test_list_models_describes_the_served_model(client: AsyncClient, model_layout: str) -> None:
    models = await client.list_models()
    assert len(models) == 1
    tiny = models[0]
    assert tiny.name == "tiny"
    assert tiny.is_default and tiny.has_chat_template
    assert tiny.context_length == 256
    assert tiny.vocab_size == 512
    assert tiny.format == model_layout
