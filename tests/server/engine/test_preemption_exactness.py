"""Preempted generations on the real tiny models: swapped out and back in, they produce what
they would have produced in their slot all along.

The engine is driven round by round over the real ONNX Runtime runners of both KV layouts. A
generation swapped out mid-way (its KV rows copied aside) and swapped back in must give, greedy,
the same tokens as the same prompt generated alone; on the shared-buffer (GenAI) layout bit for
bit, which the log-probabilities (computed from the raw logits) show.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from pathlib import Path

import pytest

from tokenwire.server.engine.engine import Engine, EngineConfig
from tokenwire.server.engine.types import (
    Caller,
    Completed,
    EngineEvent,
    GenerationRequest,
    GenerationResult,
    StopConditions,
    TokensGenerated,
)
from tokenwire.server.models.loader import LoadSettings, load_model
from tokenwire.server.models.session import SessionSettings
from tokenwire.server.sampling.params import SamplingParams

FLOOD = Caller("flood")
QUIET = Caller("quiet")
PROMPTS = {
    name: [(i * 29 + seed * 7) % 400 + 40 for i in range(10 + 9 * seed)] for seed, name in enumerate("abc")
}


@pytest.fixture(params=["optimum", "genai"])
def model_dir(request: pytest.FixtureRequest, tiny_model_dir: Path, tiny_llama_dir: Path) -> Path:
    return tiny_model_dir if request.param == "optimum" else tiny_llama_dir


class Harness:
    def __init__(self, model_dir: Path, *, slots: int) -> None:
        loaded = load_model(
            model_dir,
            LoadSettings(
                max_batch_size=slots,
                max_context_length=256,
                session=SessionSettings(device="cpu", intra_op_threads=1),
            ),
        )
        self.layout = loaded.info.format
        config = EngineConfig(max_batch_size=slots, prefix_cache_bytes=0, batch_reserved_slots=0)
        self.engine = Engine(loaded.runner, loaded.tokenizer, config)
        self.events: dict[str, list[EngineEvent]] = defaultdict(list)
        self._ids = itertools.count()

    def submit(self, prompt: list[int], caller: Caller, *, tokens: int) -> str:
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
            caller=caller,
        )
        self.engine.submit(request, self.events[request_id].append)
        return request_id

    def streamed(self, request_id: str) -> list[int]:
        return [t for e in self.events[request_id] if isinstance(e, TokensGenerated) for t in e.token_ids]

    def result(self, request_id: str) -> GenerationResult:
        while not any(isinstance(e, Completed) for e in self.events[request_id]):
            self.engine.run_round()
        final = self.events[request_id][-1]
        assert isinstance(final, Completed)
        return final.result


def test_a_generation_swapped_out_and_back_in_generates_what_it_would_have_alone(model_dir: Path) -> None:
    alone = Harness(model_dir, slots=2)
    expected = {name: alone.result(alone.submit(PROMPTS[name], FLOOD, tokens=24)) for name in "ab"}

    busy = Harness(model_dir, slots=2)
    flood = {name: busy.submit(PROMPTS[name], FLOOD, tokens=24) for name in "ab"}
    for _ in range(8):  # both decoding, some tokens in
        busy.engine.run_round()
    quiet = busy.submit(PROMPTS["c"], QUIET, tokens=6)
    busy.engine.run_round()
    assert busy.engine.stats.preemptions == 1
    busy.result(quiet)
    results = {name: busy.result(request_id) for name, request_id in flood.items()}
    assert busy.engine.stats.resumptions == 1

    for name, got in results.items():
        assert got.token_ids == expected[name].token_ids, name
        assert busy.streamed(flood[name]) == list(got.token_ids), "every token streamed once"
        if busy.layout == "genai":
            # Equal floats: the logits after the swap are bit-identical to those without one.
            assert [lp.logprob for lp in got.logprobs] == [lp.logprob for lp in expected[name].logprobs]
