"""Domain types of a generation: the validated request, the events it produces, its result."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from tokenwire.server.engine.errors import ErrorKind, GenerationError
from tokenwire.server.sampling.params import ResponseFormat, SamplingParams


class FinishReason(Enum):
    LENGTH = "length"
    EOS = "eos"
    STOP = "stop"
    CANCELLED = "cancelled"


class Outcome(Enum):
    """How a request ended: the one list of values metrics, traces and the access log label it with."""

    OK = "ok"
    CANCELLED = "cancelled"
    DEADLINE = "deadline"
    UNAVAILABLE = "unavailable"
    ERROR = "error"
    STOPPED = "stopped"
    """Stopped by the server because its client left the output unread past a bound."""
    REJECTED = "rejected"
    """Refused at admission: the queue was full or the server was not taking work."""
    INVALID = "invalid"
    """Refused at admission: the request named no model it could be served by, or broke a bound."""
    UNAUTHENTICATED = "unauthenticated"

    @classmethod
    def of_finish(cls, finish: FinishReason) -> Outcome:
        return cls.CANCELLED if finish is FinishReason.CANCELLED else cls.OK

    @classmethod
    def of_failure(cls, error: GenerationError) -> Outcome:
        """The outcome of a request the engine accepted and then failed."""
        return _FAILURE_OUTCOMES.get(error.kind, cls.ERROR)

    @classmethod
    def of_refusal(cls, error: GenerationError) -> Outcome:
        """The outcome of a request refused before the engine accepted it."""
        return _REFUSAL_OUTCOMES.get(error.kind, cls.ERROR)


_FAILURE_OUTCOMES = {
    ErrorKind.DEADLINE_EXCEEDED: Outcome.DEADLINE,
    ErrorKind.UNAVAILABLE: Outcome.UNAVAILABLE,
    ErrorKind.RESOURCE_EXHAUSTED: Outcome.STOPPED,
}
_REFUSAL_OUTCOMES = {
    ErrorKind.INVALID_ARGUMENT: Outcome.INVALID,
    ErrorKind.NOT_FOUND: Outcome.INVALID,
    ErrorKind.ALREADY_EXISTS: Outcome.INVALID,
    ErrorKind.PERMISSION_DENIED: Outcome.INVALID,
    ErrorKind.RESOURCE_EXHAUSTED: Outcome.REJECTED,
    ErrorKind.UNAVAILABLE: Outcome.REJECTED,
    ErrorKind.UNAUTHENTICATED: Outcome.UNAUTHENTICATED,
    ErrorKind.DEADLINE_EXCEEDED: Outcome.DEADLINE,
}


class AbortReason(Enum):
    """Why a live request is stopped before it finishes by itself."""

    CANCELLED = "cancelled"
    """The client asked to cancel: the request completes with FinishReason.CANCELLED."""
    DISCONNECTED = "disconnected"
    """The caller went away; the request is stopped and nobody hears about it."""
    DEADLINE = "deadline"
    """The request's deadline passed: it fails with DEADLINE_EXCEEDED."""
    SHUTDOWN = "shutdown"
    """The server is stopping and could not finish it: it fails with UNAVAILABLE."""
    OUTPUT_UNREAD = "output_unread"
    """Its call's output waited unread past the unread-output timeout: it fails with
    RESOURCE_EXHAUSTED (reason STREAM_OUTPUT_UNREAD). The call has told its client already, so,
    as for DISCONNECTED, the call hears nothing more; the ending is on record as `stopped`."""
    BACKLOG = "backlog"
    """Its call's unread output passed the call's byte bound: as OUTPUT_UNREAD, reason STREAM_BACKLOG."""


_UNREAD_REASONS = {AbortReason.OUTPUT_UNREAD: "STREAM_OUTPUT_UNREAD", AbortReason.BACKLOG: "STREAM_BACKLOG"}


def unread_output_error(reason: AbortReason) -> GenerationError | None:
    """The failure a request stopped for its unread output ends with; None for other reasons."""
    code = _UNREAD_REASONS.get(reason)
    if code is None:
        return None
    return GenerationError(
        ErrorKind.RESOURCE_EXHAUSTED, "stopped: its call left the output unread", reason=code
    )


class Priority(Enum):
    """How urgently a request wants a slot; lower values are admitted first."""

    INTERACTIVE = 0
    DEFAULT = 1
    BATCH = 2


@dataclass(frozen=True)
class Caller:
    """Who sent a request, as the server's token file names them (never the token itself)."""

    name: str
    weight: float = 1.0
    """Share of the slots relative to other callers of the same priority."""
    max_queued: int | None = None
    """Most requests this caller may have waiting; None: only its fair share limits it."""
    group: str | None = None
    """Callers of one group reuse each other's cached prompt prefixes; None: a group of its own."""
    adapters: frozenset[str] | None = None
    """The LoRA adapters this caller may ask for; None: every one served (the base model always)."""

    @property
    def tenant(self) -> str:
        """Whose cached prompt prefixes this caller's requests may reuse (and add to).

        Names and groups are told apart by their prefix, so a caller named like a group never
        lands in that group's cache.
        """
        return f"caller:{self.name}" if self.group is None else f"group:{self.group}"


ANONYMOUS = Caller("anonymous")
"""The one caller of a server without authentication."""


@dataclass(frozen=True)
class StopConditions:
    max_new_tokens: int
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True)
class GenerationRequest:
    """A validated request, ready for the queue. Times are monotonic seconds."""

    request_id: str
    """The caller's id for it, or one the server made: cancellation, the access log, spans and
    errors name the request by it."""
    model: str
    prompt_ids: tuple[int, ...]
    """After tokenization or the chat template: what the model is given."""
    sampling: SamplingParams
    stopping: StopConditions
    received_at: float
    """When the service received the request (before validation): every duration of its
    TimingReport is measured from here."""
    logprobs: bool = False
    top_logprobs: int = 0
    deadline: float | None = None
    """When it ends with DEADLINE_EXCEEDED, queued or running; None: it has none."""
    response_format: ResponseFormat | None = None
    """What the output must match; None for free text."""
    caller: Caller = ANONYMOUS
    priority: Priority = Priority.DEFAULT
    n: int = 1
    """Completions to generate from the prompt (prefilled once); with a seed, completion i
    samples with seed + i (modulo 2**64)."""
    adapter: str = ""
    """The LoRA adapter the model runs with for this request; empty: the base model."""


MAX_COMPLETIONS = 16
"""Most completions one request may ask for (`n`)."""


def completion_seed(seed: int, index: int) -> int:
    """The seed completion `index` of a request samples with: the request's seed (given, or drawn
    at random by validation) plus the index, modulo 2**64; completion 0 keeps the request's seed."""
    return (seed + index) % 2**64


@dataclass(frozen=True)
class TokenLogprobs:
    token_id: int
    token: str
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()
    """(token id, text, logprob) of the most likely tokens at this position."""


@dataclass(frozen=True)
class TimingReport:
    """Durations in seconds, all measured from the moment the service received the request.

    A stage the request never reached (a first token, for a request cancelled in the queue) is None.
    """

    queued: float
    """From receipt to a slot (to the end, for a request that never got one)."""
    total: float
    """From receipt to the request's end, however it ended."""
    time_to_first_token: float | None = None
    """From receipt to the first token: queued + paced + prefill. Slow here with a normal token
    rate is queueing or prompt work, not slow decoding."""
    prefill: float | None = None
    """The prompt's own work (its chunks, or copying a cached prefix or a forked prompt)."""
    decode_tokens_per_second: float = 0.0
    """Tokens after the first over the time after the first: the decode rate alone, whatever
    the wait before it (0 with fewer than two tokens)."""
    time_per_output_token: float | None = None
    """The same rate's inverse: seconds between tokens after the first."""
    paced: float | None = None
    """Between the start of work and the first token, the time the prompt waited while other
    requests ran (their decode steps, other prompts): time_to_first_token = queued + paced + prefill."""


@dataclass(frozen=True)
class CompletionChoice:
    """One of the completions of a request that asked for n > 1."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    logprobs: tuple[TokenLogprobs, ...] = ()


@dataclass(frozen=True)
class GenerationResult:
    request_id: str
    model: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    prompt_tokens: int
    timing: TimingReport
    logprobs: tuple[TokenLogprobs, ...] = ()
    cached_prompt_tokens: int = 0
    """Prompt tokens whose KV cache came from the prefix cache instead of a prefill."""
    draft_tokens: int = 0
    """Speculative draft tokens verified for this request (0 when it did not speculate)."""
    accepted_draft_tokens: int = 0
    """Of `draft_tokens`, those accepted: generated tokens that cost no model call of their own."""
    choices: tuple[CompletionChoice, ...] = ()
    """One per completion, in index order, when the request asked for n > 1. The top-level
    text, token_ids and logprobs are then empty; finish_reason is CANCELLED when the request was
    cancelled, otherwise that of the completion that ended last; the counts cover every
    completion (the prompt once)."""

    @property
    def completion_tokens(self) -> int:
        if self.choices:
            return sum(len(choice.token_ids) for choice in self.choices)
        return len(self.token_ids)


@dataclass(frozen=True)
class Started:
    """The request took a slot: its wait in the queue is over and its prompt's work begins."""

    queued_seconds: float
    """From receipt to the slot: the queueing part of the time to first token."""
    prompt_tokens: int


@dataclass(frozen=True)
class TokensGenerated:
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprobs, ...] = ()
    index: int = 0
    """Which of the request's completions produced them (0 unless it asked for n > 1)."""


@dataclass(frozen=True)
class Completed:
    result: GenerationResult

    @property
    def outcome(self) -> Outcome:
        return Outcome.of_finish(self.result.finish_reason)

    @property
    def timing(self) -> TimingReport:
        return self.result.timing


@dataclass(frozen=True)
class Failed:
    error: GenerationError
    timing: TimingReport
    """How long the request lived, queued and (if it started) running, before it failed."""
    completion_tokens: int = 0
    prompt_tokens: int = 0

    @property
    def outcome(self) -> Outcome:
        return Outcome.of_failure(self.error)


EngineEvent = Started | TokensGenerated | Completed | Failed
TerminalEvent = Completed | Failed
"""The last event of every request: each carries its outcome and timing."""
EventSink = Callable[[EngineEvent], None]
"""Receives a request's events, on the event loop the engine was started with."""


@dataclass(frozen=True)
class RequestTicket:
    """What submitting a request returns: the key to abort it with and its place in the queue."""

    key: int
    queue_position: int
