"""A live request as the scheduler sees it: one object from submit to finish, with an explicit status.

A request is in exactly one status at a time and moves only forward through them, except that
preemption takes a request in a slot back to the queue (SWAPPED_OUT) and resumption returns it
to where it was (its prompt's remaining chunks, or its next token):

    WAITING_FOR_FORMAT -> WAITING -> PREFILLING -> DECODING -> FINISHED
                                     PREFILLING <-> SWAPPED_OUT <-> DECODING

One progress counter, `computed_tokens`, says how many of its positions are in the KV cache
(prompt tokens prefilled or copied from the prefix cache, then one more per decode step), and
`generated_tokens` how many tokens it has produced. The text, sampler and stop matching of its
output live with the engine core (output.py), so the scheduler needs no tokenizer.

A request that asked for n completions is n requests here, one a completion, sharing a
`PromptFork`: the first prefills the prompt, and the others, once its rows are kept, copy them
into their own slots instead of prefilling (they wait in the queue until then).

`RequestTable` is the one index of live requests by key. The engine thread changes requests and
the table; the event loop reads the table (queue admission) only under the engine's lock.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from tokenwire.server.engine.shares import work
from tokenwire.server.engine.types import Caller, EventSink, GenerationRequest, Priority

if TYPE_CHECKING:  # a compiled format is opaque here: the scheduler only waits for it
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
RUNNING = frozenset({RequestStatus.PREFILLING, RequestStatus.DECODING})


@dataclass(eq=False)
class PromptFork:
    """The completions of one request: `source` prefills the prompt; the `followers` copy it."""

    source: int
    followers: tuple[int, ...]
    ready: bool = False
    """The source's prompt rows and last logits are kept: a follower may take a slot and copy them."""
    abandoned: bool = False
    """No copy will come (the rows could not be kept, or the source ended first): the followers
    prefill the prompt themselves."""
    ended: set[int] = field(default_factory=set)
    """Members that have ended (the engine core adds each as it finishes it)."""

    def live_followers(self) -> list[int]:
        return [key for key in self.followers if key not in self.ended]


@dataclass(eq=False)
class Request:
    key: int
    spec: GenerationRequest
    sink: EventSink
    response_format: Future[CompiledFormat] | None = None
    """The request's compiled format, once a worker has it; the request waits until then."""
    status: RequestStatus = RequestStatus.WAITING
    computed_tokens: int = 0
    """Positions of this request in the KV cache: prompt tokens first, then one per decode step."""
    generated_tokens: int = 0
    started_at: float | None = None
    """When it first got a slot (its prefill began)."""
    fork: PromptFork | None = None
    """Set on each of the completions of a request that asked for n > 1."""

    def __post_init__(self) -> None:
        if self.response_format is not None and not self.response_format.done():
            self.status = RequestStatus.WAITING_FOR_FORMAT

    # What the fair queue asks of an entry.
    @property
    def caller(self) -> Caller:
        return self.spec.caller

    @property
    def priority(self) -> Priority:
        return self.spec.priority

    @property
    def ready(self) -> bool:
        """May take a slot: not waiting for its format (a compile worker finishes it off-thread),
        nor for the prompt it copies."""
        if self.copies_prompt and not self.fork_ready:
            return False
        return self.response_format is None or self.response_format.done()

    @property
    def copies_prompt(self) -> bool:
        """A follower of a fork that will copy its prompt's rows rather than prefill them."""
        fork = self.fork
        return fork is not None and fork.source != self.key and not fork.abandoned

    @property
    def fork_ready(self) -> bool:
        return self.fork is not None and self.fork.ready

    @property
    def keeps_prompt(self) -> bool:
        """The source of a fork whose followers wait for its prompt."""
        fork = self.fork
        return fork is not None and fork.source == self.key and not fork.ready and not fork.abandoned

    @property
    def prompt_length(self) -> int:
        return len(self.spec.prompt_ids)

    @property
    def prompt_remaining(self) -> int:
        return max(0, self.prompt_length - self.computed_tokens)

    @property
    def work(self) -> int:
        """The work still ahead of it (shares.work): what its caller's turn is charged when it
        takes a slot, and what it weighs while it holds one."""
        prompt = 0 if self.copies_prompt else self.prompt_remaining
        return work(prompt, self.spec.stopping.max_new_tokens - self.generated_tokens)

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens it would add to the queue's bound: none once its prompt is done (a
        swapped-out generation), nor for a prompt it copies."""
        return 0 if self.copies_prompt else self.prompt_remaining

    @property
    def swappable(self) -> bool:
        """In a slot, so its KV rows and state can be set aside and resumed: decoding with a token
        produced, or prefilling (a long prompt mid-way holds its slot as surely as a generation)."""
        if self.status is RequestStatus.PREFILLING:
            return True
        return self.status is RequestStatus.DECODING and self.generated_tokens > 0

    @property
    def resumes_prompt(self) -> bool:
        """Swapped out (or about to be) with prompt tokens still to prefill: it resumes prefilling."""
        return self.prompt_remaining > 0

    def past_deadline(self, now: float) -> bool:
        return self.spec.deadline is not None and now >= self.spec.deadline


class RequestTable:
    """Every live request by key, in submission order."""

    def __init__(self) -> None:
        self._by_key: dict[int, Request] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._by_key.values())

    def __contains__(self, key: int) -> bool:
        return key in self._by_key

    def add(self, request: Request) -> None:
        self._by_key[request.key] = request

    def get(self, key: int) -> Request | None:
        return self._by_key.get(key)

    def __getitem__(self, key: int) -> Request:
        return self._by_key[key]

    def remove(self, key: int) -> Request | None:
        return self._by_key.pop(key, None)

    def keys(self) -> list[int]:
        return list(self._by_key)
