"""Callers' fair shares: the one formula admission, preemption and prompt order all use, and the
one measure of the work a request asks for.

A caller's share of some capacity (queue places, queued prompt tokens, slots) is the part of it
its weight earns among the weights of the callers contending for it. Queue admission compares
what a caller has queued (requests, and prompt tokens) with its share of the queue; preemption
compares what each caller holds with its share of the slots; prompt order serves first the
caller holding the least work in slots for its weight; and the fair queue's turns charge each
request its work over its caller's weight.

Work is counted in tokens: every prompt token still to prefill and every token it may still
generate counts one. Measured on the 2-core CPU this was tuned on (BENCHMARKS.md,
benchmarks/chunk_cost.py), a prompt token costs about 3.1 ms inside a chunk (plus 16 ms a model
call) and a generated token about 4 ms of a full 8-row decode step (32 ms): within a third of
each other, so one unit each keeps the measure simple and free of a machine-specific constant.
A caller sending 1,000-token prompts thus pays about ten times the turns of one sending
100-token prompts for the same output.
"""

from __future__ import annotations

from collections.abc import Mapping

_MIN_WEIGHT = 1e-6
"""A weight is positive by validation; the floor only keeps a division defined."""


def fair_share(capacity: float, weight: float, weights: Mapping[str, float]) -> float:
    """The part of `capacity` that `weight` earns among `weights` (the contenders, itself included).

    With no weight among the contenders, the whole capacity.
    """
    total = sum(weights.values())
    if total <= 0:
        return float(capacity)
    return capacity * max(weight, _MIN_WEIGHT) / total


def held_per_share(held: float, weight: float) -> float:
    """How much a caller holds relative to what its weight earns: comparable across callers of
    one pool, since every caller's share of it is its weight times the same factor."""
    return held / max(weight, _MIN_WEIGHT)


def work(prompt_tokens: int, new_tokens: int) -> int:
    """The work a request asks of the engine: prompt tokens to prefill plus tokens to generate."""
    return max(0, prompt_tokens) + max(0, new_tokens)
