"""Tools a request offers the model, the calls the model makes, and the format it writes them in.

Plain data shared by the chat template (which renders the tools and earlier calls), the tool-call
reader (which finds calls in the model's text, text/tool_calls.py) and the grammar that forces a
call (sampling/tool_grammar.py).

Each model family writes its calls its own way, and its chat template says which (the markup it
uses to render earlier calls, or the instructions it gives):

- HERMES (Hermes, Qwen 2.5 and 3), for a template holding `<tool_call>`: one block per call,
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.
- MISTRAL, for a template holding `[TOOL_CALLS]`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}]`.
- LLAMA3_JSON (Llama 3.1 to 3.3), for a template holding `<|python_tag|>` or Llama 3's
  `<|start_header_id|>`: `{"name": ..., "parameters": {...}}`, calls separated by `;`.
- JSON, for any other template: `{"name": ..., "arguments": {...}}`, one object per call (a list
  of them, or a Markdown code fence around them, is read too).

Control tokens (`[TOOL_CALLS]` and `<|python_tag|>` are control tokens in their tokenizers) are
not part of the generated text, which is decoded without them; the reader reads the JSON that
follows them. A template that does not render `tools` at all (SmolLM2's, Gemma's, Phi-3's) gets
the JSON format with instructions of tokenwire's own (text/tool_prompt.py).
"""

from __future__ import annotations

import re
import secrets
import string
from dataclasses import dataclass
from enum import Enum

NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""A tool's name, as OpenAI's API bounds it: letters, digits, '_' and '-', at most 64."""
MAX_TOOLS = 128
"""Most tools one request may offer (OpenAI's bound)."""


@dataclass(frozen=True)
class ToolDefinition:
    """A function the model may call."""

    name: str
    description: str = ""
    parameters: str = '{"type": "object", "properties": {}}'
    """A JSON Schema of the call's arguments, as JSON text (an object)."""


class ToolChoiceMode(Enum):
    AUTO = "auto"
    """The model chooses between text and calls; what it calls is checked against the tools."""
    NONE = "none"
    """No call: the tools are not offered and the output is text."""
    REQUIRED = "required"
    """At least one call to any of the tools, forced by a grammar."""
    NAMED = "named"
    """Exactly one call to the named tool, forced by a grammar."""


@dataclass(frozen=True)
class ToolChoice:
    mode: ToolChoiceMode = ToolChoiceMode.AUTO
    name: str = ""
    """The tool a NAMED choice calls."""


@dataclass(frozen=True)
class ToolCall:
    """A call the model made (or, in a conversation, made earlier)."""

    id: str
    name: str
    arguments: str
    """The arguments as JSON text."""


class ToolCallFormat(Enum):
    HERMES = "hermes"
    MISTRAL = "mistral"
    LLAMA3_JSON = "llama3_json"
    JSON = "json"

    @property
    def arguments_key(self) -> str:
        """The key the call object holds its arguments under."""
        return "parameters" if self is ToolCallFormat.LLAMA3_JSON else "arguments"


def tool_call_format(template_source: str, *, renders_tools: bool) -> ToolCallFormat:
    """The format a chat template's model writes its calls in (see the module's table)."""
    if not renders_tools:
        return ToolCallFormat.JSON
    if "<tool_call>" in template_source:
        return ToolCallFormat.HERMES
    if "[TOOL_CALLS]" in template_source:
        return ToolCallFormat.MISTRAL
    if "<|python_tag|>" in template_source or "<|start_header_id|>" in template_source:
        return ToolCallFormat.LLAMA3_JSON
    return ToolCallFormat.JSON


_ALPHANUMERIC = string.ascii_letters + string.digits


def new_call_id(call_format: ToolCallFormat) -> str:
    """A fresh id for a call the model made: OpenAI's `call_` and 24 hex digits, or the nine
    letters and digits Mistral's templates insist on."""
    if call_format is ToolCallFormat.MISTRAL:
        return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolCalling:
    """What a request asked of tools, for the reader of its output: None of it when the request
    offered no tools or chose none."""

    format: ToolCallFormat
    tools: tuple[ToolDefinition, ...]
    choice: ToolChoice
    parallel: bool
    """Whether the output may hold more than one call."""

    @property
    def forced(self) -> bool:
        """Whether a grammar makes the output calls and nothing else."""
        return self.choice.mode in (ToolChoiceMode.REQUIRED, ToolChoiceMode.NAMED)
