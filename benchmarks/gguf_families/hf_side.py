"""Runs in a venv with torch and transformers: builds a tiny random model of one family, exports
it with llama.cpp's convert_hf_to_gguf.py, and prints transformers' greedy tokens and logits.

Usage: python hf_side.py FAMILY MODEL_DIR CONVERT_SCRIPT_DIR PROMPT_JSON STEPS
MODEL_DIR must already hold the tokenizer files (written by run.py with tokenwire's tiny
tokenizer). The result goes to MODEL_DIR/hf_result.json and MODEL_DIR/model-f32.gguf.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers

# Families whose llama.cpp conversion reads a SentencePiece tokenizer.model.
SENTENCEPIECE_FAMILIES = ("gemma2", "gemma3", "phi3")
WINDOW = 8  # shorter than prompt + generated tokens, so sliding layers matter
# Phi-3's tokenizer is Llama 2's SentencePiece model (<unk> 0, <s> 1, </s> 2, a leading space
# on the text) plus added chat tokens after it, <|endoftext|> first. llama.cpp looks
# <|endoftext|> up by name when it loads any model called Phi-3, so the file must have it.
PHI3_SENTENCEPIECE_SIZE = 400
PHI3_ADDED_START = PHI3_SENTENCEPIECE_SIZE
PHI3_ADDED = ("<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>")
PHI3_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' + '\\n' + message['content']"
    " + '<|end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}"
    "{% endif %}"
)

SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 512,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
}


def config_for(family: str) -> transformers.PretrainedConfig:
    common = dict(SHAPE, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    if family in SENTENCEPIECE_FAMILIES:
        common.update(bos_token_id=2, eos_token_id=1)
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "mistral":
        return transformers.MistralConfig(**common, sliding_window=WINDOW)
    if family == "qwen2":
        return transformers.Qwen2Config(**dict(common, tie_word_embeddings=True))
    if family == "qwen3":
        return transformers.Qwen3Config(**common)
    if family == "gemma2":
        return transformers.Gemma2Config(
            **dict(common, tie_word_embeddings=True),
            sliding_window=WINDOW,
            query_pre_attn_scalar=64,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            hidden_activation="gelu_pytorch_tanh",
        )
    if family == "gemma3":
        return transformers.Gemma3TextConfig(
            **dict(common, tie_word_embeddings=True),
            sliding_window=WINDOW,
            query_pre_attn_scalar=64,
            layer_types=["sliding_attention", "full_attention"],
            rope_theta=1_000_000.0,
            rope_local_base_freq=10_000.0,
            hidden_activation="gelu_pytorch_tanh",
        )
    if family == "phi3":
        phi = {k: v for k, v in common.items() if k != "head_dim"}
        # Phi-3's ids: <s> 1, and <|endoftext|> (the first added token) ends and pads.
        phi.update(bos_token_id=1, eos_token_id=PHI3_ADDED_START, pad_token_id=PHI3_ADDED_START)
        return transformers.Phi3Config(**phi)
    raise SystemExit(f"unknown family {family}")


def build(family: str, out: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    config = config_for(family)
    if family == "gemma3":
        model = transformers.Gemma3ForCausalLM(config)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                # Gemma's norms are (1 + w): random w near 0; the others near 1.
                base = 0.0 if family.startswith("gemma") else 1.0
                p.copy_(base + 0.1 * torch.randn_like(p))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    return model


def export(convert_dir: Path, model_dir: Path) -> Path:
    sys.path.insert(0, str(convert_dir))
    sys.path.insert(0, str(convert_dir / "gguf-py"))
    import convert_hf_to_gguf as convert
    from conversion import base

    # The tiny tokenizer is GPT-2-style byte-level BPE with no entry in llama.cpp's table of
    # known tokenizer hashes; name its pre-tokenizer instead of letting the lookup refuse it.
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    target = model_dir / "model-f32.gguf"
    sys.argv = ["convert_hf_to_gguf.py", str(model_dir), "--outtype", "f32", "--outfile", str(target)]
    convert.main()
    return target


def sentencepiece_tokenizer(model_dir: Path, family: str) -> list[int]:
    """Gemma's and Phi-3's conversions read a SentencePiece model: train one on run.py's corpus
    instead of the byte-level BPE files, and return the prompt's ids under it."""
    import sentencepiece

    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (model_dir / name).unlink(missing_ok=True)
    corpus = (model_dir / "corpus.txt").read_text().splitlines()
    if family == "phi3":
        layout: dict[str, object] = dict(
            vocab_size=PHI3_SENTENCEPIECE_SIZE,
            hard_vocab_limit=True,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            add_dummy_prefix=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
        )
    else:
        layout = dict(
            vocab_size=400,
            hard_vocab_limit=False,
            pad_id=0,
            eos_id=1,
            bos_id=2,
            unk_id=3,
            user_defined_symbols=["<start_of_turn>", "<end_of_turn>"],
            add_dummy_prefix=False,
        )
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus * 20),
        model_prefix=str(model_dir / "tokenizer"),
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        minloglevel=2,
        **layout,
    )
    processor = sentencepiece.SentencePieceProcessor(model_file=str(model_dir / "tokenizer.model"))
    if family == "phi3":
        write_phi3_added_tokens(model_dir, processor.get_piece_size())
    return [int(i) for i in processor.encode((model_dir / "prompt.txt").read_text())]


def write_phi3_added_tokens(model_dir: Path, sentencepiece_size: int) -> None:
    """tokenizer_config.json as Phi-3's: the chat tokens added after the SentencePiece pieces,
    special (so convert_hf_to_gguf.py marks them control tokens), and the chat template."""
    if sentencepiece_size != PHI3_ADDED_START:
        raise SystemExit(f"the SentencePiece model has {sentencepiece_size} pieces, not {PHI3_ADDED_START}")
    added = {
        str(PHI3_ADDED_START + i): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": token != "<|endoftext|>",
            "single_word": False,
            "special": True,
        }
        for i, token in enumerate(PHI3_ADDED)
    }
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "added_tokens_decoder": added,
        "bos_token": "<s>",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<unk>",
        "add_bos_token": False,
        "add_eos_token": False,
        "chat_template": PHI3_CHAT_TEMPLATE,
    }
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def main() -> None:
    family, model_dir, convert_dir = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    prompt = json.loads(sys.argv[4])
    steps = int(sys.argv[5])
    if family in SENTENCEPIECE_FAMILIES:
        prompt = sentencepiece_tokenizer(model_dir, family)
    model = build(family, model_dir)
    export(convert_dir, model_dir)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, min_new_tokens=steps
        )
        tokens = out[0, len(prompt) :].tolist()
        logits = model(out).logits[0].float().numpy()
    np.save(model_dir / "hf_logits.npy", logits)
    (model_dir / "hf_result.json").write_text(json.dumps({"tokens": tokens, "prompt": prompt}))


if __name__ == "__main__":
    main()
