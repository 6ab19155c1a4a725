"""POST /v1/embeddings: OpenAI's request body to the plain EmbeddingInput, the result to its JSON.

`input` is a string, a list of strings, a list of token ids or a list of lists of token ids;
`encoding_format` is "float" (a JSON list per embedding) or "base64" (the float32 values,
little-endian, base64-encoded, which the official SDKs ask for by default); `dimensions` is
served only as the model's own size; `user` is accepted and ignored. Anything else is a 400
naming the parameter, as on the other routes.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenwire.server.api.embeddings import Embedded, EmbeddingInput, EmbedItem
from tokenwire.server.openai_api.parsing import bad, decode_json

EMBEDDINGS_PATH = "/v1/embeddings"
PARAMETERS = frozenset({"input", "model", "encoding_format", "dimensions", "user"})
ENCODINGS = ("float", "base64")


@dataclass(frozen=True)
class EmbeddingsBody:
    request: EmbeddingInput
    encoding: str


def parse_embeddings(body: bytes) -> EmbeddingsBody:
    """A POST /v1/embeddings body. Raises GenerationError (INVALID_ARGUMENT) naming the parameter."""
    fields = decode_json(body)
    unknown = sorted(name for name in fields if name not in PARAMETERS)
    if unknown:
        raise bad(unknown[0][:40], "unknown parameter (or one this server does not serve)")
    model = fields.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "must be a model's name")
    encoding = fields.get("encoding_format") or "float"
    if encoding not in ENCODINGS:
        raise bad("encoding_format", f"must be one of {', '.join(ENCODINGS)}")
    if fields.get("user") is not None and not isinstance(fields.get("user"), str):
        raise bad("user", "must be a string")
    dimensions = fields.get("dimensions")
    if dimensions is not None and (
        isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1
    ):
        raise bad("dimensions", "must be a positive integer")
    return EmbeddingsBody(
        EmbeddingInput(model, _items(fields.get("input")), "input", dimensions=dimensions), encoding
    )


def _items(value: Any) -> tuple[EmbedItem, ...]:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and value and all(_is_token(t) for t in value):
        return (tuple(value),)
    if isinstance(value, list):
        items: list[EmbedItem] = []
        for index, item in enumerate(value):
            if isinstance(item, str):
                items.append(item)
            elif isinstance(item, list) and all(_is_token(t) for t in item):
                items.append(tuple(item))
            else:
                raise bad(f"input[{index}]", "must be a string or a list of token ids")
        return tuple(items)
    raise bad("input", "must be a string, a list of strings or token ids, or a list of token-id lists")


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def embeddings_json(embedded: Embedded, encoding: str) -> bytes:
    """OpenAI's CreateEmbeddingResponse for `embedded`."""
    vectors = embedded.result.vectors
    data: list[Mapping[str, Any]] = [
        {"object": "embedding", "index": index, "embedding": _encoded(vector, encoding)}
        for index, vector in enumerate(vectors)
    ]
    tokens = embedded.result.prompt_tokens
    return json.dumps(
        {
            "object": "list",
            "data": data,
            "model": embedded.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    ).encode()


def _encoded(vector: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(np.ascontiguousarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return [float(x) for x in vector]
