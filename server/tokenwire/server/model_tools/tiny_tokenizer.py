"""A small byte-level BPE tokenizer for the project's own test models.

Byte-level BPE starts from all 256 bytes, so it round-trips any UTF-8 text; merges learned from a
built-in English passage make common words a single token, so tests see realistic multi-byte
and multi-token behaviour. Training is deterministic for a given vocabulary size.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

END_OF_TEXT = "<|endoftext|>"
TURN_START = "<|im_start|>"
TURN_END = "<|im_end|>"
SPECIAL_TOKENS = (END_OF_TEXT, TURN_START, TURN_END)

# ChatML, the template format SmolLM2 and many other instruction-tuned models use.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A model reads tokens and predicts the next one.
Streaming lets users read early; cancellation stops the work. Time to first token measures how
long a request waited and how long its prompt took, while the token rate measures decoding.
Gravity is the force by which a planet or other body draws objects toward its centre. The
capital of France is Paris. Servers queue requests, schedule them in batches and return text.
Hello, world! Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Déjà vu, naïve café, 東京, 😀.
"""


def build_byte_level_tokenizer(vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer with `vocab_size` tokens (specials included)."""
    minimum = len(SPECIAL_TOKENS) + 256
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be at least {minimum} (256 bytes plus special tokens)")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return tokenizer


def write_tokenizer_files(
    out_dir: Path,
    tokenizer: Tokenizer,
    *,
    bos_token: str | None,
    eos_token: str,
    chat_template: str | None,
) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json like Hugging Face does."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos_token,
        "bos_token": bos_token,
        "model_max_length": 1 << 30,
        "clean_up_tokenization_spaces": False,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    special: dict[str, object] = {"eos_token": eos_token}
    if bos_token is not None:
        special["bos_token"] = bos_token
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
