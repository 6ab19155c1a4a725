"""An OpenAI request body (already bounded in bytes) -> a RequestSpec, or a 400 naming the parameter.

Only shapes and types are checked here: a parameter of the wrong JSON type, a value only
OpenAI's API has (echo, best_of, suffix other than their defaults), an unknown parameter. Every
numeric bound, count and length (n, max_tokens, temperature, top_p, top_logprobs, messages, stop,
prompt characters, the schema's size, the tools) is the request validator's, the same as for
gRPC, named back into OpenAI's parameter names by `name_fields`.

Every parameter OpenAI's API defines is accepted. Those tokenwire serves act (CHAT_SERVED,
COMPLETION_SERVED, and vLLM's extensions top_k, min_p and repetition_penalty); the others change
nothing (IGNORED: OpenAI's storage, routing and caching hints, reasoning and audio options, the
deprecated `functions`), and a response to a request that set any of them names them in its
IGNORED_HEADER. A parameter OpenAI's API does not define is a 400 naming it.

Parsing a body costs time in proportion to its size: the caller runs it on a worker thread
beyond a small body (app.py).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from tokenwire.server.api.admission import AdmissionInput
from tokenwire.server.api.request_bounds import spec_sizes
from tokenwire.server.engine.errors import FieldViolation, GenerationError, excerpt
from tokenwire.server.engine.types import Priority
from tokenwire.server.engine.validation import RequestSpec
from tokenwire.server.openai_api.json_text import body_text, unicode_violation
from tokenwire.server.sampling.params import FormatKind, ResponseFormat
from tokenwire.server.text.chat import ChatTurn
from tokenwire.server.text.tools import ToolCall, ToolChoice, ToolChoiceMode, ToolDefinition

PRIORITY_HEADER = "x-tokenwire-priority"
"""interactive, default or batch: the engine's priorities (docs/operations.md)."""
TIMEOUT_HEADER = "x-tokenwire-timeout"
"""Seconds, from the moment the request is received, before it fails with 504."""
IDEMPOTENCY_HEADER = "idempotency-key"
"""Makes the request idempotent for its caller, as GenerateRequest.idempotency_key does on gRPC."""
IGNORED_HEADER = "x-tokenwire-ignored-parameters"
"""On a response: the parameters of its request that this server accepted and ignored."""
MAX_USER_CHARACTERS = 256
MAX_SEED = 2**64 - 1
"""Seeds are unsigned 64-bit, as on gRPC."""
ROLE_ALIASES = {"developer": "system"}
"""OpenAI's newer name for the system turn; the chat templates know only "system"."""

_PRIORITIES = {"interactive": Priority.INTERACTIVE, "default": Priority.DEFAULT, "batch": Priority.BATCH}

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
    }
)
EXTENSIONS = frozenset({"top_k", "min_p", "repetition_penalty"})
"""Served beyond OpenAI's parameters, as vLLM serves them (the gRPC SamplingParams' fields)."""
CHAT_SERVED = _COMMON | {
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
}
COMPLETION_SERVED = _COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix", "response_format"}
"""response_format is an extension on completions, as on vLLM."""
CHAT_IGNORED = frozenset(
    {
        "metadata",
        "store",
        "service_tier",
        "user",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "reasoning_effort",
        "verbosity",
        "modalities",
        "audio",
        "prediction",
        "web_search_options",
        "functions",
        "function_call",
    }
)
"""OpenAI's chat parameters that change nothing here (docs/operations.md lists why)."""
COMPLETION_IGNORED = frozenset({"user"})
CHAT_PARAMETERS = CHAT_SERVED | CHAT_IGNORED | EXTENSIONS
COMPLETION_PARAMETERS = COMPLETION_SERVED | COMPLETION_IGNORED | EXTENSIONS
_STREAM_OPTIONS = frozenset({"include_usage", "include_obfuscation"})
"""include_obfuscation pads chunks against length side channels on OpenAI's own API; ignored."""
_TOOL_RENAMES = (
    (re.compile(r"^tools\[(\d+)\]\.(name|description|parameters)"), r"tools[\1].function.\2"),
    (
        re.compile(r"^messages\[(\d+)\]\.tool_calls\[(\d+)\]\.(name|arguments)"),
        r"messages[\1].tool_calls[\2].function.\3",
    ),
)


@dataclass(frozen=True)
class ParsedRequest:
    spec: RequestSpec
    chat: bool
    stream: bool = False
    include_usage: bool = False
    renames: Mapping[str, str] = field(default_factory=dict)
    """RequestSpec field -> the OpenAI parameter (or header) that set it."""
    idempotency_key: str | None = None
    """From the Idempotency-Key header; None without one."""
    ignored: tuple[str, ...] = ()
    """The parameters the request set that change nothing here, sorted."""
    paths: Mapping[str, str] = field(default_factory=dict)
    """RequestSpec path (a field, or one of its entries such as `messages[3]`) -> where the body
    set it, for an edge whose body is not laid out as RequestSpec (the Responses API's input
    items); the longest path that begins a violation's field renames it."""
    path_patterns: tuple[tuple[re.Pattern[str], str], ...] = ()
    """Rewrites of a violation's field tried after `paths` (chat's nested tool fields)."""
    echo: Mapping[str, object] = field(default_factory=dict)
    """What the response repeats of the request (the Responses API's response object does)."""

    def admission_input(self) -> AdmissionInput:
        """The request as the admission both edges share takes it."""
        spec = self.spec
        key = self.idempotency_key
        return AdmissionInput(spec_sizes(spec, key or ""), lambda: spec, self.name_fields, key)

    def name_fields(self, error: GenerationError) -> GenerationError:
        """`error` from admission, its violations named by OpenAI parameter (or header)."""
        if not error.violations:
            return error
        if error.reason is not None:  # a reasoned refusal keeps its message; its field is renamed
            return GenerationError(
                error.kind,
                error.message,
                violations=tuple(
                    FieldViolation(self._rename(v.field), v.description) for v in error.violations
                ),
                retry_after=error.retry_after,
                reason=error.reason,
                omitted_violations=error.omitted_violations,
            )
        return GenerationError.invalid(
            *(FieldViolation(self._rename(v.field), v.description) for v in error.violations),
            omitted=error.omitted_violations,
        )

    def _rename(self, name: str) -> str:
        if self.paths:
            ends = [len(name), *(i for i in range(len(name) - 1, 0, -1) if name[i] in ".[")]
            for end in ends:
                found = self.paths.get(name[:end])
                if found is not None:
                    return found + name[end:]
        for pattern, replacement in self.path_patterns:
            path, count = pattern.subn(replacement, name)
            if count:
                return path
        end = min((i for i in (name.find("["), name.find(".")) if i >= 0), default=len(name))
        head, rest = name[:end], name[end:]
        renamed = self.renames.get(head)
        if renamed is None:
            return name
        if head == "response_format":
            # The schema's own path, whatever the kind's name in the engine; the whole parameter
            # (combined with something it cannot be) is itself.
            return renamed if rest else head
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
    refuse_unknown(fields, CHAT_PARAMETERS)
    messages = _messages(fields.get("messages"))
    tools = _tools(fields.get("tools"))
    logprobs = optional(fields, "logprobs", bool) or False
    top_logprobs = optional(fields, "top_logprobs", int) or 0
    max_tokens, max_name = _max_tokens(fields, ("max_completion_tokens", "max_tokens"))
    spec = RequestSpec(
        request_id=request_id,
        model=model_name(fields),
        messages=messages,
        max_new_tokens=max_tokens,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        tools=tools,
        tool_choice=_tool_choice(fields.get("tool_choice")),
        parallel_tool_calls=optional(fields, "parallel_tool_calls", bool),
    )
    renames = {
        "max_new_tokens": max_name,
        "top_logprobs": "top_logprobs",
        "logprobs": "logprobs",
    }
    return _finish(fields, headers, spec, renames, chat=True, ignored=CHAT_IGNORED)


def parse_completion(body: bytes, headers: Mapping[str, str], request_id: str) -> ParsedRequest:
    """A POST /v1/completions body. Raises GenerationError (INVALID_ARGUMENT)."""
    fields = decode_json(body)
    refuse_unknown(fields, COMPLETION_PARAMETERS)
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
    top = optional(fields, "logprobs", int)
    max_tokens, max_name = _max_tokens(fields, ("max_tokens",))
    spec = RequestSpec(
        request_id=request_id,
        model=model_name(fields),
        prompt=prompt,
        token_ids=token_ids,
        max_new_tokens=16 if max_tokens is None else max_tokens,  # OpenAI's default for completions
        logprobs=top is not None,
        top_logprobs=top or 0,
    )
    renames = {"max_new_tokens": max_name, "top_logprobs": "logprobs", "token_ids": "prompt"}
    return _finish(fields, headers, spec, renames, chat=False, ignored=COMPLETION_IGNORED)


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
    ignored: frozenset[str],
) -> ParsedRequest:
    stream = optional(fields, "stream", bool) or False
    include_usage = False
    options = fields.get("stream_options")
    if options is not None:
        if not stream:
            raise bad("stream_options", "only allowed when stream is true")
        if not isinstance(options, dict):
            raise bad("stream_options", "must be an object")
        unknown = sorted(set(options) - _STREAM_OPTIONS)
        if unknown:
            raise bad(f"stream_options.{excerpt(unknown[0])}", "unknown option")
        include_usage = optional(options, "include_usage", bool, prefix="stream_options.") or False
    spec = replace(
        sampled(fields, headers, spec), response_format=_response_format(fields.get("response_format"))
    )
    renames = {**renames, **HEADER_RENAMES, "response_format": "response_format.json_schema.schema"}
    return ParsedRequest(
        spec,
        chat,
        stream,
        include_usage,
        renames,
        headers.get(IDEMPOTENCY_HEADER) or None,
        set_but_ignored(fields, ignored),
        path_patterns=_TOOL_RENAMES,
    )


HEADER_RENAMES = {
    "priority": PRIORITY_HEADER,
    "timeout": TIMEOUT_HEADER,
    "idempotency_key": IDEMPOTENCY_HEADER,
    "adapter": "model",  # not a header: an adapter is named in model, as BASE:ADAPTER or ADAPTER
}
"""The RequestSpec fields the headers set (and the adapter, which the model field names)."""


def sampled(fields: Mapping[str, Any], headers: Mapping[str, str], spec: RequestSpec) -> RequestSpec:
    """`spec` with the sampling parameters and headers every route reads (a route that does not
    define a parameter has refused it as unknown already, so it keeps its default here)."""
    user = fields.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > MAX_USER_CHARACTERS):
        raise bad("user", f"must be a string of at most {MAX_USER_CHARACTERS} characters")
    seed = optional(fields, "seed", int)
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise bad("seed", f"must be between 0 and {MAX_SEED}")
    return replace(
        spec,
        temperature=optional_number(fields, "temperature"),
        top_p=optional_number(fields, "top_p"),
        seed=seed,
        top_k=_top_k(fields),
        min_p=optional_number(fields, "min_p") or 0.0,
        repetition_penalty=optional_number(fields, "repetition_penalty"),
        stop=_stop(fields.get("stop")),
        priority=_priority(headers.get(PRIORITY_HEADER)),
        timeout=_timeout(headers.get(TIMEOUT_HEADER)),
        logit_bias=_logit_bias(fields.get("logit_bias")),
        presence_penalty=optional_number(fields, "presence_penalty") or 0.0,
        frequency_penalty=optional_number(fields, "frequency_penalty") or 0.0,
        n=optional(fields, "n", int),  # 1 to 16: the validator's bound, named n as here
    )


def set_but_ignored(fields: Mapping[str, Any], ignored: frozenset[str]) -> tuple[str, ...]:
    """The parameters of `ignored` the request set (not null), sorted."""
    return tuple(sorted(name for name in ignored if fields.get(name) is not None))


def refuse_unknown(fields: Mapping[str, Any], known: frozenset[str]) -> None:
    unknown = sorted(name for name in fields if name not in known)
    if unknown:
        raise bad(excerpt(unknown[0]), "unknown parameter (or one this server does not serve)")


def model_name(fields: Mapping[str, Any]) -> str:
    model = fields.get("model", "")
    if model is None:
        return ""
    if not isinstance(model, str):
        raise bad("model", "must be a string")
    return model  # its length is admission's bound (request_bounds.py)


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
        calls = _message_tool_calls(message.get("tool_calls"), where)
        content = message.get("content")
        turns.append(
            ChatTurn(
                ROLE_ALIASES.get(role, role),
                "" if content is None and (calls or role == "assistant") else content_text(content, where),
                calls,
                optional_string(message, "tool_call_id", where),
                optional_string(message, "name", where),
            )
        )
    return tuple(turns)


def optional_string(message: Mapping[str, Any], name: str, where: str) -> str:
    value = message.get(name)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise bad(f"{where}.{name}", "must be a string")
    return value


def _message_tool_calls(value: Any, where: str) -> tuple[ToolCall, ...]:
    """An assistant message's earlier calls: [{id, type: function, function: {name, arguments}}]."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise bad(f"{where}.tool_calls", "must be a list of calls")
    calls = []
    for index, call in enumerate(value):
        at = f"{where}.tool_calls[{index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise bad(at, 'must be {"id", "type": "function", "function": {"name", "arguments"}}')
        if call.get("type", "function") != "function":
            raise bad(f"{at}.type", "only function calls are served")
        name, arguments = function.get("name"), function.get("arguments", "{}")
        if not isinstance(name, str):
            raise bad(f"{at}.function.name", "must be a string")
        if not isinstance(arguments, str):
            raise bad(f"{at}.function.arguments", "must be the arguments as JSON text")
        calls.append(ToolCall(optional_string(call, "id", at), name, arguments))
    return tuple(calls)


def _tools(value: Any) -> tuple[ToolDefinition, ...]:
    """OpenAI's tools: [{"type": "function", "function": {name, description, parameters}}]."""
    tools = []
    for at, tool in function_tools(value, '{"type": "function", "function": {...}}'):
        function = tool.get("function")
        if not isinstance(function, dict):
            raise bad(f"{at}.function", "must be an object with a name")
        tools.append(tool_definition(function, f"{at}.function"))
    return tuple(tools)


def function_tools(value: Any, shape: str) -> list[tuple[str, dict[str, Any]]]:
    """A `tools` list's entries, each a function tool (of the route's `shape`), with its path."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad("tools", "must be a list of tools")
    found = []
    for index, tool in enumerate(value):
        at = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise bad(at, f"must be {shape}")
        if tool.get("type") != "function":
            raise bad(f"{at}.type", "only function tools are served (not OpenAI's hosted tools)")
        found.append((at, tool))
    return found


def tool_definition(function: Mapping[str, Any], at: str) -> ToolDefinition:
    """A function tool's {name, description, parameters} (its bounds are the validator's)."""
    name = function.get("name")
    description = function.get("description") or ""
    if not isinstance(name, str):
        raise bad(f"{at}.name", "must be a string")
    if not isinstance(description, str):
        raise bad(f"{at}.description", "must be a string")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise bad(f"{at}.parameters", "must be a JSON Schema object")
    return ToolDefinition(name, description, json.dumps(parameters))


TOOL_CHOICES = {
    mode.value: mode for mode in (ToolChoiceMode.AUTO, ToolChoiceMode.NONE, ToolChoiceMode.REQUIRED)
}
"""tool_choice's strings, the same on every route."""


def _tool_choice(value: Any) -> ToolChoice | None:
    if value is None:
        return None
    if isinstance(value, str) and value in TOOL_CHOICES:
        return ToolChoice(TOOL_CHOICES[value])
    function = value.get("function") if isinstance(value, dict) else None
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(function, dict):
        name = function.get("name")
        if isinstance(name, str):
            return ToolChoice(ToolChoiceMode.NAMED, name)
    raise bad(
        "tool_choice", 'must be "none", "auto", "required" or {"type": "function", "function": {"name"}}'
    )


def _top_k(fields: Mapping[str, Any]) -> int:
    """vLLM's top_k: -1 (or 0, or unset) keeps every token."""
    value = optional(fields, "top_k", int)
    return 0 if value is None or value == -1 else int(value)


_CHAT_PARTS = frozenset({"text"})


def content_text(value: Any, where: str, kinds: frozenset[str] = _CHAT_PARTS) -> str:
    """A message's content, a string or a list of text parts (of the types `kinds`), as one text."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts: list[str] = []
        for index, part in enumerate(value):
            text = part.get("text") if isinstance(part, dict) and part.get("type") in kinds else None
            if not isinstance(text, str):
                shapes = " or ".join(f'{{"type": "{kind}", "text": ...}}' for kind in sorted(kinds))
                raise bad(f"{where}.content[{index}]", f"only {shapes} parts are served")
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
    return optional(fields, name, int), name


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
        return JSON_OBJECT
    if kind != "json_schema":
        raise bad("response_format.type", "must be text, json_object or json_schema")
    return json_schema_format(value.get("json_schema"), "response_format.json_schema")


def json_schema_format(described: Any, where: str) -> ResponseFormat:
    """A json_schema response format, `described` holding its `schema` (`where` names it)."""
    if not isinstance(described, dict):
        raise bad(where, "must be an object with a schema")
    schema = described.get("schema", {})
    if not isinstance(schema, dict | bool):
        raise bad(f"{where}.schema", "must be a JSON Schema object")
    return ResponseFormat(FormatKind.JSON_SCHEMA, json.dumps(schema))


JSON_OBJECT = ResponseFormat(FormatKind.JSON_SCHEMA, '{"type": "object"}')
"""The json_object response format: any JSON object."""


def _priority(value: str | None) -> Priority | None:
    """The priority header's; None when the request has none (the gateway's objective may set it)."""
    if value is None:
        return None
    found = _PRIORITIES.get(value.strip().lower())
    if found is None:
        raise bad(PRIORITY_HEADER, "unknown value; use interactive, default or batch")
    return found


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


def optional(fields: Mapping[str, Any], name: str, kind: type[bool] | type[int], *, prefix: str = "") -> Any:
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


def optional_number(fields: Mapping[str, Any], name: str) -> float | None:
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
