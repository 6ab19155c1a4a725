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

    @classmethod
    def from_file(cls, path: Path) -> Tokenizer:
        return cls(HfTokenizer.from_file(str(path)))

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        # Special-token markup inside the text (e.g. "<|im_start|>") is recognised, as in the
        # Hugging Face tokenizers, so rendered chat templates tokenize to the real control tokens.
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        found = self._backend.token_to_id(token)
        return None if found is None else int(found)

    def id_to_token(self, token_id: int) -> str | None:
        found = self._backend.id_to_token(token_id)
        return None if found is None else str(found)
