"""Tools for a model whose chat template does not render them: tokenwire's own instructions.

A template that never reads `tools` (SmolLM2's, Gemma's, Phi-3's) would drop a request's tools
and its earlier calls without a word. Instead, the conversation is rewritten into turns every
template renders: the tools and how to call them go into the system turn (appended to the
conversation's own, or a new first turn), an assistant turn's earlier calls become the JSON the
instructions ask for, and tool results become a user turn saying which call they answer
(consecutive results in one turn, so templates that insist on alternating roles still render).
The model is asked for the JSON format of text/tools.py, which the reader then reads.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from tokenwire.server.text.chat import ChatTurn, json_value
from tokenwire.server.text.tools import ToolCall, ToolDefinition


def tool_instructions(tools: Sequence[ToolDefinition]) -> str:
    listed = json.dumps(
        [
            {"name": tool.name, "description": tool.description, "parameters": json_value(tool.parameters)}
            for tool in tools
        ],
        ensure_ascii=False,
    )
    return (
        "You can call these tools (each with a JSON Schema of its arguments):\n"
        f"{listed}\n"
        "To call a tool, answer with nothing but a JSON object, one per call: "
        '{"name": <the tool\'s name>, "arguments": <an object of its arguments>}. '
        "Otherwise answer in plain text."
    )


def calls_text(calls: Sequence[ToolCall]) -> str:
    """Earlier calls, written as the instructions ask the model to write them."""
    return "\n".join(
        json.dumps({"name": call.name, "arguments": json_value(call.arguments)}, ensure_ascii=False)
        for call in calls
    )


def plain_turns(
    turns: Sequence[ChatTurn], tools: Sequence[ToolDefinition], *, system_turn: bool = True
) -> list[ChatTurn]:
    """`turns` with their tool fields written out as text, the instructions for `tools` (if any)
    in the system turn, or with `system_turn` False at the start of the first user turn (for a
    template that refuses system turns)."""
    plain: list[ChatTurn] = []
    for turn in turns:
        if turn.role == "tool":
            answered = turn.name or turn.tool_call_id or "a tool"
            result = f"The result of {answered}: {turn.content}"
            if plain and plain[-1].role == "user" and plain[-1].content.startswith("The result of "):
                plain[-1] = ChatTurn("user", plain[-1].content + "\n" + result)
            else:
                plain.append(ChatTurn("user", result))
        elif turn.tool_calls:
            text = "\n".join(part for part in (turn.content, calls_text(turn.tool_calls)) if part)
            plain.append(ChatTurn(turn.role, text))
        else:
            plain.append(ChatTurn(turn.role, turn.content))
    if not tools:
        return plain
    instructions = tool_instructions(tools)
    if plain and plain[0].role == "system":
        plain[0] = ChatTurn("system", plain[0].content + "\n\n" + instructions)
    elif system_turn:
        plain.insert(0, ChatTurn("system", instructions))
    else:
        first = next((i for i, turn in enumerate(plain) if turn.role == "user"), None)
        if first is None:
            plain.insert(0, ChatTurn("user", instructions))
        else:
            plain[first] = ChatTurn("user", instructions + "\n\n" + plain[first].content)
    return plain
