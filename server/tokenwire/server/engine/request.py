"""The one record of a live request, from submit to finish, and the table that owns them all.

A `Request` holds everything the engine keeps about one live request: its status and progress,
its output (tokens, text, sampler), what it holds of the KV cache beyond its slot (its prefix
cache lease, rows set aside by a preemption), its drafting history and the completion group it
belongs to. The scheduler owns the records (scheduler.py): it alone changes a status, through
`Request.transition`, which refuses every move this diagram does not draw:

    WAITING_FOR_FORMAT -> WAITING -> PREFILLING -> DECODING -> FINISHED
                                     PREFILLING <-> SWAPPED_OUT <-> DECODING

(and FINISHED from every live status; a preemption that fails puts its beneficiary back where it
was: PREFILLING -> WAITING, DECODING -> SWAPPED_OUT). Finishing a request is dropping its record
from the table. The engine core writes the record's output as it runs the plan; the KV reuse
fills in its KV holding.

One progress counter, `computed_tokens`, says how many of its positions are in the KV cache
(prompt tokens prefilled or copied from the prefix cache, then one more per decode step); the
tokens it has produced are its output's.

A request that asked for n completions is n records here, one a completion, in one
`CompletionSet`: where the runner can copy KV rows the first prefills the prompt and the others,
once its rows are kept, copy them into their own slots instead of prefilling (they wait in the
queue until then).

The engine thread changes records and the table; the event loop reads the table (queue
admission, aborts) only under the engine's lock.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from tokenwire.server.engine.shares import work
from tokenwire.server.engine.speculation import DraftHistory
from tokenwire.server.engine.types import Caller, EventSink, GenerationRequest, Priority

if TYPE_CHECKING:  # opaque here: the scheduler imports no sampler, runner or array library
    from tokenwire.server.engine.kv_reuse import KeptPrompt, KvRows
    from tokenwire.server.engine.output import RequestOutput
    from tokenwire.server.engine.prefix_cache import PrefixLease
    from tokenwire.server.sampling.constraint import CompiledFormat


class RequestStatus(Enum):
    WAITING_FOR_FORMAT = "waiting for its format"
    """Queued, its response format still compiling; it waits, and lets its caller's next go first."""
    WAITING = "waiting"
    """Queued for a slot."""
    PREFILLING = "prefilling"
    """In a slot; its prompt is being processed, chunk by chunk."""
    DECODING = "decoding"
    """In a slot, producing a token each step."""
    SWAPPED_OUT = "swapped out"
    """Preempted: its KV rows copied aside, queued to get a slot back and go on where it was."""
    FINISHED = "finished"


QUEUED = frozenset({RequestStatus.WAITING_FOR_FORMAT, RequestStatus.WAITING, RequestStatus.SWAPPED_OUT})

_S = RequestStatus
TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    _S.WAITING_FOR_FORMAT: frozenset({_S.WAITING, _S.FINISHED}),
    _S.WAITING: frozenset({_S.PREFILLING, _S.FINISHED}),
    # WAITING: a failed preemption's beneficiary, which had just been given the slot.
    _S.PREFILLING: frozenset({_S.DECODING, _S.SWAPPED_OUT, _S.WAITING, _S.FINISHED}),
    _S.DECODING: frozenset({_S.SWAPPED_OUT, _S.FINISHED}),
    _S.SWAPPED_OUT: frozenset({_S.PREFILLING, _S.DECODING, _S.FINISHED}),
    _S.FINISHED: frozenset(),
}
"""Every move a request may make, from each status."""


class IllegalTransitionError(RuntimeError):
    """A request was asked to move where its state machine has no edge: an engine bug."""


@dataclass(eq=False)
class CompletionSet:
    """The completions of one request that asked for n > 1, one record each, in index order.

    Where the runner copies KV rows (`shares_prompt`), `keys[0]` prefills the prompt and the
    others copy it once it is kept; otherwise each prefills the prompt itself."""

    keys: tuple[int, ...]
    shares_prompt: bool
    ready: bool = False
    """The source's prompt rows and last logits are kept: a follower may take a slot and copy them."""
    kept: KeptPrompt | None = None
    """Those rows and logits (kv_reuse.py's), until every follower has copied them or ended."""
    abandoned: bool = False
    """No copy will come (the rows could not be kept, or the source ended first): the followers
    prefill the prompt themselves."""
    ended: set[int] = field(default_factory=set)
    """Members that have ended."""

    @property
    def ticket(self) -> int:
        """The key the request was submitted under: aborting it aborts every completion."""
        return self.keys[0]

    @property
    def source(self) -> int:
        return self.keys[0]

    def live_followers(self) -> list[int]:
        return [key for key in self.keys[1:] if key not in self.ended]


@dataclass
class KvHolding:
    """What a request holds of the KV cache beyond its slot; kv_reuse.py alone reads and writes it."""

    prefix: PrefixLease | None = None
    """Its part in the prefix cache, once its prompt was looked up there."""
    prefix_tokens: int = 0
    """Of its prompt, the tokens the lookup found cached (to copy into its slot)."""
    caching_stopped: bool = False
    """The cache took no more of its prompt's blocks (or copying failed): stop offering them."""
    swapped: KvRows | None = None
    """Its rows set aside by a preemption (None too for a prompt set aside before its first chunk)."""


@dataclass(eq=False)
class Request:
    key: int
    submitted: GenerationRequest
    """The validated request (for a completion of n: with that completion's seed)."""
    sink: EventSink
    response_format: Future[CompiledFormat] | None = None
    """The request's compiled format, once a worker has it; the request waits until then."""
    group: CompletionSet | None = None
    """Set on each of the completions of a request that asked for n > 1."""
    computed_tokens: int = 0
    """Positions of this request in the KV cache: prompt tokens first, then one per decode step."""
    started_at: float | None = None
    """When it first got a slot (its prefill began)."""
    output: RequestOutput | None = None
    """What it has produced, from its first admission on (the engine core writes it)."""
    kv: KvHolding = field(default_factory=KvHolding)
    drafting: DraftHistory = field(default_factory=DraftHistory)
    _status: RequestStatus = field(init=False)

    def __post_init__(self) -> None:
        compiling = self.response_format is not None and not self.response_format.done()
        self._status = RequestStatus.WAITING_FOR_FORMAT if compiling else RequestStatus.WAITING

    @property
    def status(self) -> RequestStatus:
        return self._status

    def transition(self, to: RequestStatus) -> None:
        """Move to `to`; raises IllegalTransitionError for a move the state machine does not allow."""
        if to not in TRANSITIONS[self._status]:
            raise IllegalTransitionError(
                f"request {self.submitted.request_id!r} (key {self.key}) cannot go from "
                f"{self._status.value} to {to.value}"
            )
        self._status = to

    @property
    def finished(self) -> bool:
        return self._status is RequestStatus.FINISHED

    # What the fair queue asks of an entry.
    @property
    def caller(self) -> Caller:
        return self.submitted.caller

    @property
    def adapter(self) -> str:
        """The LoRA adapter its model runs with; empty: the base model."""
        return self.submitted.adapter

    @property
    def priority(self) -> Priority:
        return self.submitted.priority

    @property
    def ready(self) -> bool:
        """May take a slot: not waiting for its format (a compile worker finishes it off-thread),
        nor for the prompt it copies."""
        if self.copies_prompt and self.group is not None and not self.group.ready:
            return False
        return self.response_format is None or self.response_format.done()

    @property
    def copies_prompt(self) -> bool:
        """A follower of a group that will copy its prompt's rows rather than prefill them."""
        group = self.group
        return group is not None and group.shares_prompt and group.source != self.key and not group.abandoned

    @property
    def keeps_prompt(self) -> bool:
        """The source of a group whose followers wait for its prompt."""
        group = self.group
        return (
            group is not None
            and group.shares_prompt
            and group.source == self.key
            and not group.ready
            and not group.abandoned
        )

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        return self.submitted.prompt_ids

    @property
    def prompt_length(self) -> int:
        return len(self.submitted.prompt_ids)

    @property
    def prompt_remaining(self) -> int:
        return max(0, self.prompt_length - self.computed_tokens)

    @property
    def generated_tokens(self) -> int:
        return len(self.output.output_ids) if self.output is not None else 0

    @property
    def work(self) -> int:
        """The work still ahead of it (shares.work): what its caller's turn is charged when it
        takes a slot, and what it weighs while it holds one."""
        prompt = 0 if self.copies_prompt else self.prompt_remaining
        return work(prompt, self.submitted.stopping.max_new_tokens - self.generated_tokens)

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens it would add to the queue's bound: none once its prompt is done (a
        swapped-out generation), nor for a prompt it copies."""
        return 0 if self.copies_prompt else self.prompt_remaining

    @property
    def swappable(self) -> bool:
        """In a slot, so its KV rows and state can be set aside and resumed: decoding, or
        prefilling (a long prompt mid-way holds its slot as surely as a generation)."""
        return self._status is RequestStatus.PREFILLING or self._status is RequestStatus.DECODING

    @property
    def resumes_prompt(self) -> bool:
        """Swapped out (or about to be) with prompt tokens still to prefill: it resumes prefilling."""
        return self.prompt_remaining > 0

    def past_deadline(self, now: float) -> bool:
        return self.submitted.deadline is not None and now >= self.submitted.deadline


class RequestTable:
    """Every live request by key, in submission order, and the live completion groups by ticket."""

    def __init__(self) -> None:
        self._by_key: dict[int, Request] = {}
        self._groups: dict[int, CompletionSet] = {}
        """Each group with a member live, by its ticket: a ticket's own completion may end
        while its siblings run, and aborting the ticket must still reach them."""

    def __len__(self) -> int:
        return len(self._by_key)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._by_key.values())

    def __contains__(self, key: int) -> bool:
        return key in self._by_key

    def add(self, request: Request) -> None:
        self._by_key[request.key] = request
        if request.group is not None:
            self._groups[request.group.ticket] = request.group

    def get(self, key: int) -> Request | None:
        return self._by_key.get(key)

    def __getitem__(self, key: int) -> Request:
        return self._by_key[key]

    def remove(self, key: int) -> Request | None:
        request = self._by_key.pop(key, None)
        group = request.group if request is not None else None
        if group is not None and not any(k in self._by_key for k in group.keys):
            del self._groups[group.ticket]
        return request

    def keys(self) -> list[int]:
        return list(self._by_key)

    def live_keys_of(self, ticket: int) -> list[int]:
        """The live requests a ticket names: itself, or every live completion of its request."""
        group = self._groups.get(ticket)
        if group is None:
            return [ticket] if ticket in self._by_key else []
        return [key for key in group.keys if key in self._by_key]
