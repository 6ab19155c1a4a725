"""The engine's settings, declared once: `tokenwire serve` derives a flag, a TOKENWIRE_* variable
and a TOML key from each field (settings_schema.py), and the server hands the group to the engine.
Their help group is named once, where the server's settings hold the class (`settings_group`)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenwire.server.engine.drafting import MAX_DRAFT_TOKENS
from tokenwire.server.settings_schema import setting


def _draft_tokens_problem(value: int) -> str | None:
    if 0 <= value <= MAX_DRAFT_TOKENS:
        return None
    return f"must be between 0 (off) and {MAX_DRAFT_TOKENS} draft tokens, not {value}"


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = setting(8, "most sequences decoded together; sizes the KV cache", minimum=1)
    max_queue_size: int = setting(
        64, "most requests waiting for a slot; beyond it RESOURCE_EXHAUSTED", minimum=0
    )
    max_queued_tokens: int = setting(
        16384,
        "most prompt tokens waiting for a slot, all callers together (a caller under its share of them "
        "still gets in); beyond it RESOURCE_EXHAUSTED QUEUED_TOKENS_FULL; 0: no bound",
        minimum=0,
    )
    """16384: about 50 s of prefill on a 2-core CPU (3.1 ms a token), the same order as a full queue
    of typical requests (64 of 256 tokens), while a full context still fits several times over."""
    prefill_chunk_size: int = setting(256, "most prompt tokens per model call", minimum=1)
    stall_free: bool = setting(
        True,
        "while streams decode, pace prompt work so a round (prompt chunks and one decode step) keeps "
        "to --max-step-ms; off: one whole --prefill-chunk-size chunk per round",
    )
    max_step_ms: float = setting(
        0.0,
        "stall-free target for one round in ms (0: twice the measured decode step)",
        minimum=0,
    )
    prefix_cache_mb: int = setting(
        256,
        "memory for the KV rows of cached prompt prefixes, in MiB (0 turns prefix caching off)",
        minimum=0,
    )
    prefix_block_tokens: int = setting(
        16,
        "prompt tokens per prefix-cache block: prefixes are reused in whole blocks",
        minimum=1,
    )
    batch_reserved_slots: int = setting(
        1,
        "slots BATCH-priority requests leave to the others, so INTERACTIVE work is admitted within one step "
        "(capped at all slots but one)",
        minimum=0,
    )
    preemption: bool = setting(
        True,
        "when every slot is busy, swap a running generation out (KV rows copied aside, resumed later "
        "with no token lost) for a more urgent request, or for a caller under its share of the slots "
        "when another caller holds more; the rows wait in host memory, wherever the KV cache lives",
    )
    speculative_tokens: int = setting(
        0,
        f"prompt-lookup speculative decoding: most draft tokens verified per sequence and step "
        f"(0 turns it off; at most {MAX_DRAFT_TOKENS}); greedy and sampled output keep their meaning, "
        "requests with a response format do not speculate",
        check=_draft_tokens_problem,
    )
    speculative_max_batch: int = setting(
        2,
        "most sequences in a decode step for it to speculate: beyond it a step is compute-bound on "
        "a CPU and verifying drafts costs more than they gain",
        minimum=1,
    )
    """2: from section 12 of BENCHMARKS.md, a K = 4 verification costs 2x a decode step at batch 1
    and 2.7x at batch 2 (each speculating row is a model call of its own on the shared-buffer
    layout), 3.7x at batch 4, where a row gains at most 5 tokens."""

    @property
    def max_step_seconds(self) -> float | None:
        """The stall-free round target; None: a multiple of the measured decode step."""
        return self.max_step_ms / 1000 if self.max_step_ms > 0 else None

    @property
    def prefix_cache_bytes(self) -> int:
        return self.prefix_cache_mb * 2**20
