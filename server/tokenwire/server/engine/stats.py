"""The engine's counters, for tests and telemetry.

The engine thread writes them all except `rejected` and `abort_requests`, which count what the
event loop received; those live in the engine's inbox and `Engine.stats` joins the two.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    decode_steps: int = 0
    decoded_rows: int = 0
    rejected: int = 0
    """Requests refused at admission because the queue was full."""
    abort_requests: int = 0
    """Aborts callers asked for, of live requests (cancel, disconnect, deadline); not shutdown's."""
    prefill_chunks: int = 0
    finished: int = 0
    aborted: int = 0
    """Requests that an abort a caller asked for ended (a request may end by itself first)."""
    max_abort_latency_steps: int = 0
    """Most decode steps any aborted sequence took part in after its abort was requested."""
    orphaned_steps: int = 0
    """Decode steps run for aborted sequences beyond the one step an abort may take to land."""
    step_failures: int = 0
    prefill_tokens: int = 0
    """Prompt tokens the model processed (those copied from the prefix cache, or from the prompt
    of another completion of the same request, are not counted)."""
    forked_prompt_tokens: int = 0
    """Prompt tokens completions copied from another completion of their request (n > 1)."""
    preemptions: int = 0
    """Requests in a slot (decoding or prefilling) swapped out for a request owed it."""
    resumptions: int = 0
    """Swapped-out requests swapped back in."""
    speculative_rows: int = 0
    """Decode-step rows that verified speculative drafts."""
    draft_tokens: int = 0
    """Draft tokens verified."""
    accepted_draft_tokens: int = 0
    """Of `draft_tokens`, those accepted: tokens gained beyond one per decoded row."""
