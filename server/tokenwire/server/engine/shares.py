"""Callers' fair shares: the one formula admission, preemption and prompt order all use.

A caller's share of some capacity (queue places, slots) is the part of it its weight earns
among the weights of the callers contending for it. Queue admission compares what a caller
has queued with its share of the queue; preemption compares what each caller holds with its
share of the slots; prompt order serves first the caller holding the least for its share.
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
