"""A served model's chat template, at the edge: a conversation to prompt tokens.

The engine validates and queues token ids; which text a conversation becomes, and how its
message content is kept from reading as control tokens, is the model's template's business.
Failures come back as violations of `messages` (or of the one message at fault).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenwire.server.engine.errors import FieldViolation, GenerationError
from tokenwire.server.engine.validation import context_violation
from tokenwire.server.text.chat import ChatTemplate, ChatTemplateError, ChatTurn
from tokenwire.server.text.conversation import ControlTokenInContentError, conversation_ids
from tokenwire.server.text.tokenizer import Tokenizer, TooManyTokensError
from tokenwire.server.text.tools import ToolDefinition


class ChatPrompts:
    """Prompt tokens of conversations for one model; a ChatPromptIds for its RequestValidator."""

    def __init__(
        self,
        template: ChatTemplate,
        tokenizer: Tokenizer,
        *,
        control_tokens_in_content: bool,
        context_length: int,
    ) -> None:
        self._template = template
        self._tokenizer = tokenizer
        self._control_tokens_in_content = control_tokens_in_content
        self._context_length = context_length

    def __call__(self, turns: Sequence[ChatTurn], tools: Sequence[ToolDefinition] = ()) -> list[int]:
        if not self._control_tokens_in_content:
            self._refuse_control_tokens(turns, tools)
        try:
            return conversation_ids(
                self._template,
                self._tokenizer,
                turns,
                control_tokens_in_content=self._control_tokens_in_content,
                max_tokens=self._context_length - 1,
                tools=tools,
            )
        except TooManyTokensError as error:
            raise GenerationError.invalid(
                context_violation("messages", error.at_least, self._context_length, at_least=True)
            ) from None
        except ChatTemplateError as error:
            raise GenerationError.invalid(FieldViolation("messages", str(error))) from error
        except ControlTokenInContentError as error:
            raise GenerationError.invalid(
                FieldViolation(
                    f"messages[{error.index}].content",
                    f"holds the control token {error.token!r}, which this model's chat template "
                    "does not let the server keep as plain text; remove it",
                )
            ) from error

    def _refuse_control_tokens(self, turns: Sequence[ChatTurn], tools: Sequence[ToolDefinition]) -> None:
        """A template renders tools and earlier calls as its own text, so control-token markup
        in them would become control tokens: refused, as in content the template changes."""
        specials = self._tokenizer.special_tokens
        fields: list[tuple[str, str]] = []
        for index, tool in enumerate(tools):
            fields += [
                (f"tools[{index}].description", tool.description),
                (f"tools[{index}].parameters", tool.parameters),
            ]
        for index, turn in enumerate(turns):
            where = f"messages[{index}]"
            fields += [(f"{where}.tool_call_id", turn.tool_call_id), (f"{where}.name", turn.name)]
            for number, call in enumerate(turn.tool_calls):
                fields += [
                    (f"{where}.tool_calls[{number}].id", call.id),
                    (f"{where}.tool_calls[{number}].arguments", call.arguments),
                ]
        for field, text in fields:
            found = next((token for token in specials if token in text), None) if text else None
            if found is not None:
                raise GenerationError.invalid(
                    FieldViolation(field, f"holds the control token {found!r}; remove it")
                )


def chat_prompts(
    template: ChatTemplate | None,
    tokenizer: Tokenizer,
    *,
    control_tokens_in_content: bool,
    context_length: int,
) -> ChatPrompts | None:
    """A model's ChatPrompts; None when it has no chat template."""
    if template is None:
        return None
    return ChatPrompts(
        template,
        tokenizer,
        control_tokens_in_content=control_tokens_in_content,
        context_length=context_length,
    )
