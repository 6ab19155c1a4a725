"""The tokenizer a model was trained with, wrapped in the few operations the server needs."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer as HfTokenizer


class Tokenizer:
    """A Hugging Face `tokenizers` tokenizer loaded from a model directory's tokenizer.json."""

    def __init__(self, backend: HfTokenizer) -> None:
        self._backend = backend
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)
        # A twin that reads special-token markup as the characters it is made of; the setting
        # is per tokenizer, and flipping it on the shared one would race with other threads.
        self._as_text = HfTokenizer.from_str(backend.to_str())
        self._as_text.encode_special_tokens = True
        self.special_tokens: tuple[str, ...] = tuple(
            sorted(
                (added.content for added in backend.get_added_tokens_decoder().values() if added.special),
                key=len,
                reverse=True,
            )
        )
        """The text of every special (control) token, longest first."""

    @classmethod
    def from_file(cls, path: Path) -> Tokenizer:
        return cls(HfTokenizer.from_file(str(path)))

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def to_json(self) -> str:
        """The tokenizer.json text, for libraries that build their own view of the vocabulary."""
        return str(self._backend.to_str())

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        # Special-token markup inside the text (e.g. "<|im_start|>") is recognised, as in the
        # Hugging Face tokenizers, so rendered chat templates tokenize to the real control tokens.
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_as_text(self, text: str) -> list[int]:
        """Tokens of `text` read as plain text: "<|im_end|>" in it is characters, not a control token."""
        return list(self._as_text.encode(text, add_special_tokens=False).ids)

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        found = self._backend.token_to_id(token)
        return None if found is None else int(found)
