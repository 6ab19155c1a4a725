"""A POST /v1/responses body (OpenAI's Responses API) -> a RequestSpec, or a 400 naming the parameter.

The Responses API asks for a chat completion in other words: `input` (a string, or a list of
items) and `instructions` become the conversation, `max_output_tokens` the output bound,
`text.format` the response format, and its flat function tools the same tools as chat's. The
conversation goes through the chat path from here on: the one admission, the validator, the
model's chat template, the tool-call reader.

Input items served: messages (`user`, `system`, `developer`, `assistant`; a string or a list of
`input_text` / `output_text` parts), `function_call` (an earlier call of the model: an assistant
turn, joined to the assistant message before it) and `function_call_output` (its result: a tool
turn). Any other item (images, files, hosted tools' calls, reasoning, item references) is a 400
naming `input[i]`.

Nothing is stored here, so what names a stored object is refused, never ignored (ignoring it
would answer without the context the client meant): `previous_response_id`, `conversation`,
`prompt` (a stored prompt template) and `item_reference` items; `background: true` needs a
stored response to poll, and is refused too. `store` itself is accepted and ignored (nothing is
kept whatever it says), listed with the other ignored parameters in IGNORED_HEADER.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from tokenwire.server.engine.errors import excerpt
from tokenwire.server.engine.validation import RequestSpec
from tokenwire.server.openai_api.parsing import (
    EXTENSIONS,
    HEADER_RENAMES,
    IDEMPOTENCY_HEADER,
    JSON_OBJECT,
    ROLE_ALIASES,
    TOOL_CHOICES,
    ParsedRequest,
    bad,
    content_text,
    decode_json,
    function_tools,
    json_schema_format,
    model_name,
    optional,
    refuse_unknown,
    sampled,
    set_but_ignored,
    tool_definition,
)
from tokenwire.server.sampling.params import ResponseFormat
from tokenwire.server.text.chat import ChatTurn
from tokenwire.server.text.tools import ToolCall, ToolChoice, ToolChoiceMode, ToolDefinition

SERVED = frozenset(
    {
        "model",
        "input",
        "instructions",
        "max_output_tokens",
        "temperature",
        "top_p",
        "stream",
        "stream_options",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "text",
        "include",
        "top_logprobs",
        "previous_response_id",
        "conversation",
        "prompt",
        "background",
    }
)
"""Served, or refused for what only a stored response could serve (the module's docstring)."""
IGNORED = frozenset(
    {
        "metadata",
        "store",
        "user",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "service_tier",
        "reasoning",
        "truncation",
        "max_tool_calls",
        "context_management",
    }
)
"""OpenAI's Responses parameters that change nothing here (docs/operations.md lists why)."""
PARAMETERS = SERVED | IGNORED | EXTENSIONS
INCLUDABLE = frozenset(
    {
        "file_search_call.results",
        "web_search_call.results",
        "web_search_call.action.sources",
        "message.input_image.image_url",
        "computer_call_output.output.image_url",
        "code_interpreter_call.outputs",
        "reasoning.encrypted_content",
    }
)
"""`include` values that name output of hosted tools, images or reasoning, none of which an
answer here holds: accepted, and there is nothing to include."""
LOGPROBS_INCLUDE = "message.output_text.logprobs"
_ROLES = frozenset({"user", "system", "developer", "assistant"})
_TEXT_PARTS = frozenset({"input_text", "output_text"})
_STORED = {
    "previous_response_id": "responses are not stored here: send the whole conversation as input items",
    "conversation": "conversations are not stored here: send the whole conversation as input items",
    "prompt": "stored prompt templates are not served here: send the prompt as instructions and input",
}


def parse_responses(body: bytes, headers: Mapping[str, str], request_id: str) -> ParsedRequest:
    """A POST /v1/responses body. Raises GenerationError (INVALID_ARGUMENT)."""
    fields = decode_json(body)
    refuse_unknown(fields, PARAMETERS)
    for name, why in _STORED.items():
        if fields.get(name) is not None:
            raise bad(name, why)
    if optional(fields, "background", bool):
        raise bad(
            "background", "background responses are not served: nothing is stored to poll; stream instead"
        )
    top_logprobs = optional(fields, "top_logprobs", int) or 0
    logprobs = _include(fields.get("include")) or top_logprobs > 0  # alternatives imply the chosen
    stream = optional(fields, "stream", bool) or False
    _stream_options(fields.get("stream_options"), stream=stream)
    instructions = fields.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("instructions", "must be a string")
    conversation = _Conversation()
    if instructions is not None:
        conversation.add(ChatTurn("system", instructions), "instructions", content="instructions")
    conversation.read(fields.get("input"))
    tools, tools_echo = _tools(fields.get("tools"))
    choice, choice_echo = _tool_choice(fields.get("tool_choice"))
    response_format, text_echo = _text(fields.get("text"))
    max_output_tokens = optional(fields, "max_output_tokens", int)
    parallel = optional(fields, "parallel_tool_calls", bool)
    spec = RequestSpec(
        request_id=request_id,
        model=model_name(fields),
        messages=tuple(conversation.turns),
        max_new_tokens=max_output_tokens,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        response_format=response_format,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )
    spec = sampled(fields, headers, spec)
    metadata = fields.get("metadata")
    echo: dict[str, object] = {
        "instructions": instructions,
        "max_output_tokens": max_output_tokens,
        "metadata": metadata if isinstance(metadata, dict) else {},
        "parallel_tool_calls": True if parallel is None else parallel,
        "temperature": spec.temperature,
        "top_p": spec.top_p,
        "tool_choice": choice_echo,
        "tools": tools_echo,
        "text": text_echo,
        "truncation": fields.get("truncation") or "disabled",
        "top_logprobs": top_logprobs,
    }
    ignored = set_but_ignored(fields, IGNORED)
    if isinstance(fields.get("text"), dict) and fields["text"].get("verbosity") is not None:
        ignored = tuple(sorted((*ignored, "text.verbosity")))
    return ParsedRequest(
        spec,
        chat=True,
        stream=stream,
        renames={"max_new_tokens": "max_output_tokens", "logprobs": "include", **HEADER_RENAMES},
        idempotency_key=headers.get(IDEMPOTENCY_HEADER) or None,
        ignored=ignored,
        paths={
            "messages": "input",
            "response_format": "text.format",
            "response_format.json_schema": "text.format.schema",
            **conversation.paths,
        },
        echo=echo,
    )


class _Conversation:
    """The chat turns of `instructions` and `input`, and where in the body each came from."""

    def __init__(self) -> None:
        self.turns: list[ChatTurn] = []
        self.paths: dict[str, str] = {}
        """messages[k] (and its content, its calls) -> the body's path of what set it."""
        self._call_names: dict[str, str] = {}
        """call_id -> the function an earlier call called, the name its output's tool turn takes."""
        self._from_input = False
        """Whether the last turn came from an input item (only those join function calls)."""

    def add(self, turn: ChatTurn, where: str, *, content: str) -> None:
        index = len(self.turns)
        self.turns.append(turn)
        self.paths[f"messages[{index}]"] = where
        self.paths[f"messages[{index}].content"] = content

    def read(self, value: Any) -> None:
        if value is None:
            raise bad("input", "required: a string, or a list of input items")
        if isinstance(value, str):
            self.add(ChatTurn("user", value), "input", content="input")
            return
        if not isinstance(value, list) or not value:
            raise bad("input", "must be a string or a non-empty list of input items")
        for index, item in enumerate(value):
            where = f"input[{index}]"
            if not isinstance(item, dict):
                raise bad(where, "must be an input item object")
            kind = item.get("type", "message" if "role" in item else None)
            if kind == "message":
                self._message(item, where)
            elif kind == "function_call":
                self._function_call(item, where)
            elif kind == "function_call_output":
                self._function_call_output(item, where)
            elif kind == "item_reference":
                raise bad(
                    f"{where}.type", "item references need stored items, which this server does not keep"
                )
            else:
                raise bad(
                    f"{where}.type",
                    f"{excerpt(str(kind))!r}: only message, function_call and function_call_output items "
                    "are served",
                )

    def _message(self, item: Mapping[str, Any], where: str) -> None:
        role = item.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise bad(f"{where}.role", "must be user, system, developer or assistant")
        text = content_text(item.get("content"), where, _TEXT_PARTS)
        self.add(ChatTurn(ROLE_ALIASES.get(role, role), text), where, content=f"{where}.content")
        self._from_input = True

    def _function_call(self, item: Mapping[str, Any], where: str) -> None:
        call_id = _string(item, "call_id", where)
        name = _string(item, "name", where)
        arguments = _string(item, "arguments", where)
        call = ToolCall(call_id, name, arguments)
        self._call_names[call_id] = name
        last = self.turns[-1] if self.turns and self._from_input else None
        if last is not None and last.role == "assistant":
            self.turns[-1] = replace(last, tool_calls=(*last.tool_calls, call))
            index = len(self.turns) - 1
        else:
            self.add(ChatTurn("assistant", "", (call,)), where, content=where)
            index = len(self.turns) - 1
        self.paths[f"messages[{index}].tool_calls[{len(self.turns[index].tool_calls) - 1}]"] = where
        self._from_input = True

    def _function_call_output(self, item: Mapping[str, Any], where: str) -> None:
        call_id = _string(item, "call_id", where)
        output = item.get("output")
        if isinstance(output, list):
            text = content_text(output, f"{where}.output", frozenset({"input_text"}))
        elif isinstance(output, str):
            text = output
        else:
            raise bad(f"{where}.output", "must be a string or a list of input_text parts")
        turn = ChatTurn("tool", text, tool_call_id=call_id, name=self._call_names.get(call_id, ""))
        self.add(turn, where, content=f"{where}.output")
        self._from_input = True


def _string(item: Mapping[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise bad(f"{where}.{name}", "required: a string")
    return value


def _include(value: Any) -> bool:
    """Whether `include` asks for the output's log-probabilities."""
    if value is None:
        return False
    if not isinstance(value, list):
        raise bad("include", "must be a list")
    for index, entry in enumerate(value):
        if not isinstance(entry, str) or (entry != LOGPROBS_INCLUDE and entry not in INCLUDABLE):
            raise bad(f"include[{index}]", "not a value OpenAI's API defines")
    return LOGPROBS_INCLUDE in value


def _stream_options(value: Any, *, stream: bool) -> None:
    if value is None:
        return
    if not stream:
        raise bad("stream_options", "only allowed when stream is true")
    if not isinstance(value, dict):
        raise bad("stream_options", "must be an object")
    unknown = sorted(set(value) - {"include_obfuscation"})
    if unknown:
        raise bad(f"stream_options.{excerpt(unknown[0])}", "unknown option")


def _tools(value: Any) -> tuple[tuple[ToolDefinition, ...], list[dict[str, object]]]:
    """The Responses API's tools, flat: [{"type": "function", "name", "description", "parameters",
    "strict"}], and what the response repeats of them."""
    tools, echo = [], []
    for at, tool in function_tools(value, '{"type": "function", "name": ...}'):
        definition = tool_definition(tool, at)
        strict = optional(tool, "strict", bool, prefix=f"{at}.")
        tools.append(definition)
        echo.append(
            {
                "type": "function",
                "name": definition.name,
                "description": definition.description,
                "parameters": json.loads(definition.parameters),
                "strict": strict,
            }
        )
    return tuple(tools), echo


def _tool_choice(value: Any) -> tuple[ToolChoice | None, object]:
    """tool_choice: "none", "auto", "required" or {"type": "function", "name"}; and its echo."""
    if value is None:
        return None, "auto"
    if isinstance(value, str) and value in TOOL_CHOICES:
        return ToolChoice(TOOL_CHOICES[value]), value
    name = value.get("name") if isinstance(value, dict) and value.get("type") == "function" else None
    if isinstance(name, str):
        return ToolChoice(ToolChoiceMode.NAMED, name), {"type": "function", "name": name}
    raise bad("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "name": ...}')


def _text(value: Any) -> tuple[ResponseFormat | None, dict[str, object]]:
    """text.format: text, json_object or json_schema ({name, schema, strict}); and its echo."""
    plain: dict[str, object] = {"format": {"type": "text"}}
    if value is None:
        return None, plain
    if not isinstance(value, dict):
        raise bad("text", "must be an object")
    unknown = sorted(set(value) - {"format", "verbosity"})
    if unknown:
        raise bad(f"text.{excerpt(unknown[0])}", "unknown parameter")
    described = value.get("format")
    if described is None:
        return None, plain
    if not isinstance(described, dict) or not isinstance(described.get("type"), str):
        raise bad("text.format", 'must be an object with a "type"')
    kind = described["type"]
    if kind == "text":
        return None, plain
    if kind == "json_object":
        return JSON_OBJECT, {"format": {"type": "json_object"}}
    if kind != "json_schema":
        raise bad("text.format.type", "must be text, json_object or json_schema")
    response_format = json_schema_format(described, "text.format")
    name = described.get("name", "response")
    if not isinstance(name, str):
        raise bad("text.format.name", "must be a string")
    echoed: dict[str, object] = {
        "type": "json_schema",
        "name": name,
        "schema": json.loads(response_format.source),
        "strict": optional(described, "strict", bool, prefix="text.format."),
    }
    if isinstance(described.get("description"), str):
        echoed["description"] = described["description"]
    return response_format, {"format": echoed}
