"""The server's metric instruments, and what records into them.

Requests the engine saw are recorded from its observer hooks, on the engine thread, once per
finished request and once per decode step; requests refused before they reached the engine
(queue full, invalid, unauthenticated) are counted by the API edge. Gauges are read when
metrics are collected, so nothing is recorded per token.

Names follow the OpenTelemetry GenAI semantic conventions where they name the thing
(gen_ai.server.*, gen_ai.request.model); the rest are tokenwire's own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple, Protocol

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from tokenwire.server.engine.prefix_cache import PrefixCacheStats
from tokenwire.server.engine.types import FinishReason, Outcome, TimingReport

REQUEST_DURATION = "gen_ai.server.request.duration"
TIME_TO_FIRST_TOKEN = "gen_ai.server.time_to_first_token"
TIME_PER_OUTPUT_TOKEN = "gen_ai.server.time_per_output_token"
QUEUE_DURATION = "tokenwire.server.queue.duration"
PREFILL_DURATION = "tokenwire.server.prefill.duration"
PACED_DURATION = "tokenwire.server.prefill.paced.duration"
REQUESTS = "tokenwire.server.requests"
PROMPT_TOKENS = "tokenwire.server.prompt_tokens"
GENERATED_TOKENS = "tokenwire.server.generated_tokens"
DECODE_STEPS = "tokenwire.engine.decode_steps"
PREEMPTIONS = "tokenwire.engine.preemptions"
PREFILLED_TOKENS = "tokenwire.engine.prefilled_tokens"
DRAFT_TOKENS = "tokenwire.engine.draft_tokens"
ACCEPTED_DRAFT_TOKENS = "tokenwire.engine.accepted_draft_tokens"
QUEUE_DEPTH = "tokenwire.engine.queue.depth"
BATCH_SIZE = "tokenwire.engine.batch.size"
KV_CACHE_USAGE = "tokenwire.engine.kv_cache.usage"
SLOT_USAGE = "tokenwire.engine.slots.usage"
PREFIX_CACHE_SIZE = "tokenwire.engine.prefix_cache.size"
PREFIX_CACHE_CAPACITY = "tokenwire.engine.prefix_cache.capacity"
PREFIX_CACHE_HIT_RATE = "tokenwire.engine.prefix_cache.hit_rate"
PREFIX_CACHE_HIT_TOKENS = "tokenwire.engine.prefix_cache.hit_tokens"

MODEL = "gen_ai.request.model"
OUTCOME = "outcome"
CALLER = "caller"
ADAPTER = "adapter"
"""The LoRA adapter a request ran with: on request counts only, and only where one was named
(adapters are few, bounded by --max-loras)."""
"""The caller's name from the token file; never a token."""

# Bucket boundaries in seconds, from the GenAI semantic conventions' advice for these metrics.
REQUEST_DURATION_BUCKETS = tuple(0.01 * 2**i for i in range(14))  # 0.01 s doubling to 81.92 s
TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
)
TIME_PER_OUTPUT_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class QueueSource(Protocol):
    """What the gauges read from an engine at collection time."""

    @property
    def model_name(self) -> str: ...

    @property
    def queue_depth(self) -> int: ...

    @property
    def slots(self) -> int: ...

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats | None: ...


class ServerMetrics:
    """The instruments of one server. Every method is safe to call from any thread.

    Implements EngineObserver, so it can be handed to the engines directly.
    """

    def __init__(self, meter: Meter, engines: Callable[[], Sequence[QueueSource]]) -> None:
        self._engines = engines
        # Latest occupancy per model, written by each engine thread after a scheduling round and
        # read by the collector: a dict store is atomic.
        self._occupancy: dict[str, _Occupancy] = {}
        self._request_duration = meter.create_histogram(
            REQUEST_DURATION,
            unit="s",
            description="Time from receipt of a request until it finished, whatever the outcome.",
            explicit_bucket_boundaries_advisory=REQUEST_DURATION_BUCKETS,
        )
        self._time_to_first_token = meter.create_histogram(
            TIME_TO_FIRST_TOKEN,
            unit="s",
            description="Time from receipt until the first generated token was ready.",
            explicit_bucket_boundaries_advisory=TIME_TO_FIRST_TOKEN_BUCKETS,
        )
        self._time_per_output_token = meter.create_histogram(
            TIME_PER_OUTPUT_TOKEN,
            unit="s",
            description="Mean time between consecutive generated tokens of a request (inter-token latency).",
            explicit_bucket_boundaries_advisory=TIME_PER_OUTPUT_TOKEN_BUCKETS,
        )
        self._queue_duration = meter.create_histogram(
            QUEUE_DURATION,
            unit="s",
            description="Time a request waited in the queue before work on it began.",
            explicit_bucket_boundaries_advisory=TIME_TO_FIRST_TOKEN_BUCKETS,
        )
        self._prefill_duration = meter.create_histogram(
            PREFILL_DURATION,
            unit="s",
            description="The model's work on a request's prompt: its tokens not found in the prefix cache, "
            "and copying those that were.",
            explicit_bucket_boundaries_advisory=TIME_TO_FIRST_TOKEN_BUCKETS,
        )
        self._paced_duration = meter.create_histogram(
            PACED_DURATION,
            unit="s",
            description="Time between the start of work on a request and its first token that its prompt "
            "waited on other requests (their decode steps under stall-free pacing, prompts ahead of it); "
            "time to first token = queue + paced + prefill.",
            explicit_bucket_boundaries_advisory=TIME_TO_FIRST_TOKEN_BUCKETS,
        )
        self._requests = meter.create_counter(
            REQUESTS,
            unit="{request}",
            description="Requests by outcome, those refused at admission included.",
        )
        self._prompt_tokens = meter.create_counter(
            PROMPT_TOKENS, unit="{token}", description="Prompt tokens of the requests the engine finished."
        )
        self._generated_tokens = meter.create_counter(
            GENERATED_TOKENS, unit="{token}", description="Tokens generated, whatever the request's outcome."
        )
        self._decode_steps = meter.create_counter(
            DECODE_STEPS, unit="{step}", description="Batched decode steps the engine ran."
        )
        self._draft_tokens = meter.create_counter(
            DRAFT_TOKENS, unit="{token}", description="Speculative draft tokens verified in decode steps."
        )
        self._accepted_draft_tokens = meter.create_counter(
            ACCEPTED_DRAFT_TOKENS,
            unit="{token}",
            description="Of the speculative draft tokens verified, those accepted as generated tokens.",
        )
        self._prefilled_tokens = meter.create_counter(
            PREFILLED_TOKENS,
            unit="{token}",
            description=(
                "Prompt tokens the model processed: not those copied from the prefix cache, nor "
                "those a completion copied from another of its request's (n > 1)."
            ),
        )
        self._preemptions = meter.create_counter(
            PREEMPTIONS,
            unit="{request}",
            description=(
                "Requests in a slot (decoding, or prefilling their prompt) swapped out for a "
                "request owed it, by the caller that gave it up."
            ),
        )
        meter.create_observable_gauge(
            QUEUE_DEPTH,
            callbacks=[self._observe_queue_depth],
            unit="{request}",
            description="Requests waiting for a slot, now.",
        )
        meter.create_observable_gauge(
            BATCH_SIZE,
            callbacks=[self._observe_batch_size],
            unit="{sequence}",
            description="Sequences in the running batch after the latest scheduling round.",
        )
        meter.create_observable_gauge(
            KV_CACHE_USAGE,
            callbacks=[self._observe_kv_cache_usage],
            unit="1",
            description="Fraction of the KV cache's token positions held by running sequences after the "
            "latest scheduling round (0 to 1).",
        )
        meter.create_observable_gauge(
            SLOT_USAGE,
            callbacks=[self._observe_slot_usage],
            unit="1",
            description="Fraction of the batch's sequence slots in use after the latest scheduling round "
            "(0 to 1).",
        )
        meter.create_observable_gauge(
            PREFIX_CACHE_SIZE,
            callbacks=[self._observe_prefix_cache("bytes")],
            unit="By",
            description="Memory the prefix cache's KV rows take (models with the cache on).",
        )
        meter.create_observable_gauge(
            PREFIX_CACHE_CAPACITY,
            callbacks=[self._observe_prefix_cache("capacity_bytes")],
            unit="By",
            description="Most memory the prefix cache may take (--prefix-cache-mb).",
        )
        meter.create_observable_gauge(
            PREFIX_CACHE_HIT_RATE,
            callbacks=[self._observe_prefix_cache("hit_rate")],
            unit="1",
            description="Fraction of prompt tokens found in the prefix cache since the server started "
            "(0 to 1).",
        )
        meter.create_observable_counter(
            PREFIX_CACHE_HIT_TOKENS,
            callbacks=[self._observe_prefix_cache("hit_tokens")],
            unit="{token}",
            description="Prompt tokens whose KV rows were copied from the prefix cache instead of prefilled.",
        )

    # -- EngineObserver (engine thread) ---------------------------------------------------------

    def request_finished(
        self,
        *,
        model: str,
        outcome: Outcome,
        finish_reason: FinishReason | None,
        prompt_tokens: int,
        completion_tokens: int,
        timing: TimingReport,
        caller: str = "anonymous",
        adapter: str = "",
    ) -> None:
        by_model = {MODEL: model}
        by_outcome = {MODEL: model, OUTCOME: outcome.value}
        # Callers come from the token file (or are the one anonymous caller), so the label's
        # values are few and known in advance. Request counts carry it; the latency histograms
        # stay per model to keep their series few.
        self._requests.add(1, {**by_outcome, CALLER: caller, **_adapter_label(adapter)})
        self._request_duration.record(timing.total, by_outcome)
        self._queue_duration.record(timing.queued, by_model)
        if timing.time_to_first_token is not None:
            self._time_to_first_token.record(timing.time_to_first_token, by_model)
        if timing.prefill is not None:
            self._prefill_duration.record(timing.prefill, by_model)
        if timing.paced is not None:
            self._paced_duration.record(timing.paced, by_model)
        if timing.time_per_output_token is not None:
            self._time_per_output_token.record(timing.time_per_output_token, by_model)
        self._prompt_tokens.add(prompt_tokens, by_model)
        if completion_tokens:
            self._generated_tokens.add(completion_tokens, by_model)

    def decode_step(self, *, model: str, batch_size: int, seconds: float) -> None:
        self._decode_steps.add(1, {MODEL: model})

    def prefill_chunk(self, *, model: str, tokens: int, seconds: float) -> None:
        self._prefilled_tokens.add(tokens, {MODEL: model})

    def drafts_verified(self, *, model: str, drafted: int, accepted: int) -> None:
        self._draft_tokens.add(drafted, {MODEL: model})
        self._accepted_draft_tokens.add(accepted, {MODEL: model})

    def preempted(self, *, model: str, caller: str) -> None:
        self._preemptions.add(1, {MODEL: model, CALLER: caller})

    def occupancy(
        self, *, model: str, queued: int, running: int, slots: int, kv_positions_used: int, kv_positions: int
    ) -> None:
        self._occupancy[model] = _Occupancy(running, slots, kv_positions_used, kv_positions)

    # -- API edge (event loop) ------------------------------------------------------------------

    def request_refused(
        self, *, model: str, outcome: Outcome, caller: str = "anonymous", adapter: str = ""
    ) -> None:
        """A request that never reached the engine: rejected, invalid or unauthenticated."""
        self._requests.add(
            1, {MODEL: model, OUTCOME: outcome.value, CALLER: caller, **_adapter_label(adapter)}
        )

    # -- gauges (collector thread) --------------------------------------------------------------

    def _observe_queue_depth(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(engine.queue_depth, {MODEL: engine.model_name}) for engine in self._engines()]

    def _observe_batch_size(self, options: CallbackOptions) -> Iterable[Observation]:
        return [
            Observation(self._latest(engine).running, {MODEL: engine.model_name})
            for engine in self._engines()
        ]

    def _observe_kv_cache_usage(self, options: CallbackOptions) -> Iterable[Observation]:
        return [
            Observation(_fraction(latest.kv_positions_used, latest.kv_positions), {MODEL: engine.model_name})
            for engine, latest in ((engine, self._latest(engine)) for engine in self._engines())
        ]

    def _observe_slot_usage(self, options: CallbackOptions) -> Iterable[Observation]:
        return [
            Observation(_fraction(latest.running, latest.slots), {MODEL: engine.model_name})
            for engine, latest in ((engine, self._latest(engine)) for engine in self._engines())
        ]

    def _observe_prefix_cache(self, figure: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            observations = []
            for engine in self._engines():
                stats = engine.prefix_cache_stats
                if stats is not None:
                    observations.append(Observation(getattr(stats, figure), {MODEL: engine.model_name}))
            return observations

        return observe

    def _latest(self, engine: QueueSource) -> _Occupancy:
        return self._occupancy.get(engine.model_name, _Occupancy(0, engine.slots, 0, 0))


class _Occupancy(NamedTuple):
    running: int
    slots: int
    kv_positions_used: int
    kv_positions: int


def _adapter_label(adapter: str) -> dict[str, str]:
    return {ADAPTER: adapter} if adapter else {}


def _fraction(part: int, whole: int) -> float:
    return part / whole if whole else 0.0
