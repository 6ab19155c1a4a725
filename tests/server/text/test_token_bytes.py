"""Each token's own bytes, as OpenAI's logprobs report them: a byte-level token holding part of a
multi-byte character has that part, so a generation's tokens' bytes joined are its text."""

from __future__ import annotations

from tokenizers import Tokenizer as HfTokenizer
from tokenizers import decoders, models

from tokenwire.server.model_tools.tiny_tokenizer import build_byte_level_tokenizer
from tokenwire.server.text.tokenizer import Tokenizer


def test_byte_level_tokens_have_their_own_bytes_and_join_to_the_text() -> None:
    tokenizer = Tokenizer(build_byte_level_tokenizer(600))
    text = "Déjà vu, 東京 😀 <|im_end|>"
    ids = tokenizer.encode(text)
    pieces = [tokenizer.token_bytes(token_id) for token_id in ids]
    assert b"".join(pieces).decode() == text
    partial = [
        piece for piece, token_id in zip(pieces, ids, strict=True) if tokenizer.decode([token_id]) == "\ufffd"
    ]
    assert partial, "some token holds part of a character"
    assert all(piece and not _is_utf8(piece) for piece in partial)


def test_byte_fallback_tokens_are_the_byte_they_name() -> None:
    vocab = {"<unk>": 0, "<0xE6>": 1, "<0x9D>": 2, "<0xB1>": 3, "\u2581hi": 4}
    backend = HfTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tokenizer = Tokenizer(backend)
    assert [tokenizer.token_bytes(i) for i in (1, 2, 3, 4)] == [b"\xe6", b"\x9d", b"\xb1", b" hi"]


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True
