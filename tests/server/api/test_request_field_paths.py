"""The engine names fields as RequestSpec does; the edge reports them as GenerateRequest paths."""

from __future__ import annotations

from tokenwire.server.api.convert import request_error
from tokenwire.server.engine.errors import MAX_VIOLATIONS, ErrorKind, FieldViolation, GenerationError


def test_engine_field_names_become_request_paths_in_details_and_message() -> None:
    engine_error = GenerationError.invalid(
        FieldViolation("top_p", "must be in (0, 1]"),
        FieldViolation("stop[2]", "must not be empty"),
        FieldViolation("token_ids[5]", "token id 900 is outside [0, 512)"),
        FieldViolation("token_ids", "only one input may be set, got prompt and token_ids", presence=True),
        FieldViolation("messages[0].role", "unknown role 'wizard'"),
    )
    wire = request_error(engine_error)
    assert [v.field for v in wire.violations] == [
        "sampling.top_p",
        "stopping.stop[2]",
        "token_ids.ids[5]",
        "token_ids",
        "messages[0].role",
    ]
    assert wire.kind is ErrorKind.INVALID_ARGUMENT
    assert "sampling.top_p: must be in (0, 1]" in wire.message
    assert "top_p: must" not in wire.message.replace("sampling.top_p", "")


def test_the_count_of_violations_left_out_survives_the_mapping() -> None:
    engine_error = GenerationError.invalid(
        *(FieldViolation(f"stop[{i}]", "must not be empty") for i in range(MAX_VIOLATIONS + 3))
    )
    wire = request_error(engine_error)
    assert len(wire.violations) == MAX_VIOLATIONS
    assert wire.message.endswith("; and 3 more")
    assert wire.violations[0].field == "stopping.stop[0]"


def test_errors_without_violations_pass_unchanged() -> None:
    full = GenerationError(ErrorKind.RESOURCE_EXHAUSTED, "queue full", retry_after=1.0, reason="QUEUE_FULL")
    assert request_error(full) is full


def test_bias_and_penalty_fields_are_reported_under_sampling() -> None:
    engine_error = GenerationError.invalid(
        FieldViolation("logit_bias[50000]", "token id 50000 is outside [0, 49152)"),
        FieldViolation("logit_bias", "301 entries, more than 300"),
        FieldViolation("presence_penalty", "must be in [-2, 2], got 3.0"),
        FieldViolation("frequency_penalty", "must be in [-2, 2], got -3.0"),
    )
    assert [v.field for v in request_error(engine_error).violations] == [
        "sampling.logit_bias[50000]",
        "sampling.logit_bias",
        "sampling.presence_penalty",
        "sampling.frequency_penalty",
    ]


def test_a_messages_tool_fields_are_reported_in_its_tool_sub_message() -> None:
    engine_error = GenerationError.invalid(
        FieldViolation("messages[2].tool_calls[0].name", "'a b' is not a tool name"),
        FieldViolation("messages[3].tool_call_id", "holds the control token '<|im_end|>'; remove it"),
        FieldViolation("tools[1].parameters", "longer than 65536 characters"),
    )
    assert [v.field for v in request_error(engine_error).violations] == [
        "messages[2].tool.tool_calls[0].name",
        "messages[3].tool.tool_call_id",
        "tools[1].parameters",
    ]
