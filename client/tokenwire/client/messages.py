"""Typed client values <-> protobuf messages."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from google.protobuf.duration_pb2 import Duration

from tokenwire.client.errors import TokenwireError
from tokenwire.client.types import (
    ChatMessage,
    Chunk,
    Completed,
    CompletionChoice,
    Failed,
    FinishReason,
    GenerateOptions,
    Generation,
    ModelDescription,
    Priority,
    Queued,
    Started,
    StreamEvent,
    Timing,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
)
from tokenwire.v1 import inference_service_pb2 as pb

Prompt = str | Sequence[ChatMessage] | Sequence[int]
"""A text prompt, a chat conversation, or pre-tokenized ids."""

_FINISH = {
    pb.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    pb.FINISH_REASON_EOS: FinishReason.EOS,
    pb.FINISH_REASON_STOP: FinishReason.STOP,
    pb.FINISH_REASON_CANCELLED: FinishReason.CANCELLED,
    pb.FINISH_REASON_TOOL_CALLS: FinishReason.TOOL_CALLS,
}
_TOOL_CHOICE_MODES = {
    "auto": pb.TOOL_CHOICE_MODE_AUTO,
    "none": pb.TOOL_CHOICE_MODE_NONE,
    "required": pb.TOOL_CHOICE_MODE_REQUIRED,
}


def new_request_id() -> str:
    """A label for a generation's events; it makes nothing idempotent."""
    return f"req-{uuid.uuid4().hex[:16]}"


def new_idempotency_key() -> str:
    """A key for one logical request, sent again only with its retries."""
    return f"key-{uuid.uuid4().hex}"


_PRIORITIES = {
    Priority.INTERACTIVE: pb.PRIORITY_INTERACTIVE,
    Priority.DEFAULT: pb.PRIORITY_DEFAULT,
    Priority.BATCH: pb.PRIORITY_BATCH,
}


def generate_request(
    prompt: Prompt, options: GenerateOptions, request_id: str = "", idempotency_key: str = ""
) -> pb.GenerateRequest:
    message = pb.GenerateRequest(
        request_id=request_id,
        idempotency_key=idempotency_key,
        model=options.model,
        logprobs=options.logprobs,
        top_logprobs=options.top_logprobs,
    )
    if isinstance(prompt, str):
        message.prompt = prompt
    elif prompt and all(isinstance(item, ChatMessage) for item in prompt):
        message.messages.extend(_chat_message(m) for m in prompt)  # type: ignore[arg-type]
    else:
        message.token_ids.ids.extend(int(t) for t in prompt)  # type: ignore[arg-type]
    sampling = options.sampling
    message.sampling.top_k = sampling.top_k
    message.sampling.min_p = sampling.min_p
    if sampling.temperature is not None:
        message.sampling.temperature = sampling.temperature
    if sampling.top_p is not None:
        message.sampling.top_p = sampling.top_p
    if sampling.repetition_penalty is not None:
        message.sampling.repetition_penalty = sampling.repetition_penalty
    if sampling.seed is not None:
        message.sampling.seed = sampling.seed
    for token_id, bias in sampling.logit_bias.items():
        message.sampling.logit_bias[token_id] = bias
    message.sampling.presence_penalty = sampling.presence_penalty
    message.sampling.frequency_penalty = sampling.frequency_penalty
    stopping = options.stopping
    if stopping.max_new_tokens is not None:
        message.stopping.max_new_tokens = stopping.max_new_tokens
    message.stopping.stop.extend(stopping.stop)
    message.stopping.ignore_eos = stopping.ignore_eos
    if options.timeout is not None:
        message.timeout.CopyFrom(_duration(options.timeout))
    if options.priority is not Priority.DEFAULT:
        message.priority = _PRIORITIES[options.priority]
    if options.n != 1:
        message.n = options.n  # unset for one completion: the request stays what it always was
    message.tools.extend(
        pb.ToolDefinition(name=tool.name, description=tool.description, parameters=tool.parameters)
        for tool in options.tools
    )
    choice = options.tool_choice
    if choice is not None:
        if choice.name:
            message.tool_choice.name = choice.name
        else:
            message.tool_choice.mode = _TOOL_CHOICE_MODES[choice.mode]
    if options.parallel_tool_calls is not None:
        message.parallel_tool_calls = options.parallel_tool_calls
    response_format = options.response_format
    if response_format is not None:
        if response_format.json_schema is not None:
            message.response_format.json_schema = response_format.json_schema
        elif response_format.regex is not None:
            message.response_format.regex = response_format.regex
        elif response_format.choice is not None:
            message.response_format.choice.options.extend(response_format.choice)
        elif response_format.grammar is not None:
            message.response_format.grammar = response_format.grammar
    return message


def generation(message: pb.GenerateResponse) -> Generation:
    return Generation(
        request_id=message.request_id,
        model=message.model,
        text=message.text,
        token_ids=tuple(message.token_ids),
        finish_reason=_FINISH.get(message.finish_reason, FinishReason.UNSPECIFIED),
        prompt_tokens=message.usage.prompt_tokens,
        completion_tokens=message.usage.completion_tokens,
        cached_prompt_tokens=message.usage.cached_prompt_tokens,
        accepted_draft_tokens=message.usage.accepted_draft_tokens,
        draft_tokens=message.usage.draft_tokens,
        timing=timing(message.timing),
        logprobs=tuple(logprob(lp) for lp in message.logprobs),
        choices=tuple(completion_choice(choice) for choice in message.choices),
        tool_calls=tuple(_tool_call(call) for call in message.tool_calls),
    )


def completion_choice(message: pb.Completion) -> CompletionChoice:
    return CompletionChoice(
        index=message.index,
        text=message.text,
        token_ids=tuple(message.token_ids),
        finish_reason=_FINISH.get(message.finish_reason, FinishReason.UNSPECIFIED),
        logprobs=tuple(logprob(lp) for lp in message.logprobs),
        tool_calls=tuple(_tool_call(call) for call in message.tool_calls),
    )


def _chat_message(message: ChatMessage) -> pb.ChatMessage:
    chat = pb.ChatMessage(role=message.role, content=message.content)
    if message.tool_calls or message.tool_call_id or message.name:
        chat.tool.tool_calls.extend(
            pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in message.tool_calls
        )
        chat.tool.tool_call_id = message.tool_call_id
        chat.tool.name = message.name
    return chat


def _tool_call(message: pb.ToolCall) -> ToolCall:
    return ToolCall(message.id, message.name, message.arguments)


def timing(message: pb.Timing) -> Timing:
    return Timing(
        queued=_seconds(message.queued),
        time_to_first_token=(
            _seconds(message.time_to_first_token) if message.HasField("time_to_first_token") else None
        ),
        prefill=_seconds(message.prefill) if message.HasField("prefill") else None,
        total=_seconds(message.total),
        decode_tokens_per_second=message.decode_tokens_per_second,
        time_per_output_token=(
            _seconds(message.time_per_output_token) if message.HasField("time_per_output_token") else None
        ),
        paced=_seconds(message.paced) if message.HasField("paced") else None,
    )


def logprob(message: pb.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(
        token_id=message.token_id,
        token=message.token,
        logprob=message.logprob,
        top=tuple((t.token_id, t.token, t.logprob) for t in message.top_logprobs),
    )


def stream_event(message: pb.StreamGenerateResponse) -> StreamEvent:
    request_id = message.request_id
    kind = message.WhichOneof("event")
    if kind == "chunk":
        chunk = message.chunk
        return Chunk(
            request_id,
            chunk.text,
            tuple(chunk.token_ids),
            tuple(logprob(lp) for lp in chunk.logprobs),
            index=chunk.index,
            tool_calls=tuple(
                ToolCallDelta(delta.index, delta.id, delta.name, delta.arguments)
                for delta in chunk.tool_calls
            ),
        )
    if kind == "queued":
        return Queued(request_id, message.queued.position)
    if kind == "started":
        return Started(request_id, _seconds(message.started.queued), message.started.prompt_tokens)
    if kind == "completed":
        return Completed(request_id, generation(message.completed))
    if kind == "error":
        return Failed(request_id, TokenwireError.from_status(message.error))
    raise ValueError(f"unknown stream event {kind!r}")


def model_description(message: pb.ModelInfo) -> ModelDescription:
    return ModelDescription(
        name=message.name,
        context_length=message.context_length,
        vocab_size=message.vocab_size,
        has_chat_template=message.has_chat_template,
        is_default=message.is_default,
        max_batch_size=message.max_batch_size,
        format=message.format,
    )


def _duration(seconds: float) -> Duration:
    value = Duration()
    value.FromNanoseconds(round(seconds * 1e9))
    return value


def _seconds(value: Duration) -> float:
    return value.seconds + value.nanos / 1e9
