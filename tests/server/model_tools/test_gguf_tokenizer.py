"""tokenizer.json rebuilt from a GGUF vocabulary tokenizes like the original byte-level BPE."""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from tests.server.model_tools.reference_bpe import ReferenceBpe
from tests.server.model_tools.reference_spm import ReferenceSpm
from tests.server.model_tools.synthetic_gguf import tokenizer_vocabulary
from tokenwire.server.model_tools.convert import read_gguf
from tokenwire.server.model_tools.convert.gguf_tokenizer import (
    TOKEN_CONTROL,
    GgufVocabulary,
    UnsupportedTokenizerError,
    build_tokenizer,
    pre_tokenizer_for,
    strip_after_tokens,
)
from tokenwire.server.model_tools.tiny_tokenizer import (
    END_OF_TEXT,
    TURN_END,
    TURN_START,
    build_byte_level_tokenizer,
)

SAMPLES = [
    "Hello world",
    "The year 2024 had 365 days; pi is about 3.14159!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n\n   indented   \n",
    "Déjà vu, naïve café, 東京, Ünïcödé and emoji 😀🚀",
    "don't you'll we've I'm they'd 're 'S",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "before<|endoftext|>after <|im_end|>",
    "x = [1, 22, 333]  # comment\n\tdef f():\n\t\treturn 4242",
    "١٢٣ Arabic-Indic digits, Ⅻ and ½",
    "     ",
    "\n\n\n",
    "",
    "a",
    "mixed\u3000ideographic space",
]


@cache
def tiny_vocabulary(pre: str) -> GgufVocabulary:
    tokens, merges, types = tokenizer_vocabulary(build_byte_level_tokenizer(512))
    return GgufVocabulary(
        model="gpt2",
        pre=pre,
        tokens=tokens,
        token_types=types,
        merges=merges,
        bos_token_id=tokens.index(TURN_START),
        eos_token_id=tokens.index(TURN_END),
        eot_token_id=None,
        pad_token_id=tokens.index(END_OF_TEXT),
        unknown_token_id=None,
        add_bos_token=False,
        add_eos_token=False,
        chat_template=None,
    )


@cache
def tiny_tokenizer(pre: str) -> Tokenizer:
    return build_tokenizer(tiny_vocabulary(pre))


def reference_for(vocab: GgufVocabulary) -> ReferenceBpe:
    control = [t for i, t in enumerate(vocab.tokens) if vocab.type_of(i) == TOKEN_CONTROL]
    return ReferenceBpe(vocab.tokens, vocab.merges, control, split_digits=vocab.pre == "smollm")


@pytest.mark.parametrize("pre", ["gpt2", "smollm"])
@pytest.mark.parametrize("text", SAMPLES)
def test_matches_reference_bpe(pre: str, text: str) -> None:
    assert tiny_tokenizer(pre).encode(text).ids == reference_for(tiny_vocabulary(pre)).encode(text)


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trips_text(text: str) -> None:
    tokenizer = tiny_tokenizer("smollm")
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_control_tokens_are_single_ids_and_skippable() -> None:
    vocab = tiny_vocabulary("gpt2")
    tokenizer = build_tokenizer(vocab)
    ids = tokenizer.encode("<|im_start|>hi<|im_end|>").ids
    assert ids[0] == vocab.tokens.index(TURN_START)
    assert ids[-1] == vocab.tokens.index(TURN_END)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "hi"


def test_smollm_splits_every_digit_and_gpt2_does_not() -> None:
    digits = [piece for piece, _ in pre_tokenizer_for("smollm").pre_tokenize_str("year 2024")]
    assert digits[-4:] == ["2", "0", "2", "4"]
    grouped = [piece for piece, _ in pre_tokenizer_for("gpt2").pre_tokenize_str("year 2024")]
    assert grouped[-1] == "Ġ2024"
    llama3 = [piece for piece, _ in pre_tokenizer_for("llama-bpe").pre_tokenize_str("12345")]
    assert llama3 == ["123", "45"]


def test_bos_is_added_when_the_gguf_asks_for_it() -> None:
    vocab = replace(tiny_vocabulary("gpt2"), add_bos_token=True)
    ids = build_tokenizer(vocab).encode("hello").ids
    assert ids[0] == vocab.bos_token_id
    assert build_tokenizer(vocab).encode("hello", add_special_tokens=False).ids[0] != vocab.bos_token_id


def test_end_token_ids_lead_with_the_declared_eos() -> None:
    vocab = tiny_vocabulary("gpt2")
    assert vocab.end_token_ids() == [vocab.tokens.index(TURN_END), vocab.tokens.index(END_OF_TEXT)]


def test_unknown_tokenizers_are_refused() -> None:
    with pytest.raises(UnsupportedTokenizerError, match="pre-tokenizer"):
        build_tokenizer(tiny_vocabulary("some-future-model"))
    with pytest.raises(UnsupportedTokenizerError, match="supported: gpt2"):
        build_tokenizer(replace(tiny_vocabulary("gpt2"), model="bert"))
    with pytest.raises(UnsupportedTokenizerError, match=r"tokenizer\.ggml\.scores"):
        build_tokenizer(replace(tiny_vocabulary("gpt2"), model="llama"))


@pytest.mark.slow
def test_default_model_vocabulary_matches_reference_bpe(real_gguf: Path, passage: str) -> None:
    vocab = read_gguf(real_gguf).vocabulary
    assert vocab.pre == "smollm"
    tokenizer = build_tokenizer(vocab)
    reference = reference_for(vocab)
    for text in [*SAMPLES, passage]:
        ids = tokenizer.encode(text).ids
        assert ids == reference.encode(text), text
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    # Common words are single tokens in a trained vocabulary: a broken merge list would split them.
    assert len(tokenizer.encode(" the capital of France").ids) == 4


# --- SentencePiece-style vocabularies (Gemma, Llama 2, Mistral) ------------------------------

SPM_TEXTS = [
    "Hello, world! The capital of France is Paris.",
    "  two  spaces, a tab\there and a newline\nthen 1234567 + 89 = 1234656.",
    "Déjà vu, naïve café, 東京, 😀 and ♞ (the knight has no token: bytes).",
    "<start_of_turn>user\nWhat is gravity?<end_of_turn>\n<start_of_turn>model\n",
]


GEMMA_SPECIALS = ("<unk>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>")
PHI3_SPECIALS = ("<unk>", "<s>", "</s>", "<|endoftext|>", "<|user|>", "<|end|>", "<|assistant|>")


def spm_vocabulary(
    seed: int, *, add_space_prefix: bool, specials: tuple[str, ...] = GEMMA_SPECIALS
) -> GgufVocabulary:
    """Specials, 256 byte tokens and pieces taken from the tiny BPE vocabulary, random scores."""
    import numpy as np

    byte_of = {ch: b for b, ch in _bytes_to_unicode().items()}
    pieces: list[str] = []
    for token in tokenizer_vocabulary(build_byte_level_tokenizer(512))[0]:
        try:
            text = bytes(byte_of[c] for c in token).decode("utf-8")
        except (KeyError, UnicodeDecodeError):
            continue
        if text in specials:
            continue  # the tiny vocabulary's own markup tokens, which are specials here
        piece = text.replace(" ", "\u2581")
        # As in a trained SentencePiece vocabulary, each character of a piece is a piece too.
        for candidate in [*piece, piece]:
            if candidate not in pieces:
                pieces.append(candidate)
    tokens = [*specials] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2] + [3] * (len(specials) - 1) + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * (len(specials) + 256) + list(np.random.default_rng(seed).normal(size=len(pieces)))
    return GgufVocabulary(
        model="llama",
        pre="default",
        tokens=tokens,
        token_types=types,
        merges=[],
        bos_token_id=1,
        eos_token_id=2,
        eot_token_id=4,
        pad_token_id=None,
        unknown_token_id=0,
        add_bos_token=True,
        add_eos_token=False,
        chat_template=None,
        scores=[float(s) for s in scores],
        add_space_prefix=add_space_prefix,
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what byte-level BPE tokens are spelled in)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@pytest.mark.parametrize("add_space_prefix", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_sentencepiece_vocabulary_tokenizes_like_llama_cpp(seed: int, add_space_prefix: bool) -> None:
    vocab = spm_vocabulary(seed, add_space_prefix=add_space_prefix)
    tokenizer = build_tokenizer(vocab)
    specials = [t for i, t in enumerate(vocab.tokens) if vocab.type_of(i) == 3]
    reference = ReferenceSpm(vocab.tokens, vocab.scores or [], specials, add_space_prefix=add_space_prefix)
    for text in SPM_TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert ids == reference.encode(text), text
        if not (add_space_prefix and "<start_of_turn>" in text):
            # (With a space prefix, the text after a special token gained a space, in llama.cpp too.)
            assert tokenizer.decode(ids, skip_special_tokens=False) == text
    # Characters without a token are spelled in bytes, not mapped to <unk>.
    knight = tokenizer.encode("♞", add_special_tokens=False).ids
    assert [vocab.tokens[i] for i in knight][-3:] == ["<0xE2>", "<0x99>", "<0x9E>"]
    # add_bos_token puts <bos> first.
    assert tokenizer.encode("hi").ids[0] == vocab.bos_token_id


PHI3_TEXTS = [
    "<|user|>\nWhat is gravity?<|end|>\n<|assistant|>\n",
    "<|user|>  \t\n  two lines\n\nhere<|end|>  tail",
    "end</s>  of text<|endoftext|>\n kept<s> kept too<unk>  and here",
]


def test_phi3_chat_tokens_swallow_the_whitespace_after_them_as_in_llama_cpp() -> None:
    vocab = spm_vocabulary(0, add_space_prefix=True, specials=PHI3_SPECIALS)
    strip = strip_after_tokens("Phi3 Mini", vocab.tokens, vocab.token_types)
    # llama.cpp's rule for a model named Phi-3: every special token but <unk>, <s>, <|endoftext|>.
    assert strip == {"</s>", "<|user|>", "<|end|>", "<|assistant|>"}
    vocab = replace(vocab, strip_after=strip)
    tokenizer = build_tokenizer(vocab)
    reference = ReferenceSpm(
        vocab.tokens, vocab.scores or [], list(PHI3_SPECIALS[1:]), add_space_prefix=True, strip_after=strip
    )
    for text in PHI3_TEXTS:
        assert tokenizer.encode(text, add_special_tokens=False).ids == reference.encode(text), text
    user = vocab.tokens.index("<|user|>")
    assert (
        tokenizer.encode("<|user|>\nHi", add_special_tokens=False).ids
        == tokenizer.encode("<|user|>Hi", add_special_tokens=False).ids
    )
    assert tokenizer.encode("<|user|>\n", add_special_tokens=False).ids == [user]


def test_only_a_model_named_phi3_strips_after_its_special_tokens() -> None:
    vocab = spm_vocabulary(0, add_space_prefix=True, specials=PHI3_SPECIALS)
    for name in ("Gemma 3", "Llama 2", ""):
        assert strip_after_tokens(name, vocab.tokens, vocab.token_types) == frozenset(), name
    assert strip_after_tokens("microsoft/Phi-3-mini", vocab.tokens, vocab.token_types)
    newline = build_tokenizer(vocab).encode("<|user|>\n", add_special_tokens=False).ids
    assert [vocab.tokens[i] for i in newline] == ["<|user|>", "\u2581", "\n"]
