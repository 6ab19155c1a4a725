"""Carries out a round's plan on the model: prompt chunks, a decode step, sampling, outputs, endings.

The engine core is the mechanism under the scheduler's policy. For each plan it ends the
requests the plan ends, swaps the planned generation out and the admitted ones in, runs the
prompt work within its budget (with prefix-cache copies through kv_reuse.py), runs one batched
decode step (verifying the rows' speculative drafts in it, through speculation.py), samples a
token per row, updates each request's output (detokenizer, stop strings,
log-probabilities) and finishes the requests that are done. It answers with what it did
(plan.RoundOutcome). Every request leaves through `finish`, which emits its terminal event.

Used from the engine thread only.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable

import numpy as np

from tokenwire.server.engine.errors import ErrorKind, GenerationError
from tokenwire.server.engine.format_cache import invalid_format
from tokenwire.server.engine.kv_reuse import KvReuse
from tokenwire.server.engine.observer import EngineObserver
from tokenwire.server.engine.output import RequestOutput, timing_report
from tokenwire.server.engine.pacing import chunk_length
from tokenwire.server.engine.plan import Abort, Finished, RoundOutcome, RoundPlan
from tokenwire.server.engine.request import Request
from tokenwire.server.engine.speculation import Describe, SpeculationSettings, Speculator, verify_run
from tokenwire.server.engine.stats import EngineStats
from tokenwire.server.engine.types import (
    Completed,
    EngineEvent,
    EventSink,
    Failed,
    FinishReason,
    GenerationResult,
    Started,
    TerminalEvent,
    TokenLogprobs,
    TokensGenerated,
)
from tokenwire.server.models.runner import ModelRunner, MultiTokenDecode
from tokenwire.server.sampling.constraint import MaskWorkspace
from tokenwire.server.sampling.logprobs import token_logprob
from tokenwire.server.sampling.sampler import pick_tokens
from tokenwire.server.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

Emit = Callable[[EventSink, EngineEvent], None]


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
        emit: Emit,
        flush: Callable[[], None],
        forget: Callable[[int], None],
        publish_step: Callable[[int], None],
        clock: Callable[[], float] = time.monotonic,
        speculation: SpeculationSettings | None = None,
    ) -> None:
        """`emit` queues an event for delivery and `flush` delivers what is queued; `forget` tells
        the engine a request has ended; `publish_step` tells it the count of decode steps.
        `speculation` is honoured only on a runner that can decode runs of tokens."""
        self._runner = runner
        self._tokenizer = tokenizer
        self._kv = kv
        self._stats = stats
        self._observer = observer
        self._masks = masks
        self._emit = emit
        self._flush = flush
        self._forget = forget
        self._publish_step = publish_step
        self._clock = clock
        self._model = runner.info.name
        self._outputs: dict[int, RequestOutput] = {}
        """The output of every request that has started, swapped-out ones included."""
        self._outcome = RoundOutcome()
        self._multi: MultiTokenDecode | None = None
        if isinstance(runner, MultiTokenDecode) and runner.can_decode_runs:
            self._multi = runner
        self._speculator = Speculator(
            speculation if speculation is not None and self._multi is not None else SpeculationSettings(0, 1)
        )

    def execute(self, plan: RoundPlan) -> RoundOutcome:
        self._outcome = outcome = RoundOutcome()
        for ending in plan.endings:
            self.finish(plan.requests[ending.key], ending.end, plan.now, abort=ending.abort)
        skipped = self._preempt(plan)
        forked: list[Request] = []
        for key in plan.admitted:
            if key not in skipped and self._admit(plan.requests[key], plan.now):
                forked.append(plan.requests[key])
        continuing = self._run_prompts(plan, skipped)
        # First tokens go out now rather than after the decode step: that step's time is not
        # part of these requests' time to first token.
        self._flush()
        rows = [plan.requests[key] for key in plan.decode if key in self._outputs and key not in skipped]
        preemption = plan.preemption
        if outcome.preemption_failed and preemption is not None and not preemption.prefilling:
            rows.append(plan.requests[preemption.victim])  # it keeps its slot and decodes on
        # Completions that copied their prompt decode on like prompts done this round.
        continuing.extend(r for r in forked if r.key in self._outputs)
        self._decode([*rows, *continuing])
        return outcome

    def _preempt(self, plan: RoundPlan) -> set[int]:
        """Swap the plan's victim out; the keys to leave alone this round if that fails."""
        preemption = plan.preemption
        if preemption is None:
            return set()
        victim = plan.requests[preemption.victim]
        if not self._kv.swap_out(victim.key, preemption.positions):
            self._outcome.preemption_failed = True
            return {preemption.beneficiary}
        self._runner.release(victim.key)
        self._stats.preemptions += 1
        self._observer.preempted(model=self._model, caller=victim.caller.name)
        return set()

    def _admit(self, request: Request, now: float) -> bool:
        """Into a slot: a swapped-out request's rows go back, a new one's output begins. True for
        a completion that copied its fork's prompt and has its first token."""
        if request.key in self._outputs:  # swapped out: its rows go back into a slot
            try:
                self._kv.swap_in(request.key)
            except Exception as error:
                log.exception("swapping in request %s failed", request.spec.request_id)
                self._stats.step_failures += 1
                self.finish(request, _model_error(error), now)
                return False
            self._stats.resumptions += 1
            return False
        constraint = None
        if request.response_format is not None:
            constraint = request.response_format.result().constraint()
        info = self._runner.info
        self._outputs[request.key] = RequestOutput(
            request=request.spec,
            tokenizer=self._tokenizer,
            eos_token_ids=info.eos_token_ids,
            context_length=info.context_length,
            started_at=now,
            constraint=constraint,
        )
        self._emit(request.sink, Started(now - request.spec.received_at, request.prompt_length))
        return request.copies_prompt and self._fork(request, now)

    def _fork(self, request: Request, now: float) -> bool:
        """Start a completion from the prompt its fork's source prefilled, and sample its first
        token from the logits kept with it; False if it failed (and is finished)."""
        began = self._clock()
        try:
            logits = self._kv.fork_prompt(request.key)
        except Exception as error:
            log.exception("copying the prompt of request %s failed", request.spec.request_id)
            self._stats.step_failures += 1
            self.finish(request, _model_error(error), now)
            return False
        self._stats.forked_prompt_tokens += request.prompt_length
        self._outcome.prompt_positions[request.key] = request.prompt_length
        self._outcome.first_tokens.append(request.key)
        copied = self._clock()
        self._outputs[request.key].prefill_seconds += copied - began
        self._accept_tokens([request], logits[np.newaxis, :], copied)
        return True

    def _keep_prompt(self, request: Request, logits: np.ndarray) -> None:
        """A fork's source has its whole prompt in: keep it for the completions that copy it."""
        assert request.fork is not None
        kept = self._kv.keep_prompt(request.key, request.prompt_length, logits, request.fork.live_followers())
        self._outcome.prompts_kept[request.key] = kept

    def _run_prompts(self, plan: RoundPlan, skipped: set[int]) -> list[Request]:
        """Spend the round's prompt budget in the plan's order; the requests whose prompt is done
        and that decode on."""
        work = plan.prompts
        budget = work.budget
        continuing: list[Request] = []
        for key in work.order:
            if budget <= 0:
                break
            request = plan.requests[key]
            if key in skipped or key not in self._outputs:
                continue
            done, budget = self._prefill(request, budget, work.chunk_size)
            if done and request.key in self._outputs:
                continuing.append(request)
                if math.isinf(budget):
                    # Streams decode from now on: the prompts behind it are paced.
                    budget = work.paced_budget
        return continuing

    def _prefill(self, request: Request, budget: float, chunk_size: int) -> tuple[bool, float]:
        """Run chunks of one prompt while the budget lasts; whether the prompt is done, and the
        budget left. A prompt done gets its first token at once."""
        output = self._outputs[request.key]
        prompt = request.spec.prompt_ids
        positions = self._outcome.prompt_positions
        key = request.key
        while budget > 0:
            own_work_began = self._clock()
            start = request.computed_tokens + positions.get(key, 0)
            if not self._kv.looked_up(key):
                loaded = self._kv.load_prefix(key, prompt, tenant=request.caller.tenant)
                if loaded:
                    output.cached_prompt_tokens = loaded
                    positions[key] = positions.get(key, 0) + loaded
                    start += loaded
            chunk = prompt[start : start + chunk_length(len(prompt) - start, int(min(budget, chunk_size)))]
            began = self._clock()
            try:
                logits = self._runner.prefill(key, chunk, start=start)
            except Exception as error:
                log.exception("prefill failed for request %s", request.spec.request_id)
                self._stats.step_failures += 1
                self.finish(request, _model_error(error), self._clock())
                return False, budget
            now = self._clock()
            self._stats.prefill_chunks += 1
            self._stats.prefill_tokens += len(chunk)
            self._observer.prefill_chunk(model=self._model, tokens=len(chunk), seconds=now - began)
            self._outcome.prompt_chunks.append((len(chunk), now - began))
            budget -= len(chunk)
            start += len(chunk)
            positions[key] = positions.get(key, 0) + len(chunk)
            if self._kv.caches_prefixes:
                self._kv.cache_prompt(key, prompt, start)
                now = self._clock()
            # The prompt's own work: its model call and its cache copies, in and out.
            output.prefill_seconds += now - own_work_began
            if start >= len(prompt):
                if request.keeps_prompt:
                    self._keep_prompt(request, logits)  # before sampling, which may rewrite logits
                self._outcome.first_tokens.append(key)
                self._accept_tokens([request], logits[np.newaxis, :], now)
                # Its first token leaves now, not after the round's other prompts.
                self._flush()
                return True, budget
        return False, budget

    def _decode(self, rows: list[Request]) -> None:
        if not rows:
            return
        outputs = [self._outputs[r.key] for r in rows]
        drafts = self._speculator.drafts([r.key for r in rows], outputs)
        began = self._clock()
        try:
            if drafts is None:
                logits = self._runner.decode([r.key for r in rows], [o.last_token for o in outputs])
            else:
                assert self._multi is not None
                runs = self._multi.decode_runs(
                    [r.key for r in rows], [[o.last_token, *d] for o, d in zip(outputs, drafts, strict=True)]
                )
        except Exception as error:
            log.exception("decode step failed for %d sequences", len(rows))
            self._stats.step_failures += 1
            now = self._clock()
            for request in rows:
                self.finish(request, _model_error(error), now)
            return
        now = self._clock()
        self._outcome.decode_seconds = now - began
        self._outcome.decoded.extend(r.key for r in rows)
        self._stats.decode_steps += 1
        self._stats.decoded_rows += len(rows)
        self._publish_step(self._stats.decode_steps)
        self._observer.decode_step(model=self._model, batch_size=len(rows), seconds=now - began)
        if drafts is None:
            self._accept_tokens(rows, logits, now)
            return
        plain = [i for i, d in enumerate(drafts) if not d]
        if plain:
            self._accept_tokens([rows[i] for i in plain], np.concatenate([runs[i] for i in plain]), now)
        for request, row_drafts, row_logits in zip(rows, drafts, runs, strict=True):
            if row_drafts:
                self._accept_run(request, row_logits, row_drafts, now)

    def _accept_run(self, request: Request, logits: np.ndarray, drafts: list[int], now: float) -> None:
        """Verify one row's drafts, emit the tokens it gained, roll back the rest of its run."""
        assert self._multi is not None
        output = self._outputs[request.key]
        top_n = request.spec.top_logprobs
        describe: Describe | None = None
        if request.spec.logprobs:
            describe = functools.partial(self._token_logprobs, top_n=top_n)
        run = verify_run(output, logits, drafts, now, describe)
        if run.rollback:
            try:
                self._multi.rollback(request.key, run.rollback)
            except Exception as error:
                log.exception("rolling back drafts failed for request %s", request.spec.request_id)
                self._stats.step_failures += 1
                self.finish(request, _model_error(error), now)
                return
        self._speculator.record(request.key, drafted=len(drafts), accepted=run.accepted)
        output.drafted_tokens += len(drafts)
        output.accepted_draft_tokens += run.accepted
        self._stats.speculative_rows += 1
        self._stats.draft_tokens += len(drafts)
        self._stats.accepted_draft_tokens += run.accepted
        self._observer.drafts_verified(model=self._model, drafted=len(drafts), accepted=run.accepted)
        # The scheduler counts one token for every decoded row; these are the rest.
        self._outcome.extra_tokens[request.key] = run.gained - 1
        self._emit(request.sink, run.event)
        if run.finish is not None:
            self.finish(request, run.finish, now)

    def _accept_tokens(self, rows: list[Request], logits: np.ndarray, now: float) -> None:
        """Sample one token per row, emit it, and finish the rows that are done."""
        outputs = [self._outputs[r.key] for r in rows]
        # Sampling may rewrite logits in place (repetition penalty): keep the model's own
        # distribution for the rows that report log-probabilities.
        raw = {i: logits[i].copy() for i, r in enumerate(rows) if r.spec.logprobs}
        tokens = pick_tokens(logits, [o.sampler for o in outputs], self._masks)
        for i, (request, output, token) in enumerate(zip(rows, outputs, tokens, strict=True)):
            token_logprobs = (
                self._token_logprobs(raw[i], token, request.spec.top_logprobs) if i in raw else None
            )
            step = output.add_token(token, now, token_logprobs)
            self._emit(request.sink, step.event)
            end: FinishReason | GenerationError | None = step.finish
            if end is None and output.constraint is not None and output.constraint.error is not None:
                assert request.spec.response_format is not None
                end = invalid_format(
                    request.spec.response_format, f"too costly to enforce: {output.constraint.error}"
                )
            if end is not None:
                self.finish(request, end, now)

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
    ) -> None:
        """The one way a request leaves the engine: a result or a failure, started or not.

        Emits its terminal event (with timing), frees its slot and KV rows, counts it and tells
        the observer.
        """
        output = self._outputs.pop(request.key, None)
        self._speculator.forget(request.key)
        if request.fork is not None:
            request.fork.ended.add(request.key)
        if abort is not None:
            self._count_abort(abort, started=output is not None)
        prompt_tokens = request.prompt_length
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
            timing = output.timing(now)
            completion_tokens = len(output.output_ids)
        else:
            timing = timing_report(
                received=request.spec.received_at,
                started=None,
                first_token=None,
                last_token=None,
                finished=now,
                tokens=0,
            )
            completion_tokens = 0
        self._kv.release(request.key)
        event: TerminalEvent
        if isinstance(end, FinishReason):
            if output is not None:
                result = output.result(end, now)
            else:
                result = GenerationResult(
                    request_id=request.spec.request_id,
                    model=request.spec.model,
                    text="",
                    token_ids=(),
                    finish_reason=end,
                    prompt_tokens=prompt_tokens,
                    timing=timing,
                )
            event = Completed(result)
        else:
            event = Failed(end, timing, completion_tokens=completion_tokens, prompt_tokens=prompt_tokens)
        self._emit(request.sink, event)
        self._stats.finished += 1
        self._observer.request_finished(
            model=self._model,
            outcome=event.outcome,
            finish_reason=end if isinstance(end, FinishReason) else None,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            timing=timing,
            caller=request.caller.name,
        )
        self._outcome.finished.append(Finished(request.key, service))
        self._forget(request.key)

    def _count_abort(self, abort: Abort, *, started: bool) -> None:
        if abort.requested_at_step is None:
            return
        self._stats.aborted += 1
        if started:  # a request still queued took part in no step at all
            latency = self._stats.decode_steps - abort.requested_at_step
            self._stats.max_abort_latency_steps = max(self._stats.max_abort_latency_steps, latency)
            self._stats.orphaned_steps += max(0, latency - 1)


def _model_error(error: Exception) -> GenerationError:
    return GenerationError(ErrorKind.INTERNAL, f"model failure: {error}", reason="MODEL_FAILURE")
