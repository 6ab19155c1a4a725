"""Typed values of the client API: what you send and what comes back. No protobuf here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum


class FinishReason(Enum):
    LENGTH = "length"
    EOS = "eos"
    STOP = "stop"
    CANCELLED = "cancelled"
    TOOL_CALLS = "tool_calls"
    """The output ended by itself holding tool calls (Generation.tool_calls)."""
    UNSPECIFIED = "unspecified"


class Priority(Enum):
    """How urgently a request wants a slot (GenerateRequest.priority)."""

    INTERACTIVE = "interactive"
    DEFAULT = "default"
    BATCH = "batch"


@dataclass(frozen=True)
class ToolCall:
    """A call of a tool: one the model made, or one made earlier in a conversation."""

    id: str
    name: str
    arguments: str
    """The arguments as JSON text."""


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    """An assistant message's calls."""
    tool_call_id: str = ""
    """A "tool" message: the call it answers."""
    name: str = ""
    """A "tool" message: the tool that answered."""


@dataclass(frozen=True)
class Tool:
    """A function the model may call (GenerateRequest.tools)."""

    name: str
    description: str = ""
    parameters: str = ""
    """A JSON Schema of its arguments, as JSON text; empty: any object."""


@dataclass(frozen=True)
class ToolChoice:
    """auto, none or required (`mode`), or one named tool (`name`, exactly one call of it)."""

    mode: str = "auto"
    name: str = ""


@dataclass(frozen=True)
class Sampling:
    """How tokens are picked. None leaves a field to the server's documented default."""

    temperature: float | None = None
    top_k: int = 0
    top_p: float | None = None
    min_p: float = 0.0
    repetition_penalty: float | None = None
    seed: int | None = None
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    """Token id -> bias in [-100, 100] added to its logit: +100 forces it, -100 bans it."""
    presence_penalty: float = 0.0
    """In [-2, 2]: subtracted once from each token already generated (not the prompt)."""
    frequency_penalty: float = 0.0
    """In [-2, 2]: subtracted from each generated token once per time it was generated."""


@dataclass(frozen=True)
class Stopping:
    max_new_tokens: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True)
class ResponseFormat:
    """What the output must match; set exactly one field. See GenerateRequest.response_format."""

    json_schema: str | None = None
    """A JSON Schema as JSON text (json.dumps a dict)."""
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    """A Lark grammar whose rule `start` is the whole output."""


@dataclass(frozen=True)
class GenerateOptions:
    """Everything about a generation besides its input."""

    model: str = ""
    sampling: Sampling = field(default_factory=Sampling)
    stopping: Stopping = field(default_factory=Stopping)
    logprobs: bool = False
    top_logprobs: int = 0
    timeout: float | None = None
    """Per-request deadline in seconds, enforced by the server through queue and generation."""
    response_format: ResponseFormat | None = None
    priority: Priority = Priority.DEFAULT
    n: int = 1
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice | None = None
    """None: auto when tools are given."""
    parallel_tool_calls: bool | None = None
    """Completions to generate from the prompt, 1 to 16 (prefilled once). With a seed, completion i
    samples with seed + i. With n > 1 they come back in Generation.choices, and each Chunk names
    its completion by index."""


@dataclass(frozen=True)
class Timing:
    """Seconds, measured by the server from the moment it received the request."""

    queued: float
    time_to_first_token: float | None
    prefill: float | None
    total: float
    decode_tokens_per_second: float
    time_per_output_token: float | None
    paced: float | None = None
    """Before the first token, time the prompt waited while other requests ran (after `queued`)."""


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()


@dataclass(frozen=True)
class CompletionChoice:
    """One of the completions of a generation that asked for n > 1."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    logprobs: tuple[TokenLogprob, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class Generation:
    request_id: str
    model: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    timing: Timing
    logprobs: tuple[TokenLogprob, ...] = ()
    cached_prompt_tokens: int = 0
    """Prompt tokens the server took from its prefix cache instead of processing them."""
    accepted_draft_tokens: int = 0
    """Of completion_tokens, speculative drafts the model accepted (0 without speculation)."""
    draft_tokens: int = 0
    """Speculative draft tokens the server verified for this request, accepted or not."""
    choices: tuple[CompletionChoice, ...] = ()
    """Every completion, in index order, when the request asked for n > 1 (text, token_ids and
    logprobs above are then empty, and completion_tokens counts all of them); empty for n = 1."""
    tool_calls: tuple[ToolCall, ...] = ()
    """The calls the output holds when the request offered tools (text is then the rest)."""


@dataclass(frozen=True)
class ModelDescription:
    name: str
    context_length: int
    vocab_size: int
    has_chat_template: bool
    is_default: bool
    max_batch_size: int
    format: str


@dataclass(frozen=True)
class Queued:
    request_id: str
    position: int


@dataclass(frozen=True)
class Started:
    request_id: str
    queued: float
    prompt_tokens: int


@dataclass(frozen=True)
class Chunk:
    request_id: str
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    index: int = 0
    """Which completion these tokens belong to (0 unless the request asked for n > 1)."""
    tool_calls: tuple[ToolCallDelta, ...] = ()
    """Pieces of the tool calls the output holds; `text` is then what is not a call."""


@dataclass(frozen=True)
class ToolCallDelta:
    """The next piece of a streamed call: its index, its id and name on its first piece, then
    pieces of its arguments' JSON text."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass(frozen=True)
class Completed:
    """The last event of a successful generation; text and tokens came in the chunks (with n > 1,
    generation.choices carries each completion's index and finish reason only)."""

    request_id: str
    generation: Generation


@dataclass(frozen=True)
class Failed:
    """The last event of a failed generation."""

    request_id: str
    error: Exception


StreamEvent = Queued | Started | Chunk | Completed | Failed
