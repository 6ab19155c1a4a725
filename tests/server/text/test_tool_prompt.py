"""Tools in a conversation's prompt: a template that renders tools gets them (and earlier calls,
their arguments as objects) as Hugging Face passes them; one that does not gets tokenwire's own
instructions in the system turn (or the first user turn, for a template refusing system turns),
earlier calls as the JSON it asks for and tool results as user turns."""

from __future__ import annotations

from tokenwire.server.model_tools.tiny_tokenizer import CHATML_TEMPLATE, build_byte_level_tokenizer
from tokenwire.server.text.chat import ChatTemplate, ChatTurn
from tokenwire.server.text.conversation import conversation_ids
from tokenwire.server.text.tokenizer import Tokenizer
from tokenwire.server.text.tool_prompt import plain_turns
from tokenwire.server.text.tools import ToolCall, ToolCallFormat, ToolDefinition

TOOL = ToolDefinition(
    "get_weather", "The weather", '{"type": "object", "properties": {"city": {"type": "string"}}}'
)
CALL = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
CONVERSATION = [
    ChatTurn("user", "Weather in Paris?"),
    ChatTurn("assistant", "", (CALL,)),
    ChatTurn("tool", "18 degrees", tool_call_id="call_1", name="get_weather"),
    ChatTurn("tool", "sunny", tool_call_id="call_1"),
]
RENDERING = (
    "{% for t in tools or [] %}[{{ t.function.name }}:"
    "{{ t.function.parameters.properties | list | join(',') }}]{% endfor %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}"
    "({{ c.function.arguments.city }})</tool_call>{% endfor %}"
    "{% if m.tool_call_id %}@{{ m.tool_call_id }}{% endif %}{% endfor %}"
)


def test_a_template_that_renders_tools_gets_them_and_the_calls_as_objects() -> None:
    template = ChatTemplate(RENDERING)
    assert template.renders_tools and template.tool_format is ToolCallFormat.HERMES
    rendered = template.render(CONVERSATION, add_generation_prompt=True, tools=[TOOL])
    assert rendered == (
        "[get_weather:city]<user>Weather in Paris?<assistant><tool_call>get_weather(Paris)</tool_call>"
        "<tool>18 degrees@call_1<tool>sunny@call_1"
    )


def test_a_template_that_ignores_tools_gets_instructions_and_plain_turns() -> None:
    template = ChatTemplate(CHATML_TEMPLATE)
    assert not template.renders_tools and template.tool_format is ToolCallFormat.JSON
    turns = plain_turns(CONVERSATION, [TOOL])
    assert [turn.role for turn in turns] == ["system", "user", "assistant", "user"]
    assert '"name": "get_weather"' in turns[0].content and "JSON object" in turns[0].content
    assert turns[2].content == '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert turns[3].content == "The result of get_weather: 18 degrees\nThe result of call_1: sunny"
    tokenizer = Tokenizer(build_byte_level_tokenizer(600))
    ids = conversation_ids(template, tokenizer, CONVERSATION, tools=[TOOL])
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nYou can call these tools")
    assert "The result of get_weather: 18 degrees" in text


def test_a_template_refusing_system_turns_gets_the_instructions_in_the_first_user_turn() -> None:
    template = ChatTemplate(
        "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    )
    tokenizer = Tokenizer(build_byte_level_tokenizer(600))
    ids = conversation_ids(template, tokenizer, CONVERSATION[:1], tools=[TOOL])
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith("<user>You can call these tools") and text.endswith("Weather in Paris?")
