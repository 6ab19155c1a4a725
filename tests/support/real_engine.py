"""An engine over a real tiny model's ONNX Runtime runner, driven round by round.

For the tests whose claim is about what the models compute (prefix caching, preemption): greedy
outputs with a feature must equal those without it, so the runner is the real one and only the
rounds are driven by the test (`Engine.run_round`), never by a thread.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

from tests.support.tiny_models import TinyModel
from tokenwire.server.engine.engine import Engine, EngineConfig
from tokenwire.server.engine.types import (
    ANONYMOUS,
    Caller,
    Completed,
    EngineEvent,
    GenerationRequest,
    GenerationResult,
    StopConditions,
    TokensGenerated,
)
from tokenwire.server.sampling.params import SamplingParams


class RealEngine:
    """Requests are greedy, ignore EOS and ask for log-probabilities (top 3), so two runs can be
    compared token for token and, on the shared-buffer layout, bit for bit."""

    def __init__(self, model: TinyModel, config: EngineConfig) -> None:
        loaded = model.load(max_batch_size=config.max_batch_size, max_context_length=256)
        self.layout = loaded.info.format
        self.runner = loaded.runner
        self.tokenizer = loaded.tokenizer
        self.engine = Engine(loaded.runner, loaded.tokenizer, config)
        self.events: dict[str, list[EngineEvent]] = defaultdict(list)
        self._ids = itertools.count()

    def submit(
        self,
        prompt: list[int],
        *,
        tokens: int = 8,
        caller: Caller = ANONYMOUS,
        stop: tuple[str, ...] = (),
        sampling: SamplingParams | None = None,
        n: int = 1,
    ) -> str:
        request_id = f"r{next(self._ids)}"
        request = GenerationRequest(
            request_id=request_id,
            model="tiny",
            prompt_ids=tuple(prompt),
            sampling=sampling or SamplingParams(),
            stopping=StopConditions(max_new_tokens=tokens, stop_strings=stop, ignore_eos=True),
            received_at=0.0,
            logprobs=True,
            top_logprobs=3,
            caller=caller,
            n=n,
        )
        self.engine.submit(request, self.events[request_id].append)
        return request_id

    def streamed(self, request_id: str) -> list[int]:
        """Every token the request's stream carried, in order."""
        return [t for e in self.events[request_id] if isinstance(e, TokensGenerated) for t in e.token_ids]

    def result(self, request_id: str) -> GenerationResult:
        """Run rounds until the request completes; its result."""
        while not any(isinstance(e, Completed) for e in self.events[request_id]):
            self.engine.run_round()
        final = self.events[request_id][-1]
        assert isinstance(final, Completed)
        return final.result

    def generate(self, prompt: list[int], *, tokens: int = 8) -> GenerationResult:
        return self.result(self.submit(prompt, tokens=tokens))


def assert_same_output(got: GenerationResult, expected: GenerationResult, layout: str) -> None:
    """Same tokens; on the shared-buffer (GenAI) layout the same log-probabilities to the bit,
    which come from the raw logits, so equal floats mean bit-identical logits."""
    assert got.token_ids == expected.token_ids
    if layout == "genai":
        assert [lp.logprob for lp in got.logprobs] == [lp.logprob for lp in expected.logprobs]
        assert [lp.top for lp in got.logprobs] == [lp.top for lp in expected.logprobs]
