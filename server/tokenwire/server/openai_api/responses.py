"""Engine results and events -> OpenAI's JSON objects and server-sent-event chunks.

Besides OpenAI's own fields, every completion (and a stream's last chunk) carries tokenwire's
timing as an extension member, all in seconds from the moment the request was received:

    "tokenwire": {"timing": {"queued": ..., "time_to_first_token": ..., "prefill": ...,
                             "total": ..., "decode_tokens_per_second": ...}}

A stage the request never reached is null. OpenAI's SDKs keep unknown members, so a client
reads it as `completion.tokenwire` (Python) or `completion["tokenwire"]` (Node).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from tokenwire.server.engine.types import (
    CompletionChoice,
    FinishReason,
    GenerationResult,
    TimingReport,
    TokenLogprobs,
)

EXTENSION = "tokenwire"
DONE = b"data: [DONE]\n\n"

_FINISH_REASONS = {
    FinishReason.EOS: "stop",
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CANCELLED: "stop",  # only a client that has gone away is cancelled: nobody reads it
}


@dataclass(frozen=True)
class Identity:
    """What every object of one response repeats."""

    id: str
    created: int
    model: str
    chat: bool


def timing(report: TimingReport) -> dict[str, object]:
    return {
        "queued": report.queued,
        "time_to_first_token": report.time_to_first_token,
        "prefill": report.prefill,
        "paced": report.paced,
        "total": report.total,
        "decode_tokens_per_second": report.decode_tokens_per_second,
    }


def usage(result: GenerationResult) -> dict[str, object]:
    found: dict[str, object] = {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": result.cached_prompt_tokens},
    }
    if result.draft_tokens:
        # OpenAI's names for a prediction's tokens the model kept and those it did not: the
        # nearest thing its API has to speculative drafts.
        found["completion_tokens_details"] = {
            "accepted_prediction_tokens": result.accepted_draft_tokens,
            "rejected_prediction_tokens": result.draft_tokens - result.accepted_draft_tokens,
        }
    return found


def completion(identity: Identity, result: GenerationResult, *, logprobs: bool) -> bytes:
    """The whole answer of a request that did not stream: one choice per completion (n)."""
    completions = result.choices or (
        CompletionChoice(0, result.text, result.token_ids, result.finish_reason, result.logprobs),
    )
    choices: list[dict[str, object]] = []
    for completed in completions:
        choice: dict[str, object] = {
            "index": completed.index,
            "finish_reason": _FINISH_REASONS[completed.finish_reason],
        }
        if identity.chat:
            choice["message"] = {"role": "assistant", "content": completed.text}
            choice["logprobs"] = chat_logprobs(completed.logprobs) if logprobs else None
        else:
            choice["text"] = completed.text
            choice["logprobs"] = completion_logprobs(completed.logprobs, 0) if logprobs else None
        choices.append(choice)
    body = {
        **_head(identity, chunk=False),
        "choices": choices,
        "usage": usage(result),
        EXTENSION: {"timing": timing(result.timing)},
    }
    return json.dumps(body).encode()


class ChunkWriter:
    """The server-sent events of one streamed response, in OpenAI's chunk format.

    With n completions every chunk carries one choice, whose index says which completion it
    belongs to; their chunks interleave as the completions are generated, and each completion's
    finish reason comes in a chunk of its own once all of them have ended.
    """

    def __init__(
        self, identity: Identity, *, logprobs: bool, include_usage: bool, completions: int = 1
    ) -> None:
        self._identity = identity
        self._logprobs = logprobs
        self._include_usage = include_usage
        self._completions = completions
        self._text_offsets: dict[int, int] = {}
        """Per completion, how much text its chunks have carried (the legacy logprobs' offsets)."""

    def opening(self) -> bytes:
        """Chat's first chunk of each completion names the role; completions have none."""
        if not self._identity.chat:
            return b""
        return b"".join(
            self._event(self._choice(index, {"role": "assistant", "content": ""}, None, None))
            for index in range(self._completions)
        )

    def tokens(self, text: str, logprobs: Sequence[TokenLogprobs], index: int = 0) -> bytes:
        if not text and not logprobs:
            return b""
        if self._identity.chat:
            choice = self._choice(
                index, {"content": text}, chat_logprobs(logprobs) if self._logprobs else None, None
            )
        else:
            offset = self._text_offsets.get(index, 0)
            choice = self._choice(
                index,
                text,
                completion_logprobs(logprobs, offset) if self._logprobs else None,
                None,
            )
            self._text_offsets[index] = offset + len(text)
        return self._event(choice)

    def closing(self, result: GenerationResult) -> bytes:
        """Each completion's finish reason, the usage chunk when asked for, then [DONE]; timing
        on the last."""
        extension: dict[str, object] = {EXTENSION: {"timing": timing(result.timing)}}
        ended = [(choice.index, choice.finish_reason) for choice in result.choices] or [
            (0, result.finish_reason)
        ]
        empty: object = {} if self._identity.chat else ""
        finishes = [self._choice(index, empty, None, _FINISH_REASONS[reason]) for index, reason in ended]
        data = b"".join(self._event(finish) for finish in finishes[:-1])
        if not self._include_usage:
            return data + self._event(finishes[-1], extension) + DONE
        last = {**_head(self._identity, chunk=True), "choices": [], "usage": usage(result), **extension}
        return data + self._event(finishes[-1]) + self._frame(last) + DONE

    def _choice(self, index: int, delta: object, logprobs: object, finish: str | None) -> dict[str, object]:
        choice: dict[str, object] = {"index": index}
        if self._identity.chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish
        return choice

    def _event(self, choice: dict[str, object], extra: dict[str, object] | None = None) -> bytes:
        body: dict[str, object] = {**_head(self._identity, chunk=True), "choices": [choice]}
        if self._include_usage:
            body["usage"] = None
        if extra:
            body.update(extra)
        return self._frame(body)

    @staticmethod
    def _frame(body: dict[str, object]) -> bytes:
        return b"data: " + json.dumps(body).encode() + b"\n\n"


def error_event(error: dict[str, object]) -> bytes:
    """A failure after the stream began: OpenAI's SDKs raise on an event with an `error` member."""
    return b"data: " + json.dumps({"error": error}).encode() + b"\n\n"


def chat_logprobs(items: Sequence[TokenLogprobs]) -> dict[str, object]:
    return {
        "content": [
            {
                "token": item.token,
                "logprob": item.logprob,
                "bytes": list(item.token.encode()),
                "top_logprobs": [
                    {"token": text, "logprob": logprob, "bytes": list(text.encode())}
                    for _, text, logprob in item.top
                ],
            }
            for item in items
        ]
    }


def completion_logprobs(items: Sequence[TokenLogprobs], offset: int) -> dict[str, object]:
    """The legacy completions layout: parallel lists, alternatives as {token: logprob}."""
    offsets: list[int] = []
    for item in items:
        offsets.append(offset)
        offset += len(item.token)
    return {
        "tokens": [item.token for item in items],
        "token_logprobs": [item.logprob for item in items],
        "top_logprobs": [{text: logprob for _, text, logprob in item.top} for item in items],
        "text_offset": offsets,
    }


def models_list(names: Sequence[str], created: int) -> bytes:
    return json.dumps({"object": "list", "data": [model_object(name, created) for name in names]}).encode()


def model_object(name: str, created: int) -> dict[str, object]:
    return {"id": name, "object": "model", "created": created, "owned_by": "tokenwire"}


def model_json(name: str, created: int) -> bytes:
    return json.dumps(model_object(name, created)).encode()


def _head(identity: Identity, *, chunk: bool) -> dict[str, object]:
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if identity.chat else "text_completion"
    return {
        "id": identity.id,
        "object": kind,
        "created": identity.created,
        "model": identity.model,
        "system_fingerprint": None,
    }
