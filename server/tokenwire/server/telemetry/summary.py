"""What is known about one request when it ends: the input of its span and its access-log line."""

from __future__ import annotations

from dataclasses import dataclass

from tokenwire.server.engine.types import Outcome


@dataclass(frozen=True)
class RequestParameters:
    """The request's own settings worth recording (never its prompt)."""

    operation: str
    """GenAI operation name: "chat" for messages, "text_completion" otherwise."""
    requested_model: str
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int = 0
    seed: int | None = None
    completions: int = 1
    """How many completions the request asked for (`n`)."""


@dataclass(frozen=True)
class Stages:
    """Seconds from receipt of the request; None for a stage it never reached."""

    total: float
    queued: float | None = None
    """When the request left the queue (work began, or it ended there); None: it was never queued."""
    first_token: float | None = None
    time_per_output_token: float | None = None
    paced: float | None = None
    """Of the time between `queued` and `first_token`, how long the prompt waited on other requests;
    the rest was its own prefill."""


@dataclass(frozen=True)
class RequestSummary:
    method: str
    """The gRPC method: Generate or StreamGenerate."""
    request_id: str
    model: str
    """The served model's name, or "" when the request never resolved to one."""
    outcome: Outcome
    """ok, cancelled, deadline, stopped, rejected, invalid, unauthenticated, unavailable or error."""
    stages: Stages
    parameters: RequestParameters | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    """Prompt tokens taken from the prefix cache."""
    draft_tokens: int = 0
    """Speculative draft tokens verified for the request."""
    accepted_draft_tokens: int = 0
    """Of `draft_tokens`, those accepted."""
    error_code: str | None = None
    """The status code's name (e.g. DEADLINE_EXCEEDED) when the request failed."""
    error_reason: str | None = None
    """The machine-readable reason (e.g. QUEUE_FULL) when the request failed."""
    error_message: str | None = None
    caller: str = "anonymous"
    """Who sent the request, as the token file names them (never the token)."""
    adapter: str = ""
    """The LoRA adapter the request ran with, once admission found it served and allowed; empty:
    the base model (or a request refused before then)."""
