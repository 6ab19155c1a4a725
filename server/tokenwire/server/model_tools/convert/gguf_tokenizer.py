"""A Hugging Face `tokenizers` tokenizer rebuilt from a GGUF file's vocabulary.

GGUF stores byte-level BPE ("gpt2" tokenizer model) as the token strings, the merge list and a
short name of the pre-tokenizer ("tokenizer.ggml.pre"), whose split rules live in llama.cpp's
source rather than in the file. This module maps those names back to the pre-tokenizers the
original tokenizer.json files use.

SentencePiece-style vocabularies ("llama" tokenizer model: Gemma, Llama 2, Mistral) carry a
score per token instead of merges. llama.cpp tokenizes them by repeatedly joining the adjacent
pair of pieces whose join is a token with the highest score, then spelling what no token covers
as <0xXX> byte tokens. That is BPE whose merges are ranked by the joined token's score, with byte
fallback, which is what is built here. The two agree when every character of a multi-character
token is a token itself, as SentencePiece's training guarantees; a character outside the
vocabulary is spelled in bytes at once by `tokenizers`, where llama.cpp could still join it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from tokenwire.server.model_tools.convert.errors import ConversionError, excerpt

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

# Split rules of the Llama 3 and Qwen 2 tokenizers; they differ only in how digits group.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# llama.cpp pre-tokenizer names, grouped by the rule they share.
_GPT2_STYLE = {"default", "gpt2", "gpt-2", "mpt", "olmo", "jais"}
# GPT-2's regex after splitting every digit on its own (StarCoder and SmolLM tokenizers).
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone"}
_LLAMA3_STYLE = {"llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "pixtral"}
_QWEN2_STYLE = {"qwen2"}


class UnsupportedTokenizerError(ConversionError):
    """The GGUF vocabulary uses a tokenizer this module cannot rebuild exactly."""


@dataclass(frozen=True)
class GgufVocabulary:
    model: str  # tokenizer.ggml.model: "gpt2" is byte-level BPE
    pre: str  # tokenizer.ggml.pre
    tokens: list[str]
    token_types: list[int]
    merges: list[str]  # "left right", in priority order
    bos_token_id: int | None
    eos_token_id: int | None
    eot_token_id: int | None
    pad_token_id: int | None
    unknown_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None
    # SentencePiece-style vocabularies: a score per token, and whether text gets a leading space.
    scores: list[float] | None = None
    add_space_prefix: bool = True
    # Tokens that swallow the whitespace after them when matched in text (llama.cpp's RSTRIP).
    strip_after: frozenset[str] = frozenset()

    def token(self, token_id: int | None) -> str | None:
        if token_id is None or not 0 <= token_id < len(self.tokens):
            return None
        return self.tokens[token_id]

    def type_of(self, token_id: int) -> int:
        return self.token_types[token_id] if token_id < len(self.token_types) else TOKEN_NORMAL

    def end_token_ids(self) -> list[int]:
        """Every id that ends generation: the declared EOS and end-of-turn, then the usual markers."""
        ids: list[int] = []
        for candidate in (self.eos_token_id, self.eot_token_id):
            if candidate is not None and candidate not in ids:
                ids.append(candidate)
        lookup = {token: i for i, token in enumerate(self.tokens) if self.type_of(i) == TOKEN_CONTROL}
        for marker in (
            "<|im_end|>",
            "<|eot_id|>",
            "<|end_of_text|>",
            "<|endoftext|>",
            "<|end|>",
            "<end_of_turn>",
        ):
            found = lookup.get(marker)
            if found is not None and found not in ids:
                ids.append(found)
        return ids


def strip_after_tokens(model_name: str, tokens: list[str], token_types: list[int]) -> frozenset[str]:
    """The tokens llama.cpp strips the whitespace after, by its rule for a model named Phi-3.

    The attribute is not in the file: llama.cpp sets it when general.name contains "phi-3" or
    "phi3" (as Phi-3's own tokenizer.json marks its chat tokens rstrip), on every control,
    user-defined and unknown token and </s>, but not <unk>, <s> or <|endoftext|>. (`tokenizers`
    strips Unicode whitespace there, llama.cpp only ASCII: they differ only for a character such
    as U+3000 right after a chat token.)
    """
    name = model_name.lower()
    if "phi-3" not in name and "phi3" not in name:
        return frozenset()
    marked = {TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN}
    special = {t for i, t in enumerate(tokens) if i < len(token_types) and token_types[i] in marked}
    return frozenset((special | {"</s>"}) - {"<unk>", "<s>", "<|endoftext|>"})


def pre_tokenizer_for(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level_with_gpt2_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _GPT2_STYLE:
        return byte_level_with_gpt2_regex
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level_with_gpt2_regex]
        )
    for names, pattern in ((_LLAMA3_STYLE, _LLAMA3_SPLIT), (_QWEN2_STYLE, _QWEN2_SPLIT)):
        if pre in names:
            return pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
    raise UnsupportedTokenizerError(f"unknown GGUF pre-tokenizer {pre!r}")


# llama.cpp treats these as control tokens, matched in text, even where a file marks them normal.
_END_OF_TURN_MARKERS = frozenset(
    {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>"}
)

SPACE_PIECE = "\u2581"  # SentencePiece's visible space


def _byte_level_bpe(vocab: GgufVocabulary, ids: dict[str, int]) -> Tokenizer:
    merges: list[tuple[str, str]] = []
    for index, merge in enumerate(vocab.merges):
        left, sep, right = merge.partition(" ")
        if not sep:
            raise UnsupportedTokenizerError(f"malformed merge {excerpt(merge)!r}")
        # `tokenizers` refuses a half it does not know, and panics on a join it does not know.
        unknown = next((t for t in (left, right, left + right) if t not in ids), None)
        if unknown is not None:
            raise UnsupportedTokenizerError(
                f"GGUF metadata tokenizer.ggml.merges[{index}] ({excerpt(merge)!r}) names "
                f"{excerpt(unknown)!r}, which is not in the vocabulary"
            )
        merges.append((left, right))
    tokenizer = Tokenizer(models.BPE(vocab=ids, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizer_for(vocab.pre)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def sentencepiece_merges(vocab: GgufVocabulary, ids: dict[str, int]) -> list[tuple[str, str]]:
    """Every way to join two tokens into a third, best-scoring result first (llama.cpp's order)."""
    if vocab.scores is None or len(vocab.scores) != len(vocab.tokens):
        raise UnsupportedTokenizerError("SentencePiece-style GGUF vocabulary lacks tokenizer.ggml.scores")
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, token_id in ids.items():
        if vocab.type_of(token_id) == TOKEN_BYTE:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            left_id, right_id = ids.get(left), ids.get(right)
            if left_id is not None and right_id is not None:
                ranked.append((-vocab.scores[token_id], left_id, right_id, left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _sentencepiece_bpe(vocab: GgufVocabulary, ids: dict[str, int]) -> Tokenizer:
    unknown = vocab.token(vocab.unknown_token_id)
    model = models.BPE(
        vocab=ids,
        merges=sentencepiece_merges(vocab, ids),
        unk_token=unknown,
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = Tokenizer(model)
    # llama.cpp adds the leading space to the text before each special token's split, as
    # Prepend does to each segment between added tokens.
    steps: list[normalizers.Normalizer] = []
    if vocab.add_space_prefix:
        steps.append(normalizers.Prepend(SPACE_PIECE))
    steps.append(normalizers.Replace(" ", SPACE_PIECE))
    tokenizer.normalizer = normalizers.Sequence(steps)
    decode_steps: list[decoders.Decoder] = [
        decoders.Replace(SPACE_PIECE, " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
    ]
    if vocab.add_space_prefix:
        decode_steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(decode_steps)
    return tokenizer


def build_tokenizer(vocab: GgufVocabulary) -> Tokenizer:
    if vocab.model not in ("gpt2", "llama"):
        raise UnsupportedTokenizerError(
            f"tokenizer model {vocab.model!r} is not supported "
            "(supported: gpt2, byte-level BPE; llama, SentencePiece-style with scores)"
        )
    ids = {token: i for i, token in enumerate(vocab.tokens)}
    if len(ids) != len(vocab.tokens):
        raise UnsupportedTokenizerError("GGUF vocabulary has duplicate tokens")
    tokenizer = _byte_level_bpe(vocab, ids) if vocab.model == "gpt2" else _sentencepiece_bpe(vocab, ids)

    # Control tokens are matched in text before BPE runs (as chat-template markup must be) and
    # are dropped by decode(skip_special_tokens=True); user-defined ones are matched but kept.
    control = [
        AddedToken(t, special=True, normalized=False, rstrip=t in vocab.strip_after)
        for i, t in enumerate(vocab.tokens)
        if vocab.type_of(i) == TOKEN_CONTROL or t in _END_OF_TURN_MARKERS
    ]
    user = [
        AddedToken(t, special=False, normalized=False, rstrip=t in vocab.strip_after)
        for i, t in enumerate(vocab.tokens)
        if vocab.type_of(i) == TOKEN_USER_DEFINED
    ]
    tokenizer.add_special_tokens(control)
    tokenizer.add_tokens(user)

    bos = vocab.token(vocab.bos_token_id)
    eos = vocab.token(vocab.eos_token_id)
    single, pair, specials = "$A", "$A $B", []
    if vocab.add_bos_token and bos is not None and vocab.bos_token_id is not None:
        single, pair = f"{bos} {single}", f"{bos} $A {bos} $B"
        specials.append((bos, vocab.bos_token_id))
    if vocab.add_eos_token and eos is not None and vocab.eos_token_id is not None:
        single, pair = f"{single} {eos}", f"{pair} {eos}"
        specials.append((eos, vocab.eos_token_id))
    if specials:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=specials
        )
    return tokenizer


def write_gguf_tokenizer_files(out_dir: Path, vocab: GgufVocabulary, *, model_max_length: int) -> Tokenizer:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json, as Hugging Face writes them."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab)
    tokenizer.save(str(out_dir / "tokenizer.json"))

    special = {
        "bos_token": vocab.token(vocab.bos_token_id),
        "eos_token": vocab.token(vocab.eos_token_id),
        "pad_token": vocab.token(vocab.pad_token_id),
        "unk_token": vocab.token(vocab.unknown_token_id),
    }
    present = {key: value for key, value in special.items() if value is not None}
    control = [t for i, t in enumerate(vocab.tokens) if vocab.type_of(i) == TOKEN_CONTROL]
    extra = [t for t in control if t not in present.values()]
    config: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **present,
        "additional_special_tokens": extra,
        "add_bos_token": vocab.add_bos_token,
        "add_eos_token": vocab.add_eos_token,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    if vocab.chat_template is not None:
        config["chat_template"] = vocab.chat_template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps({**present, "additional_special_tokens": extra}, indent=2, ensure_ascii=False)
    )
    return tokenizer
