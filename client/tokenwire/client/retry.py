"""Sending a streamed generation again when a replica refused it before admitting it.

gRPC's retry policy (service_config.json) covers a call that fails as a whole before any
response. A StreamGenerate call can be accepted and still refuse the generation on it, with a
Failed event as the generation's first event: the replica began draining between the two, or its
queue is full. Nothing ran, so the generation is sent again on a new call, which the balancer may
place on another replica, with the same policy's attempts and backoff. A generation that had any
other event first (queued, tokens) is never sent again: its failure is the caller's to see.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from importlib import resources

from tokenwire.client.errors import TokenwireError
from tokenwire.client.types import Failed, StreamEvent

INFERENCE_SERVICE = "tokenwire.v1.InferenceService"


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int
    initial_backoff: float
    max_backoff: float
    multiplier: float

    def delay(
        self, first_event: StreamEvent, attempts: int, *, jitter: Callable[[], float] = random.random
    ) -> float | None:
        """Seconds to wait before sending a generation again after `attempts` tries whose last
        began with `first_event`; None when it must not be sent again."""
        if attempts >= self.max_attempts or not isinstance(first_event, Failed):
            return None
        error = first_event.error
        if not isinstance(error, TokenwireError) or not error.retryable:
            return None
        if error.retry_after is not None:  # the server's pushback, as gRPC honours it for calls
            return error.retry_after
        backoff = min(self.max_backoff, self.initial_backoff * self.multiplier ** (attempts - 1))
        return jitter() * backoff  # gRPC's full jitter, so refused callers do not return in step


@cache
def inference_retry_policy() -> RetryPolicy:
    """The InferenceService retry policy of the service config the client ships with."""
    text = resources.files("tokenwire.client").joinpath("service_config.json").read_text(encoding="utf-8")
    for method_config in json.loads(text)["methodConfig"]:
        if {"service": INFERENCE_SERVICE} in method_config["name"]:
            policy = method_config["retryPolicy"]
            return RetryPolicy(
                max_attempts=int(policy["maxAttempts"]),
                initial_backoff=_seconds(policy["initialBackoff"]),
                max_backoff=_seconds(policy["maxBackoff"]),
                multiplier=float(policy["backoffMultiplier"]),
            )
    raise LookupError(f"service_config.json has no retry policy for {INFERENCE_SERVICE}")


def _seconds(duration: str) -> float:
    return float(duration.removesuffix("s"))
