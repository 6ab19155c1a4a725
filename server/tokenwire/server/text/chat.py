"""Chat templates: render a conversation into a prompt the way Hugging Face does, within bounds.

Templates are Jinja2 with the Hugging Face conventions: the variables `messages`, `tools`,
`add_generation_prompt`, `bos_token`, `eos_token`, and the `raise_exception` helper. Messages
carry OpenAI's tool fields (`tool_calls` with their arguments as objects, `tool_call_id`, `name`)
and `tools` OpenAI's function definitions, as Hugging Face passes them; a template that never
reads `tools` (`renders_tools` is False) gets tokenwire's own tool instructions instead
(text/tool_prompt.py).

A template comes with the model files, which the operator may not have written, and runs once per
request on input the caller chose: it runs in Jinja's immutable sandbox, within a budget of CPU
time and of text built that no expression escapes (template_budget.py).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from jinja2 import TemplateError, meta

from tokenwire.server.text.template_budget import (
    DEFAULT_MAX_OUTPUT_CHARS,
    DEFAULT_RENDER_SECONDS,
    BudgetedSandbox,
    ChatTemplateError,
    ChatTemplateLimitError,
    RenderBudget,
)
from tokenwire.server.text.tools import ToolCall, ToolCallFormat, ToolDefinition, tool_call_format

__all__ = ["ChatTemplate", "ChatTemplateError", "ChatTemplateLimitError", "ChatTurn"]

ALLOWED_ROLES = frozenset({"system", "user", "assistant", "tool"})


@dataclass(frozen=True)
class ChatTurn:
    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    """An assistant turn's calls."""
    tool_call_id: str = ""
    """A tool turn's answer to this call."""
    name: str = ""
    """A tool turn's tool."""


SAMPLE_CONVERSATIONS = (
    (ChatTurn("user", "Hello"),),
    (
        ChatTurn("system", "Answer briefly."),
        ChatTurn("user", "Hello"),
        ChatTurn("assistant", "Hi."),
        ChatTurn("user", "What is 2 + 2?"),
    ),
)
"""What a template renders when its model is loaded, to refuse one over budget before serving."""


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


class ChatTemplate:
    """A compiled chat template."""

    def __init__(
        self,
        source: str,
        *,
        bos_token: str = "",
        eos_token: str = "",
        render_seconds: float = DEFAULT_RENDER_SECONDS,
        max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
    ) -> None:
        self._budgets = threading.local()
        environment = BudgetedSandbox(self._budgets, trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = _raise_exception
        try:
            self._template = environment.from_string(source)
        except TemplateError as error:
            raise ChatTemplateError(f"the chat template does not compile: {error}") from error
        self.source = source
        self.renders_tools = "tools" in meta.find_undeclared_variables(environment.parse(source))
        """Whether the template renders the tools a request offers (it reads `tools`)."""
        self.tool_format: ToolCallFormat = tool_call_format(source, renders_tools=self.renders_tools)
        self._bos_token = bos_token
        self._eos_token = eos_token
        self.render_seconds = render_seconds
        self.max_output_chars = max_output_chars

    def check_budget(self) -> None:
        """Render sample conversations, as a model is loaded: raise ChatTemplateLimitError if one
        runs past its budget (a template that fails them otherwise may just want other turns)."""
        for turns in SAMPLE_CONVERSATIONS:
            try:
                self.render(turns)
            except ChatTemplateLimitError:
                raise
            except ChatTemplateError:
                continue

    def render(
        self,
        turns: Sequence[ChatTurn],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[ToolDefinition] = (),
    ) -> str:
        """The prompt for `turns`. Raises ChatTemplateError when the template rejects them or
        fails, ChatTemplateLimitError when it runs past its time budget or output bound."""
        context = {
            "messages": [_message(turn) for turn in turns],
            "tools": [_tool(tool) for tool in tools] or None,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self._bos_token,
            "eos_token": self._eos_token,
        }
        budget = RenderBudget.for_input(
            context, max_seconds=self.render_seconds, max_output_chars=self.max_output_chars
        )
        self._budgets.current = budget
        try:
            pieces: list[str] = []
            size = 0
            for piece in self._template.generate(**context):
                size += len(piece)
                if size > self.max_output_chars:
                    raise ChatTemplateLimitError(
                        f"the chat template would build text longer than {self.max_output_chars} characters"
                    )
                budget.check()
                pieces.append(piece)
            return "".join(pieces)
        except ChatTemplateError:
            raise
        except TemplateError as error:
            raise ChatTemplateError(f"chat template failed: {error}") from error
        except (MemoryError, OverflowError, RecursionError) as error:
            raise ChatTemplateLimitError(f"chat template failed: {type(error).__name__}") from error
        except Exception as error:  # a template's own bug (e.g. "a" + 1) on these messages
            raise ChatTemplateError(f"chat template failed: {type(error).__name__}: {error}"[:200]) from error
        finally:
            self._budgets.current = None


def _message(turn: ChatTurn) -> dict[str, Any]:
    message: dict[str, Any] = {"role": turn.role, "content": turn.content}
    if turn.tool_calls:
        message["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": json_value(call.arguments)},
            }
            for call in turn.tool_calls
        ]
    if turn.tool_call_id:
        message["tool_call_id"] = turn.tool_call_id
    if turn.name:
        message["name"] = turn.name
    return message


def _tool(tool: ToolDefinition) -> dict[str, Any]:
    function = {"name": tool.name, "description": tool.description, "parameters": json_value(tool.parameters)}
    return {"type": "function", "function": function}


def json_value(text: str) -> Any:
    """JSON text as the value it spells (templates render arguments and schemas with `tojson`),
    or the text itself when it is not JSON."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text
