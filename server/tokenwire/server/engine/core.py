"""Carries out a round's plan on the model: copies, prompt chunks, a decode step, sampling, endings.

The engine core is the mechanism under the scheduler's policy and decides nothing: the plan names
every request that ends, the generation swapped out and the requests admitted (new, resumed or
forked), every prompt chunk (with the cached prefix copied in first) and every decode row with
the most drafts it may verify. The core runs that on the runner, samples a token per row,
updates each request's output (detokenizer, stop strings, log-probabilities) and finishes the
requests that are done. Where the plan cannot run as written (a copy into a slot fails), the core
leaves that request's planned work out of the round and says so in its outcome (plan.RoundOutcome),
with what finished, what the verifications kept and what the model calls cost.

Every request leaves through `finish`, which emits its terminal event and hands the record back
to the scheduler to drop.

Used from the engine thread only.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tokenwire.server.engine.embedding_pass import run_embeddings
from tokenwire.server.engine.errors import ErrorKind, GenerationError
from tokenwire.server.engine.format_cache import invalid_format
from tokenwire.server.engine.kv_reuse import KvReuse
from tokenwire.server.engine.observer import EngineObserver
from tokenwire.server.engine.output import RequestOutput, terminal_event
from tokenwire.server.engine.plan import (
    Abort,
    Admission,
    DecodeRow,
    Entry,
    Finished,
    PromptChunk,
    RoundOutcome,
    RoundPlan,
    Verification,
)
from tokenwire.server.engine.request import Request, RequestStatus
from tokenwire.server.engine.speculation import OFF, SpeculationSettings
from tokenwire.server.engine.stats import EngineStats
from tokenwire.server.engine.types import (
    EngineEvent,
    EventSink,
    FinishReason,
    Started,
    TokenLogprobs,
    TokensGenerated,
)
from tokenwire.server.engine.verification import Describe, DraftProposer, runs_speculation, verify_run
from tokenwire.server.models.adapters import NO_ADAPTER
from tokenwire.server.models.runner import AdapterRunner, HiddenStates, ModelRunner, MultiTokenDecode
from tokenwire.server.sampling.constraint import MaskWorkspace
from tokenwire.server.sampling.logprobs import token_logprob
from tokenwire.server.sampling.sampler import pick_tokens
from tokenwire.server.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

Emit = Callable[[EventSink, EngineEvent], None]


@dataclass(frozen=True)
class CoreHooks:
    """How the core reaches the engine around it."""

    emit: Emit
    """Queues an event for delivery."""
    flush: Callable[[], None]
    """Delivers what is queued."""
    drop: Callable[[Request], None]
    """Hands an ended request back to the scheduler, which drops its record."""
    publish_step: Callable[[int], None]
    """Tells the engine the count of decode steps, for the aborts to carry."""


class EngineCore:
    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        kv: KvReuse,
        *,
        stats: EngineStats,
        observer: EngineObserver,
        masks: MaskWorkspace | None,
        hooks: CoreHooks,
        clock: Callable[[], float] = time.monotonic,
        speculation: SpeculationSettings = OFF,
    ) -> None:
        """Drafts are verified only on a runner that can decode runs of tokens."""
        self._runner = runner
        self._tokenizer = tokenizer
        self._kv = kv
        self._stats = stats
        self._observer = observer
        self._masks = masks
        self._emit, self._flush, self._drop = hooks.emit, hooks.flush, hooks.drop
        self._publish_step = hooks.publish_step
        self._clock = clock
        self._model = runner.info.name
        # A runner over a graph with LoRA sites is told every row's adapter slot.
        self._lora: AdapterRunner | None = None
        if isinstance(runner, AdapterRunner) and runner.adapters is not None:
            self._lora = runner
        self._multi: MultiTokenDecode | None = None
        self._proposer: DraftProposer | None = None
        if runs_speculation(runner, speculation):
            assert isinstance(runner, MultiTokenDecode)
            self._multi = runner
            self._proposer = DraftProposer(speculation)

    def execute(self, plan: RoundPlan) -> RoundOutcome:
        outcome = RoundOutcome()
        for ending in plan.endings:
            outcome.finished.append(
                self.finish(plan.requests[ending.key], ending.end, plan.now, abort=ending.abort)
            )
        self._preempt(plan, outcome)
        for admission in plan.admitted:
            if admission.key not in outcome.skipped:
                self._admit(plan.requests[admission.key], admission, plan.now, outcome)
        for chunk in plan.prompts:
            request = plan.requests[chunk.key]
            if not request.finished and chunk.key not in outcome.skipped:
                self._run_chunk(request, chunk, outcome)
        # First tokens go out now rather than after the decode step: that step's time is not
        # part of these requests' time to first token.
        self._flush()
        if plan.embeddings:
            # The engine queues embeddings only for a runner that has hidden states.
            assert isinstance(self._runner, HiddenStates)
            info = self._runner.info
            run_embeddings(self._runner, plan.embeddings, pooling=info.pooling, max_rows=info.max_batch_size)
        self._decode(self._decode_rows(plan, outcome), plan, outcome)
        return outcome

    def _preempt(self, plan: RoundPlan, outcome: RoundOutcome) -> None:
        """Swap the plan's victim out; should that fail, its beneficiary sits the round out."""
        preemption = plan.preemption
        if preemption is None:
            return
        victim = plan.requests[preemption.victim]
        if not self._kv.swap_out(victim, preemption.positions):
            outcome.preemption_failed = True
            outcome.skipped.add(preemption.beneficiary)
            return
        self._runner.release(victim.key)
        self._stats.preemptions += 1
        self._observer.preempted(model=self._model, caller=victim.caller.name)

    def _admit(self, request: Request, admission: Admission, now: float, outcome: RoundOutcome) -> None:
        """Into a slot: a swapped-out request's rows go back; a new one's output begins; a forked
        one copies its group's prompt and samples its first token."""
        if admission.entry is Entry.RESUMED:
            try:
                self._kv.swap_in(request)
            except Exception as error:
                log.exception("swapping in request %s failed", request.submitted.request_id)
                self._stats.step_failures += 1
                outcome.finished.append(self.finish(request, _model_error(error), now))
                return
            self._stats.resumptions += 1
            return
        constraint = None
        if request.response_format is not None:
            constraint = request.response_format.result().constraint()
        info = self._runner.info
        request.output = RequestOutput(
            request=request.submitted,
            tokenizer=self._tokenizer,
            eos_token_ids=info.eos_token_ids,
            context_length=info.context_length,
            started_at=now,
            constraint=constraint,
        )
        self._emit(request.sink, Started(now - request.submitted.received_at, request.prompt_length))
        if admission.entry is Entry.FORKED:
            self._fork(request, now, outcome)

    def _fork(self, request: Request, now: float, outcome: RoundOutcome) -> None:
        """Start a completion from the prompt its group's source prefilled, and sample its first
        token from the logits kept with it."""
        began = self._clock()
        try:
            logits = self._kv.fork_prompt(request)
        except Exception as error:
            log.exception("copying the prompt of request %s failed", request.submitted.request_id)
            self._stats.step_failures += 1
            outcome.finished.append(self.finish(request, _model_error(error), now))
            return
        self._stats.forked_prompt_tokens += request.prompt_length
        copied = self._clock()
        output = _output(request)
        output.prefill_seconds += copied - began
        self._accept_tokens([request], logits[np.newaxis, :], copied, outcome)

    def _run_chunk(self, request: Request, chunk: PromptChunk, outcome: RoundOutcome) -> None:
        """One prompt chunk, after copying in the cached prefix the plan names. The chunk that
        ends the prompt samples the request's first token, which leaves at once."""
        output = _output(request)
        own_work_began = self._clock()
        if chunk.cached:
            if not self._kv.load_prefix(request):
                outcome.skipped.add(request.key)  # it prefills from the start next round
                return
            output.cached_prompt_tokens = chunk.cached
        prompt = request.prompt_ids
        began = self._clock()
        try:
            tokens = prompt[chunk.start : chunk.end]
            if self._lora is None:
                logits = self._runner.prefill(request.key, tokens, start=chunk.start)
            else:
                adapter = self._adapter_slot(request)
                logits = self._lora.prefill(request.key, tokens, start=chunk.start, adapter=adapter)
        except Exception as error:
            log.exception("prefill failed for request %s", request.submitted.request_id)
            self._stats.step_failures += 1
            outcome.finished.append(self.finish(request, _model_error(error), self._clock()))
            return
        now = self._clock()
        self._stats.prefill_chunks += 1
        self._stats.prefill_tokens += chunk.length
        self._observer.prefill_chunk(model=self._model, tokens=chunk.length, seconds=now - began)
        outcome.prompt_chunks.append((chunk.length, now - began))
        if self._kv.caches_prefixes:
            self._kv.cache_prompt(request, chunk.end)
            now = self._clock()
        # The prompt's own work: its model call and its cache copies, in and out.
        output.prefill_seconds += now - own_work_began
        if chunk.end < len(prompt):
            return
        if chunk.keep_for_group:  # before sampling, which may rewrite logits
            outcome.prompts_kept[request.key] = self._kv.keep_prompt(request, logits)
        self._accept_tokens([request], logits[np.newaxis, :], now, outcome)
        # Its first token leaves now, not after the round's other prompts.
        self._flush()

    def _decode_rows(self, plan: RoundPlan, outcome: RoundOutcome) -> list[tuple[Request, DecodeRow]]:
        """The plan's decode rows still live (a row whose first token ended it does not decode),
        with the preemption's victim when it kept its slot, after the rows that were decoding."""
        rows = [
            (plan.requests[row.key], row)
            for row in plan.decode
            if row.key not in outcome.skipped and not plan.requests[row.key].finished
        ]
        preemption = plan.preemption
        if outcome.preemption_failed and preemption is not None and preemption.if_kept is not None:
            at = sum(request.status is RequestStatus.DECODING for request, _ in rows)
            rows.insert(at, (plan.requests[preemption.victim], preemption.if_kept))
        return rows

    def _decode(self, rows: list[tuple[Request, DecodeRow]], plan: RoundPlan, outcome: RoundOutcome) -> None:
        if not rows:
            return
        requests = [request for request, _ in rows]
        outputs = [_output(request) for request in requests]
        keys = [request.key for request in requests]
        drafts = self._drafts(rows, outputs)
        began = self._clock()
        try:
            if drafts is None:
                logits = self._decode_step(requests, [o.last_token for o in outputs])
            else:
                assert self._multi is not None
                if self._lora is not None:
                    # Every row's slot, every step: a sequence whose rows were copied in (a fork,
                    # a swap back in) runs with its adapter from its first step.
                    self._lora.assign_adapters(keys, [self._adapter_slot(r) for r in requests])
                runs = self._multi.decode_runs(
                    keys, [[o.last_token, *d] for o, d in zip(outputs, drafts, strict=True)]
                )
        except Exception as error:
            log.exception("decode step failed for %d sequences", len(rows))
            self._stats.step_failures += 1
            now = self._clock()
            outcome.finished.extend(self.finish(request, _model_error(error), now) for request in requests)
            return
        now = self._clock()
        outcome.decode_seconds = now - began
        self._stats.decode_steps += 1
        self._stats.decoded_rows += len(rows)
        self._publish_step(self._stats.decode_steps)
        self._observer.decode_step(model=self._model, batch_size=len(rows), seconds=now - began)
        if drafts is None:
            self._accept_tokens(requests, logits, now, outcome)
        else:
            plain = [i for i, d in enumerate(drafts) if not d]
            if plain:
                self._accept_tokens(
                    [requests[i] for i in plain], np.concatenate([runs[i] for i in plain]), now, outcome
                )
            for request, row_drafts, row_logits in zip(requests, drafts, runs, strict=True):
                if row_drafts:
                    self._accept_run(request, row_logits, row_drafts, now, outcome)
        # What the rows waited for their tokens: the model call and the sampling and verifying.
        outcome.step_seconds = self._clock() - began

    def _adapter_slot(self, request: Request) -> int:
        assert self._lora is not None and self._lora.adapters is not None
        return NO_ADAPTER if not request.adapter else self._lora.adapters.slot(request.adapter)

    def _decode_step(self, requests: list[Request], tokens: list[int]) -> np.ndarray:
        keys = [request.key for request in requests]
        if self._lora is None:
            return self._runner.decode(keys, tokens)
        return self._lora.decode(keys, tokens, adapters=[self._adapter_slot(r) for r in requests])

    def _drafts(
        self, rows: list[tuple[Request, DecodeRow]], outputs: list[RequestOutput]
    ) -> list[list[int]] | None:
        """Each row's drafts, at most the plan's count ([] for a row that does not speculate);
        None when no row has any."""
        if self._proposer is None:
            return None
        proposer = self._proposer
        drafts = [
            proposer.propose(output, row.max_drafts) for (_, row), output in zip(rows, outputs, strict=True)
        ]
        return drafts if any(drafts) else None

    def _accept_run(
        self, request: Request, logits: np.ndarray, drafts: list[int], now: float, outcome: RoundOutcome
    ) -> None:
        """Verify one row's drafts, emit the tokens it gained, roll back the rest of its run."""
        assert self._multi is not None
        output = _output(request)
        describe: Describe | None = None
        if request.submitted.logprobs:
            describe = functools.partial(self._token_logprobs, top_n=request.submitted.top_logprobs)
        run = verify_run(output, logits, drafts, now, describe)
        if run.rollback:
            try:
                self._multi.rollback(request.key, run.rollback)
            except Exception as error:
                log.exception("rolling back drafts failed for request %s", request.submitted.request_id)
                self._stats.step_failures += 1
                outcome.finished.append(self.finish(request, _model_error(error), now))
                return
        outcome.verified[request.key] = Verification(drafted=len(drafts), accepted=run.accepted)
        output.drafted_tokens += len(drafts)
        output.accepted_draft_tokens += run.accepted
        self._stats.speculative_rows += 1
        self._stats.draft_tokens += len(drafts)
        self._stats.accepted_draft_tokens += run.accepted
        self._observer.drafts_verified(model=self._model, drafted=len(drafts), accepted=run.accepted)
        self._emit(request.sink, run.event)
        if run.finish is not None:
            outcome.finished.append(self.finish(request, run.finish, now))

    def _accept_tokens(
        self, rows: list[Request], logits: np.ndarray, now: float, outcome: RoundOutcome
    ) -> None:
        """Sample one token per row, emit it, and finish the rows that are done."""
        outputs = [_output(r) for r in rows]
        # Sampling may rewrite logits in place (repetition penalty): keep the model's own
        # distribution for the rows that report log-probabilities.
        raw = {i: logits[i].copy() for i, r in enumerate(rows) if r.submitted.logprobs}
        tokens = pick_tokens(logits, [o.sampler for o in outputs], self._masks)
        for i, (request, output, token) in enumerate(zip(rows, outputs, tokens, strict=True)):
            token_logprobs = (
                self._token_logprobs(raw[i], token, request.submitted.top_logprobs) if i in raw else None
            )
            step = output.add_token(token, now, token_logprobs)
            self._emit(request.sink, step.event)
            end: FinishReason | GenerationError | None = step.finish
            if end is None and output.constraint is not None and output.constraint.error is not None:
                assert request.submitted.response_format is not None
                end = invalid_format(
                    request.submitted.response_format, f"too costly to enforce: {output.constraint.error}"
                )
            if end is not None:
                outcome.finished.append(self.finish(request, end, now))

    def _token_logprobs(self, row: np.ndarray, token: int, top_n: int) -> TokenLogprobs:
        found = token_logprob(row, token, top_n)
        decode = self._tokenizer.decode
        return TokenLogprobs(
            token_id=token,
            token=decode([token], skip_special_tokens=False),
            logprob=found.logprob,
            top=tuple((tid, decode([tid], skip_special_tokens=False), lp) for tid, lp in found.top),
        )

    # -- finishing -------------------------------------------------------------------------------

    def finish(
        self, request: Request, end: FinishReason | GenerationError, now: float, *, abort: Abort | None = None
    ) -> Finished:
        """The one way a request leaves the engine: a result or a failure, started or not.

        Emits its terminal event (with timing), frees its slot and KV rows, counts it, tells the
        observer and hands the record back to the scheduler; what the scheduler's retry hint
        learns from it is returned.
        """
        output = request.output
        if abort is not None:
            self._count_abort(abort, started=output is not None)
        service: float | None = None
        if output is not None:
            if end is FinishReason.CANCELLED:
                # Text held back (an incomplete character, a possible stop-string prefix) is real
                # output that will now never complete: hand it over before the summary.
                remainder = output.flush_text()
                if remainder:
                    self._emit(request.sink, TokensGenerated((), remainder))
            self._runner.release(request.key)
            service = now - output.started_at
        self._kv.release(request)
        event = terminal_event(request.submitted, output, end, now)
        self._emit(request.sink, event)
        self._stats.finished += 1
        self._observer.request_finished(
            model=self._model,
            outcome=event.outcome,
            finish_reason=end if isinstance(end, FinishReason) else None,
            prompt_tokens=request.prompt_length,
            completion_tokens=0 if output is None else len(output.output_ids),
            timing=event.timing,
            caller=request.caller.name,
            adapter=request.adapter,
        )
        self._drop(request)
        return Finished(request.key, service)

    def _count_abort(self, abort: Abort, *, started: bool) -> None:
        if abort.requested_at_step is None:
            return
        self._stats.aborted += 1
        if started:  # a request still queued took part in no step at all
            latency = self._stats.decode_steps - abort.requested_at_step
            self._stats.max_abort_latency_steps = max(self._stats.max_abort_latency_steps, latency)
            self._stats.orphaned_steps += max(0, latency - 1)


def _output(request: Request) -> RequestOutput:
    assert request.output is not None, "a request in a slot has its output"
    return request.output


def _model_error(error: Exception) -> GenerationError:
    return GenerationError(ErrorKind.INTERNAL, f"model failure: {error}", reason="MODEL_FAILURE")
