"""A served model's chat template, at the edge: a conversation to prompt tokens.

The engine validates and queues token ids; which text a conversation becomes, and how its
message content is kept from reading as control tokens, is the model's template's business.
Failures come back as violations of `messages` (or of the one message at fault).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenwire.server.engine.errors import FieldViolation, GenerationError
from tokenwire.server.text.chat import ChatTemplate, ChatTemplateError, ChatTurn
from tokenwire.server.text.conversation import ControlTokenInContentError, conversation_ids
from tokenwire.server.text.tokenizer import Tokenizer, TooManyTokensError


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

    def __call__(self, turns: Sequence[ChatTurn]) -> list[int]:
        try:
            return conversation_ids(
                self._template,
                self._tokenizer,
                turns,
                control_tokens_in_content=self._control_tokens_in_content,
                max_tokens=self._context_length - 1,
            )
        except TooManyTokensError as error:
            raise GenerationError.invalid(
                FieldViolation(
                    "messages",
                    f"at least {error.at_least} tokens leave no room in the context of "
                    f"{self._context_length} tokens",
                )
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
