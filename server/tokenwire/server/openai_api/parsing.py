"""An OpenAI request body (already bounded in bytes) -> a RequestSpec, or a 400 naming the parameter.

Only shapes and types are checked here: a parameter of the wrong JSON type, a value only
OpenAI's API has (echo, best_of, suffix other than their defaults), an unknown parameter. Every
numeric bound, count and length (n, max_tokens, temperature, top_p, top_logprobs, messages, stop,
prompt characters, the schema's size) is the request validator's, the same as for gRPC, named
back into OpenAI's parameter names by `name_fields`.

Parsing a body costs time in proportion to its size: the caller runs it on a worker thread
beyond a small body (app.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from tokenwire.server.api.request_bounds import MAX_MODEL_NAME_CHARACTERS
from tokenwire.server.engine.errors import ErrorKind, FieldViolation, GenerationError, excerpt
from tokenwire.server.engine.types import Priority
from tokenwire.server.engine.validation import RequestSpec
from tokenwire.server.openai_api.json_text import body_text, unicode_violation
from tokenwire.server.sampling.params import FormatKind, ResponseFormat
from tokenwire.server.text.chat import ChatTurn

PRIORITY_HEADER = "x-tokenwire-priority"
"""interactive, default or batch: the engine's priorities (docs/operations.md)."""
TIMEOUT_HEADER = "x-tokenwire-timeout"
"""Seconds, from the moment the request is received, before it fails with 504."""
MAX_USER_CHARACTERS = 256
MAX_SEED = 2**64 - 1
"""Seeds are unsigned 64-bit, as on gRPC."""
ROLE_ALIASES = {"developer": "system"}
"""OpenAI's newer name for the system turn; the chat templates know only "system"."""

_PRIORITIES = {"interactive": Priority.INTERACTIVE, "default": Priority.DEFAULT, "batch": Priority.BATCH}

# Parameters a client may send that change nothing here: metadata for OpenAI's own storage.
_IGNORED = frozenset({"metadata", "store", "service_tier", "user", "parallel_tool_calls"})
_COMMON = frozenset(
    {
        "model",
        "stream",
        "stream_options",
        "max_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "n",
        "logit_bias",
        "presence_penalty",
        "frequency_penalty",
        "response_format",
    }
)
CHAT_PARAMETERS = _COMMON | _IGNORED | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
COMPLETION_PARAMETERS = _COMMON | _IGNORED | {"prompt", "logprobs", "echo", "best_of", "suffix"}


@dataclass(frozen=True)
class ParsedRequest:
    spec: RequestSpec
    chat: bool
    stream: bool = False
    include_usage: bool = False
    renames: Mapping[str, str] = field(default_factory=dict)
    """RequestSpec field -> the OpenAI parameter (or header) that set it."""

    def name_fields(self, error: GenerationError) -> GenerationError:
        """`error` from the validator, its violations named by OpenAI parameter."""
        if error.kind is not ErrorKind.INVALID_ARGUMENT or not error.violations or error.reason is not None:
            return error
        return GenerationError.invalid(
            *(FieldViolation(self._rename(v.field), v.description) for v in error.violations),
            omitted=error.omitted_violations,
        )

    def _rename(self, name: str) -> str:
        end = min((i for i in (name.find("["), name.find(".")) if i >= 0), default=len(name))
        head, rest = name[:end], name[end:]
        renamed = self.renames.get(head)
        if renamed is None:
            return name
        if head == "response_format":
            return renamed  # the schema's own path, whatever the kind's name in the engine
        return renamed + rest


def bad(param: str, description: str) -> GenerationError:
    return GenerationError.invalid(FieldViolation(param, description))


def decode_json(body: bytes) -> dict[str, Any]:
    """The body as a JSON object; NaN and Infinity, which JSON does not have, are refused."""

    def refuse_constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        decoded = json.loads(body_text(body), parse_constant=refuse_constant)
    except (ValueError, RecursionError) as error:
        raise bad("body", f"not valid JSON: {excerpt(str(error), 120)}") from None
    if not isinstance(decoded, dict):
        raise bad("body", "must be a JSON object")
    where = unicode_violation(body, decoded)
    if where is not None:
        raise bad(excerpt(where), "is not valid UTF-8 (an unpaired surrogate, or bytes that are not UTF-8)")
    return decoded


def parse_chat(body: bytes, headers: Mapping[str, str], request_id: str) -> ParsedRequest:
    """A POST /v1/chat/completions body. Raises GenerationError (INVALID_ARGUMENT)."""
    fields = decode_json(body)
    _refuse_unknown(fields, CHAT_PARAMETERS)
    messages = _messages(fields.get("messages"))
    logprobs = _optional(fields, "logprobs", bool) or False
    top_logprobs = _optional(fields, "top_logprobs", int) or 0
    max_tokens, max_name = _max_tokens(fields, ("max_completion_tokens", "max_tokens"))
    spec = RequestSpec(
        request_id=request_id,
        model=_model(fields),
        messages=messages,
        max_new_tokens=max_tokens,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )
    renames = {"max_new_tokens": max_name, "top_logprobs": "top_logprobs", "logprobs": "logprobs"}
    return _finish(fields, headers, spec, renames, chat=True)


def parse_completion(body: bytes, headers: Mapping[str, str], request_id: str) -> ParsedRequest:
    """A POST /v1/completions body. Raises GenerationError (INVALID_ARGUMENT)."""
    fields = decode_json(body)
    _refuse_unknown(fields, COMPLETION_PARAMETERS)
    for name, default in (("echo", False), ("best_of", 1), ("suffix", None)):
        value = fields.get(name)
        if value is not None and value != default:
            raise bad(name, f"only {json.dumps(default)} is served")
    n = fields.get("n")
    if fields.get("best_of") is not None and isinstance(n, int) and not isinstance(n, bool) and n > 1:
        # OpenAI's own rule: best_of completions are generated and the best n returned.
        raise bad("best_of", "must be at least n (only 1 is served, so leave it out with n > 1)")
    prompt, token_ids = _prompt(fields.get("prompt"))
    # Completions' logprobs is a count: that many alternatives at each position (0 to 5 in OpenAI).
    top = _optional(fields, "logprobs", int)
    max_tokens, max_name = _max_tokens(fields, ("max_tokens",))
    spec = RequestSpec(
        request_id=request_id,
        model=_model(fields),
        prompt=prompt,
        token_ids=token_ids,
        max_new_tokens=16 if max_tokens is None else max_tokens,  # OpenAI's default for completions
        logprobs=top is not None,
        top_logprobs=top or 0,
    )
    renames = {"max_new_tokens": max_name, "top_logprobs": "logprobs", "token_ids": "prompt"}
    return _finish(fields, headers, spec, renames, chat=False)


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias, an object of token ids (as strings) to biases, as the engine's pairs.

    The body's size bounds its size here (it is parsed JSON already); the count, the ids' range
    and the biases' bounds are the validator's, as on gRPC, which names each bad entry logit_bias[ID].
    """
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise bad("logit_bias", "must be an object of token ids to biases")
    pairs = []
    for key, bias in value.items():
        if not isinstance(key, str) or not key.isascii() or not key.isdigit():
            raise bad(f"logit_bias[{excerpt(str(key), 24)}]", "a token id must be a non-negative integer")
        if _is_bool(bias) or not isinstance(bias, int | float):
            raise bad(f"logit_bias[{key}]", "the bias must be a number")
        pairs.append((int(key), float(bias)))
    return tuple(pairs)


def _finish(
    fields: Mapping[str, Any],
    headers: Mapping[str, str],
    spec: RequestSpec,
    renames: dict[str, str],
    *,
    chat: bool,
) -> ParsedRequest:
    stream = _optional(fields, "stream", bool) or False
    include_usage = False
    options = fields.get("stream_options")
    if options is not None:
        if not stream:
            raise bad("stream_options", "only allowed when stream is true")
        if not isinstance(options, dict):
            raise bad("stream_options", "must be an object")
        unknown = sorted(set(options) - {"include_usage"})
        if unknown:
            raise bad(f"stream_options.{excerpt(unknown[0])}", "unknown option")
        include_usage = _optional(options, "include_usage", bool, prefix="stream_options.") or False
    user = fields.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > MAX_USER_CHARACTERS):
        raise bad("user", f"must be a string of at most {MAX_USER_CHARACTERS} characters")
    seed = _optional(fields, "seed", int)
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise bad("seed", f"must be between 0 and {MAX_SEED}")
    spec = replace(
        spec,
        temperature=_optional_number(fields, "temperature"),
        top_p=_optional_number(fields, "top_p"),
        seed=seed,
        stop=_stop(fields.get("stop")),
        response_format=_response_format(fields.get("response_format")),
        priority=_priority(headers.get(PRIORITY_HEADER)),
        timeout=_timeout(headers.get(TIMEOUT_HEADER)),
        logit_bias=_logit_bias(fields.get("logit_bias")),
        presence_penalty=_optional_number(fields, "presence_penalty") or 0.0,
        frequency_penalty=_optional_number(fields, "frequency_penalty") or 0.0,
        n=_optional(fields, "n", int),  # 1 to 16: the validator's bound, named n as here
    )
    renames = {
        **renames,
        "priority": PRIORITY_HEADER,
        "timeout": TIMEOUT_HEADER,
        "response_format": "response_format.json_schema.schema",
    }
    return ParsedRequest(spec, chat, stream, include_usage, renames)


def _refuse_unknown(fields: Mapping[str, Any], known: frozenset[str]) -> None:
    unknown = sorted(name for name in fields if name not in known)
    if unknown:
        raise bad(excerpt(unknown[0]), "unknown parameter (or one this server does not serve)")


def _model(fields: Mapping[str, Any]) -> str:
    model = fields.get("model", "")
    if model is None:
        return ""
    if not isinstance(model, str):
        raise bad("model", "must be a string")
    if len(model) > MAX_MODEL_NAME_CHARACTERS:
        raise bad("model", f"{len(model)} characters: no model has such a name")
    return model


def _messages(value: Any) -> tuple[ChatTurn, ...]:
    if value is None:
        raise bad("messages", "required: a list of {role, content} objects")
    if not isinstance(value, list) or not value:
        raise bad("messages", "must be a non-empty list of {role, content} objects")
    turns: list[ChatTurn] = []
    for index, message in enumerate(value):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise bad(where, "must be an object with role and content")
        role = message.get("role")
        if not isinstance(role, str):
            raise bad(f"{where}.role", "must be a string")
        for name in ("tool_calls", "function_call", "audio"):
            if message.get(name) is not None:
                raise bad(f"{where}.{name}", "not served: tools and audio are not supported")
        turns.append(ChatTurn(ROLE_ALIASES.get(role, role), _content(message.get("content"), where)))
    return tuple(turns)


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts: list[str] = []
        for index, part in enumerate(value):
            text = part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None
            if not isinstance(text, str):
                raise bad(f"{where}.content[{index}]", 'only {"type": "text", "text": ...} parts are served')
            parts.append(text)
        return "".join(parts)
    raise bad(f"{where}.content", "must be a string or a list of text parts")


def _prompt(value: Any) -> tuple[str | None, tuple[int, ...] | None]:
    """A completion's prompt: a string, or token ids; a list of one of either is the same."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str):
        return value, None
    if isinstance(value, list) and value and all(isinstance(t, int) and not _is_bool(t) for t in value):
        return None, tuple(value)
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, str | list) for p in value):
        raise bad("prompt", "one prompt per request is served")
    raise bad("prompt", "must be a string or a list of token ids")


def _max_tokens(fields: Mapping[str, Any], names: tuple[str, ...]) -> tuple[int | None, str]:
    given = [name for name in names if fields.get(name) is not None]
    if len(given) > 1:
        raise bad(given[1], f"give {' or '.join(names)}, not both")
    name = given[0] if given else names[0]
    return _optional(fields, name, int), name


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list):
        for index, item in enumerate(value):
            if not isinstance(item, str):
                raise bad(f"stop[{index}]", "must be a string")
        return tuple(value)
    raise bad("stop", "must be a string or a list of strings")


def _response_format(value: Any) -> ResponseFormat | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad("response_format", 'must be an object with a "type"')
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat(FormatKind.JSON_SCHEMA, '{"type": "object"}')
    if kind != "json_schema":
        raise bad("response_format.type", "must be text, json_object or json_schema")
    described = value.get("json_schema")
    if not isinstance(described, dict):
        raise bad("response_format.json_schema", "must be an object with a schema")
    schema = described.get("schema", {})
    if not isinstance(schema, dict | bool):
        raise bad("response_format.json_schema.schema", "must be a JSON Schema object")
    return ResponseFormat(FormatKind.JSON_SCHEMA, json.dumps(schema))


def _priority(value: str | None) -> Priority | None:
    if value is None:
        return Priority.DEFAULT
    return _PRIORITIES.get(value.strip().lower())  # None: the validator names the header


def _timeout(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        raise bad(TIMEOUT_HEADER, "must be a number of seconds") from None
    if not math.isfinite(seconds):
        raise bad(TIMEOUT_HEADER, "must be a positive number of seconds")
    return seconds


def _optional(fields: Mapping[str, Any], name: str, kind: type[bool] | type[int], *, prefix: str = "") -> Any:
    value = fields.get(name)
    if value is None:
        return None
    if kind is bool and not isinstance(value, bool):
        raise bad(prefix + name, "must be true or false")
    if kind is int and (_is_bool(value) or not isinstance(value, int)):
        # JSON has one number type: 5.0 is the integer 5, as OpenAI's API reads it.
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise bad(prefix + name, "must be an integer")
    return value


def _optional_number(fields: Mapping[str, Any], name: str) -> float | None:
    value = fields.get(name)
    if value is None:
        return None
    if _is_bool(value) or not isinstance(value, int | float):
        raise bad(name, "must be a number")
    try:
        return float(value)
    except OverflowError:
        raise bad(name, "out of range") from None


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


ParseBody = Callable[[bytes, Mapping[str, str], str], ParsedRequest]
