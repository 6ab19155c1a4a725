"""Validation resolves defaults and reports every problem with the field it concerns."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenwire.server.api.chat import ChatPrompts
from tokenwire.server.engine.errors import ErrorKind, GenerationError
from tokenwire.server.engine.validation import RequestLimits, RequestSpec, RequestValidator
from tokenwire.server.models.runner import ModelInfo
from tokenwire.server.text.chat import ChatTemplate, ChatTurn
from tokenwire.server.text.tokenizer import Tokenizer

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
