"""Speculative decoding seen from outside: a real server on the tiny shared-buffer model, with
`--speculative-tokens 4`, against one without. The tokens are the same; usage (gRPC, the Python
client, OpenAI's SDK), the Prometheus counters and the access log report the drafts."""

from __future__ import annotations

import io
import json
from pathlib import Path

import openai

from tests.conftest import tiny_settings
from tests.server.openai_api.conftest import base_url, http_settings
from tests.support.options import greedy
from tests.support.prometheus import scrape
from tests.support.servers import serving
from tests.support.tiny_models import TinyModel
from tokenwire.client import AsyncClient, Chunk, Completed, GenerateOptions, Sampling, Stopping
from tokenwire.server.config import TelemetrySettings

BY_MODEL = {"gen_ai_request_model": "tiny"}
PROMPT = list(range(50, 70)) * 3
"""A prompt whose greedy output on the tiny Llama soon repeats itself: drafts are accepted."""


async def test_a_speculating_server_gives_the_same_tokens_and_reports_its_drafts(
    each_kv_location: TinyModel, every_log_line: io.StringIO
) -> None:
    model, kv_cache = each_kv_location.path, each_kv_location.kv_cache
    async with (
        serving(tiny_settings(model, kv_cache=kv_cache)) as plain,
        AsyncClient(f"127.0.0.1:{plain.port}", retries=False) as client,
    ):
        expected = await client.generate(PROMPT, greedy(40))
    telemetry = TelemetrySettings(metrics_port=0, metrics_cache_seconds=0)
    settings = tiny_settings(model, speculative_tokens=4, telemetry=telemetry, kv_cache=kv_cache)
    async with (
        serving(settings) as server,
        AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client,
    ):
        assert server.metrics_port
        unary = await client.generate(PROMPT, greedy(40))
        streamed: list[int] = []
        completed = None
        async for event in client.stream(PROMPT, greedy(40)):
            if isinstance(event, Chunk):
                streamed.extend(event.token_ids)
            elif isinstance(event, Completed):
                completed = event.generation
        metrics = await scrape(server.metrics_port)

    assert expected.accepted_draft_tokens == expected.draft_tokens == 0
    assert unary.token_ids == expected.token_ids
    assert 0 < unary.accepted_draft_tokens <= unary.draft_tokens
    assert unary.accepted_draft_tokens < unary.completion_tokens
    assert completed is not None
    assert streamed == list(expected.token_ids)
    assert (completed.accepted_draft_tokens, completed.draft_tokens) == (
        unary.accepted_draft_tokens,
        unary.draft_tokens,
    )
    # Two requests speculated, the same way: the unary one and the stream.
    drafted = metrics.value("tokenwire_engine_draft_tokens_total", **BY_MODEL)
    accepted = metrics.value("tokenwire_engine_accepted_draft_tokens_total", **BY_MODEL)
    assert (drafted, accepted) == (2 * unary.draft_tokens, 2 * unary.accepted_draft_tokens)
    lines = every_log_line.getvalue().splitlines()
    records = [json.loads(line) for line in lines if '"draft_tokens"' in line]
    speculated = [r for r in records if r.get("draft_tokens")]
    assert len(speculated) == 2
    for record in speculated:
        assert record["accepted_draft_tokens"] == unary.accepted_draft_tokens
        assert record["draft_acceptance"] == round(unary.accepted_draft_tokens / unary.draft_tokens, 3)


async def test_openai_usage_reports_accepted_and_rejected_drafts_as_prediction_tokens(
    tiny_llama_dir: Path,
) -> None:
    options = GenerateOptions(sampling=Sampling(temperature=0.0), stopping=Stopping(max_new_tokens=40))
    async with (
        serving(http_settings(tiny_llama_dir, speculative_tokens=4)) as server,
        AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client,
        openai.AsyncOpenAI(base_url=base_url(server), api_key="unused", max_retries=0) as sdk,
    ):
        reference = await client.generate(PROMPT, options)
        completion = await sdk.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0)
    assert reference.accepted_draft_tokens > 0
    usage = completion.usage
    assert usage is not None and usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.accepted_prediction_tokens == reference.accepted_draft_tokens
    assert usage.completion_tokens_details.rejected_prediction_tokens == (
        reference.draft_tokens - reference.accepted_draft_tokens
    )
