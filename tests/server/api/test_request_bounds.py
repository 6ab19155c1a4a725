"""Sizes are bounded on the decoded message, before it is converted or any entry is looked at."""

from __future__ import annotations

import pytest

from tokenwire.server.api.convert import request_sizes
from tokenwire.server.api.request_bounds import check_before_model
from tokenwire.server.engine.errors import ErrorKind, GenerationError
from tokenwire.server.engine.validation import RequestLimits
from tokenwire.v1 import inference_service_pb2 as pb


def test_too_many_logit_biases_are_refused_by_their_count() -> None:
    message = pb.GenerateRequest(prompt="Hi")
    for token_id in range(20_000):
        message.sampling.logit_bias[token_id] = 1.0
    with pytest.raises(GenerationError) as raised:
        check_before_model(request_sizes(message), RequestLimits())
    assert raised.value.kind is ErrorKind.INVALID_ARGUMENT
    [violation] = raised.value.violations
    assert violation.field == "logit_bias"  # admission names it sampling.logit_bias on gRPC
    assert violation.description == "20000 entries, more than 300"


def test_300_logit_biases_pass_the_count() -> None:
    message = pb.GenerateRequest(prompt="Hi")
    for token_id in range(300):
        message.sampling.logit_bias[token_id] = 1.0
    check_before_model(request_sizes(message), RequestLimits())
