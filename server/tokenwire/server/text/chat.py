"""Chat templates: render a conversation into a prompt the way Hugging Face does, within bounds.

Templates are Jinja2 with the Hugging Face conventions: the variables `messages`, `tools`,
`add_generation_prompt`, `bos_token`, `eos_token`, and the `raise_exception` helper. Messages
carry OpenAI's tool fields (`tool_calls` with their arguments as objects, `tool_call_id`, `name`)
and `tools` OpenAI's function definitions, as Hugging Face passes them; a template that never
reads `tools` (`renders_tools` is False) gets tokenwire's own tool instructions instead
(text/tool_prompt.py).

A template comes with the model files, which the operator may not have written, and runs once per
request on input the caller chose: it runs in Jinja's immutable sandbox, and each rendering has a
time budget and an output bound. The budget is checked at every call, attribute or item lookup,
`range` step, `*` or `+` and piece of output, so a loop that does anything at all stops once the
budget is spent; `*` and `+` refuse to build a string or list beyond the output bound before
building it.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from jinja2 import TemplateError, meta
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

from tokenwire.server.text.tools import ToolCall, ToolCallFormat, ToolDefinition, tool_call_format

ALLOWED_ROLES = frozenset({"system", "user", "assistant", "tool"})
DEFAULT_RENDER_SECONDS = 1.0
DEFAULT_MAX_OUTPUT_CHARS = 4_000_000


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


class ChatTemplateError(ValueError):
    """The template rejected the conversation (e.g. roles out of order) or failed on it."""


class ChatTemplateLimitError(ChatTemplateError):
    """Rendering this conversation ran past the template's time budget or output bound."""


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


@dataclass
class _Budget:
    deadline: float
    max_output_chars: int

    def check(self) -> None:
        if time.monotonic() > self.deadline:
            raise ChatTemplateLimitError("the chat template ran past its time budget for these messages")

    def check_size(self, size: int) -> None:
        if size > self.max_output_chars:
            raise ChatTemplateLimitError(
                f"the chat template would build text longer than {self.max_output_chars} characters"
            )


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, checking the rendering thread's budget at every step it can see."""

    intercepted_binops = frozenset({"*", "+"})

    def __init__(self, budgets: threading.local, **options: Any) -> None:
        super().__init__(**options)
        self._budgets = budgets
        self.globals["range"] = self._range

    def budget(self) -> _Budget:
        budget: _Budget | None = getattr(self._budgets, "current", None)
        if budget is None:  # rendered outside ChatTemplate.render: no budget to keep
            return _Budget(deadline=float("inf"), max_output_chars=DEFAULT_MAX_OUTPUT_CHARS)
        return budget

    def _range(self, *args: int) -> Iterator[int]:
        budget = self.budget()
        for value in safe_range(*args):
            budget.check()
            yield value

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        budget = self.budget()
        budget.check()
        if operator == "*":
            for sequence, count in ((left, right), (right, left)):
                if isinstance(sequence, str | list | tuple) and isinstance(count, int):
                    budget.check_size(len(sequence) * count)
        elif isinstance(left, str | list | tuple) and isinstance(right, str | list | tuple):
            budget.check_size(len(left) + len(right))
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        __self.budget().check()
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        self.budget().check()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        self.budget().check()
        return super().getitem(obj, argument)


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
        environment = _BoundedSandbox(self._budgets, trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = _raise_exception
        self._template = environment.from_string(source)
        self.source = source
        self.renders_tools = "tools" in meta.find_undeclared_variables(environment.parse(source))
        """Whether the template renders the tools a request offers (it reads `tools`)."""
        self.tool_format: ToolCallFormat = tool_call_format(source, renders_tools=self.renders_tools)
        self._bos_token = bos_token
        self._eos_token = eos_token
        self.render_seconds = render_seconds
        self.max_output_chars = max_output_chars

    def render(
        self,
        turns: Sequence[ChatTurn],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[ToolDefinition] = (),
    ) -> str:
        """The prompt for `turns`. Raises ChatTemplateError when the template rejects them or
        fails, ChatTemplateLimitError when it runs past its time budget or output bound."""
        budget = _Budget(time.monotonic() + self.render_seconds, self.max_output_chars)
        self._budgets.current = budget
        try:
            pieces: list[str] = []
            size = 0
            for piece in self._template.generate(
                messages=[_message(turn) for turn in turns],
                tools=[_tool(tool) for tool in tools] or None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos_token,
                eos_token=self._eos_token,
            ):
                size += len(piece)
                budget.check_size(size)
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
