"""The load generator: closed-loop concurrency and open-loop Poisson arrivals over one AsyncClient.

Every request is greedy, ignores end-of-sequence and is built from token ids, so its prompt and
output lengths are exactly the ones drawn. The client's retries are off: a request refused with
RESOURCE_EXHAUSTED is counted as rejected, not silently resent.

Two workloads exercise a server's prefix cache: a shared prefix (every prompt starts with the
same tokens, like a system prompt) and multi-turn chats (each turn's prompt is the whole
conversation so far, the previous turns' prompts and answers, followed by a new question).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field, replace

import grpc

from tokenwire.client.aio import AsyncClient
from tokenwire.client.bench.stats import LevelSummary, LoadLevel, Outcome, RequestRecord, summarize_level
from tokenwire.client.errors import TokenwireError
from tokenwire.client.types import (
    Chunk,
    Completed,
    Failed,
    GenerateOptions,
    Generation,
    ModelDescription,
    Sampling,
    Stopping,
)

_Send = Callable[[int, "_Conversation"], Coroutine[object, object, None]]

_FIRST_ORDINARY_TOKEN = 32
"""Prompt ids are drawn from [32, vocab): low ids are where vocabularies keep special tokens."""


@dataclass(frozen=True)
class LengthDistribution:
    """A token count: fixed (low == high) or uniform over [low, high]."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> LengthDistribution:
        """Parse `100` (fixed) or `uniform:50:150` (uniform over 50..150 inclusive)."""
        parts = text.strip().split(":")
        try:
            if len(parts) == 1:
                low = high = int(parts[0])
            elif len(parts) == 3 and parts[0] == "uniform":
                low, high = int(parts[1]), int(parts[2])
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"{text!r} is neither N nor uniform:LOW:HIGH") from None
        if low < 1 or high < low:
            raise ValueError(f"{text!r}: need 1 <= LOW <= HIGH")
        return cls(low, high)

    def draw(self, rng: random.Random) -> int:
        return self.low if self.low == self.high else rng.randint(self.low, self.high)

    def describe(self) -> str:
        return str(self.low) if self.low == self.high else f"uniform:{self.low}:{self.high}"


@dataclass(frozen=True)
class BenchConfig:
    target: str
    levels: tuple[LoadLevel, ...]
    prompt_tokens: LengthDistribution = field(default_factory=lambda: LengthDistribution(100, 100))
    max_new_tokens: LengthDistribution = field(default_factory=lambda: LengthDistribution(128, 128))
    streaming: bool = True
    requests: int | None = None
    """Requests per level; with `duration` as well, whichever limit is reached first."""
    duration: float | None = None
    """Seconds per level during which new requests are sent; those in flight then still finish."""
    warmup: int = 0
    """Requests sent once before the first level and left out of every figure."""
    model: str = ""
    seed: int = 0
    request_timeout: float = 300.0
    """gRPC deadline of each request in seconds, so a stuck server cannot hang the benchmark."""
    token: str | None = None
    shared_prefix_tokens: int = 0
    """Tokens every prompt starts with (the same for every request), before its drawn tokens."""
    chat_turns: int = 1
    """Turns per conversation; each turn resends the conversation so far. 1: independent requests."""

    def __post_init__(self) -> None:
        if not self.levels:
            raise ValueError("give at least one concurrency or rate level")
        if self.requests is None and self.duration is None:
            raise ValueError("give --requests or --duration (or both) to bound each level")
        if self.requests is not None and self.requests < 1:
            raise ValueError("requests per level must be at least 1")
        if self.duration is not None and self.duration <= 0:
            raise ValueError("duration must be positive")
        if self.shared_prefix_tokens < 0:
            raise ValueError("shared prefix tokens must not be negative")
        if self.chat_turns < 1:
            raise ValueError("chat turns must be at least 1")
        for level in self.levels:
            if level.value <= 0 or (level.kind == "concurrency" and level.value != int(level.value)):
                raise ValueError(f"invalid load level {level.label}")


@dataclass(frozen=True)
class BenchReport:
    config: BenchConfig
    model: ModelDescription
    levels: tuple[LevelSummary, ...]
    records: tuple[tuple[RequestRecord, ...], ...]
    """Each level's request records, in the order of `levels`."""


class Progress:
    """Hooks the load generator calls as it goes; the default does nothing."""

    def level_started(self, level: LoadLevel, expected_requests: int | None) -> None:
        """A level begins; `expected_requests` is None when it is bounded by time only."""

    def request_finished(self, record: RequestRecord) -> None:
        """A measured request ended (completed, rejected or failed)."""

    def level_finished(self, summary: LevelSummary) -> None:
        """A level's last request ended."""


async def run_bench(config: BenchConfig, progress: Progress | None = None) -> BenchReport:
    """Run every level of the sweep against a server and summarise each."""
    hooks = progress or Progress()
    async with AsyncClient(config.target, token=config.token, retries=False) as client:
        model = _pick_model(await client.list_models(), config.model)
        generator = _LoadGenerator(client, config, model)
        if config.warmup:
            await generator.warm_up(config.warmup)
        summaries: list[LevelSummary] = []
        all_records: list[tuple[RequestRecord, ...]] = []
        for number, level in enumerate(config.levels):
            hooks.level_started(level, _expected_requests(config, level))
            records, wall = await generator.run_level(level, number, hooks)
            summary = summarize_level(level, records, wall)
            hooks.level_finished(summary)
            summaries.append(summary)
            all_records.append(tuple(records))
    return BenchReport(config, model, tuple(summaries), tuple(all_records))


def _pick_model(models: list[ModelDescription], name: str) -> ModelDescription:
    if not models:
        raise TokenwireError(grpc.StatusCode.FAILED_PRECONDITION, "the server serves no model")
    if not name:
        return next((m for m in models if m.is_default), models[0])
    for model in models:
        if model.name == name:
            return model
    served = ", ".join(m.name for m in models)
    raise TokenwireError(grpc.StatusCode.NOT_FOUND, f"model {name!r} is not served (served: {served})")


def _expected_requests(config: BenchConfig, level: LoadLevel) -> int | None:
    if config.requests is not None:
        return config.requests
    if level.kind == "rate" and config.duration is not None:
        return round(level.value * config.duration)
    return None


class _LoadGenerator:
    def __init__(self, client: AsyncClient, config: BenchConfig, model: ModelDescription) -> None:
        self._client = client
        self._config = config
        self._model = model
        self._ids_high = max(_FIRST_ORDINARY_TOKEN + 1, model.vocab_size)
        self._ids_low = min(_FIRST_ORDINARY_TOKEN, self._ids_high - 1)
        prefix_rng = random.Random(f"{config.seed}:shared-prefix")
        self._shared_prefix = self._token_ids(prefix_rng, config.shared_prefix_tokens)

    async def warm_up(self, count: int) -> None:
        rng = random.Random(self._config.seed - 1)
        parallel = max(1, min(count, self._model.max_batch_size or 1))
        remaining = list(range(count))

        async def worker() -> None:
            while remaining:
                index = remaining.pop()
                await self._request(index, rng, 0.0, _Conversation())

        await asyncio.gather(*(worker() for _ in range(parallel)))

    async def run_level(
        self, level: LoadLevel, number: int, hooks: Progress
    ) -> tuple[list[RequestRecord], float]:
        # One seeded RNG per level: the same sweep sends the same prompts in the same order.
        rng = random.Random(f"{self._config.seed}:{number}")
        records: list[RequestRecord] = []
        started = time.perf_counter()

        async def send(index: int, conversation: _Conversation) -> None:
            record = await self._request(index, rng, time.perf_counter() - started, conversation)
            records.append(record)
            hooks.request_finished(record)

        if level.kind == "concurrency":
            await self._closed_loop(int(level.value), started, send)
        else:
            await self._open_loop(level.value, started, rng, send)
        wall = time.perf_counter() - started
        records.sort(key=lambda r: r.index)
        return records, wall

    async def _closed_loop(self, clients: int, started: float, send: _Send) -> None:
        # Each client sends its next request as soon as its previous one ends; the request
        # numbers are shared, so --requests bounds the level's total, not each client's.
        # In a chat workload each client holds one conversation at a time, turn after turn.
        sent = 0

        async def client_loop() -> None:
            nonlocal sent
            conversation = _Conversation()
            while self._may_send(started, sent=sent):
                index = sent
                sent += 1
                if conversation.turns == self._config.chat_turns:
                    conversation = _Conversation()
                await send(index, conversation)

        await asyncio.gather(*(client_loop() for _ in range(clients)))

    async def _open_loop(
        self,
        rate: float,
        started: float,
        rng: random.Random,
        send: _Send,
    ) -> None:
        # Arrival times are fixed by the seed, not by how fast the server answers: an open loop
        # keeps sending while the server falls behind, which is what shows its queue filling.
        # In a chat workload an arrival is a conversation, whose turns follow one another.
        in_flight: set[asyncio.Task[None]] = set()
        index = 0
        next_at = rng.expovariate(rate)
        turns = self._config.chat_turns

        async def converse(first: int) -> None:
            conversation = _Conversation()
            for turn in range(turns):
                await send(first + turn, conversation)

        while self._may_send(started, sent=index, at=next_at):
            delay = started + next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(converse(index))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
            index += turns
            next_at += rng.expovariate(rate)
        if in_flight:
            await asyncio.gather(*in_flight)

    def _may_send(self, started: float, *, sent: int, at: float | None = None) -> bool:
        config = self._config
        if config.requests is not None and sent >= config.requests:
            return False
        elapsed = time.perf_counter() - started if at is None else at
        return config.duration is None or elapsed < config.duration

    def _token_ids(self, rng: random.Random, count: int) -> list[int]:
        return [rng.randrange(self._ids_low, self._ids_high) for _ in range(count)]

    async def _request(
        self, index: int, rng: random.Random, sent_at: float, conversation: _Conversation
    ) -> RequestRecord:
        question_tokens = self._config.prompt_tokens.draw(rng)
        max_new_tokens = self._config.max_new_tokens.draw(rng)
        question = self._token_ids(rng, question_tokens)
        history = conversation.history or self._shared_prefix
        prompt = [*history, *question]
        prompt_tokens = len(prompt)
        options = GenerateOptions(
            model=self._model.name,
            sampling=Sampling(temperature=0.0),
            stopping=Stopping(max_new_tokens=max_new_tokens, ignore_eos=True),
        )
        base = RequestRecord(
            index=index,
            sent_at=sent_at,
            prompt_tokens=prompt_tokens,
            max_new_tokens=max_new_tokens,
            outcome="failed",
            turn=conversation.turns,
        )
        conversation.turns += 1
        try:
            if self._config.streaming:
                record, answer = await self._streamed(base, prompt, options)
            else:
                record, answer = await self._unary(base, prompt, options)
        except TokenwireError as error:
            return _refused(base, error)
        conversation.history = [*prompt, *answer]
        return record

    async def _unary(
        self, base: RequestRecord, prompt: list[int], options: GenerateOptions
    ) -> tuple[RequestRecord, list[int]]:
        sent = time.perf_counter()
        generation = await self._client.generate(prompt, options, deadline=self._config.request_timeout)
        return _completed(base, generation, latency=time.perf_counter() - sent), list(generation.token_ids)

    async def _streamed(
        self, base: RequestRecord, prompt: list[int], options: GenerateOptions
    ) -> tuple[RequestRecord, list[int]]:
        """The request's record and the token ids it generated."""
        sent = time.perf_counter()
        first_token: float | None = None
        last_chunk = sent
        gaps: list[float] = []
        answer: list[int] = []
        events = self._client.stream(prompt, options, deadline=self._config.request_timeout)
        async for event in events:
            now = time.perf_counter()
            if isinstance(event, Chunk) and event.token_ids:
                answer.extend(event.token_ids)
                if first_token is None:
                    first_token = now - sent
                else:
                    gaps.append(now - last_chunk)
                last_chunk = now
            elif isinstance(event, Failed):
                raise event.error if isinstance(event.error, TokenwireError) else _wrap(event.error)
            elif isinstance(event, Completed):
                record = _completed(base, event.generation, latency=now - sent)
                return _with_stream_times(record, first_token, tuple(gaps)), answer
        return _with_error(base, "failed", "stream ended before the generation completed"), answer


@dataclass
class _Conversation:
    """A chat in progress: what the next turn resends, and how many turns it has had."""

    history: list[int] = field(default_factory=list)
    turns: int = 0


def _wrap(error: Exception) -> TokenwireError:
    return TokenwireError(grpc.StatusCode.UNKNOWN, str(error))


def _completed(base: RequestRecord, generation: Generation, *, latency: float) -> RequestRecord:
    timing = generation.timing
    return RequestRecord(
        index=base.index,
        sent_at=base.sent_at,
        prompt_tokens=base.prompt_tokens,
        max_new_tokens=base.max_new_tokens,
        outcome="ok",
        turn=base.turn,
        latency=latency,
        output_tokens=generation.completion_tokens,
        server_prompt_tokens=generation.prompt_tokens,
        server_queued=timing.queued,
        server_first_token=timing.time_to_first_token,
        server_prefill=timing.prefill,
        server_time_per_output_token=timing.time_per_output_token,
        cached_prompt_tokens=generation.cached_prompt_tokens,
        server_paced=timing.paced,
    )


def _with_stream_times(
    record: RequestRecord, first_token: float | None, gaps: tuple[float, ...]
) -> RequestRecord:
    return replace(record, first_token=first_token, token_gaps=gaps)


def _with_error(base: RequestRecord, outcome: Outcome, message: str) -> RequestRecord:
    return replace(base, outcome=outcome, error=message)


def _refused(base: RequestRecord, error: TokenwireError) -> RequestRecord:
    outcome: Outcome = "rejected" if error.code == grpc.StatusCode.RESOURCE_EXHAUSTED else "failed"
    return _with_error(base, outcome, f"{error.code.name}: {error.message}")
