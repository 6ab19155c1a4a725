"""Check a request against the model and the server's limits and resolve every default.

Every problem found is reported at once, each naming the field it concerns, so a client can fix
a request in one round trip. Fields are named as in RequestSpec; the API edge maps them to the
paths of its own messages.
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tokenwire.server.engine.errors import MAX_VIOLATIONS, FieldViolation, GenerationError, excerpt
from tokenwire.server.engine.types import MAX_COMPLETIONS, GenerationRequest, Priority, StopConditions
from tokenwire.server.models.runner import ModelInfo
from tokenwire.server.sampling.params import FormatKind, ResponseFormat, SamplingParams
from tokenwire.server.settings_schema import setting
from tokenwire.server.text.chat import ALLOWED_ROLES, ChatTurn
from tokenwire.server.text.tokenizer import Tokenizer, TooManyTokensError

MAX_TOP_LOGPROBS = 20
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
    priority: Priority | None = Priority.DEFAULT
    """None: a value this server does not know."""
    n: int | None = None
    """Completions to generate; None: one."""


ChatPromptIds = Callable[[Sequence[ChatTurn]], list[int]]
"""A model's conversation to prompt tokens, through its chat template (which the API edge owns).
Raises GenerationError naming `messages`, or one message, when the conversation cannot be made."""


class RequestValidator:
    """Validates requests for one model."""

    def __init__(
        self,
        info: ModelInfo,
        tokenizer: Tokenizer,
        chat: ChatPromptIds | None,
        limits: RequestLimits,
    ) -> None:
        """chat: the model's conversations to prompt tokens; None: it has no chat template."""
        self._info = info
        self._tokenizer = tokenizer
        self._chat = chat
        self._limits = limits

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
        if spec.priority is None:
            violations.append(FieldViolation("priority", "unknown value; use INTERACTIVE, DEFAULT or BATCH"))
        if spec.timeout is not None and not (math.isfinite(spec.timeout) and spec.timeout > 0):
            violations.append(FieldViolation("timeout", "must be a positive duration"))
        if spec.n is not None and not 1 <= spec.n <= MAX_COMPLETIONS:
            violations.append(FieldViolation("n", f"must be between 1 and {MAX_COMPLETIONS}, got {spec.n}"))
        if violations:
            raise GenerationError.invalid(*violations)

        prompt_ids = self._prompt_ids(spec)
        max_new_tokens = self._max_new_tokens(spec, len(prompt_ids))
        deadline = call_deadline
        if spec.timeout is not None:
            own = received_at + spec.timeout
            deadline = own if deadline is None else min(deadline, own)
        sampling = SamplingParams(
            temperature=self._info.default_temperature if spec.temperature is None else spec.temperature,
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
            model=self._info.name,
            prompt_ids=tuple(prompt_ids),
            sampling=sampling,
            stopping=StopConditions(max_new_tokens, tuple(spec.stop), spec.ignore_eos),
            received_at=received_at,
            logprobs=spec.logprobs,
            top_logprobs=spec.top_logprobs,
            deadline=deadline,
            response_format=spec.response_format,
            priority=spec.priority or Priority.DEFAULT,
            n=1 if spec.n is None else spec.n,
        )

    def _check_response_format(self, spec: RequestSpec) -> list[FieldViolation]:
        # Only bounds and syntax a client can fix at once; whether the format compiles is found
        # off the event loop, by the engine's format cache.
        response_format = spec.response_format
        if response_format is None:
            return []
        limits = self._limits
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

    def _check_logit_bias(self, spec: RequestSpec) -> list[FieldViolation]:
        entries = spec.logit_bias
        bound = self._limits.max_logit_bias_entries
        if len(entries) > bound:
            return [FieldViolation("logit_bias", f"{len(entries)} entries, more than {bound}")]
        vocab = self._info.vocab_size
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
        if len(request_id) > self._limits.max_request_id_length:
            return [
                FieldViolation("request_id", f"longer than {self._limits.max_request_id_length} characters")
            ]
        return []

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
        limits = self._limits
        max_chars = limits.prompt_chars(self._info.context_length)
        found: list[FieldViolation] = []
        if spec.prompt is not None:
            if not spec.prompt:
                found.append(FieldViolation("prompt", "must not be empty"))
            elif len(spec.prompt) > max_chars:
                found.append(FieldViolation("prompt", f"longer than {max_chars} characters"))
        elif spec.messages:
            if self._chat is None:
                found.append(
                    FieldViolation(
                        "messages",
                        f"model {self._info.name!r} has no chat template; send prompt or token_ids",
                    )
                )
            if len(spec.messages) > limits.max_messages:
                found.append(FieldViolation("messages", f"more than {limits.max_messages} messages"))
            for index, turn in enumerate(spec.messages[: limits.max_messages]):
                if turn.role not in ALLOWED_ROLES:
                    allowed = ", ".join(sorted(ALLOWED_ROLES))
                    found.append(
                        FieldViolation(
                            f"messages[{index}].role",
                            f"unknown role {excerpt(turn.role)!r}; use one of {allowed}",
                        )
                    )
                    if len(found) >= MAX_VIOLATIONS:
                        break
            total = sum(len(t.content) for t in spec.messages)
            if total > max_chars:
                found.append(FieldViolation("messages", f"longer than {max_chars} characters in all"))
        elif spec.token_ids is not None:
            if not spec.token_ids:
                found.append(FieldViolation("token_ids", "must not be empty"))
            if len(spec.token_ids) >= self._info.context_length:
                # Checked before the ids are looked at: the count alone says they cannot fit.
                found.append(
                    FieldViolation(
                        "token_ids",
                        f"{len(spec.token_ids)} tokens leave no room in the context of "
                        f"{self._info.context_length} tokens",
                    )
                )
                return found
            vocab = self._info.vocab_size
            bad = next((i for i, t in enumerate(spec.token_ids) if not 0 <= t < vocab), None)
            if bad is not None:
                found.append(
                    FieldViolation(
                        f"token_ids[{bad}]", f"token id {spec.token_ids[bad]} is outside [0, {vocab})"
                    )
                )
        return found

    def _check_stopping(self, spec: RequestSpec) -> list[FieldViolation]:
        limits = self._limits
        found: list[FieldViolation] = []
        if spec.max_new_tokens is not None and not 1 <= spec.max_new_tokens <= limits.max_new_tokens_cap:
            found.append(
                FieldViolation(
                    "max_new_tokens",
                    f"must be between 1 and {limits.max_new_tokens_cap}, got {spec.max_new_tokens}",
                )
            )
        if len(spec.stop) > limits.max_stop_strings:
            found.append(FieldViolation("stop", f"at most {limits.max_stop_strings} stop strings"))
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

    def _prompt_ids(self, spec: RequestSpec) -> list[int]:
        if spec.token_ids is not None:
            return list(spec.token_ids)
        if spec.messages:
            assert self._chat is not None
            return self._chat(spec.messages)
        assert spec.prompt is not None
        room = self._info.context_length - 1
        try:
            return self._tokenizer.encode_within(spec.prompt, room)
        except TooManyTokensError as error:
            raise GenerationError.invalid(
                FieldViolation(
                    "prompt",
                    f"at least {error.at_least} tokens leave no room in the context of "
                    f"{self._info.context_length} tokens",
                )
            ) from None

    def _max_new_tokens(self, spec: RequestSpec, prompt_tokens: int) -> int:
        context = self._info.context_length
        field = "prompt" if spec.prompt is not None else "messages" if spec.messages else "token_ids"
        if prompt_tokens == 0:
            raise GenerationError.invalid(FieldViolation(field, "tokenizes to nothing"))
        room = context - prompt_tokens
        if room < 1:
            raise GenerationError.invalid(
                FieldViolation(
                    field, f"{prompt_tokens} tokens leave no room in the context of {context} tokens"
                )
            )
        if spec.max_new_tokens is None:
            return min(self._limits.default_max_new_tokens, room)
        if spec.max_new_tokens > room:
            raise GenerationError.invalid(
                FieldViolation(
                    "max_new_tokens",
                    f"prompt ({prompt_tokens} tokens) + max_new_tokens ({spec.max_new_tokens}) exceeds the "
                    f"context length of {context} tokens",
                )
            )
        return spec.max_new_tokens


def _check_sampling(spec: RequestSpec) -> list[FieldViolation]:
    found: list[FieldViolation] = []
    if spec.temperature is not None and not (math.isfinite(spec.temperature) and spec.temperature >= 0):
        found.append(FieldViolation("temperature", "must be a finite number >= 0 (0 means greedy)"))
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
