"""The tiny GPT graph computes what a plain numpy transformer computes with the same weights."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from tokenwire.server.model_tools.tiny_gpt import TinyGptConfig, build_tiny_gpt_graph, tiny_gpt_weights

CONFIG = TinyGptConfig(layers=2, hidden=64, heads=4, vocab=512, context_length=64, seed=11)


def layer_norm(x: np.ndarray, gain: np.ndarray, bias: np.ndarray) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + 1e-5) * gain + bias


def gelu(x: np.ndarray) -> np.ndarray:
    from math import erf

    return 0.5 * x * (1 + np.vectorize(erf)(x / np.sqrt(2)))


def numpy_forward(tokens: list[int], config: TinyGptConfig) -> np.ndarray:
    """Logits for every position of `tokens`, float64, written from the textbook definitions."""
    w = {k: v.astype(np.float64) for k, v in tiny_gpt_weights(config).items()}
    n, h, d = len(tokens), config.heads, config.head_dim
    x = w["wte"][tokens] + w["wpe"][np.arange(n)]
    causal = np.tril(np.ones((n, n), dtype=bool))
    for i in range(config.layers):
        p = f"h{i}."
        a = layer_norm(x, w[p + "ln1.g"], w[p + "ln1.b"])
        q, k, v = ((a @ w[p + f"w{m}"] + w[p + f"b{m}"]).reshape(n, h, d).transpose(1, 0, 2) for m in "qkv")
        scores = q @ k.transpose(0, 2, 1) / np.sqrt(d)
        scores = np.where(causal, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attended = (probs @ v).transpose(1, 0, 2).reshape(n, h * d)
        x = x + attended @ w[p + "wo"] + w[p + "bo"]
        m = layer_norm(x, w[p + "ln2.g"], w[p + "ln2.b"])
        x = x + gelu(m @ w[p + "w1"] + w[p + "b1"]) @ w[p + "w2"] + w[p + "b2"]
    return layer_norm(x, w["lnf.g"], w["lnf.b"]) @ w["lm_head"]


@pytest.fixture(scope="module")
def session() -> ort.InferenceSession:
    model = build_tiny_gpt_graph(CONFIG)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def run_full(session: ort.InferenceSession, tokens: list[int]) -> np.ndarray:
    n = len(tokens)
    feeds: dict[str, np.ndarray] = {
        "input_ids": np.array([tokens], dtype=np.int64),
        "attention_mask": np.ones((1, n), dtype=np.int64),
        "position_ids": np.arange(n, dtype=np.int64)[None],
    }
    for i in range(CONFIG.layers):
        for kind in ("key", "value"):
            feeds[f"past_key_values.{i}.{kind}"] = np.zeros((1, CONFIG.heads, 0, CONFIG.head_dim), np.float32)
    return np.asarray(session.run(["logits"], feeds)[0][0])


def test_logits_match_a_numpy_forward_pass(session: ort.InferenceSession) -> None:
    tokens = [7, 300, 42, 42, 511, 0, 19, 256, 128]
    expected = numpy_forward(tokens, CONFIG)
    actual = run_full(session, tokens)
    # float32 against float64 through 2 layers of width 64: agreement to ~1e-4 relative to the
    # logits' spread (a few units) is what float32 rounding allows; a wrong mask, position or
    # layout would be off by whole units.
    assert np.max(np.abs(actual - expected)) < 2e-3
    assert np.array_equal(actual.argmax(-1), expected.argmax(-1))


def test_cached_decoding_equals_full_recomputation(session: ort.InferenceSession) -> None:
    prompt = [5, 6, 7, 8]
    past = {
        f"past_key_values.{i}.{k}": np.zeros((1, CONFIG.heads, 0, CONFIG.head_dim), np.float32)
        for i in range(CONFIG.layers)
        for k in ("key", "value")
    }
    tokens = list(prompt)
    output_names = ["logits"] + [f"present.{i}.{k}" for i in range(CONFIG.layers) for k in ("key", "value")]
    feeds = {
        "input_ids": np.array([prompt]),
        "attention_mask": np.ones((1, 4), np.int64),
        "position_ids": np.arange(4)[None],
        **past,
    }
    for _ in range(12):
        outputs = session.run(output_names, feeds)
        cached_next = int(outputs[0][0, -1].argmax())
        recomputed_next = int(run_full(session, tokens)[-1].argmax())
        assert cached_next == recomputed_next
        np.testing.assert_allclose(outputs[0][0, -1], run_full(session, tokens)[-1], atol=1e-4)
        tokens.append(cached_next)
        feeds = {
            "input_ids": np.array([[cached_next]]),
            "attention_mask": np.ones((1, len(tokens)), np.int64),
            "position_ids": np.array([[len(tokens) - 1]]),
        }
        feeds.update(
            {
                name.replace("present", "past_key_values"): value
                for name, value in zip(output_names[1:], outputs[1:], strict=True)
            }
        )
