"""Prefix caching in the engine, on the real tiny models: same outputs, less prompt work.

The engine is driven round by round (`Engine.run_round`) over the real ONNX Runtime runners, so
what is compared is what the models compute. Greedy outputs with the cache must equal those
without it: token for token on both layouts, and on the shared-buffer (GenAI) layout bit for bit,
which the log-probabilities (computed from the raw logits) show.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.real_engine import RealEngine, assert_same_output
from tests.support.tiny_models import TinyModel
from tokenwire.server.engine.engine import EngineConfig

BLOCK = 16
SYSTEM = [(i * 37 + 11) % 400 + 40 for i in range(50)]  # 3 full blocks and 2 tokens
QUESTIONS = {name: [(i * 13 + seed) % 400 + 40 for i in range(12)] for seed, name in enumerate("abcdef")}


def engine_with(each_runner: TinyModel, *, cache: bool, chunk: int = 256) -> RealEngine:
    config = EngineConfig(
        max_batch_size=4,
        prefill_chunk_size=chunk,
        prefix_cache_mb=8 if cache else 0,
        prefix_block_tokens=BLOCK,
    )
    return RealEngine(each_runner, config)


def test_a_prompt_after_a_cached_prefix_generates_what_it_would_without_the_cache(
    each_runner: TinyModel,
) -> None:
    without = engine_with(each_runner, cache=False)
    expected = without.generate(SYSTEM + QUESTIONS["b"])

    cached = engine_with(each_runner, cache=True)
    first = cached.generate(SYSTEM + QUESTIONS["a"])
    second = cached.generate(SYSTEM + QUESTIONS["b"])

    assert first.cached_prompt_tokens == 0
    assert second.cached_prompt_tokens == 48  # the system prompt's three full blocks
    assert_same_output(second, expected, cached.layout)


def test_cached_prefixes_give_the_same_outputs_inside_a_busy_batch(each_runner: TinyModel) -> None:
    prompts = [SYSTEM + QUESTIONS[name] for name in "cdef"]
    without = engine_with(each_runner, cache=False)
    expected = [without.generate(p, tokens=12) for p in prompts]

    cached = engine_with(each_runner, cache=True)
    cached.generate(SYSTEM + QUESTIONS["a"])  # warms the cache
    busy = cached.submit(list(range(300, 360)), tokens=40)  # a stream decoding throughout
    cached.engine.run_round()
    ids = []
    for prompt in prompts:  # they join while others decode, one per round
        ids.append(cached.submit(prompt, tokens=12))
        cached.engine.run_round()
    results = [cached.result(request_id) for request_id in ids]

    for got, want in zip(results, expected, strict=True):
        assert got.cached_prompt_tokens >= 48
        assert_same_output(got, want, cached.layout)
    assert cached.result(busy).completion_tokens == 40


def test_two_prompts_with_the_same_prefix_arriving_together_process_it_once(each_runner: TinyModel) -> None:
    h = engine_with(each_runner, cache=True)
    first = h.submit(SYSTEM + QUESTIONS["a"])
    second = h.submit(SYSTEM + QUESTIONS["b"])

    results = [h.result(first), h.result(second)]

    assert [r.cached_prompt_tokens for r in results] == [0, 48]
    prompt_tokens = sum(r.prompt_tokens for r in results)
    assert h.engine.stats.prefill_tokens == prompt_tokens - 48


def test_a_multi_turn_chat_reuses_each_earlier_turn(each_runner: TinyModel) -> None:
    without, cached = engine_with(each_runner, cache=False), engine_with(each_runner, cache=True)
    history: list[int] = []
    for turn, name in enumerate("abc"):
        prompt = history + QUESTIONS[name]
        got, want = cached.generate(prompt), without.generate(prompt)
        assert_same_output(got, want, cached.layout)
        # The previous turn's whole prompt is found again (its full blocks and its partial tail).
        previous_prompt = len(history) - 8  # the history ends with the previous answer's 8 tokens
        assert got.cached_prompt_tokens == (previous_prompt if turn else 0)
        history = prompt + list(got.token_ids)


def test_prompts_processed_in_small_chunks_cache_the_same_prefix(each_runner: TinyModel) -> None:
    h = engine_with(each_runner, cache=True, chunk=5)  # blocks complete across chunk boundaries
    h.generate(SYSTEM + QUESTIONS["a"])
    again = h.generate(SYSTEM + QUESTIONS["b"])
    assert again.cached_prompt_tokens == 48
    assert_same_output(
        again, engine_with(each_runner, cache=False).generate(SYSTEM + QUESTIONS["b"]), h.layout
    )


def test_the_cache_reports_its_size_and_hits(each_runner: TinyModel) -> None:
    h = engine_with(each_runner, cache=True)
    h.generate(SYSTEM + QUESTIONS["a"])
    h.generate(SYSTEM + QUESTIONS["b"])

    stats = h.engine.prefix_cache_stats
    assert stats is not None
    assert stats.lookups == 2 and stats.hit_tokens == 48
    assert stats.prompt_tokens == 2 * len(SYSTEM + QUESTIONS["a"])
    assert 0 < stats.bytes <= stats.capacity_bytes == 8 << 20
    assert engine_with(each_runner, cache=False).engine.prefix_cache_stats is None


def test_the_cache_s_bound_is_reported_when_the_engine_starts(
    tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("INFO", logger="tokenwire.server.engine.engine"):
        engine_with(TinyModel(tiny_llama_dir, "genai"), cache=True)
    assert any("prefix cache" in r.message and "8 MiB" in r.message for r in caplog.records)
