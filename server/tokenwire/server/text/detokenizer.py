"""Incremental detokenization: turn a growing list of token ids into text deltas.

Byte-level tokenizers split multi-byte UTF-8 characters across tokens, and some tokenizers
decode a token differently depending on its left neighbour (leading-space rules). Decoding each
token on its own would therefore split characters and lose spaces. Instead we decode a short
window of recent tokens twice, with and without the newest ones, and emit the difference only
when it does not end in an incomplete character (U+FFFD).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenwire.server.text.tokenizer import Tokenizer

REPLACEMENT_CHARACTER = "\ufffd"

# How many prompt tokens give the first generated tokens their left context.
_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    """Produces the text of generated tokens piece by piece, never splitting a UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        context = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._ids: list[int] = context
        # Tokens before `_prefix` are fully emitted and no longer needed for context;
        # tokens in [_prefix, _read) are emitted but kept as left context.
        self._prefix = 0
        self._read = len(context)

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text that became complete (may be empty)."""
        self._ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """Return whatever text is still held back (at the end of generation)."""
        return self._emit(final=True)

    def _emit(self, *, final: bool) -> str:
        decode = self._tokenizer.decode
        window = self._ids[self._prefix :]
        prefix_text = decode(self._ids[self._prefix : self._read])
        full_text = decode(window)
        if len(full_text) <= len(prefix_text) and not final:
            return ""
        if full_text.endswith(REPLACEMENT_CHARACTER) and not final:
            # The newest token ends inside a multi-byte character: wait for its remaining bytes.
            return ""
        delta = full_text[len(prefix_text) :]
        self._prefix = self._read
        self._read = len(self._ids)
        # Keep the list short: only the window from `_prefix` on is ever decoded again.
        if self._prefix > 64:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return delta
