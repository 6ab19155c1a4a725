"""Chat templates: render a conversation into a prompt the way Hugging Face does.

Templates are Jinja2 with the Hugging Face conventions: the variables `messages`,
`add_generation_prompt`, `bos_token`, `eos_token`, and the `raise_exception` helper.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

ALLOWED_ROLES = frozenset({"system", "user", "assistant", "tool"})


@dataclass(frozen=True)
class ChatTurn:
    role: str
    content: str


class ChatTemplateError(ValueError):
    """The template rejected the conversation (e.g. roles out of order)."""


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


class ChatTemplate:
    """A compiled chat template."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        # A sandbox because templates come with model files, which the operator may not have written.
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = _raise_exception
        self._template = environment.from_string(source)
        self.source = source
        self._bos_token = bos_token
        self._eos_token = eos_token

    def render(self, turns: Sequence[ChatTurn], *, add_generation_prompt: bool = True) -> str:
        try:
            return self._template.render(
                messages=[{"role": t.role, "content": t.content} for t in turns],
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos_token,
                eos_token=self._eos_token,
            )
        except ChatTemplateError:
            raise
        except TemplateError as error:
            raise ChatTemplateError(f"chat template failed: {error}") from error
