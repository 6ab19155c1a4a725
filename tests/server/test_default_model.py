"""The real default model, served end to end (slow: pulls and converts SmolLM2 on first use)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.conftest import ServerFactory
from tokenwire.client import AsyncClient, ChatMessage, FinishReason, GenerateOptions, Sampling, Stopping

pytestmark = pytest.mark.slow


@pytest.fixture
async def real_client(start_server: ServerFactory, real_model_dir: Path) -> AsyncIterator[AsyncClient]:
    server = await start_server(
        model_dir=real_model_dir, max_batch_size=2, intra_op_threads=2, max_context_length=1024
    )
    async with AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client:
        yield client


@pytest.mark.parametrize("model_layout", ["genai"], indirect=True)
async def test_capital_of_france_is_paris(real_client: AsyncClient) -> None:
    result = await real_client.generate(
        "The capital of France is",
        GenerateOptions(sampling=Sampling(temperature=0.0), stopping=Stopping(max_new_tokens=8)),
    )
    assert result.text.strip().startswith("Paris")


@pytest.mark.parametrize("model_layout", ["genai"], indirect=True)
async def test_chat_answer_is_english_and_ends_at_the_end_of_turn(real_client: AsyncClient) -> None:
    models = await real_client.list_models()
    assert models[0].has_chat_template and models[0].vocab_size == 49152
    result = await real_client.generate(
        [ChatMessage("user", "What is gravity?")],
        GenerateOptions(sampling=Sampling(temperature=0.0), stopping=Stopping(max_new_tokens=400)),
    )
    assert result.finish_reason is FinishReason.EOS
    assert "<|im_end|>" not in result.text
    words = re.findall(r"[A-Za-z']+", result.text)
    assert len(words) >= 15
    assert "gravity" in result.text.lower() or "force" in result.text.lower()
    # Mostly plain English: letters, spaces and punctuation, not byte soup.
    plain = sum(ch.isascii() for ch in result.text) / len(result.text)
    assert plain > 0.95
