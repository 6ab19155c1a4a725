"""Tool calls on the gRPC edge, end to end: forced calls (a named tool, or `required`) in every
family's format, unary and streamed as argument deltas, with the tiny model (whose output is
noise, so everything it says well-formed is the grammar's doing) and with the real default model,
whose template does not render tools (tokenwire's own instructions, the JSON format)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import grpc
import pytest

from tests.conftest import ServerFactory
from tokenwire.client import (
    AsyncClient,
    ChatMessage,
    Chunk,
    Completed,
    FinishReason,
    GenerateOptions,
    Sampling,
    Stopping,
    TokenwireError,
    Tool,
    ToolCall,
    ToolChoice,
)

WEATHER = Tool(
    "get_weather",
    "The weather in a city",
    json.dumps(
        {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    ),
)
FORCED = GenerateOptions(
    sampling=Sampling(temperature=0.0),
    stopping=Stopping(max_new_tokens=150),
    tools=(WEATHER,),
    tool_choice=ToolChoice(name="get_weather"),
)
QUESTION = [ChatMessage("user", "Weather in Paris?")]

# Templates in the style of each family: each renders the tools and earlier calls with its marker.
FAMILY_TEMPLATES = {
    "hermes": (
        "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t.function.name }} {% endfor %}"
        "<tool_call></tool_call><|im_end|>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "<|im_start|>assistant\n"
    ),
    "mistral": (
        "{% if tools %}[AVAILABLE_TOOLS]{% for t in tools %}{{ t.function.name }}{% endfor %}{% endif %}"
        "{% for m in messages %}{{ m.content }}{% if m.tool_calls %}[TOOL_CALLS]{% endif %}{% endfor %}"
    ),
    "llama3_json": (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}"
        "{% if tools %}<|start_header_id|>{% for t in tools %}{{ t.function.name }}{% endfor %}{% endif %}"
        "<|im_start|>assistant\n"
    ),
    "json": (
        "{% if tools %}{{ tools | length }} tools{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}"
        "<|im_start|>assistant\n"
    ),
}


def with_template(model_dir: Path, destination: Path, template: str) -> Path:
    shutil.copytree(model_dir, destination)
    config_path = destination / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config))
    return destination


def check_call(call: ToolCall) -> None:
    """A forced call: the named tool, arguments valid against its schema."""
    assert call.name == "get_weather"
    arguments = json.loads(call.arguments)
    assert set(arguments) == {"city"} and isinstance(arguments["city"], str) and len(arguments["city"]) <= 12


async def streamed(
    client: AsyncClient, options: GenerateOptions
) -> tuple[str, dict[int, ToolCall], list[int], Completed]:
    text = ""
    calls: dict[int, ToolCall] = {}
    argument_pieces: list[int] = []
    completed: Completed | None = None
    async for event in client.stream(QUESTION, options):
        if isinstance(event, Chunk):
            text += event.text
            for delta in event.tool_calls:
                known = calls.get(delta.index)
                if known is None:
                    calls[delta.index] = ToolCall(delta.id, delta.name, delta.arguments)
                else:
                    calls[delta.index] = ToolCall(known.id, known.name, known.arguments + delta.arguments)
                if delta.arguments:
                    argument_pieces.append(delta.index)
        elif isinstance(event, Completed):
            completed = event
    assert completed is not None
    return text, calls, argument_pieces, completed


@pytest.mark.parametrize("model_layout", ["optimum"], indirect=True)
@pytest.mark.parametrize("family", sorted(FAMILY_TEMPLATES))
async def test_a_forced_call_is_well_formed_in_every_family_format(
    start_server: ServerFactory, tiny_model_dir: Path, tmp_path: Path, family: str
) -> None:
    model_dir = with_template(tiny_model_dir, tmp_path / family, FAMILY_TEMPLATES[family])
    server = await start_server(model_dir=model_dir)
    assert server.registry.default.model.chat_template is not None
    assert server.registry.default.model.chat_template.tool_format.value == family
    async with AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client:
        unary = await client.generate(QUESTION, FORCED)
        text, calls, pieces, completed = await streamed(client, FORCED)
    [call] = unary.tool_calls
    check_call(call)
    assert unary.finish_reason is FinishReason.TOOL_CALLS
    assert unary.text == ""
    # The stream says the same, its arguments in pieces as they were generated.
    assert text == ""
    assert [(c.name, c.arguments) for c in calls.values()] == [(call.name, call.arguments)]
    assert len(pieces) >= 2
    assert completed.generation.finish_reason is FinishReason.TOOL_CALLS


@pytest.mark.parametrize("model_layout", ["optimum"], indirect=True)
async def test_required_with_parallel_calls_off_is_exactly_one_call(
    start_server: ServerFactory, tiny_model_dir: Path, tmp_path: Path
) -> None:
    # A template that renders the tools itself: the tiny model's context has no room for
    # tokenwire's own instructions.
    server = await start_server(
        model_dir=with_template(tiny_model_dir, tmp_path / "m", FAMILY_TEMPLATES["json"])
    )
    options = GenerateOptions(
        sampling=Sampling(temperature=1.0, seed=5),
        stopping=Stopping(max_new_tokens=150),
        tools=(WEATHER, Tool("get_time", "", '{"type": "object", "properties": {}}')),
        tool_choice=ToolChoice("required"),
        parallel_tool_calls=False,
    )
    async with AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client:
        result = await client.generate(QUESTION, options)
    [call] = result.tool_calls
    assert call.name in {"get_weather", "get_time"}
    assert result.finish_reason is FinishReason.TOOL_CALLS


@pytest.mark.parametrize("model_layout", ["optimum"], indirect=True)
async def test_bad_tools_are_invalid_argument_naming_the_field(start_server: ServerFactory) -> None:
    server = await start_server()
    cases = [
        (GenerateOptions(tools=(Tool("get weather"),)), "tools[0].name"),
        (GenerateOptions(tools=(WEATHER, WEATHER)), "tools[1].name"),
        (GenerateOptions(tools=(Tool("f", parameters="{" + " " * 70_000 + "}"),)), "tools[0].parameters"),
        (GenerateOptions(tools=(WEATHER,), tool_choice=ToolChoice(name="nope")), "tool_choice"),
    ]
    async with AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client:
        for options, field in cases:
            with pytest.raises(TokenwireError) as refused:
                await client.generate(QUESTION, options)
            assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
            assert [v.field for v in refused.value.field_violations] == [field]
        with pytest.raises(TokenwireError) as needs_messages:
            await client.generate("a prompt", GenerateOptions(tools=(WEATHER,)))
        assert [v.field for v in needs_messages.value.field_violations] == ["tools"]


@pytest.mark.slow
@pytest.mark.parametrize("model_layout", ["genai"], indirect=True)
async def test_the_default_model_calls_a_forced_tool_and_answers_its_result(
    start_server: ServerFactory, real_model_dir: Path
) -> None:
    server = await start_server(model_dir=real_model_dir, max_context_length=1024)
    async with AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client:
        called = await client.generate(QUESTION, FORCED)
        [call] = called.tool_calls
        check_call(call)
        assert called.finish_reason is FinishReason.TOOL_CALLS
        conversation = [
            *QUESTION,
            ChatMessage("assistant", "", tool_calls=(call,)),
            ChatMessage("tool", "18 degrees and sunny", tool_call_id=call.id, name="get_weather"),
        ]
        answer = await client.generate(
            conversation,
            GenerateOptions(
                sampling=Sampling(temperature=0.0),
                stopping=Stopping(max_new_tokens=40),
                tools=(WEATHER,),
                tool_choice=ToolChoice("none"),
            ),
        )
    assert answer.text.strip() and not answer.tool_calls
