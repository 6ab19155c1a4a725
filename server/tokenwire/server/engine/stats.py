"""The engine's counters, for tests and telemetry.

The engine thread writes them all except `rejected` and `abort_requests`, which count what the
event loop received; those live in the engine's inbox and `Engine.stats` joins the two.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    decode_steps: int = 0
    """Decode steps that ran (one model call each, speculative rows included)."""
    decoded_rows: int = 0
    """Rows summed over those steps: `decoded_rows / decode_steps` is the mean batch, the
    figure that says whether the slots are used."""
    rejected: int = 0
    """Requests refused at admission because the queue was full."""
    abort_requests: int = 0
    """Aborts callers asked for, of live requests (cancel, disconnect, deadline); not shutdown's."""
    prefill_chunks: int = 0
    """Prompt chunks that ran, one model call each: a long prompt is several."""
    finished: int = 0
    """Requests that left the engine, however they ended (each is dropped with its record)."""
    aborted: int = 0
    """Requests that an abort a caller asked for ended (a request may end by itself first, so
    this can be below `abort_requests`)."""
    max_abort_latency_steps: int = 0
    """Most decode steps any aborted sequence took part in after its abort was requested."""
    orphaned_steps: int = 0
    """Decode steps run for aborted sequences beyond the one step an abort may take to land."""
    step_failures: int = 0
    """Model calls or KV copies that raised: the requests they served end with an internal error
    and the engine goes on."""
    prefill_tokens: int = 0
    """Prompt tokens the model processed (those copied from the prefix cache, or from the prompt
    of another completion of the same request, are not counted)."""
    forked_prompt_tokens: int = 0
    """Prompt tokens completions copied from another completion of their request (n > 1)."""
    preemptions: int = 0
    """Requests in a slot (decoding or prefilling) swapped out for a request owed it: each
    copies the victim's KV rows to host memory."""
    resumptions: int = 0
    """Swapped-out requests swapped back in; `preemptions - resumptions` wait in host memory,
    or ended while they waited."""
    speculative_rows: int = 0
    """Decode-step rows that verified speculative drafts (one per speculating sequence and
    step)."""
    draft_tokens: int = 0
    """Draft tokens verified."""
    accepted_draft_tokens: int = 0
    """Of `draft_tokens`, those accepted: tokens gained beyond one per decoded row."""
