"""What the scheduler decides for a round, and what the round did: plain data between scheduler and core.

The scheduler returns a `RoundPlan` that says exactly what runs: which requests end, which one
is preempted for which, which are admitted into slots and how (new, resumed, or copying their
group's prompt), every prompt chunk by request, start and length (with the cached prefix to
copy in first), and every row of the decode step with the most drafts it may verify. The engine
core carries it out on the runner and decides nothing; it answers with a `RoundOutcome`: what
finished, what could not run (a failed copy), what the verifications kept and what the model
calls cost. The scheduler takes the outcome back and counts the planned progress of everything
else. Neither side reaches into the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from tokenwire.server.engine.embedding import EmbeddingJob
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
class DecodeRow:
    """One row of the round's decode step."""

    key: int
    max_drafts: int = 0
    """The most speculative drafts the row may verify in this step (0: one token, as usual)."""


@dataclass(frozen=True)
class Preemption:
    """A running generation set aside (its KV rows copied out) so `beneficiary` can take its slot."""

    victim: int
    positions: int
    """The victim's KV positions to copy aside (none for a prompt that has not begun)."""
    beneficiary: int
    if_kept: DecodeRow | None = None
    """Should the copy fail, the victim keeps its slot: the row it decodes this round (None for a
    prompt mid-prefill, which has no token to decode). The beneficiary then does nothing."""


@dataclass(frozen=True)
class Admission:
    """A request the scheduler gives a slot this round, and how it enters it."""

    key: int
    entry: Entry


class Entry(Enum):
    """How an admitted request enters its slot."""

    NEW = "new"
    """Its output begins; its prompt chunks follow in the plan."""
    RESUMED = "resumed"
    """Swapped out before: its rows are copied back in and it goes on where it was."""
    FORKED = "forked"
    """A completion of a group: it copies the prompt its group kept and samples its first token
    from the logits kept with it."""


@dataclass(frozen=True)
class PromptChunk:
    """Prompt positions [start, start + length) of one request, run in one model call."""

    key: int
    start: int
    length: int
    cached: int = 0
    """Before this chunk, copy the first `cached` prompt positions from the prefix cache (the
    lease the scheduler's lookup took); `start` equals it then."""
    keep_for_group: bool = False
    """The chunk ends the prompt of a group's source: keep its rows and last logits for the
    other completions."""

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class RoundPlan:
    now: float
    """The scheduler's clock when it planned: endings and admissions are stamped with it."""
    endings: tuple[Ending, ...] = ()
    preemption: Preemption | None = None
    admitted: tuple[Admission, ...] = ()
    """Into a slot, in admission order."""
    prompts: tuple[PromptChunk, ...] = ()
    """In the order they run; a request's chunks follow each other. The chunk that reaches the
    end of its prompt samples the request's first token."""
    decode: tuple[DecodeRow, ...] = ()
    """Rows of the round's decode step: the requests decoding, then those whose first token comes
    this round (their prompt's last chunk, or a forked prompt), each if it is still live then."""
    requests: dict[int, Request] = field(default_factory=dict)
    """Every request the plan names, by key."""
    embeddings: tuple[EmbeddingJob, ...] = ()
    """Embedding jobs run whole this round (prefill-only, no slot), before the decode step."""


@dataclass(frozen=True)
class Finished:
    key: int
    service_seconds: float | None
    """From its start to its end, for a request that had started; the retry hint averages these."""


@dataclass(frozen=True)
class Verification:
    drafted: int
    accepted: int


@dataclass
class RoundOutcome:
    """What the core did with a plan, beyond the plan itself."""

    finished: list[Finished] = field(default_factory=list)
    """Every request that ended this round, whatever ended it."""
    skipped: set[int] = field(default_factory=set)
    """Requests whose planned work did not run (a copy into their slot failed, or the preemption
    that made room for them did): none of their planned progress counts."""
    preemption_failed: bool = False
    """The plan's victim could not be swapped out: it keeps its slot and its beneficiary waits."""
    verified: dict[int, Verification] = field(default_factory=dict)
    """Decoded rows that verified drafts: what they drafted and kept (each kept draft is one
    more token and one more position)."""
    prompts_kept: dict[int, bool] = field(default_factory=dict)
    """Group sources whose prompt is done: whether its rows were kept for the followers (False:
    they prefill it themselves)."""
    prompt_chunks: list[tuple[int, float]] = field(default_factory=list)
    """(tokens, seconds) of each prompt chunk the model ran, for the pacer."""
    decode_seconds: float | None = None
    """The decode step's model call."""
    step_seconds: float | None = None
    """The whole decode step: its model call, then sampling and verifying the rows' tokens."""
