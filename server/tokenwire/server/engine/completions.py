"""n completions of one request, heard as one request: their events merged into the request's.

The engine runs a request that asked for n > 1 as n requests, one a completion (scheduler.py's
forks: the prompt is prefilled once). Whoever submitted it hears one request: one `Started` (the
first completion's), every completion's tokens tagged with its index, and one terminal event,
once every completion has ended (a `Completed` whose result holds them all as `choices`), or as
soon as one fails (its `Failed`, after which the others are stopped and nothing more is heard).

Runs where the engine's events are delivered (the event loop); nothing here is shared.
"""

from __future__ import annotations

from collections.abc import Callable

from tokenwire.server.engine.types import (
    Completed,
    CompletionChoice,
    EngineEvent,
    EventSink,
    Failed,
    FinishReason,
    GenerationResult,
    Started,
    TimingReport,
    TokensGenerated,
)


class CompletionGroup:
    def __init__(self, n: int, sink: EventSink, stop_others: Callable[[], None]) -> None:
        """`stop_others` stops every completion still running (one failed)."""
        self._n = n
        self._sink = sink
        self._stop_others = stop_others
        self._started = False
        self._ended = False
        self._tokens = [0] * n
        self._results: dict[int, GenerationResult] = {}

    def sink_for(self, index: int) -> EventSink:
        """Where completion `index` sends its events."""

        def receive(event: EngineEvent) -> None:
            self._receive(index, event)

        return receive

    def _receive(self, index: int, event: EngineEvent) -> None:
        if self._ended:
            return
        if isinstance(event, Started):
            if not self._started:
                self._started = True
                self._sink(event)
        elif isinstance(event, TokensGenerated):
            self._tokens[index] += len(event.token_ids)
            self._sink(TokensGenerated(event.token_ids, event.text, event.logprobs, index=index))
        elif isinstance(event, Completed):
            self._results[index] = event.result
            if len(self._results) == self._n:
                self._ended = True
                self._sink(Completed(merged_result([self._results[i] for i in range(self._n)])))
        else:
            self._ended = True
            self._stop_others()
            self._sink(
                Failed(
                    event.error,
                    event.timing,
                    completion_tokens=sum(self._tokens),
                    prompt_tokens=event.prompt_tokens,
                )
            )


def merged_result(results: list[GenerationResult]) -> GenerationResult:
    """One result for a request's completions (in index order), each a choice.

    Counted as one request: its prompt once, every completion's tokens and drafts. It was
    cancelled if any completion was (a cancel stops them all); otherwise it ends as the
    completion that ended last.
    """
    first = results[0]
    cancelled = any(r.finish_reason is FinishReason.CANCELLED for r in results)
    last = max(results, key=lambda r: r.timing.total)
    return GenerationResult(
        request_id=first.request_id,
        model=first.model,
        text="",
        token_ids=(),
        finish_reason=FinishReason.CANCELLED if cancelled else last.finish_reason,
        prompt_tokens=first.prompt_tokens,
        timing=merged_timing([r.timing for r in results], [len(r.token_ids) for r in results]),
        cached_prompt_tokens=first.cached_prompt_tokens,
        draft_tokens=sum(r.draft_tokens for r in results),
        accepted_draft_tokens=sum(r.accepted_draft_tokens for r in results),
        choices=tuple(
            CompletionChoice(i, r.text, r.token_ids, r.finish_reason, r.logprobs)
            for i, r in enumerate(results)
        ),
    )


def merged_timing(timings: list[TimingReport], tokens: list[int]) -> TimingReport:
    """The request's timing from its completions': queued, paced and prefill are the first
    completion's (it prefilled the prompt); time to first token is the earliest first token;
    total the last end. The token rate counts every completion's tokens after its first over the
    span from the earliest first token to the latest last one; the time per output token is the
    completions' mean (each one's own pace)."""
    source = timings[0]
    firsts = [t.time_to_first_token for t in timings if t.time_to_first_token is not None]
    ttft = min(firsts) if firsts else None
    rate = 0.0
    per_token = [t.time_per_output_token for t in timings if t.time_per_output_token is not None]
    if ttft is not None:
        last_tokens = [
            t.time_to_first_token + (count - 1) * (t.time_per_output_token or 0.0)
            for t, count in zip(timings, tokens, strict=True)
            if t.time_to_first_token is not None and count > 0
        ]
        last = max(last_tokens, default=ttft)
        decoded = sum(max(0, count - 1) for count in tokens)
        if decoded and last > ttft:
            rate = decoded / (last - ttft)
    return TimingReport(
        queued=source.queued,
        total=max(t.total for t in timings),
        time_to_first_token=ttft,
        prefill=source.prefill,
        decode_tokens_per_second=rate,
        time_per_output_token=sum(per_token) / len(per_token) if per_token else None,
        paced=source.paced,
    )
