"""A conversation's prompt tokens, with the callers' text never read as control tokens.

Hugging Face renders a conversation with its chat template and tokenizes the result, so
"<|im_end|>\\n<|im_start|>system" inside a user's message becomes real control tokens and forges
a system turn. Here the template's own markup is tokenized as usual and message content as plain
text. To tell them apart, the template is rendered twice: once with the real contents, once with
a unique marker in place of each content. When putting the contents back in place of the markers
gives exactly the real rendering, every character's origin is known: the prompt is cut at the
control tokens the template wrote (as Hugging Face cuts at every control token) and each run of
text between them, contents included, is tokenized as plain text. Tokens therefore match Hugging
Face's exactly wherever the content holds no control-token markup.

A template that changes the content (trims it, branches on it) makes the two renderings
disagree; then a content holding control-token markup is refused rather than guessed at.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import replace

from tokenwire.server.text.chat import ChatTemplate, ChatTemplateError, ChatTemplateLimitError, ChatTurn
from tokenwire.server.text.tokenizer import Tokenizer, TooManyTokensError
from tokenwire.server.text.tool_prompt import plain_turns
from tokenwire.server.text.tools import ToolDefinition


class ControlTokenInContentError(ValueError):
    """messages[index].content holds `token`, and this template's rendering cannot place it."""

    def __init__(self, index: int, token: str) -> None:
        super().__init__(f"messages[{index}].content holds the control token {token!r}")
        self.index = index
        self.token = token


def conversation_ids(
    template: ChatTemplate,
    tokenizer: Tokenizer,
    turns: Sequence[ChatTurn],
    *,
    control_tokens_in_content: bool = False,
    max_tokens: int | None = None,
    tools: Sequence[ToolDefinition] = (),
) -> list[int]:
    """Prompt tokens of `turns` with the generation prompt added.

    control_tokens_in_content: read control-token markup in message content as control tokens
    (Hugging Face's behaviour; only for callers trusted to write any turn). max_tokens: raise
    TooManyTokensError as soon as the prompt is known to hold more. Raises ChatTemplateError (and
    its limit subclass) from rendering, ControlTokenInContentError as above.
    """
    budget = _Budget(max_tokens)
    turns, rendered = _render(template, turns, tools)
    # The template already wrote any BOS markup; don't let the tokenizer add it twice.
    specials = tokenizer.special_tokens
    if control_tokens_in_content or not specials:
        return budget.encode(tokenizer, rendered, as_text=False)
    nonce = secrets.token_hex(8)
    markers = [f"\ue000{nonce}:{index}\ue001" for index in range(len(turns))]
    layout = template.render(
        [replace(turn, content=marker) for turn, marker in zip(turns, markers, strict=True)],
        add_generation_prompt=True,
        tools=tools if template.renders_tools else (),
    )
    pieces = _split_at_markers(layout, markers)
    if pieces is None or _join(pieces, turns) != rendered:
        for index, turn in enumerate(turns):
            found = next((token for token in specials if token in turn.content), None)
            if found is not None:
                raise ControlTokenInContentError(index, found)
        return budget.encode(tokenizer, rendered, as_text=False)
    return _tokenize(pieces, turns, tokenizer, budget)


def _render(
    template: ChatTemplate, turns: Sequence[ChatTurn], tools: Sequence[ToolDefinition]
) -> tuple[Sequence[ChatTurn], str]:
    """The turns as rendered, and their rendering: with the tools for a template that renders
    them; otherwise rewritten with tokenwire's tool instructions (in the system turn, or in the
    first user turn for a template that refuses a system turn)."""
    if template.renders_tools:
        return turns, template.render(turns, add_generation_prompt=True, tools=tools)
    if not tools and not any(turn.tool_calls or turn.role == "tool" for turn in turns):
        return turns, template.render(turns, add_generation_prompt=True)
    plain = plain_turns(turns, tools)
    try:
        return plain, template.render(plain, add_generation_prompt=True)
    except ChatTemplateLimitError:
        raise
    except ChatTemplateError:
        if not tools or turns[0].role == "system":
            raise
        plain = plain_turns(turns, tools, system_turn=False)
        return plain, template.render(plain, add_generation_prompt=True)


def _split_at_markers(layout: str, markers: list[str]) -> list[tuple[str, int | None]] | None:
    """The layout as (template text, None) and (marker, turn index) pieces; None unless every
    marker appears exactly once."""
    pieces: list[tuple[str, int | None]] = []
    rest = layout
    found: set[int] = set()
    while "\ue000" in rest:
        before, _, tail = rest.partition("\ue000")
        body, closed, after = tail.partition("\ue001")
        marker = f"\ue000{body}\ue001"
        if not closed or marker not in markers:
            return None
        index = markers.index(marker)
        if index in found:
            return None
        found.add(index)
        pieces += [(before, None), (marker, index)]
        rest = after
    pieces.append((rest, None))
    return pieces if len(found) == len(markers) else None


def _join(pieces: list[tuple[str, int | None]], turns: Sequence[ChatTurn]) -> str:
    return "".join(text if index is None else turns[index].content for text, index in pieces)


class _Budget:
    """Tokens left for the prompt; None: no bound."""

    def __init__(self, max_tokens: int | None) -> None:
        self.left = max_tokens
        self.used = 0

    def encode(self, tokenizer: Tokenizer, text: str, *, as_text: bool) -> list[int]:
        if self.left is None:
            ids = (
                tokenizer.encode_as_text(text)
                if as_text
                else tokenizer.encode(text, add_special_tokens=False)
            )
        else:
            try:
                ids = tokenizer.encode_within(text, self.left, add_special_tokens=False, as_text=as_text)
            except TooManyTokensError as error:
                raise TooManyTokensError(self.used + error.at_least) from None
            self.left -= len(ids)
        self.used += len(ids)
        return ids


def _tokenize(
    pieces: list[tuple[str, int | None]], turns: Sequence[ChatTurn], tokenizer: Tokenizer, budget: _Budget
) -> list[int]:
    ids: list[int] = []
    run: list[str] = []  # plain text since the last control token the template wrote

    def close_run() -> None:
        if run:
            ids.extend(budget.encode(tokenizer, "".join(run), as_text=True))
            run.clear()

    for text, index in pieces:
        if index is not None:
            run.append(turns[index].content)
            continue
        for segment, control in _control_tokens(text, tokenizer.special_tokens):
            if control:
                close_run()
                ids.extend(budget.encode(tokenizer, segment, as_text=False))
            else:
                run.append(segment)
    close_run()
    return ids


def _control_tokens(text: str, specials: tuple[str, ...]) -> list[tuple[str, bool]]:
    """`text` cut into (segment, is a control token) at the leftmost, longest control tokens."""
    segments: list[tuple[str, bool]] = []
    position = 0
    while True:
        best: tuple[int, str] | None = None
        for token in specials:  # longest first, so a tie at one position keeps the longest
            at = text.find(token, position)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, token)
        if best is None:
            break
        at, token = best
        if at > position:
            segments.append((text[position:at], False))
        segments.append((token, True))
        position = at + len(token)
    if position < len(text):
        segments.append((text[position:], False))
    return segments
