"""Token masks that keep a generation inside a response format: a JSON Schema, a regular
expression, a choice among strings or a Lark grammar.

Built on llguidance, chosen by measurement (BENCHMARKS.md, "Structured output"): on this
vocabulary it compiled every schema in about a millisecond, enforced the most JSON Schema
features, needs no deep-learning framework, and computes a whole batch's masks in one call that
releases the GIL. Its parser works under fuel limits, so a grammar too costly for one step fails
that step instead of stalling the engine.

A format is compiled once into a template matcher (`CompiledFormat`, cached by the caller); each
sequence then gets its own cheap copy (`TokenConstraint`). Per step, `apply_masks` computes the
allowed tokens of every constrained row together and pushes disallowed logits to the lowest
float, so greedy, temperature, top-k, top-p and min-p all choose among allowed tokens only.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import llguidance
import llguidance.numpy
import numpy as np

from tokenwire.server.sampling.params import FormatKind, ResponseFormat

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# Added to a disallowed token's logit: the lowest float32, so the token's probability is exactly
# 0 after the softmax whatever the temperature, and no inf - inf can turn a row into NaN.
_DISALLOWED = np.float32(np.finfo(np.float32).max)


# One layout for JSON output: single spaces after separators and no other whitespace, so a model
# cannot spend its tokens on blank space. A schema may choose its own through "x-guidance".
_JSON_LAYOUT: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class FormatError(ValueError):
    """The format cannot be used: the library's reason, short enough for an error detail."""


class CompiledFormat:
    """A checked format, ready to hand a fresh matcher to each sequence that uses it."""

    def __init__(self, template: llguidance.LLMatcher) -> None:
        self._template = template

    def constraint(self) -> TokenConstraint:
        return TokenConstraint(self._template.deep_copy())


class TokenConstraint:
    """One sequence's position in its format. Used by the engine thread only."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    @property
    def matcher(self) -> llguidance.LLMatcher:
        return self._matcher

    def advance(self, token_id: int) -> None:
        """Move past a chosen token (always one the mask allowed)."""
        self._matcher.consume_token(token_id)

    @property
    def error(self) -> str | None:
        """Why the matcher gave up (a step ran out of fuel), or None while it is healthy."""
        return _short(self._matcher.get_error()) if self._matcher.is_error() else None


class FormatCompiler:
    """Compiles formats for one model's vocabulary. `compile` is slow by nature: call it off the
    event loop and off the engine thread."""

    def __init__(self, tokenizer_json: str, *, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self._tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=sorted(eos_token_ids)
        )
        # Errors stay short and never echo parser state into logs or responses.
        self._limits = llguidance.LLParserLimits(verbose_errors=False)
        self.vocab_size = vocab_size

    def compile(self, response_format: ResponseFormat) -> CompiledFormat:
        grammar = _grammar(response_format)
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=self._limits)
        if matcher.is_error():
            raise FormatError(_short(matcher.get_error()))
        return CompiledFormat(matcher)


class MaskWorkspace:
    """Reusable bitmask buffer and worker pool for one engine's masks."""

    def __init__(self, vocab_size: int, rows: int) -> None:
        self._words = (vocab_size + 31) // 32
        self._bitmask = np.zeros((rows, self._words), dtype=np.int32)
        self._executor = llguidance.LLExecutor()

    def apply(self, logits: np.ndarray, rows: Sequence[int], constraints: Sequence[TokenConstraint]) -> None:
        """Mask `logits` ([n, vocab], modified in place) so row rows[i] allows only what
        constraints[i] accepts next."""
        count = len(rows)
        if count > self._bitmask.shape[0]:
            self._bitmask = np.zeros((count, self._words), dtype=np.int32)
        bitmask = self._bitmask[:count]
        llguidance.numpy.fill_next_token_bitmask_par(
            self._executor, [(c.matcher, i) for i, c in enumerate(constraints)], bitmask
        )
        vocab = logits.shape[1]
        allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, count=vocab, bitorder="little")
        penalty = (allowed.astype(np.float32) - np.float32(1.0)) * _DISALLOWED
        if list(rows) == list(range(count)) and count == logits.shape[0]:
            logits += penalty
        else:
            logits[list(rows)] += penalty


def _grammar(response_format: ResponseFormat) -> str:
    kind = response_format.kind
    try:
        if kind is FormatKind.JSON_SCHEMA:
            return str(
                llguidance.LLMatcher.grammar_from_json_schema(response_format.source, defaults=_JSON_LAYOUT)
            )
        if kind is FormatKind.REGEX:
            return str(llguidance.LLMatcher.grammar_from_regex(response_format.source))
        if kind is FormatKind.CHOICE:
            # JSON string literals are valid Lark literals, escapes included.
            alternatives = " | ".join(json.dumps(choice) for choice in response_format.choices)
            return str(llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}"))
        return str(llguidance.LLMatcher.grammar_from_lark(response_format.source))
    except ValueError as error:
        raise FormatError(_short(str(error))) from error


def _short(message: str) -> str:
    """A library message on one line and bounded: enough to fix the input by."""
    flat = " ".join(message.split()) or "rejected"
    return flat if len(flat) <= 300 else flat[:297] + "..."
