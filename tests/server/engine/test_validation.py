"""Validation resolves defaults and reports every problem with the field it concerns."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HfTokenizer

from tokenwire.server.api.chat import ChatPrompts
from tokenwire.server.engine.errors import ErrorKind, GenerationError
from tokenwire.server.engine.validation import RequestLimits, RequestSpec, RequestValidator
from tokenwire.server.models.runner import ModelInfo
from tokenwire.server.text.chat import ChatTemplate, ChatTurn
from tokenwire.server.text.tokenizer import Tokenizer
from tokenwire.server.text.tools import ToolCallFormat, ToolChoice, ToolChoiceMode, ToolDefinition

INFO = ModelInfo(
    name="tiny",
    format="optimum",
    vocab_size=512,
    context_length=64,
    eos_token_ids=frozenset({0}),
    max_batch_size=4,
    default_temperature=0.7,
)


@pytest.fixture(scope="module")
def validator(tiny_model_dir: Path) -> RequestValidator:
    tokenizer = Tokenizer.from_file(tiny_model_dir / "tokenizer.json")
    template = ChatTemplate("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    chat = ChatPrompts(
        template, tokenizer, control_tokens_in_content=False, context_length=INFO.context_length
    )
    return RequestValidator(
        INFO, tokenizer, chat, RequestLimits(max_new_tokens_cap=100, default_max_new_tokens=50)
    )


def test_defaults_are_resolved(validator: RequestValidator) -> None:
    request = validator.validate(RequestSpec(prompt="Hello"), received_at=10.0)
    assert request.sampling.temperature == 0.7  # the model's own default
    assert request.sampling.top_p == 1.0 and request.sampling.repetition_penalty == 1.0
    assert request.stopping.max_new_tokens == 50
    assert request.deadline is None
    assert request.received_at == 10.0


def test_default_max_new_tokens_shrinks_to_the_room_left_in_the_context(validator: RequestValidator) -> None:
    request = validator.validate(RequestSpec(token_ids=tuple(range(1, 41))), received_at=0.0)
    assert request.stopping.max_new_tokens == 64 - 40


def test_deadline_is_the_earlier_of_timeout_and_call_deadline(validator: RequestValidator) -> None:
    own = validator.validate(RequestSpec(prompt="x", timeout=2.0), received_at=100.0, call_deadline=105.0)
    call = validator.validate(RequestSpec(prompt="x", timeout=9.0), received_at=100.0, call_deadline=105.0)
    assert own.deadline == 102.0
    assert call.deadline == 105.0


def test_unseeded_requests_get_distinct_seeds(validator: RequestValidator) -> None:
    seeds = {validator.validate(RequestSpec(prompt="x"), received_at=0).sampling.seed for _ in range(5)}
    assert len(seeds) == 5


def test_chat_messages_are_rendered_and_tokenized(validator: RequestValidator) -> None:
    request = validator.validate(RequestSpec(messages=(ChatTurn("user", "hi"),)), received_at=0)
    assert request.prompt_ids  # "user: hi\n"


def test_all_violations_are_reported_together(validator: RequestValidator) -> None:
    spec = RequestSpec(prompt="x", temperature=-1.0, top_k=-1, top_p=2.0, max_new_tokens=0, top_logprobs=30)
    with pytest.raises(GenerationError) as raised:
        validator.validate(spec, received_at=0)
    assert raised.value.kind is ErrorKind.INVALID_ARGUMENT
    # Named as RequestSpec names them; the API edge maps them to GenerateRequest paths.
    assert [v.field for v in raised.value.violations] == [
        "temperature",
        "top_k",
        "top_p",
        "max_new_tokens",
        "top_logprobs",
    ]


def test_stream_requests_need_a_request_id(validator: RequestValidator) -> None:
    with pytest.raises(GenerationError) as raised:
        validator.validate(RequestSpec(prompt="x"), received_at=0, require_request_id=True)
    assert [v.field for v in raised.value.violations] == ["request_id"]


def test_logit_bias_and_penalties_reach_the_sampling_params(validator: RequestValidator) -> None:
    spec = RequestSpec(
        prompt="x",
        logit_bias=((300, -100.0), (7, 2.5), (0, 100.0), (9, 0.0)),
        presence_penalty=-2.0,
        frequency_penalty=1.25,
    )
    sampling = validator.validate(spec, received_at=0).sampling
    # Ascending ids; a zero bias changes nothing and is left out.
    assert sampling.logit_bias == ((0, 100.0), (7, 2.5), (300, -100.0))
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (-2.0, 1.25)
    assert validator.validate(RequestSpec(prompt="x"), received_at=0).sampling.changes_logits is False


BAD_SAMPLING_CONTROLS: list[tuple[str, RequestSpec, list[str]]] = [
    (
        "bias id at the vocabulary size",
        RequestSpec(prompt="x", logit_bias=((512, 1.0),)),
        ["logit_bias[512]"],
    ),
    ("negative bias id", RequestSpec(prompt="x", logit_bias=((-1, 1.0),)), ["logit_bias[-1]"]),
    ("bias above 100", RequestSpec(prompt="x", logit_bias=((5, 100.5),)), ["logit_bias[5]"]),
    ("bias below -100", RequestSpec(prompt="x", logit_bias=((5, -101.0),)), ["logit_bias[5]"]),
    ("NaN bias", RequestSpec(prompt="x", logit_bias=((5, math.nan),)), ["logit_bias[5]"]),
    ("infinite bias", RequestSpec(prompt="x", logit_bias=((5, -math.inf),)), ["logit_bias[5]"]),
    ("bias id listed twice", RequestSpec(prompt="x", logit_bias=((5, 1.0), (5, 2.0))), ["logit_bias[5]"]),
    (
        "more than 300 biases",
        RequestSpec(prompt="x", logit_bias=tuple((t, 1.0) for t in range(301))),
        ["logit_bias"],
    ),
    ("presence penalty above 2", RequestSpec(prompt="x", presence_penalty=2.5), ["presence_penalty"]),
    ("presence penalty NaN", RequestSpec(prompt="x", presence_penalty=math.nan), ["presence_penalty"]),
    ("frequency penalty below -2", RequestSpec(prompt="x", frequency_penalty=-2.01), ["frequency_penalty"]),
    (
        "frequency penalty infinite",
        RequestSpec(prompt="x", frequency_penalty=math.inf),
        ["frequency_penalty"],
    ),
    (
        "every bad entry at once, in id order",
        RequestSpec(
            prompt="x",
            logit_bias=((900, 1.0), (3, 1.0), (4, 200.0), (-7, 0.0)),
            presence_penalty=3.0,
            frequency_penalty=-3.0,
        ),
        ["presence_penalty", "frequency_penalty", "logit_bias[-7]", "logit_bias[4]", "logit_bias[900]"],
    ),
]


@pytest.mark.parametrize(
    ("spec", "fields"),
    [case[1:] for case in BAD_SAMPLING_CONTROLS],
    ids=[case[0] for case in BAD_SAMPLING_CONTROLS],
)
def test_bad_bias_or_penalty_names_its_field(
    validator: RequestValidator, spec: RequestSpec, fields: list[str]
) -> None:
    with pytest.raises(GenerationError) as raised:
        validator.validate(spec, received_at=0)
    assert raised.value.kind is ErrorKind.INVALID_ARGUMENT
    assert [v.field for v in raised.value.violations] == fields
    assert all(v.description for v in raised.value.violations)


def test_n_is_one_unless_asked_and_reaches_the_request(validator: RequestValidator) -> None:
    assert validator.validate(RequestSpec(prompt="x"), received_at=0.0).n == 1
    assert validator.validate(RequestSpec(prompt="x", n=16), received_at=0.0).n == 16


@pytest.mark.parametrize("n", [0, -1, 17])
def test_n_outside_1_to_16_names_n(validator: RequestValidator, n: int) -> None:
    with pytest.raises(GenerationError) as refused:
        validator.validate(RequestSpec(prompt="x", n=n), received_at=0.0)
    assert refused.value.kind is ErrorKind.INVALID_ARGUMENT
    assert [(v.field, v.description) for v in refused.value.violations] == [
        ("n", f"must be between 1 and 16, got {n}")
    ]


@pytest.mark.parametrize("tool_format", [ToolCallFormat.MISTRAL, ToolCallFormat.JSON])
def test_a_forced_tool_call_opens_with_the_marker_token_only_in_the_mistral_format(
    tiny_model_dir: Path, tool_format: ToolCallFormat
) -> None:
    backend = HfTokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    backend.add_special_tokens(["[TOOL_CALLS]"])
    tokenizer = Tokenizer(backend)
    marker = tokenizer.token_to_id("[TOOL_CALLS]")
    assert marker is not None
    template = ChatTemplate("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    info = dataclasses.replace(INFO, context_length=1024)  # room for the tools the prompt renders
    chat = ChatPrompts(template, tokenizer, control_tokens_in_content=False, context_length=1024)
    validator = RequestValidator(info, tokenizer, chat, RequestLimits(), tool_format)
    spec = RequestSpec(
        messages=(ChatTurn("user", "weather?"),),
        tools=(ToolDefinition("get_weather"),),
        tool_choice=ToolChoice(ToolChoiceMode.REQUIRED),
    )

    request = validator.validate(spec, received_at=0.0)

    assert request.response_format is not None and request.response_format.field == "tools"
    assert (f"<[{marker}]>" in request.response_format.source) is (tool_format is ToolCallFormat.MISTRAL)
