"""Hugging Face twins of the tiny models, and PEFT adapters made on them, for the LoRA tests.

The tiny Llama is LlamaForCausalLM with the same weights (both keep Q and K rows in
rotate-half order); the tiny GPT is GPT2LMHeadModel with exact-erf GELU and an untied head. The
adapters are made by PEFT itself (get_peft_model, save_pretrained) with seeded random A and B
(PEFT starts B at zero, which would make every adapter a no-op), so the files the tests load are
the files PEFT writes, and the reference numbers come from PEFT's own forward pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import peft
import torch
import transformers

from tokenwire.server.model_tools.tiny_gpt import TinyGptConfig, tiny_gpt_weights
from tokenwire.server.model_tools.tiny_llama import tiny_llama_config, tiny_llama_weights

HfModel = Any  # transformers' PreTrainedModel (or a PeftModel around one)


def _tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))


def hf_tiny_llama(seed: int = 0) -> HfModel:
    c = tiny_llama_config()
    config = transformers.LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_size,
        max_position_embeddings=c.context_length,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        tie_word_embeddings=False,
        hidden_act="silu",
    )
    model = transformers.LlamaForCausalLM(config)
    w = tiny_llama_weights(c, seed)
    state = {
        "model.embed_tokens.weight": w.embed_tokens,
        "model.norm.weight": w.final_norm,
        "lm_head.weight": w.lm_head,
    }
    for i, layer in enumerate(w.layers):
        p = f"model.layers.{i}."
        state |= {
            p + "input_layernorm.weight": layer.attn_norm,
            p + "post_attention_layernorm.weight": layer.ffn_norm,
            p + "self_attn.q_proj.weight": layer.q_proj,
            p + "self_attn.k_proj.weight": layer.k_proj,
            p + "self_attn.v_proj.weight": layer.v_proj,
            p + "self_attn.o_proj.weight": layer.o_proj,
            p + "mlp.gate_proj.weight": layer.gate_proj,
            p + "mlp.up_proj.weight": layer.up_proj,
            p + "mlp.down_proj.weight": layer.down_proj,
        }
    model.load_state_dict({k: _tensor(np.asarray(v)) for k, v in state.items()}, strict=True)
    return model.eval()


def hf_tiny_gpt(config: TinyGptConfig) -> HfModel:
    c = config.hidden
    hf_config = transformers.GPT2Config(
        vocab_size=config.vocab,
        n_positions=config.context_length,
        n_embd=c,
        n_layer=config.layers,
        n_head=config.heads,
        activation_function="gelu",  # exact erf, as the tiny graph computes it
        layer_norm_epsilon=1e-5,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=False,
    )
    model = transformers.GPT2LMHeadModel(hf_config)
    w = tiny_gpt_weights(config)
    # GPT-2's Conv1D weights are [in, out], as the tiny graph's MatMul weights are.
    state = {
        "transformer.wte.weight": w["wte"],
        "transformer.wpe.weight": w["wpe"],
        "transformer.ln_f.weight": w["lnf.g"],
        "transformer.ln_f.bias": w["lnf.b"],
        "lm_head.weight": w["lm_head"].T,
    }
    for i in range(config.layers):
        p, h = f"h{i}.", f"transformer.h.{i}."
        state |= {
            h + "ln_1.weight": w[p + "ln1.g"],
            h + "ln_1.bias": w[p + "ln1.b"],
            h + "ln_2.weight": w[p + "ln2.g"],
            h + "ln_2.bias": w[p + "ln2.b"],
            h + "attn.c_attn.weight": np.concatenate([w[p + "wq"], w[p + "wk"], w[p + "wv"]], axis=1),
            h + "attn.c_attn.bias": np.concatenate([w[p + "bq"], w[p + "bk"], w[p + "bv"]]),
            h + "attn.c_proj.weight": w[p + "wo"],
            h + "attn.c_proj.bias": w[p + "bo"],
            h + "mlp.c_fc.weight": w[p + "w1"],
            h + "mlp.c_fc.bias": w[p + "b1"],
            h + "mlp.c_proj.weight": w[p + "w2"],
            h + "mlp.c_proj.bias": w[p + "b2"],
        }
    missing, unexpected = model.load_state_dict({k: _tensor(v) for k, v in state.items()}, strict=False)
    # GPT-2 keeps a causal-mask buffer per layer, which is no weight.
    assert not unexpected and all(name.endswith(".attn.bias") or "masked_bias" in name for name in missing)
    return model.eval()


def make_peft_adapter(
    base: Callable[[], HfModel], directory: Path, *, seed: int, std: float = 0.15, **lora_config: Any
) -> Path:
    """A PEFT LoRA adapter on a fresh `base()`, with seeded random A and B, saved to `directory`."""
    model = peft.get_peft_model(base(), peft.LoraConfig(lora_dropout=0.0, **lora_config))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)
    model.save_pretrained(str(directory))
    return directory


def peft_model(base: Callable[[], HfModel], directory: Path | None) -> HfModel:
    """`base()` with the adapter in `directory` (None: the base alone), loaded by PEFT."""
    model = base()
    if directory is None:
        return model
    return peft.PeftModel.from_pretrained(model, str(directory)).eval()


def greedy(model: HfModel, prompt: Sequence[int], steps: int) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and each step's log-probabilities ([steps, vocab], float64), recomputing the
    whole sequence every step (no cache, so nothing of tokenwire's batching is shared)."""
    tokens = list(prompt)
    logprobs = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=torch.tensor([tokens])).logits[0, -1].double()
            step = torch.log_softmax(logits, dim=-1).numpy()
            logprobs.append(step)
            tokens.append(int(step.argmax()))
    return tokens[len(prompt) :], np.stack(logprobs)
