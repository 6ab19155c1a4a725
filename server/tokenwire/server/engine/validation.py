"""Check a request against the model and the server's limits and resolve every default.

Every problem found is reported at once, each naming the field it concerns, so a client can fix
a request in one round trip. Fields are named as in RequestSpec; the API edge maps them to the
paths of its own messages.
"""

from __future__ import annotations

import functools
import json
import math
import secrets
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import jsonschema

from tokenwire.server.engine.errors import MAX_VIOLATIONS, ErrorKind, FieldViolation, GenerationError, excerpt
from tokenwire.server.engine.types import MAX_COMPLETIONS, Caller, GenerationRequest, Priority, StopConditions
from tokenwire.server.models.runner import ModelInfo
from tokenwire.server.sampling.params import FormatKind, ResponseFormat, SamplingParams
from tokenwire.server.sampling.tool_grammar import tool_format
from tokenwire.server.settings_schema import setting
from tokenwire.server.text.chat import ALLOWED_ROLES, ChatTurn
from tokenwire.server.text.tokenizer import Tokenizer, TooManyTokensError
from tokenwire.server.text.tools import (
    MAX_TOOLS,
    NAME_PATTERN,
    ToolCallFormat,
    ToolCalling,
    ToolChoice,
    ToolChoiceMode,
    ToolDefinition,
)

MAX_TOP_LOGPROBS = 20
MAX_TEMPERATURE = 2.0
"""As OpenAI's API: beyond 2 the distribution is all but uniform."""
MAX_LOGIT_BIAS = 100.0
"""Largest bias, either way: as OpenAI's, enough to force a token (+100) or ban it (-100)."""
MAX_PRESENCE_OR_FREQUENCY_PENALTY = 2.0
PROMPT_CHARS_PER_TOKEN = 8
"""Characters per token of context that --max-prompt-chars allows by default: about twice what
text that fills a context holds, so only prompts that cannot fit are refused untokenized."""


@dataclass(frozen=True)
class RequestLimits:
    max_new_tokens_cap: int = setting(4096, "largest max_new_tokens a request may ask for", minimum=1)
    default_max_new_tokens: int = setting(256, "max_new_tokens when a request leaves it unset", minimum=1)
    max_stop_strings: int = setting(16, "most stop strings per request; more is INVALID_ARGUMENT", minimum=0)
    max_stop_string_length: int = 256
    max_request_id_length: int = 128
    max_prompt_chars: int | None = setting(
        None,
        "longest prompt in characters (all chat messages together); longer is INVALID_ARGUMENT before "
        f"anything is tokenized (default: {PROMPT_CHARS_PER_TOKEN} per token of the model's context)",
        minimum=1,
    )
    """Bound on raw prompt text, checked before tokenizing so huge inputs cost nothing."""
    max_messages: int = setting(
        1024, "most chat messages in one request; more is INVALID_ARGUMENT", minimum=1
    )
    max_embedding_inputs: int = setting(
        256, "most inputs in one embedding request; more is INVALID_ARGUMENT", minimum=1
    )
    max_format_chars: int = 65_536
    """Longest JSON Schema or grammar text."""
    max_regex_chars: int = 4096
    max_choices: int = 256
    max_choice_chars: int = 1024
    max_logit_bias_entries: int = 300
    """Most tokens one request may bias (OpenAI's bound)."""
    control_tokens_in_messages: bool = setting(
        False,
        "read control-token markup such as <|im_start|> in chat message content as control tokens, as "
        "Hugging Face does: only for callers trusted to write any turn (off: it is plain text)",
    )

    def prompt_chars(self, context_length: int) -> int:
        """Longest prompt, in characters, for a model with this context."""
        if self.max_prompt_chars is not None:
            return self.max_prompt_chars
        return PROMPT_CHARS_PER_TOKEN * context_length


@dataclass(frozen=True)
class RequestSpec:
    """A request as the client sent it, before validation. None means "not set"."""

    request_id: str = ""
    model: str = ""
    prompt: str | None = None
    messages: tuple[ChatTurn, ...] = ()
    token_ids: tuple[int, ...] | None = None
    temperature: float | None = None
    top_k: int = 0
    top_p: float | None = None
    min_p: float = 0.0
    repetition_penalty: float | None = None
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs; ids must be unique."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_new_tokens: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    timeout: float | None = None
    """Seconds, from the moment the request was received."""
    response_format: ResponseFormat | None = None
    priority: Priority | None = None
    """None: not set, which is DEFAULT (an edge refuses a value this server does not know)."""
    n: int | None = None
    """Completions to generate; None: one."""
    tools: tuple[ToolDefinition, ...] = ()
    """Functions the model may call (a conversation only)."""
    tool_choice: ToolChoice | None = None
    """None: AUTO when tools are offered."""
    parallel_tool_calls: bool | None = None
    """None: calls in parallel are allowed."""
    adapter: str = ""
    """The LoRA adapter to run with; empty: the base model."""


# The size bounds of a request, worded once: the edges check them on the decoded request before
# converting it (api/request_bounds.py), and the validator again on the converted one. Fields are
# named as in RequestSpec; each edge renames them into its own terms.


def count_violation(field: str, count: int, bound: int, things: str) -> FieldViolation | None:
    """`count` entries where at most `bound` are allowed."""
    if count <= bound:
        return None
    return FieldViolation(field, f"{count} {things}, more than {bound}")


def role_violation(index: int, role: str) -> FieldViolation | None:
    if role in ALLOWED_ROLES:
        return None
    allowed = ", ".join(sorted(ALLOWED_ROLES))
    return FieldViolation(f"messages[{index}].role", f"unknown role {excerpt(role)!r}; use one of {allowed}")


def prompt_length_violation(
    field: str, length: int, limits: RequestLimits, context_length: int, *, in_all: bool = False
) -> FieldViolation | None:
    """A prompt (or all of a conversation's messages) longer than the characters allowed."""
    max_chars = limits.prompt_chars(context_length)
    if length <= max_chars:
        return None
    where = " in all" if in_all else ""
    origin = (
        "--max-prompt-chars"
        if limits.max_prompt_chars is not None
        else f"--max-prompt-chars, by default the context length times {PROMPT_CHARS_PER_TOKEN}"
    )
    return FieldViolation(field, f"{length} characters{where}, more than {max_chars} ({origin})")


def context_violation(
    field: str, tokens: int, context_length: int, *, at_least: bool = False
) -> FieldViolation:
    """A prompt of `tokens` tokens that leaves no room to generate."""
    count = f"at least {tokens}" if at_least else str(tokens)
    return FieldViolation(field, f"{count} tokens leave no room in the context of {context_length} tokens")


REQUEST_ID_CHARACTERS = "printable ASCII other than space (! to ~)"


def identifier_violation(field: str, value: str, max_length: int) -> FieldViolation | None:
    """An identifier's bounds (request_id, idempotency_key): its length first, its characters
    only once the length is known to be small."""
    if len(value) > max_length:
        return FieldViolation(field, f"{len(value)} characters, more than {max_length}")
    if not (value.isascii() and all("!" <= c <= "~" for c in value)):
        return FieldViolation(field, f"{excerpt(ascii(value))}: use only {REQUEST_ID_CHARACTERS}")
    return None


ChatPromptIds = Callable[[Sequence[ChatTurn], Sequence[ToolDefinition]], list[int]]
"""A model's conversation (and the tools it renders) to prompt tokens, through its chat template
(which the API edge owns). Raises GenerationError naming `messages`, or one message, when the
conversation cannot be made."""


@dataclass(frozen=True, eq=False)
class RequestValidator:
    """Validates requests for one model."""

    info: ModelInfo
    tokenizer: Tokenizer
    chat: ChatPromptIds | None
    """The model's conversations to prompt tokens; None: it has no chat template."""
    limits: RequestLimits
    tool_format: ToolCallFormat = ToolCallFormat.JSON
    """How the model writes tool calls (its chat template's format)."""
    adapters: AbstractSet[str] = frozenset()
    """The LoRA adapters served on the model (a live set: loads and unloads change it)."""

    @functools.cached_property
    def _mistral_marker(self) -> int | None:
        """The [TOOL_CALLS] token a Mistral-format model opens its tool calls with; None for other
        formats."""
        if self.tool_format is not ToolCallFormat.MISTRAL:
            return None
        return self.tokenizer.token_to_id("[TOOL_CALLS]")

    def check_adapter(self, spec: RequestSpec, caller: Caller) -> None:
        """Refuse an adapter this model does not serve (NOT_FOUND) or the caller was not given
        (PERMISSION_DENIED), naming the field; before any of the request's other work."""
        name = spec.adapter
        if not name:
            return
        if name not in self.adapters:
            served = ", ".join(sorted(self.adapters)) or "none"
            raise GenerationError(
                ErrorKind.NOT_FOUND,
                f"adapter {excerpt(name)!r} is not served on model {self.info.name} (served: {served})",
                violations=(FieldViolation("adapter", "no adapter of that name is served on this model"),),
                reason="ADAPTER_NOT_FOUND",
            )
        if caller.adapters is not None and name not in caller.adapters:
            raise GenerationError(
                ErrorKind.PERMISSION_DENIED,
                f"caller {caller.name} may not use adapter {name!r}",
                violations=(FieldViolation("adapter", "not among the adapters this caller is given"),),
                reason="ADAPTER_NOT_ALLOWED",
            )

    def tool_calling(self, spec: RequestSpec) -> ToolCalling | None:
        """How the output of a valid `spec` is read for tool calls; None: it offers none (or
        chose none), and its output is all text."""
        choice = spec.tool_choice or ToolChoice()
        if not spec.tools or choice.mode is ToolChoiceMode.NONE:
            return None
        parallel = True if spec.parallel_tool_calls is None else spec.parallel_tool_calls
        return ToolCalling(self.tool_format, spec.tools, choice, parallel)

    def validate(
        self,
        spec: RequestSpec,
        *,
        received_at: float,
        call_deadline: float | None = None,
        require_request_id: bool = False,
    ) -> GenerationRequest:
        violations: list[FieldViolation] = []
        violations += self._check_request_id(spec.request_id, required=require_request_id)
        violations += self._check_input(spec)
        violations += _check_sampling(spec)
        violations += self._check_logit_bias(spec)
        violations += self._check_stopping(spec)
        violations += _check_logprobs(spec)
        violations += self._check_response_format(spec)
        violations += self._check_tools(spec)
        if spec.timeout is not None and not (math.isfinite(spec.timeout) and spec.timeout > 0):
            violations.append(FieldViolation("timeout", "must be a positive duration"))
        if spec.n is not None and not 1 <= spec.n <= MAX_COMPLETIONS:
            violations.append(FieldViolation("n", f"must be between 1 and {MAX_COMPLETIONS}, got {spec.n}"))
        if violations:
            raise GenerationError.invalid(*violations)

        calling = self.tool_calling(spec)
        response_format = spec.response_format
        if calling is not None and calling.forced:
            response_format = tool_format(calling, mistral_marker_id=self._mistral_marker)
        prompt_ids = self._prompt_ids(spec, () if calling is None else calling.tools)
        max_new_tokens = self._max_new_tokens(spec, len(prompt_ids))
        deadline = call_deadline
        if spec.timeout is not None:
            own = received_at + spec.timeout
            deadline = own if deadline is None else min(deadline, own)
        sampling = SamplingParams(
            temperature=self.info.default_temperature if spec.temperature is None else spec.temperature,
            top_k=spec.top_k,
            top_p=1.0 if spec.top_p is None else spec.top_p,
            min_p=spec.min_p,
            repetition_penalty=1.0 if spec.repetition_penalty is None else spec.repetition_penalty,
            seed=secrets.randbits(63) if spec.seed is None else spec.seed,
            logit_bias=tuple(sorted((t, b) for t, b in spec.logit_bias if b != 0.0)),
            presence_penalty=spec.presence_penalty,
            frequency_penalty=spec.frequency_penalty,
        )
        return GenerationRequest(
            request_id=spec.request_id,
            model=self.info.name,
            prompt_ids=tuple(prompt_ids),
            sampling=sampling,
            stopping=StopConditions(max_new_tokens, tuple(spec.stop), spec.ignore_eos),
            received_at=received_at,
            logprobs=spec.logprobs,
            top_logprobs=spec.top_logprobs,
            deadline=deadline,
            response_format=response_format,
            priority=spec.priority or Priority.DEFAULT,
            n=1 if spec.n is None else spec.n,
            adapter=spec.adapter,
        )

    def _check_response_format(self, spec: RequestSpec) -> list[FieldViolation]:
        # Only bounds and syntax a client can fix at once; whether the format compiles is found
        # off the event loop, by the engine's format cache.
        response_format = spec.response_format
        if response_format is None:
            return []
        limits = self.limits
        field = f"response_format.{response_format.kind.value}"
        found: list[FieldViolation] = []
        if spec.ignore_eos:
            found.append(
                FieldViolation(
                    "ignore_eos", "cannot be combined with response_format: a complete match ends the output"
                )
            )
        if response_format.kind is FormatKind.CHOICE:
            choices = response_format.choices
            if not 1 <= len(choices) <= limits.max_choices:
                found.append(
                    FieldViolation(f"{field}.options", f"must list 1 to {limits.max_choices} strings")
                )
            bad = next((i for i, c in enumerate(choices) if not 0 < len(c) <= limits.max_choice_chars), None)
            if bad is not None:
                found.append(
                    FieldViolation(
                        f"{field}.options[{bad}]", f"must be 1 to {limits.max_choice_chars} characters"
                    )
                )
            return found
        regex = response_format.kind is FormatKind.REGEX
        bound = limits.max_regex_chars if regex else limits.max_format_chars
        if not response_format.source:
            found.append(FieldViolation(field, "must not be empty"))
        elif len(response_format.source) > bound:
            found.append(FieldViolation(field, f"longer than {bound} characters"))
        elif response_format.kind is FormatKind.JSON_SCHEMA:
            try:
                schema = json.loads(response_format.source)
            except ValueError as error:
                found.append(FieldViolation(field, f"not JSON: {error}"))
            else:
                if not isinstance(schema, dict | bool):
                    found.append(FieldViolation(field, "must be a JSON object (or true/false)"))
        return found

    def _check_tools(self, spec: RequestSpec) -> list[FieldViolation]:
        # A tool's schema is bounded as a response format's is: it becomes one when a call is forced.
        bound = self.limits.max_format_chars
        too_many = count_violation("tools", len(spec.tools), MAX_TOOLS, "tools")
        if too_many is not None:
            return [too_many]
        found: list[FieldViolation] = []
        names: set[str] = set()
        for index, tool in enumerate(spec.tools):
            where = f"tools[{index}]"
            if not NAME_PATTERN.fullmatch(tool.name):
                found.append(
                    FieldViolation(
                        f"{where}.name",
                        f"{excerpt(tool.name)!r} is not a tool name: 1 to 64 letters, digits, '_' or '-'",
                    )
                )
            elif tool.name in names:
                found.append(FieldViolation(f"{where}.name", f"{tool.name!r} names another tool too"))
            names.add(tool.name)
            if len(tool.description) > bound:
                found.append(FieldViolation(f"{where}.description", f"longer than {bound} characters"))
            found += _present(_schema_violation(f"{where}.parameters", tool.parameters, bound))
            if len(found) >= MAX_VIOLATIONS:
                return found
        choice = spec.tool_choice or ToolChoice()
        forced = choice.mode in (ToolChoiceMode.REQUIRED, ToolChoiceMode.NAMED)
        if forced and not spec.tools:
            found.append(FieldViolation("tool_choice", f"{choice.mode.value} needs tools to call"))
        elif choice.mode is ToolChoiceMode.NAMED and choice.name not in names:
            found.append(
                FieldViolation(
                    "tool_choice", f"names {excerpt(choice.name)!r}, which is not one of the tools"
                )
            )
        if forced and spec.tools and spec.response_format is not None:
            found.append(
                FieldViolation("response_format", "cannot be combined with a tool_choice that forces a call")
            )
        if forced and spec.tools and spec.ignore_eos:
            found.append(
                FieldViolation("ignore_eos", "cannot be combined with a tool_choice that forces a call")
            )
        if spec.tools and not spec.messages:
            found.append(FieldViolation("tools", "need messages: the model's chat template renders them"))
        for index, turn in enumerate(spec.messages[: self.limits.max_messages]):
            if turn.tool_calls and turn.role != "assistant":
                found.append(
                    FieldViolation(f"messages[{index}].tool_calls", "only an assistant message makes calls")
                )
            for number, call in enumerate(turn.tool_calls):
                if not NAME_PATTERN.fullmatch(call.name):
                    found.append(
                        FieldViolation(
                            f"messages[{index}].tool_calls[{number}].name",
                            f"{excerpt(call.name)!r} is not a tool name",
                        )
                    )
            if len(found) >= MAX_VIOLATIONS:
                break
        return found

    def _check_logit_bias(self, spec: RequestSpec) -> list[FieldViolation]:
        entries = spec.logit_bias
        bound = self.limits.max_logit_bias_entries
        too_many = count_violation("logit_bias", len(entries), bound, "entries")
        if too_many is not None:
            return [too_many]
        vocab = self.info.vocab_size
        found: list[FieldViolation] = []
        listed: set[int] = set()
        for token_id, bias in sorted(entries, key=lambda entry: entry[0]):
            field = f"logit_bias[{token_id}]"
            if not 0 <= token_id < vocab:
                found.append(FieldViolation(field, f"token id {token_id} is outside [0, {vocab})"))
            elif token_id in listed:
                found.append(FieldViolation(field, "token id listed more than once"))
            elif not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                found.append(
                    FieldViolation(field, f"bias {bias} is outside [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
                )
            listed.add(token_id)
            if len(found) >= MAX_VIOLATIONS:
                break
        return found

    def _check_request_id(self, request_id: str, *, required: bool) -> list[FieldViolation]:
        if required and not request_id:
            return [
                FieldViolation(
                    "request_id", "required for a request on a stream: choose an id unique in the stream"
                )
            ]
        found = identifier_violation("request_id", request_id, self.limits.max_request_id_length)
        return [] if found is None else [found]

    def _check_input(self, spec: RequestSpec) -> list[FieldViolation]:
        given = [
            name
            for name, present in (
                ("prompt", spec.prompt is not None),
                ("messages", bool(spec.messages)),
                ("token_ids", spec.token_ids is not None),
            )
            if present
        ]
        if not given:
            return [FieldViolation("prompt", "exactly one of prompt, messages or token_ids is required")]
        if len(given) > 1:
            return [
                FieldViolation(name, f"only one input may be set, got {' and '.join(given)}", presence=True)
                for name in given[1:]
            ]
        limits = self.limits
        context = self.info.context_length
        found: list[FieldViolation] = []
        if spec.prompt is not None:
            if not spec.prompt:
                found.append(FieldViolation("prompt", "must not be empty"))
            else:
                found += _present(prompt_length_violation("prompt", len(spec.prompt), limits, context))
        elif spec.messages:
            if self.chat is None:
                found.append(
                    FieldViolation(
                        "messages",
                        f"model {self.info.name!r} has no chat template; send prompt or token_ids",
                    )
                )
            found += _present(
                count_violation("messages", len(spec.messages), limits.max_messages, "messages")
            )
            for index, turn in enumerate(spec.messages[: limits.max_messages]):
                found += _present(role_violation(index, turn.role))
                if len(found) >= MAX_VIOLATIONS:
                    break
            total = sum(len(t.content) for t in spec.messages)
            found += _present(prompt_length_violation("messages", total, limits, context, in_all=True))
        elif spec.token_ids is not None:
            if not spec.token_ids:
                found.append(FieldViolation("token_ids", "must not be empty"))
            if len(spec.token_ids) >= context:
                # Checked before the ids are looked at: the count alone says they cannot fit.
                found.append(context_violation("token_ids", len(spec.token_ids), context))
                return found
            vocab = self.info.vocab_size
            bad = next((i for i, t in enumerate(spec.token_ids) if not 0 <= t < vocab), None)
            if bad is not None:
                found.append(
                    FieldViolation(
                        f"token_ids[{bad}]", f"token id {spec.token_ids[bad]} is outside [0, {vocab})"
                    )
                )
        return found

    def _check_stopping(self, spec: RequestSpec) -> list[FieldViolation]:
        limits = self.limits
        found: list[FieldViolation] = []
        if spec.max_new_tokens is not None and not 1 <= spec.max_new_tokens <= limits.max_new_tokens_cap:
            found.append(
                FieldViolation(
                    "max_new_tokens",
                    f"must be between 1 and {limits.max_new_tokens_cap}, got {spec.max_new_tokens}",
                )
            )
        too_many = count_violation("stop", len(spec.stop), limits.max_stop_strings, "stop strings")
        if too_many is not None:
            found.append(too_many)
            return found
        for index, stop in enumerate(spec.stop[: limits.max_stop_strings]):
            if not stop:
                found.append(FieldViolation(f"stop[{index}]", "must not be empty"))
            elif len(stop) > limits.max_stop_string_length:
                found.append(
                    FieldViolation(
                        f"stop[{index}]", f"longer than {limits.max_stop_string_length} characters"
                    )
                )
        return found

    def _prompt_ids(self, spec: RequestSpec, tools: Sequence[ToolDefinition]) -> list[int]:
        if spec.token_ids is not None:
            return list(spec.token_ids)
        if spec.messages:
            assert self.chat is not None
            return self.chat(spec.messages, tools)
        assert spec.prompt is not None
        room = self.info.context_length - 1
        try:
            return self.tokenizer.encode_within(spec.prompt, room)
        except TooManyTokensError as error:
            raise GenerationError.invalid(
                context_violation("prompt", error.at_least, self.info.context_length, at_least=True)
            ) from None

    def _max_new_tokens(self, spec: RequestSpec, prompt_tokens: int) -> int:
        context = self.info.context_length
        field = "prompt" if spec.prompt is not None else "messages" if spec.messages else "token_ids"
        if prompt_tokens == 0:
            raise GenerationError.invalid(FieldViolation(field, "tokenizes to nothing"))
        room = context - prompt_tokens
        if room < 1:
            raise GenerationError.invalid(context_violation(field, prompt_tokens, context))
        if spec.max_new_tokens is None:
            return min(self.limits.default_max_new_tokens, room)
        if spec.max_new_tokens > room:
            raise GenerationError.invalid(
                FieldViolation(
                    "max_new_tokens",
                    f"prompt ({prompt_tokens} tokens) + max_new_tokens ({spec.max_new_tokens}) exceeds the "
                    f"context length of {context} tokens",
                )
            )
        return spec.max_new_tokens


def _schema_violation(field: str, source: str, bound: int) -> FieldViolation | None:
    """A JSON Schema's text: within the bound, an object, and a schema."""
    if len(source) > bound:
        return FieldViolation(field, f"longer than {bound} characters")
    try:
        schema = json.loads(source)
    except (ValueError, RecursionError) as error:
        return FieldViolation(field, f"not JSON: {excerpt(str(error), 120)}")
    if not isinstance(schema, dict):
        return FieldViolation(field, "must be a JSON Schema object")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.exceptions.SchemaError as error:
        return FieldViolation(field, f"not a JSON Schema: {excerpt(error.message, 120)}")
    except RecursionError:
        return FieldViolation(field, "nested too deeply")
    return None


def _present(violation: FieldViolation | None) -> list[FieldViolation]:
    return [] if violation is None else [violation]


def _check_sampling(spec: RequestSpec) -> list[FieldViolation]:
    found: list[FieldViolation] = []
    temperature = spec.temperature
    if temperature is not None and not (math.isfinite(temperature) and 0 <= temperature <= MAX_TEMPERATURE):
        found.append(FieldViolation("temperature", f"must be in [0, {MAX_TEMPERATURE:g}] (0 means greedy)"))
    if spec.top_k < 0:
        found.append(FieldViolation("top_k", "must be >= 0 (0 disables top-k)"))
    if spec.top_p is not None and not (0 < spec.top_p <= 1):
        found.append(FieldViolation("top_p", "must be in (0, 1]"))
    if not (0 <= spec.min_p <= 1):
        found.append(FieldViolation("min_p", "must be in [0, 1]"))
    penalty = spec.repetition_penalty
    if penalty is not None and not (math.isfinite(penalty) and penalty > 0):
        found.append(FieldViolation("repetition_penalty", "must be a finite number > 0"))
    bound = MAX_PRESENCE_OR_FREQUENCY_PENALTY
    penalties = (("presence_penalty", spec.presence_penalty), ("frequency_penalty", spec.frequency_penalty))
    for name, value in penalties:
        if not (math.isfinite(value) and -bound <= value <= bound):
            found.append(FieldViolation(name, f"must be in [-{bound:g}, {bound:g}], got {value}"))
    return found


def _check_logprobs(spec: RequestSpec) -> list[FieldViolation]:
    if not 0 <= spec.top_logprobs <= MAX_TOP_LOGPROBS:
        return [FieldViolation("top_logprobs", f"must be between 0 and {MAX_TOP_LOGPROBS}")]
    if spec.top_logprobs and not spec.logprobs:
        return [FieldViolation("top_logprobs", "needs logprobs to be true")]
    return []
