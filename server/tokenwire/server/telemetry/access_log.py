"""One log line per request, on the `tokenwire.access` logger, with its outcome and timings."""

from __future__ import annotations

import logging

from tokenwire.server.engine.types import Outcome
from tokenwire.server.telemetry.logs import FIELDS_ATTRIBUTE
from tokenwire.server.telemetry.summary import RequestSummary

ACCESS_LOGGER = "tokenwire.access"


class AccessLog:
    def __init__(self, logger: logging.Logger | None = None) -> None:
        self._logger = logger or logging.getLogger(ACCESS_LOGGER)

    @property
    def enabled(self) -> bool:
        """Whether a line would be written (the logger's level can change at run time)."""
        return self._logger.isEnabledFor(logging.INFO)

    def write(self, summary: RequestSummary, trace_id: str | None) -> None:
        if not self.enabled:
            return
        stages = summary.stages
        prefill = None
        if stages.first_token is not None and stages.queued is not None:
            prefill = stages.first_token - stages.queued - (stages.paced or 0.0)
        fields: dict[str, object] = {
            "method": summary.method,
            "request_id": summary.request_id,
            "model": summary.model,
            "caller": summary.caller,
            "adapter": summary.adapter or None,
            "outcome": summary.outcome.value,
            "code": summary.error_code or "OK",
            "reason": summary.error_reason,
            "finish_reason": summary.finish_reason,
            "prompt_tokens": summary.prompt_tokens,
            "completion_tokens": summary.completion_tokens,
            "cached_prompt_tokens": summary.cached_prompt_tokens,
            "draft_tokens": summary.draft_tokens,
            "accepted_draft_tokens": summary.accepted_draft_tokens,
            "draft_acceptance": (
                round(summary.accepted_draft_tokens / summary.draft_tokens, 3)
                if summary.draft_tokens
                else None
            ),
            "queued_ms": _ms(stages.queued),
            "ttft_ms": _ms(stages.first_token),
            "paced_ms": _ms(stages.paced),
            "prefill_ms": _ms(prefill),
            "tpot_ms": _ms(stages.time_per_output_token),
            "total_ms": _ms(stages.total),
            "trace_id": trace_id,
        }
        level = logging.WARNING if summary.outcome is Outcome.ERROR else logging.INFO
        self._logger.log(
            level, "%s %s", summary.method, summary.outcome.value, extra={FIELDS_ATTRIBUTE: fields}
        )


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0
