"""What one request has produced: its tokens, text, stop conditions, log-probabilities and times,
and the terminal event that reports them when it ends.

The engine core keeps one per request in a slot and updates it with every sampled token: the
sampler (with its seeded generator and penalties' history), the incremental detokenizer and the
stop-string matcher live here, so the scheduler needs neither a tokenizer nor a sampler.

Owned by the engine thread; nothing here is shared with the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenwire.server.engine.errors import GenerationError
from tokenwire.server.engine.types import (
    Completed,
    Failed,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    TerminalEvent,
    TimingReport,
    TokenLogprobs,
    TokensGenerated,
)
from tokenwire.server.sampling.constraint import TokenConstraint
from tokenwire.server.sampling.sampler import SequenceSampler
from tokenwire.server.text.detokenizer import IncrementalDetokenizer
from tokenwire.server.text.stop import StopStringMatcher
from tokenwire.server.text.tokenizer import Tokenizer


@dataclass
class StepOutput:
    """What one new token did to a sequence."""

    event: TokensGenerated
    finish: FinishReason | None


@dataclass
class RequestOutput:
    request: GenerationRequest
    tokenizer: Tokenizer
    eos_token_ids: frozenset[int]
    context_length: int
    started_at: float
    constraint: TokenConstraint | None = None
    """The matcher of the request's response format, if it has one."""
    sampler: SequenceSampler = field(init=False)
    cached_prompt_tokens: int = 0
    """Prompt tokens whose KV rows were copied from the prefix cache instead of prefilled."""
    prefill_seconds: float = 0.0
    """Time spent on this prompt's own model calls and cache copies (not waiting on others)."""
    drafted_tokens: int = 0
    """Speculative draft tokens verified for this request."""
    accepted_draft_tokens: int = 0
    """Of `drafted_tokens`, those accepted (each is one of `output_ids`)."""
    output_ids: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    first_token_at: float | None = None
    last_token_at: float | None = None
    _detokenizer: IncrementalDetokenizer = field(init=False)
    _stops: StopStringMatcher = field(init=False)
    _stopped_by_string: bool = False

    def __post_init__(self) -> None:
        history = list(self.request.prompt_ids) if self.request.sampling.needs_history else []
        self.sampler = SequenceSampler(self.request.sampling, history=history, constraint=self.constraint)
        self._detokenizer = IncrementalDetokenizer(self.tokenizer, self.request.prompt_ids)
        self._stops = StopStringMatcher(self.request.stopping.stop_strings)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1]

    def add_token(self, token_id: int, now: float, logprobs: TokenLogprobs | None) -> StepOutput:
        """Record a generated token; say what text it released and whether the sequence ends."""
        if self.first_token_at is None:
            self.first_token_at = now
        self.last_token_at = now
        self.output_ids.append(token_id)
        self.sampler.observe(token_id)
        if logprobs is not None:
            self.logprobs.append(logprobs)
        stopping = self.request.stopping
        finish: FinishReason | None = None
        if token_id in self.eos_token_ids and not stopping.ignore_eos:
            finish = FinishReason.EOS
            text = self._release(self._detokenizer.flush(), final=True)
        else:
            text = self._release(self._detokenizer.push(token_id), final=False)
            if self._stopped_by_string:
                finish = FinishReason.STOP
            elif len(self.output_ids) >= stopping.max_new_tokens or self._context_full():
                finish = FinishReason.LENGTH
                text += self._release(self._detokenizer.flush(), final=True)
        logprob_items = (logprobs,) if logprobs is not None else ()
        return StepOutput(TokensGenerated((token_id,), text, logprob_items), finish)

    def flush_text(self) -> str:
        """Release all held-back text (the sequence is being stopped from outside)."""
        return self._release(self._detokenizer.flush(), final=True)

    def _context_full(self) -> bool:
        return len(self.request.prompt_ids) + len(self.output_ids) >= self.context_length

    def _release(self, delta: str, *, final: bool) -> str:
        if self._stopped_by_string:
            return ""
        scan = self._stops.feed(delta)
        released = scan.released
        if scan.stopped:
            self._stopped_by_string = True
        elif final:
            released += self._stops.flush()
        self.text_parts.append(released)
        return released

    def result(self, finish: FinishReason, now: float) -> GenerationResult:
        return GenerationResult(
            request_id=self.request.request_id,
            model=self.request.model,
            text="".join(self.text_parts),
            token_ids=tuple(self.output_ids),
            finish_reason=finish,
            prompt_tokens=len(self.request.prompt_ids),
            timing=self.timing(now),
            logprobs=tuple(self.logprobs),
            cached_prompt_tokens=self.cached_prompt_tokens,
            draft_tokens=self.drafted_tokens,
            accepted_draft_tokens=self.accepted_draft_tokens,
        )

    def timing(self, now: float) -> TimingReport:
        return timing_report(
            received=self.request.received_at,
            started=self.started_at,
            first_token=self.first_token_at,
            last_token=self.last_token_at,
            finished=now,
            tokens=len(self.output_ids),
            prefill_busy=self.prefill_seconds,
        )


def terminal_event(
    request: GenerationRequest,
    output: RequestOutput | None,
    end: FinishReason | GenerationError,
    now: float,
) -> TerminalEvent:
    """The last event of a request that ended at `now`: its result or its failure, with its timing
    and token counts. `output` is None for a request that ended before it started (in the queue)."""
    prompt_tokens = len(request.prompt_ids)
    if output is not None:
        timing = output.timing(now)
        completion_tokens = len(output.output_ids)
    else:
        timing = timing_report(
            received=request.received_at,
            started=None,
            first_token=None,
            last_token=None,
            finished=now,
            tokens=0,
        )
        completion_tokens = 0
    if isinstance(end, GenerationError):
        return Failed(end, timing, completion_tokens=completion_tokens, prompt_tokens=prompt_tokens)
    if output is not None:
        return Completed(output.result(end, now))
    return Completed(
        GenerationResult(
            request_id=request.request_id,
            model=request.model,
            text="",
            token_ids=(),
            finish_reason=end,
            prompt_tokens=prompt_tokens,
            timing=timing,
        )
    )


def timing_report(
    *,
    received: float,
    started: float | None,
    first_token: float | None,
    last_token: float | None,
    finished: float,
    tokens: int,
    prefill_busy: float | None = None,
) -> TimingReport:
    """`prefill_busy`: of the time from start to first token, what the prompt's own work took;
    the rest is reported as paced (waiting on other requests). None: all of it is prefill."""
    queued = (started if started is not None else finished) - received
    ttft = None if first_token is None else first_token - received
    prefill = None if first_token is None or started is None else first_token - started
    paced: float | None = None
    if prefill is not None and prefill_busy is not None:
        busy = min(prefill, prefill_busy)
        paced = prefill - busy
        prefill = busy
    rate = 0.0
    per_token: float | None = None
    if tokens > 1 and first_token is not None and last_token is not None and last_token > first_token:
        decode_seconds = last_token - first_token
        rate = (tokens - 1) / decode_seconds
        per_token = decode_seconds / (tokens - 1)
    return TimingReport(
        queued=queued,
        total=finished - received,
        time_to_first_token=ttft,
        prefill=prefill,
        decode_tokens_per_second=rate,
        time_per_output_token=per_token,
        paced=paced,
    )
