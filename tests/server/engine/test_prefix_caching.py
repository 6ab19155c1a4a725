"""Prefix caching in the engine, on the real tiny models: same outputs, less prompt work.

The engine is driven round by round (`Engine.run_round`) over the real ONNX Runtime runners, so
what is compared is what the models compute. Greedy outputs with the cache must equal those
without it: token for token on both layouts, and on the shared-buffer (GenAI) layout bit for bit,
which the log-probabilities (computed from the raw logits) show.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from pathlib import Path

import pytest

from tokenwire.server.engine.engine import Engine, EngineConfig
from tokenwire.server.engine.types import (
    Completed,
    EngineEvent,
    GenerationRequest,
    GenerationResult,
    StopConditions,
)
from tokenwire.server.models.loader import LoadSettings, load_model
from tokenwire.server.models.session import SessionSettings
from tokenwire.server.sampling.params import SamplingParams

BLOCK = 16
SYSTEM = [(i * 37 + 11) % 400 + 40 for i in range(50)]  # 3 full blocks and 2 tokens
QUESTIONS = {name: [(i * 13 + seed) % 400 + 40 for i in range(12)] for seed, name in enumerate("abcdef")}


@pytest.fixture(params=["optimum", "genai"])
def model_dir(request: pytest.FixtureRequest, tiny_model_dir: Path, tiny_llama_dir: Path) -> Path:
    return tiny_model_dir if request.param == "optimum" else tiny_llama_dir


class Harness:
    """An engine over a real runner, driven round by round."""

    def __init__(self, model_dir: Path, *, cache: bool, chunk: int = 256) -> None:
        loaded = load_model(
            model_dir,
            LoadSettings(
                max_batch_size=4,
                max_context_length=256,
                session=SessionSettings(device="cpu", intra_op_threads=1),
            ),
        )
        self.layout = loaded.info.format
        config = EngineConfig(
            max_batch_size=4,
            prefill_chunk_size=chunk,
            prefix_cache_bytes=(8 << 20) if cache else 0,
            prefix_block_tokens=BLOCK,
        )
        self.engine = Engine(loaded.runner, loaded.tokenizer, config)
        self.events: dict[str, list[EngineEvent]] = defaultdict(list)
        self._ids = itertools.count()

    def submit(self, prompt: list[int], *, tokens: int = 8) -> str:
        request_id = f"r{next(self._ids)}"
        request = GenerationRequest(
            request_id=request_id,
            model="tiny",
            prompt_ids=tuple(prompt),
            sampling=SamplingParams(),
            stopping=StopConditions(max_new_tokens=tokens, ignore_eos=True),
            received_at=0.0,
            logprobs=True,
            top_logprobs=3,
        )
        self.engine.submit(request, self.events[request_id].append)
        return request_id

    def result(self, request_id: str) -> GenerationResult:
        while not any(isinstance(e, Completed) for e in self.events[request_id]):
            self.engine.run_round()
        final = self.events[request_id][-1]
        assert isinstance(final, Completed)
        return final.result

    def generate(self, prompt: list[int], *, tokens: int = 8) -> GenerationResult:
        return self.result(self.submit(prompt, tokens=tokens))


def assert_same_output(got: GenerationResult, expected: GenerationResult, layout: str) -> None:
    assert got.token_ids == expected.token_ids
    if layout == "genai":
        # Log-probabilities come from the raw logits: equal floats mean bit-identical logits.
        assert [lp.logprob for lp in got.logprobs] == [lp.logprob for lp in expected.logprobs]
        assert [lp.top for lp in got.logprobs] == [lp.top for lp in expected.logprobs]


def test_a_prompt_after_a_cached_prefix_generates_what_it_would_without_the_cache(model_dir: Path) -> None:
    without = Harness(model_dir, cache=False)
    expected = without.generate(SYSTEM + QUESTIONS["b"])

    cached = Harness(model_dir, cache=True)
    first = cached.generate(SYSTEM + QUESTIONS["a"])
    second = cached.generate(SYSTEM + QUESTIONS["b"])

    assert first.cached_prompt_tokens == 0
    assert second.cached_prompt_tokens == 48  # the system prompt's three full blocks
    assert_same_output(second, expected, cached.layout)


def test_cached_prefixes_give_the_same_outputs_inside_a_busy_batch(model_dir: Path) -> None:
    prompts = [SYSTEM + QUESTIONS[name] for name in "cdef"]
    without = Harness(model_dir, cache=False)
    expected = [without.generate(p, tokens=12) for p in prompts]

    cached = Harness(model_dir, cache=True)
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


def test_two_prompts_with_the_same_prefix_arriving_together_process_it_once(model_dir: Path) -> None:
    h = Harness(model_dir, cache=True)
    first = h.submit(SYSTEM + QUESTIONS["a"])
    second = h.submit(SYSTEM + QUESTIONS["b"])

    results = [h.result(first), h.result(second)]

    assert [r.cached_prompt_tokens for r in results] == [0, 48]
    prompt_tokens = sum(r.prompt_tokens for r in results)
    assert h.engine.stats.prefill_tokens == prompt_tokens - 48


def test_a_multi_turn_chat_reuses_each_earlier_turn(model_dir: Path) -> None:
    without, cached = Harness(model_dir, cache=False), Harness(model_dir, cache=True)
    history: list[int] = []
    for turn, name in enumerate("abc"):
        prompt = history + QUESTIONS[name]
        got, want = cached.generate(prompt), without.generate(prompt)
        assert_same_output(got, want, cached.layout)
        # The previous turn's whole prompt is found again (its full blocks and its partial tail).
        previous_prompt = len(history) - 8  # the history ends with the previous answer's 8 tokens
        assert got.cached_prompt_tokens == (previous_prompt if turn else 0)
        history = prompt + list(got.token_ids)


def test_prompts_processed_in_small_chunks_cache_the_same_prefix(model_dir: Path) -> None:
    h = Harness(model_dir, cache=True, chunk=5)  # blocks complete across chunk boundaries
    h.generate(SYSTEM + QUESTIONS["a"])
    again = h.generate(SYSTEM + QUESTIONS["b"])
    assert again.cached_prompt_tokens == 48
    assert_same_output(again, Harness(model_dir, cache=False).generate(SYSTEM + QUESTIONS["b"]), h.layout)


def test_the_cache_reports_its_size_and_hits(model_dir: Path) -> None:
    h = Harness(model_dir, cache=True)
    h.generate(SYSTEM + QUESTIONS["a"])
    h.generate(SYSTEM + QUESTIONS["b"])

    stats = h.engine.prefix_cache_stats
    assert stats is not None
    assert stats.lookups == 2 and stats.hit_tokens == 48
    assert stats.prompt_tokens == 2 * len(SYSTEM + QUESTIONS["a"])
    assert 0 < stats.bytes <= stats.capacity_bytes == 8 << 20
    assert Harness(model_dir, cache=False).engine.prefix_cache_stats is None


def test_the_cache_s_bound_is_reported_when_the_engine_starts(
    tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("INFO", logger="tokenwire.server.engine.engine"):
        Harness(tiny_llama_dir, cache=True)
    assert any("prefix cache" in r.message and "8 MiB" in r.message for r in caplog.records)
