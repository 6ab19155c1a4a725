"""Embedding requests from either edge: bounds, tokenizing off the event loop, the engine.

Each edge decodes its request into one plain `EmbeddingInput` (the model, the inputs as text or
token ids, and its own name for the inputs field) and hands it to the server's one `Embedder`.
Every bound is checked before the work it bounds: the count of inputs and each text's characters
before anything is tokenized, each input's tokens against the model's context while it is
tokenized (counting stops past the bound), all on a worker thread, so the event loop never holds
work that grows with the input. Problems are reported together, each naming its field.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

from tokenwire.server.api.registry import ModelRegistry, ServedModel
from tokenwire.server.engine.embedding import EmbeddingRequest, EmbeddingResult
from tokenwire.server.engine.errors import ErrorKind, FieldViolation, GenerationError
from tokenwire.server.engine.validation import count_violation
from tokenwire.server.models.pooling import Pooling
from tokenwire.server.text.tokenizer import TooManyTokensError

EmbedItem = str | tuple[int, ...]
"""One input: a text, or token ids."""
MAX_REQUEST_ID_CHARS = 128


@dataclass(frozen=True)
class EmbeddingInput:
    model: str
    items: tuple[EmbedItem, ...]
    field: str = "input"
    """The edge's name for the inputs; violations name `field[i]`."""
    request_id: str = ""
    dimensions: int | None = None
    """Floats asked for per embedding; only the model's own size is served (None: that size)."""


@dataclass(frozen=True)
class Embedded:
    request_id: str
    model: str
    result: EmbeddingResult
    pooling: Pooling


class Embedder:
    """Serves embedding requests for every served model."""

    def __init__(self, registry: ModelRegistry) -> None:
        self._registry = registry

    async def embed(self, request: EmbeddingInput) -> Embedded:
        if len(request.request_id) > MAX_REQUEST_ID_CHARS:
            raise GenerationError.invalid(
                FieldViolation("request_id", f"longer than {MAX_REQUEST_ID_CHARS} characters")
            )
        try:
            served = self._registry.resolve(request.model)
        except GenerationError as error:
            if error.kind is not ErrorKind.NOT_FOUND:
                raise
            raise GenerationError(
                error.kind,
                error.message,
                violations=(FieldViolation("model", error.message),),
                reason=error.reason,
            ) from None
        _check_counts(request, served)
        inputs = await asyncio.to_thread(_tokenize, request, served)
        request_id = request.request_id or "emb-" + uuid.uuid4().hex[:24]
        result = await served.engine.embed(EmbeddingRequest(request_id, inputs))
        return Embedded(request_id, served.name, result, served.model.info.pooling)


def _check_counts(request: EmbeddingInput, served: ServedModel) -> None:
    """The bounds that need no tokenizing: the count of inputs, empty inputs, text length, ids."""
    limits = served.validator.limits
    info = served.model.info
    field = request.field
    if not request.items:
        raise GenerationError.invalid(FieldViolation(field, "must hold at least one input"))
    too_many = count_violation(field, len(request.items), limits.max_embedding_inputs, "inputs")
    if too_many is not None:
        raise GenerationError.invalid(too_many)
    if not served.engine.embedding_size:
        raise GenerationError.invalid(
            FieldViolation("model", f"model {served.name!r} serves no embeddings (no hidden states)")
        )
    size = served.engine.embedding_size
    if request.dimensions is not None and request.dimensions != size:
        raise GenerationError.invalid(
            FieldViolation(
                "dimensions",
                f"model {served.name!r} returns {size} floats per embedding and cannot shorten them",
            )
        )
    chars = limits.prompt_chars(info.context_length)
    violations: list[FieldViolation] = []
    for index, item in enumerate(request.items):
        where = f"{field}[{index}]"
        if not item:
            violations.append(FieldViolation(where, "must not be empty"))
        elif isinstance(item, str) and len(item) > chars:
            violations.append(FieldViolation(where, f"{len(item)} characters, more than {chars}"))
        elif isinstance(item, tuple):
            if len(item) > info.context_length:
                violations.append(
                    FieldViolation(
                        where, f"{len(item)} tokens, more than the model's context of {info.context_length}"
                    )
                )
            elif any(not 0 <= token < info.vocab_size for token in item):
                violations.append(FieldViolation(where, f"token ids must be in [0, {info.vocab_size})"))
    if violations:
        raise GenerationError.invalid(*violations)


def _tokenize(request: EmbeddingInput, served: ServedModel) -> tuple[tuple[int, ...], ...]:
    """Every input as token ids (texts as plain text, no special tokens), each within the context."""
    tokenizer = served.model.tokenizer
    context = served.model.info.context_length
    inputs: list[tuple[int, ...]] = []
    violations: list[FieldViolation] = []
    for index, item in enumerate(request.items):
        if isinstance(item, tuple):
            inputs.append(item)
            continue
        where = f"{request.field}[{index}]"
        try:
            tokens = tokenizer.encode_within(item, context, add_special_tokens=False, as_text=True)
        except TooManyTokensError as error:
            violations.append(
                FieldViolation(
                    where, f"at least {error.at_least} tokens, more than the model's context of {context}"
                )
            )
            continue
        if not tokens:
            violations.append(FieldViolation(where, "holds no tokens"))
        inputs.append(tuple(tokens))
    if violations:
        raise GenerationError.invalid(*violations)
    return tuple(inputs)
