"""An engine over the fake runner, with named callers and priorities, driven round by round.

Shared by the tests of admission order (priorities, fair turns, queue shares) and of preemption;
what they check is who holds a slot when, not what a model computes.
"""

from __future__ import annotations

from collections import defaultdict

from tests.support.fake_runner import FixedLogitsRunner, ManualClock, RowCopyingRunner
from tokenwire.server.engine.engine import Engine, EngineConfig
from tokenwire.server.engine.types import (
    Caller,
    EngineEvent,
    EventSink,
    GenerationRequest,
    Priority,
    Started,
    StopConditions,
    TokensGenerated,
)
from tokenwire.server.model_tools.tiny_tokenizer import build_byte_level_tokenizer
from tokenwire.server.sampling.params import SamplingParams
from tokenwire.server.text.tokenizer import Tokenizer

TOKENIZER = Tokenizer(build_byte_level_tokenizer(300))
TOKEN = TOKENIZER.encode("a", add_special_tokens=False)[0]
FLOOD = Caller("flood")
QUIET = Caller("quiet")


class Harness:
    """`copies_rows`: the runner can swap KV rows out and in, so the engine may preempt."""

    def __init__(
        self,
        *,
        slots: int,
        queue: int,
        reserved: int = 1,
        copies_rows: bool = False,
        preemption: bool = True,
        prompt_tokens: int = 4,
        chunk: int = 256,
    ) -> None:
        """`chunk` with stall-free pacing off: while anything decodes, one chunk of prompt work a
        round, so prompts of `prompt_tokens` longer than it take several rounds."""
        self.clock = ManualClock()
        runner_type = RowCopyingRunner if copies_rows else FixedLogitsRunner
        self.runner = runner_type(vocab_size=TOKENIZER.vocab_size, token=TOKEN, slots=slots)
        config = EngineConfig(
            max_batch_size=slots,
            max_queue_size=queue,
            batch_reserved_slots=reserved,
            preemption=preemption,
            prefill_chunk_size=chunk,
            stall_free=chunk >= 256,
            prefix_cache_mb=0,
        )
        self.prompt_tokens = prompt_tokens
        self.engine = Engine(self.runner, TOKENIZER, config, clock=self.clock)
        self.events: dict[str, list[EngineEvent]] = defaultdict(list)
        self.started: list[str] = []
        self.keys: dict[str, int] = {}
        """The engine's key of each request, for aborts."""

    def submit(
        self,
        request_id: str,
        caller: Caller,
        priority: Priority = Priority.DEFAULT,
        tokens: int = 50,
        deadline: float | None = None,
        n: int = 1,
    ) -> None:
        request = GenerationRequest(
            request_id=request_id,
            model="fake",
            prompt_ids=(TOKEN,) * self.prompt_tokens,
            sampling=SamplingParams(),
            stopping=StopConditions(max_new_tokens=tokens),
            received_at=self.clock(),
            caller=caller,
            priority=priority,
            deadline=deadline,
            n=n,
        )
        self.keys[request_id] = self.engine.submit(request, self._sink(request_id)).key

    def tokens_of(self, request_id: str) -> int:
        return sum(len(e.token_ids) for e in self.events[request_id] if isinstance(e, TokensGenerated))

    def _sink(self, request_id: str) -> EventSink:
        def receive(event: EngineEvent) -> None:
            self.events[request_id].append(event)
            if isinstance(event, Started):
                self.started.append(request_id)

        return receive

    def rounds(self, count: int) -> None:
        for _ in range(count):
            self.engine.run_round()
