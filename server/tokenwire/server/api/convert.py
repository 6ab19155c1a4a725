"""Protobuf messages <-> domain objects. Nothing else in the server touches protobuf."""

from __future__ import annotations

import re
from collections.abc import Iterable

from google.protobuf.duration_pb2 import Duration

from tokenwire.server.api.admission import AdmissionInput
from tokenwire.server.api.decoding import UndecodableRequest
from tokenwire.server.api.registry import ServedAdapter
from tokenwire.server.api.request_bounds import RequestSizes
from tokenwire.server.api.tool_output import ToolOutput, ends_with_calls
from tokenwire.server.engine.errors import ErrorKind, FieldViolation, GenerationError
from tokenwire.server.engine.types import (
    Completed,
    CompletionChoice,
    EngineEvent,
    Failed,
    FinishReason,
    GenerationResult,
    Priority,
    Started,
    TimingReport,
    TokenLogprobs,
    TokensGenerated,
)
from tokenwire.server.engine.validation import RequestSpec
from tokenwire.server.models.runner import ModelInfo
from tokenwire.server.sampling.params import FormatKind, ResponseFormat
from tokenwire.server.text.chat import ChatTurn
from tokenwire.server.text.tool_calls import CallDelta
from tokenwire.server.text.tools import ToolCall, ToolChoice, ToolChoiceMode, ToolDefinition
from tokenwire.v1 import inference_service_pb2 as pb

_PRIORITIES = {
    pb.PRIORITY_INTERACTIVE: Priority.INTERACTIVE,
    pb.PRIORITY_DEFAULT: Priority.DEFAULT,
    pb.PRIORITY_BATCH: Priority.BATCH,
}

_FINISH_REASONS = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.EOS: pb.FINISH_REASON_EOS,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
}


def admission_input(message: pb.GenerateRequest | UndecodableRequest) -> AdmissionInput:
    """A decoded GenerateRequest (or bytes that did not decode) as admission takes it."""
    if isinstance(message, UndecodableRequest):
        error = message.error()

        def undecodable() -> RequestSpec:
            raise error

        return AdmissionInput(RequestSizes(), undecodable, request_error)
    return AdmissionInput(
        request_sizes(message),
        lambda: request_spec(message),
        request_error,
        idempotency_key=message.idempotency_key or None,
    )


def request_sizes(message: pb.GenerateRequest) -> RequestSizes:
    """The sizes of a decoded request, read without looking inside its repeated fields."""
    messages = message.messages
    return RequestSizes(
        request_id=message.request_id,
        idempotency_key=message.idempotency_key,
        model=message.model,
        messages=len(messages),
        roles=lambda: (turn.role for turn in messages),
        message_characters=lambda: sum(len(turn.content) for turn in messages),
        prompt_characters=len(message.prompt) if message.HasField("prompt") else None,
        token_ids=len(message.token_ids.ids) if message.HasField("token_ids") else None,
        logit_bias=len(message.sampling.logit_bias),
        stop=len(message.stopping.stop),
        tools=len(message.tools),
    )


def request_spec(message: pb.GenerateRequest) -> RequestSpec:
    """The request in domain terms. Raises GenerationError for a priority this server does not know."""
    if message.priority != pb.PRIORITY_UNSPECIFIED and message.priority not in _PRIORITIES:
        raise GenerationError.invalid(
            FieldViolation("priority", "unknown value; use INTERACTIVE, DEFAULT or BATCH")
        )
    sampling = message.sampling
    stopping = message.stopping
    return RequestSpec(
        request_id=message.request_id,
        model=message.model,
        adapter=message.adapter,
        prompt=message.prompt if message.HasField("prompt") else None,
        messages=tuple(
            ChatTurn(
                m.role,
                m.content,
                tuple(ToolCall(c.id, c.name, c.arguments) for c in m.tool.tool_calls),
                m.tool.tool_call_id,
                m.tool.name,
            )
            if m.HasField("tool")
            else ChatTurn(m.role, m.content)
            for m in message.messages
        ),
        token_ids=tuple(message.token_ids.ids) if message.HasField("token_ids") else None,
        temperature=sampling.temperature if sampling.HasField("temperature") else None,
        top_k=sampling.top_k,
        top_p=sampling.top_p if sampling.HasField("top_p") else None,
        min_p=sampling.min_p,
        repetition_penalty=sampling.repetition_penalty if sampling.HasField("repetition_penalty") else None,
        seed=sampling.seed if sampling.HasField("seed") else None,
        logit_bias=tuple(sorted(sampling.logit_bias.items())),
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        max_new_tokens=stopping.max_new_tokens if stopping.HasField("max_new_tokens") else None,
        stop=tuple(stopping.stop),
        ignore_eos=stopping.ignore_eos,
        logprobs=message.logprobs,
        top_logprobs=message.top_logprobs,
        timeout=_seconds(message.timeout) if message.HasField("timeout") else None,
        priority=_PRIORITIES.get(message.priority),  # None: unset, which is DEFAULT
        n=message.n or 1,  # proto3's unset 0 means one completion
        response_format=(
            response_format(message.response_format) if message.HasField("response_format") else None
        ),
        tools=tuple(
            ToolDefinition(tool.name, tool.description, tool.parameters or _ANY_OBJECT)
            for tool in message.tools
        ),
        tool_choice=tool_choice(message.tool_choice) if message.HasField("tool_choice") else None,
        parallel_tool_calls=(
            message.parallel_tool_calls if message.HasField("parallel_tool_calls") else None
        ),
    )


_ANY_OBJECT = '{"type": "object"}'
_TOOL_CHOICE_MODES = {
    pb.TOOL_CHOICE_MODE_UNSPECIFIED: ToolChoiceMode.AUTO,
    pb.TOOL_CHOICE_MODE_AUTO: ToolChoiceMode.AUTO,
    pb.TOOL_CHOICE_MODE_NONE: ToolChoiceMode.NONE,
    pb.TOOL_CHOICE_MODE_REQUIRED: ToolChoiceMode.REQUIRED,
}


def tool_choice(message: pb.ToolChoice) -> ToolChoice | None:
    """The choice asked for; None when neither field is set. Raises GenerationError for a mode
    this server does not know."""
    kind = message.WhichOneof("choice")
    if kind == "name":
        return ToolChoice(ToolChoiceMode.NAMED, message.name)
    if kind is None:
        return None
    mode = _TOOL_CHOICE_MODES.get(message.mode)
    if mode is None:
        raise GenerationError.invalid(
            FieldViolation("tool_choice.mode", "unknown value; use AUTO, NONE or REQUIRED")
        )
    return ToolChoice(mode)


def response_format(message: pb.ResponseFormat) -> ResponseFormat | None:
    """The format asked for; None when the message sets none of its fields."""
    kind = message.WhichOneof("format")
    if kind == "json_schema":
        return ResponseFormat(FormatKind.JSON_SCHEMA, message.json_schema)
    if kind == "regex":
        return ResponseFormat(FormatKind.REGEX, message.regex)
    if kind == "choice":
        return ResponseFormat(FormatKind.CHOICE, choices=tuple(message.choice.options))
    if kind == "grammar":
        return ResponseFormat(FormatKind.GRAMMAR, message.grammar)
    return None


# Where each RequestSpec field lives in a GenerateRequest (the rest are at the top, by the same name).
_REQUEST_PATHS = {
    **{
        name: f"sampling.{name}"
        for name in (
            "temperature",
            "top_k",
            "top_p",
            "min_p",
            "repetition_penalty",
            "seed",
            "logit_bias",
            "presence_penalty",
            "frequency_penalty",
        )
    },
    **{name: f"stopping.{name}" for name in ("max_new_tokens", "stop", "ignore_eos")},
    "token_ids": "token_ids.ids",
}


_TOOL_TURN_FIELD = re.compile(r"^(messages\[\d+\])\.(tool_calls|tool_call_id|name)")
"""A message's tool fields, which ChatMessage holds in its `tool` sub-message."""


def request_field_path(violation: FieldViolation) -> str:
    """The GenerateRequest path of a violation the engine names in RequestSpec terms."""
    field = _TOOL_TURN_FIELD.sub(r"\1.tool.\2", violation.field)
    end = min((i for i in (field.find("["), field.find(".")) if i >= 0), default=len(field))
    name, rest = field[:end], field[end:]
    if violation.presence:
        return field  # a field set at all: the message field itself, not its contents
    return _REQUEST_PATHS.get(name, name) + rest


def request_error(error: GenerationError) -> GenerationError:
    """`error` from validating a request, its violations named as GenerateRequest paths."""
    if error.kind is not ErrorKind.INVALID_ARGUMENT or not error.violations or error.reason is not None:
        return error
    return GenerationError.invalid(
        *(FieldViolation(request_field_path(v), v.description) for v in error.violations),
        omitted=error.omitted_violations,
    )


def generate_response(
    result: GenerationResult, *, include_outputs: bool = True, tools: ToolOutput | None = None
) -> pb.GenerateResponse:
    """The summary of a finished generation; without outputs for a stream's `completed` event,
    whose chunks carried them (and whose `tools` has read them)."""
    tools = tools or ToolOutput(None)
    text, calls = tools.whole(result.text) if include_outputs else ("", tools.calls(0))
    response = pb.GenerateResponse(
        request_id=result.request_id,
        model=result.model,
        finish_reason=_finish_reason(result.finish_reason, calls),
        usage=pb.Usage(
            prompt_tokens=result.prompt_tokens,
            completion_tokens=result.completion_tokens,
            cached_prompt_tokens=result.cached_prompt_tokens,
            accepted_draft_tokens=result.accepted_draft_tokens,
            draft_tokens=result.draft_tokens,
        ),
        timing=timing(result.timing),
    )
    if include_outputs:
        response.text = text
        response.token_ids.extend(result.token_ids)
        response.logprobs.extend(token_logprobs(lp) for lp in result.logprobs)
        response.tool_calls.extend(_tool_call(call) for call in calls)
    response.choices.extend(
        completion(choice, include_outputs=include_outputs, tools=tools) for choice in result.choices
    )
    return response


def completion(
    choice: CompletionChoice, *, include_outputs: bool = True, tools: ToolOutput | None = None
) -> pb.Completion:
    """One of n completions; only its index and finish reason for a stream's `completed` event,
    whose chunks carried the rest."""
    tools = tools or ToolOutput(None)
    text, calls = tools.whole(choice.text) if include_outputs else ("", tools.calls(choice.index))
    message = pb.Completion(index=choice.index, finish_reason=_finish_reason(choice.finish_reason, calls))
    if include_outputs:
        message.text = text
        message.token_ids.extend(choice.token_ids)
        message.logprobs.extend(token_logprobs(lp) for lp in choice.logprobs)
        message.tool_calls.extend(_tool_call(call) for call in calls)
    return message


def _finish_reason(reason: FinishReason, calls: list[ToolCall]) -> pb.FinishReason.ValueType:
    return pb.FINISH_REASON_TOOL_CALLS if ends_with_calls(reason, calls) else _FINISH_REASONS[reason]


def _tool_call(call: ToolCall) -> pb.ToolCall:
    return pb.ToolCall(id=call.id, name=call.name, arguments=call.arguments)


def timing(report: TimingReport) -> pb.Timing:
    message = pb.Timing(
        queued=duration(report.queued),
        total=duration(report.total),
        decode_tokens_per_second=report.decode_tokens_per_second,
    )
    if report.time_to_first_token is not None:
        message.time_to_first_token.CopyFrom(duration(report.time_to_first_token))
    if report.prefill is not None:
        message.prefill.CopyFrom(duration(report.prefill))
    if report.time_per_output_token is not None:
        message.time_per_output_token.CopyFrom(duration(report.time_per_output_token))
    if report.paced is not None:
        message.paced.CopyFrom(duration(report.paced))
    return message


def token_logprobs(item: TokenLogprobs) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=item.token_id,
        token=item.token,
        logprob=item.logprob,
        top_logprobs=[pb.TopLogprob(token_id=t, token=text, logprob=lp) for t, text, lp in item.top],
    )


def stream_messages(
    request_id: str, event: EngineEvent, tools: ToolOutput | None = None
) -> list[pb.StreamGenerateResponse]:
    """The stream messages of an engine event (Failed events go through api.errors instead):
    one, and before a `completed` event the chunks of what `tools` held back."""
    tools = tools or ToolOutput(None)
    message = pb.StreamGenerateResponse(request_id=request_id)
    if isinstance(event, TokensGenerated):
        text, deltas = tools.chunk(event.index, event.text)
        message.chunk.text = text
        message.chunk.token_ids.extend(event.token_ids)
        message.chunk.logprobs.extend(token_logprobs(lp) for lp in event.logprobs)
        message.chunk.index = event.index
        message.chunk.tool_calls.extend(_tool_call_delta(delta) for delta in deltas)
    elif isinstance(event, Started):
        message.started.queued.CopyFrom(duration(event.queued_seconds))
        message.started.prompt_tokens = event.prompt_tokens
    elif isinstance(event, Completed):
        held = []
        for index in [choice.index for choice in event.result.choices] or [0]:
            text, deltas = tools.finish(index)
            if text or deltas:
                chunk = pb.TokenChunk(index=index, text=text)
                chunk.tool_calls.extend(_tool_call_delta(delta) for delta in deltas)
                held.append(pb.StreamGenerateResponse(request_id=request_id, chunk=chunk))
        message.completed.CopyFrom(generate_response(event.result, include_outputs=False, tools=tools))
        return [*held, message]
    elif isinstance(event, Failed):  # pragma: no cover - callers route failures to errors.py
        raise TypeError("failures are converted by tokenwire.server.api.errors")
    return [message]


def _tool_call_delta(delta: CallDelta) -> pb.ToolCallDelta:
    return pb.ToolCallDelta(index=delta.index, id=delta.id, name=delta.name, arguments=delta.arguments)


def queued_event(request_id: str, position: int) -> pb.StreamGenerateResponse:
    return pb.StreamGenerateResponse(request_id=request_id, queued=pb.Queued(position=position))


def model_info(
    info: ModelInfo, *, has_chat_template: bool, is_default: bool, adapters: Iterable[ServedAdapter] = ()
) -> pb.ModelInfo:
    return pb.ModelInfo(
        adapters=[adapter_info(a) for a in adapters],
        name=info.name,
        context_length=info.context_length,
        vocab_size=info.vocab_size,
        has_chat_template=has_chat_template,
        is_default=is_default,
        max_batch_size=info.max_batch_size,
        format=info.format,
    )


def duration(seconds: float) -> Duration:
    message = Duration()
    whole = int(seconds)
    message.seconds = whole
    message.nanos = round((seconds - whole) * 1e9)
    if message.nanos >= 1_000_000_000:
        message.seconds += 1
        message.nanos -= 1_000_000_000
    return message


def _seconds(value: Duration) -> float:
    return value.seconds + value.nanos / 1e9


def adapter_info(adapter: ServedAdapter) -> pb.AdapterInfo:
    return pb.AdapterInfo(
        name=adapter.name,
        base=adapter.base,
        rank=adapter.rank,
        source=adapter.source,
        memory_bytes=adapter.memory_bytes,
    )
