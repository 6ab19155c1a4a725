"""The libraries services are built on, unchanged, against a real server with the default model:
LangChain (ChatOpenAI), LiteLLM, instructor, pydantic-ai and llama-index (OpenAILike), and
LangChain's OpenAIEmbeddings. For each chat library:
a chat, a stream, structured output in the library's default mode, and a tool-calling round trip
(tool call -> tool result -> answer); LangChain also on the Responses API (`use_responses_api`).
Their versions are pinned in pyproject.toml's dev extra.

SmolLM2-135M rarely chooses a tool by itself, so each round trip forces its first call with the
library's own tool choice (a named tool or `required`), which the server enforces with a grammar,
as OpenAI's API honours it; the arguments then always validate against the tool's schema. What
is checked is what a client relies on: the call's name and arguments, the result sent back, and
a text answer after it. Greedy decoding keeps each run the same.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from pydantic import BaseModel

from tests.conftest import DEFAULT_MODEL_NAME
from tests.support.tools import FORCE_WEATHER, WEATHER_RESULT, WEATHER_TOOL

pytestmark = pytest.mark.slow

# LiteLLM fetches its model price list from the network at import unless told to use its own copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

QUESTION = "What is the weather in Paris?"


class Person(BaseModel):
    name: str
    age: int


def get_weather(city: str) -> str:
    """The current weather in a city."""
    return WEATHER_RESULT


def assert_city(arguments: str | dict[str, Any]) -> None:
    """A forced call's arguments: valid against the tool's schema (a string city, nothing else)."""
    parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    assert set(parsed) == {"city"} and isinstance(parsed["city"], str), parsed


@pytest.fixture(scope="module")
def api(default_model_api: str) -> str:
    return default_model_api


# -- LangChain ---------------------------------------------------------------------------------


def langchain_model(api: str, **options: Any) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        base_url=api,
        api_key="unused",
        model=DEFAULT_MODEL_NAME,
        temperature=0,
        max_tokens=48,
        max_retries=0,
        **options,
    )


@pytest.fixture(scope="module")
def langchain_chat(api: str) -> Any:
    return langchain_model(api)


def test_langchain_chats_and_streams_the_same_answer(langchain_chat: Any) -> None:
    answer = langchain_chat.invoke("Name a colour.")
    assert isinstance(answer.content, str) and answer.content.strip()
    streamed = "".join(chunk.content for chunk in langchain_chat.stream("Name a colour."))
    assert streamed == answer.content
    assert answer.usage_metadata["output_tokens"] >= 1


def test_langchain_structured_output_in_its_default_mode(langchain_chat: Any) -> None:
    person = langchain_chat.with_structured_output(Person).invoke("Describe a person called Ada, aged 36.")
    assert isinstance(person, Person)


def test_langchain_tool_round_trip(langchain_chat: Any) -> None:
    langchain_tool_round_trip(langchain_chat, answering=lambda weather: langchain_chat)


def langchain_tool_round_trip(model: Any, answering: Callable[[Any], Any]) -> None:
    """A call forced by `model`, its result, and the text answer of `answering(the tool)`."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    weather = tool(get_weather)
    question = HumanMessage(QUESTION)
    call_message = model.bind_tools([weather], tool_choice="get_weather").invoke([question])
    [call] = call_message.tool_calls
    assert call["name"] == "get_weather"
    assert_city(call["args"])
    result = ToolMessage(weather.invoke(call["args"]), tool_call_id=call["id"])
    answer = answering(weather).invoke([question, call_message, result])
    assert isinstance(answer.text, str) and answer.text.strip()
    assert not answer.tool_calls


def test_langchain_embeds_documents_and_a_query(api: str) -> None:
    from langchain_openai import OpenAIEmbeddings

    # check_embedding_ctx_length off: otherwise LangChain cuts texts with OpenAI's own tokenizer
    # (tiktoken, fetched from the network) and sends its token ids, which mean nothing to another
    # model; LangChain documents this setting for OpenAI-compatible servers.
    embeddings = OpenAIEmbeddings(
        base_url=api,
        api_key="unused",
        model=DEFAULT_MODEL_NAME,
        check_embedding_ctx_length=False,
        max_retries=0,
    )
    documents = embeddings.embed_documents(["Paris is the capital of France.", "Bananas are yellow."])
    query = embeddings.embed_query("Paris is the capital of France.")
    assert len(documents) == 2 and all(len(vector) == len(query) == 576 for vector in documents)
    assert all(abs(sum(x * x for x in vector) - 1) < 1e-4 for vector in (*documents, query))
    # The same text alone and in a batch of two: equal to the 4-bit model's batch rounding.
    assert sum(a * b for a, b in zip(query, documents[0], strict=True)) > 0.99


@pytest.fixture(scope="module")
def langchain_responses(api: str) -> Any:
    return langchain_model(api, use_responses_api=True)


def test_langchain_on_the_responses_api_chats_and_streams_the_same_answer(
    langchain_responses: Any, langchain_chat: Any
) -> None:
    answer = langchain_responses.invoke("Name a colour.")
    assert answer.text.strip()
    assert answer.response_metadata["id"].startswith("resp_")
    assert answer.text == langchain_chat.invoke("Name a colour.").content  # the same conversation
    streamed = "".join(chunk.text for chunk in langchain_responses.stream("Name a colour."))
    assert streamed == answer.text
    assert answer.usage_metadata["output_tokens"] >= 1


def test_langchain_on_the_responses_api_tool_round_trip(langchain_responses: Any) -> None:
    # Answering, the model is told not to call again: the Responses API keeps the tools offered.
    langchain_tool_round_trip(
        langchain_responses,
        answering=lambda weather: langchain_responses.bind_tools([weather], tool_choice="none"),
    )


# -- LiteLLM -----------------------------------------------------------------------------------


def litellm_call(api: str, **arguments: Any) -> Any:
    import litellm

    return litellm.completion(
        model=f"openai/{DEFAULT_MODEL_NAME}",
        api_base=api,
        api_key="unused",
        temperature=0,
        max_tokens=48,
        num_retries=0,
        **arguments,
    )


def test_litellm_chats_and_streams_the_same_answer(api: str) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    answer = litellm_call(api, messages=messages)
    text = answer.choices[0].message.content
    assert text.strip()
    chunks = litellm_call(api, messages=messages, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == text


def test_litellm_structured_output_in_its_default_mode(api: str) -> None:
    answer = litellm_call(
        api, messages=[{"role": "user", "content": "Describe Ada, aged 36, as JSON."}], response_format=Person
    )
    Person.model_validate_json(answer.choices[0].message.content)


def test_litellm_tool_round_trip(api: str) -> None:
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    called = litellm_call(api, messages=messages, tools=[WEATHER_TOOL], tool_choice=FORCE_WEATHER)
    assert called.choices[0].finish_reason == "tool_calls"
    message = called.choices[0].message
    [call] = message.tool_calls
    assert call.function.name == "get_weather"
    assert_city(call.function.arguments)
    messages += [message, {"role": "tool", "tool_call_id": call.id, "content": WEATHER_RESULT}]
    answer = litellm_call(api, messages=messages, tools=[WEATHER_TOOL], tool_choice="none")
    assert answer.choices[0].message.content.strip()


# -- instructor --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def instructor_client(api: str) -> Iterator[Any]:
    import instructor
    import openai

    raw = openai.OpenAI(base_url=api, api_key="unused", max_retries=0)
    yield instructor.from_openai(raw)  # the default mode: a forced tool call
    raw.close()


def test_instructor_chats_and_streams_partial_objects(instructor_client: Any) -> None:
    arguments = {"model": DEFAULT_MODEL_NAME, "temperature": 0, "max_tokens": 48}
    answer = instructor_client.chat.completions.create(
        response_model=None, messages=[{"role": "user", "content": "Name a colour."}], **arguments
    )
    assert answer.choices[0].message.content.strip()
    # Partial objects come from the streamed argument deltas of the forced call.
    partials = list(
        instructor_client.chat.completions.create_partial(
            response_model=Person,
            messages=[{"role": "user", "content": "Describe Ada, aged 36."}],
            max_retries=0,
            **arguments,
        )
    )
    assert len(partials) >= 2
    Person.model_validate(partials[-1].model_dump())


def test_instructor_structured_output_in_its_default_mode(instructor_client: Any) -> None:
    person = instructor_client.chat.completions.create(
        model=DEFAULT_MODEL_NAME,
        response_model=Person,
        messages=[{"role": "user", "content": "Describe Ada, aged 36."}],
        temperature=0,
        max_tokens=48,
        max_retries=0,
    )
    assert isinstance(person, Person)


def test_instructor_tool_round_trip(instructor_client: Any) -> None:
    arguments = {"model": DEFAULT_MODEL_NAME, "temperature": 0, "max_tokens": 48, "response_model": None}
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    called = instructor_client.chat.completions.create(
        messages=messages, tools=[WEATHER_TOOL], tool_choice=FORCE_WEATHER, **arguments
    )
    [call] = called.choices[0].message.tool_calls
    assert_city(call.function.arguments)
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": WEATHER_RESULT},
    ]
    answer = instructor_client.chat.completions.create(messages=messages, **arguments)
    assert answer.choices[0].message.content.strip()


# -- pydantic-ai -------------------------------------------------------------------------------


def pydantic_ai_model(api: str) -> Any:
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    return OpenAIChatModel(DEFAULT_MODEL_NAME, provider=OpenAIProvider(base_url=api, api_key="unused"))


SETTINGS = {"temperature": 0.0, "max_tokens": 48, "parallel_tool_calls": False}


def test_pydantic_ai_chats_and_streams_the_same_answer(api: str) -> None:
    from pydantic_ai import Agent

    agent = Agent(pydantic_ai_model(api), model_settings=SETTINGS)  # type: ignore[arg-type]
    answer = agent.run_sync("Name a colour.").output
    assert answer.strip()

    async def stream() -> str:
        async with agent.run_stream("Name a colour.") as running:
            return "".join([delta async for delta in running.stream_text(delta=True)])

    assert asyncio.run(stream()) == answer


def test_pydantic_ai_structured_output_in_its_default_mode(api: str) -> None:
    from pydantic_ai import Agent

    # The default output mode: a tool the model must call (tool_choice required).
    agent = Agent(pydantic_ai_model(api), output_type=Person, model_settings=SETTINGS)  # type: ignore[arg-type]
    assert isinstance(agent.run_sync("Describe Ada, aged 36.").output, Person)


def test_pydantic_ai_tool_round_trip(api: str) -> None:
    from dataclasses import dataclass

    from pydantic_ai import Agent
    from pydantic_ai.capabilities import AbstractCapability
    from pydantic_ai.messages import ToolCallPart, ToolReturnPart

    @dataclass
    class WeatherFirst(AbstractCapability[None]):
        """Forces the weather tool on the first step, then lets the model answer in text."""

        def get_model_settings(self) -> Any:
            return lambda ctx: {"tool_choice": ["get_weather"] if ctx.run_step <= 1 else "none"}

    agent = Agent(
        pydantic_ai_model(api),
        tools=[get_weather],
        capabilities=[WeatherFirst()],
        model_settings=SETTINGS,  # type: ignore[arg-type]
    )
    result = agent.run_sync(QUESTION)
    parts = [part for message in result.all_messages() for part in message.parts]
    [call] = [part for part in parts if isinstance(part, ToolCallPart)]
    assert call.tool_name == "get_weather"
    assert_city(call.args_as_dict())
    [returned] = [part for part in parts if isinstance(part, ToolReturnPart)]
    assert returned.content == WEATHER_RESULT
    assert result.output.strip()


# -- llama-index -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_index_llm(api: str) -> Any:
    from llama_index.llms.openai_like import OpenAILike

    return OpenAILike(
        model=DEFAULT_MODEL_NAME,
        api_base=api,
        api_key="unused",
        is_chat_model=True,
        is_function_calling_model=True,
        context_window=2048,
        temperature=0,
        max_tokens=48,
        max_retries=0,
    )


def test_llama_index_chats_and_streams_the_same_answer(llama_index_llm: Any) -> None:
    from llama_index.core.llms import ChatMessage

    messages = [ChatMessage(role="user", content="Name a colour.")]
    answer = llama_index_llm.chat(messages).message.content
    assert answer.strip()
    assert "".join(part.delta for part in llama_index_llm.stream_chat(messages)) == answer


def test_llama_index_structured_output_in_its_default_mode(llama_index_llm: Any) -> None:
    from llama_index.core.prompts import PromptTemplate

    person = llama_index_llm.structured_predict(
        Person, PromptTemplate("Describe {name}, aged 36."), name="Ada"
    )
    assert isinstance(person, Person)


def test_llama_index_tool_round_trip(llama_index_llm: Any) -> None:
    from llama_index.core.llms import ChatMessage
    from llama_index.core.tools import FunctionTool

    weather = FunctionTool.from_defaults(fn=get_weather)
    called = llama_index_llm.chat_with_tools([weather], user_msg=QUESTION, tool_required=True)
    [selection] = llama_index_llm.get_tool_calls_from_response(called)
    assert selection.tool_name == "get_weather"
    assert_city(selection.tool_kwargs)
    result = weather.call(**selection.tool_kwargs)
    history = [
        ChatMessage(role="user", content=QUESTION),
        called.message,
        ChatMessage(role="tool", content=str(result), additional_kwargs={"tool_call_id": selection.tool_id}),
    ]
    assert llama_index_llm.chat(history).message.content.strip()
