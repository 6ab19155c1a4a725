"""What the scheduler decides for a round, and what the round did: plain data between scheduler and core.

The scheduler returns a `RoundPlan` (which requests end, which one is preempted for which, which
are admitted into slots, how much prompt work runs in what order, which rows decode); the engine
core carries it out on the runner and answers with a `RoundOutcome` (the prompt positions
processed, the tokens produced, the requests that finished, the costs measured), which the
scheduler takes back. Neither side reaches into the other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tokenwire.server.engine.errors import GenerationError
from tokenwire.server.engine.request import Request
from tokenwire.server.engine.types import AbortReason, FinishReason


@dataclass(frozen=True)
class Abort:
    """A caller's (or the server's) request to stop a live request at the next step boundary."""

    key: int
    reason: AbortReason
    requested_at_step: int | None
    """Decode steps completed when a caller asked for it; None for the server's own (shutdown)."""


@dataclass(frozen=True)
class Ending:
    """A request the scheduler ends this round: aborted, past its deadline, or its format failed."""

    key: int
    end: FinishReason | GenerationError
    abort: Abort | None = None
    """The abort that ended it, for the count of steps an abort takes to land."""


@dataclass(frozen=True)
class Preemption:
    """A running generation set aside (its KV rows copied out) so `beneficiary` can take its slot."""

    victim: int
    positions: int
    """The victim's KV positions to copy aside (none for a prompt that has not begun)."""
    beneficiary: int
    prefilling: bool = False
    """The victim was mid-prompt: if it keeps its slot, it has no token to decode this round."""


@dataclass(frozen=True)
class PromptWork:
    """The round's prompt work: its budget goes to the prompts in `order`, each until it is done.

    The core splits a prompt into chunks of at most `chunk_size` tokens (never shorter than
    `pacing.MIN_CHUNK`). A prompt that finds a cached prefix needs fewer tokens; what it does not
    use goes to the next prompt.
    """

    order: tuple[int, ...] = ()
    budget: float = 0.0
    """Prompt tokens the round may process; infinite when nothing decodes."""
    paced_budget: float = 0.0
    """For a round that began with nothing decoding: the budget once a stream decodes (after the
    first prompt that gets its first token and goes on)."""
    chunk_size: int = 1


@dataclass(frozen=True)
class RoundPlan:
    now: float
    """The scheduler's clock when it planned: endings and admissions are stamped with it."""
    endings: tuple[Ending, ...] = ()
    preemption: Preemption | None = None
    admitted: tuple[int, ...] = ()
    """Into a slot, in admission order: new requests start their prefill, swapped-out ones resume."""
    prompts: PromptWork = field(default_factory=PromptWork)
    decode: tuple[int, ...] = ()
    """Rows of the round's decode step; the prompts that get their first token this round join them."""
    requests: dict[int, Request] = field(default_factory=dict)
    """Every request the plan names, by key."""

    @property
    def unbounded_prompts(self) -> bool:
        return math.isinf(self.prompts.budget)


@dataclass(frozen=True)
class Finished:
    key: int
    service_seconds: float | None
    """From its start to its end, for a request that had started; the retry hint averages these."""


@dataclass
class RoundOutcome:
    """What the core did with a plan."""

    prompt_positions: dict[int, int] = field(default_factory=dict)
    """Prompt positions each request gained (prefilled, or copied from the prefix cache)."""
    first_tokens: list[int] = field(default_factory=list)
    """Requests whose prompt is done and that sampled their first token: they decode from now on."""
    decoded: list[int] = field(default_factory=list)
    """Rows the decode step gave a token."""
    extra_tokens: dict[int, int] = field(default_factory=dict)
    """Of the decoded rows, those that gained more than one token (accepted speculative drafts):
    how many more."""
    finished: list[Finished] = field(default_factory=list)
    """Every request that ended this round, whatever ended it."""
    prompts_kept: dict[int, bool] = field(default_factory=dict)
    """Fork sources whose prompt is done: whether its rows were kept for the followers (False:
    they prefill it themselves)."""
    preemption_failed: bool = False
    """The plan's victim could not be swapped out: it keeps its slot and its beneficiary waits."""
    prompt_chunks: list[tuple[int, float]] = field(default_factory=list)
    """(tokens, seconds) of each prompt chunk the model ran, for the pacer."""
    decode_seconds: float | None = None
