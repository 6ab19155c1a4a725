"""How far the logits of a verified position (a token inside a run of several, appended in one
call) are from those of the same token decoded alone, on every kind of graph the project builds,
and which operators make the difference.

For each graph: the largest absolute logit difference over 5 verified positions after a 40-token
prompt, how many of them change the greedy token, and, for comparison, the difference between a
row decoded alone and the same row decoded beside another (batch 1 against batch 2). Then the two
suspects alone, on random inputs: MatMulNBits (a row at M = 1 against the same row at M >= 2)
and GroupQueryAttention (a one-token step against the first token of a 2-token run).

    python benchmarks/verify_exactness.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import benchkit
import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from tokenwire.server.models.loader import LoadSettings, load_model
from tokenwire.server.models.runner import MultiTokenDecode
from tokenwire.server.models.session import SessionSettings

sys.path.insert(0, str(benchkit.REPO))

POSITIONS = 5


def compare_graph(directory: Path) -> tuple[float, int, float]:
    """(max |diff| of verified positions, greedy flips among them, max |diff| batch 1 vs 2)."""
    settings = LoadSettings(max_batch_size=2, max_context_length=256, session=SessionSettings(device="cpu"))
    runner = load_model(directory, settings).runner
    assert isinstance(runner, MultiTokenDecode)
    rng = np.random.default_rng(0)
    vocab = runner.info.vocab_size
    prompt = [int(t) for t in rng.integers(10, min(vocab, 5000), 40)]
    tokens = [int(runner.prefill(1, prompt, start=0).argmax())]
    plain = []
    for _ in range(POSITIONS):
        plain.append(runner.decode([1], [tokens[-1]])[0].copy())
        tokens.append(int(plain[-1].argmax()))
    runner.release(1)
    runner.prefill(1, prompt, start=0)
    (run,) = runner.decode_runs([1], [tokens[:POSITIONS]])
    largest = float(max(np.abs(run[j] - plain[j]).max() for j in range(POSITIONS)))
    flips = sum(int(run[j].argmax()) != int(plain[j].argmax()) for j in range(POSITIONS))
    runner.release(1)
    runner.prefill(1, prompt, start=0)
    runner.prefill(2, prompt[:20], start=0)
    beside = runner.decode([1, 2], [tokens[0], 7])[0]
    return largest, flips, float(np.abs(beside - plain[0]).max())


def model(graph: object) -> ort.InferenceSession:
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    proto = helper.make_model(graph, opset_imports=opsets)  # type: ignore[arg-type]
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])


def matmul_nbits(bits: int, accuracy_level: int) -> float:
    """Max |diff| of row 0 computed at M = 1 against M = 2..16 (the largest over those M)."""
    k, n, block = 576, 1728, 32
    rng = np.random.default_rng(1)
    blocks = k // block
    weights = rng.integers(0, 256, (n, blocks, block * bits // 8), dtype=np.uint8)
    scales = (rng.random(n * blocks) * 0.01).astype(np.float32)
    node = helper.make_node(
        "MatMulNBits", ["X", "B", "S"], ["Y"], domain="com.microsoft",
        K=k, N=n, bits=bits, block_size=block, accuracy_level=accuracy_level,
    )  # fmt: skip
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["m", k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["m", n])],
        [numpy_helper.from_array(weights, "B"), numpy_helper.from_array(scales, "S")],
    )  # fmt: skip
    session = model(graph)
    x = rng.standard_normal((16, k)).astype(np.float32)
    alone = session.run(None, {"X": x[:1]})[0][0]
    return float(max(np.abs(session.run(None, {"X": x[:m]})[0][0] - alone).max() for m in (2, 4, 8, 16)))


def group_query_attention(rotary: bool) -> float:
    """Max |diff| of a one-token step's output against the same token first in a 2-token run."""
    heads, kv_heads, head, max_len, past = 9, 3, 64, 256, 40
    names = ["qkv", "", "", "pk", "pv", "seqlens_k", "total"] + (["cos", "sin"] if rotary else [])
    node = helper.make_node(
        "GroupQueryAttention", names, ["out", "present_k", "present_v"], domain="com.microsoft",
        num_heads=heads, kv_num_heads=kv_heads, scale=1 / 8.0, do_rotary=int(rotary),
    )  # fmt: skip
    f = TensorProto.FLOAT
    inputs = [
        helper.make_tensor_value_info("qkv", f, ["b", "s", (heads + 2 * kv_heads) * head]),
        helper.make_tensor_value_info("pk", f, ["b", kv_heads, "p", head]),
        helper.make_tensor_value_info("pv", f, ["b", kv_heads, "p", head]),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["b"]),
        helper.make_tensor_value_info("total", TensorProto.INT32, []),
    ]
    if rotary:
        inputs += [helper.make_tensor_value_info(c, f, [max_len, head // 2]) for c in ("cos", "sin")]
    outputs = [helper.make_tensor_value_info(o, f, None) for o in ("out", "present_k", "present_v")]
    session = model(helper.make_graph([node], "g", inputs, outputs))
    rng = np.random.default_rng(0)
    angles = np.arange(max_len)[:, None] / (10000 ** (np.arange(head // 2) / (head // 2)))
    pk = rng.standard_normal((1, kv_heads, past, head)).astype(np.float32)
    pv = rng.standard_normal((1, kv_heads, past, head)).astype(np.float32)
    qkv = rng.standard_normal((1, 2, (heads + 2 * kv_heads) * head)).astype(np.float32)

    def run(new: np.ndarray) -> np.ndarray:
        feeds = {"qkv": new, "pk": pk, "pv": pv}
        feeds |= {"seqlens_k": np.array([past + new.shape[1] - 1], np.int32)}
        feeds |= {"total": np.array(past + new.shape[1], np.int32)}
        if rotary:
            feeds |= {"cos": np.cos(angles).astype(np.float32), "sin": np.sin(angles).astype(np.float32)}
        output: np.ndarray = session.run(None, feeds)[0][0, 0]
        return output

    return float(np.abs(run(qkv[:, :1]) - run(qkv)).max())


def graphs(scratch: Path) -> dict[str, Path]:
    from gguf import GGMLQuantizationType as Q

    from tests.server.model_tools.synthetic_gguf import MIXED_FORMATS, write_synthetic_gguf
    from tokenwire.server.model_tools.convert import convert_gguf
    from tokenwire.server.model_tools.tiny_gpt import TinyGptConfig, create_tiny_gpt
    from tokenwire.server.model_tools.tiny_llama import create_tiny_llama

    q4_1 = {key: (Q.Q4_1, Q.Q4_1) for key in MIXED_FORMATS}
    write_synthetic_gguf(scratch / "q4_1.gguf", formats=q4_1, embedding=Q.Q4_1, head=Q.Q6_K, seed=1)
    write_synthetic_gguf(scratch / "mixed.gguf", formats=MIXED_FORMATS)
    return {
        "default model (accuracy level 4)": benchkit.model_dir(),
        "tiny Llama (float weights, GroupQueryAttention)": create_tiny_llama(scratch / "tiny-llama"),
        "tiny GPT (standard ops, Optimum layout)": create_tiny_gpt(scratch / "tiny-gpt", TinyGptConfig()),
        "synthetic Q4_1 GGUF, converted": convert_gguf(scratch / "q4_1.gguf", scratch / "q4_1"),
        "synthetic mixed GGUF, converted": convert_gguf(scratch / "mixed.gguf", scratch / "mixed"),
    }


def main() -> None:
    with tempfile.TemporaryDirectory() as scratch:
        found = {name: compare_graph(path) for name, path in graphs(Path(scratch)).items()}
    print(f"\n## A verified position against one-token decode ({POSITIONS} positions)\n")
    rows = [[name, f"{d:.2g}", f"{flips}/{POSITIONS}", f"{b:.2g}"] for name, (d, flips, b) in found.items()]
    print(benchkit.markdown_table(["graph", "max abs diff", "greedy flips", "batch 1 vs 2"], rows))
    ops = {
        "MatMulNBits 4-bit, accuracy 4: M=1 vs M>=2": matmul_nbits(4, 4),
        "MatMulNBits 4-bit, accuracy 0: M=1 vs M>=2": matmul_nbits(4, 0),
        "MatMulNBits 8-bit, accuracy 4: M=1 vs M>=2": matmul_nbits(8, 4),
        "GroupQueryAttention with rotary: 1-token step vs 2-token run": group_query_attention(True),
        "GroupQueryAttention without rotary: 1-token step vs 2-token run": group_query_attention(False),
    }
    print("\n## The operators alone, same inputs\n")
    print(benchkit.markdown_table(["operator", "max abs diff"], [[k, f"{v:.2g}"] for k, v in ops.items()]))
    path = benchkit.save_results("verify_exactness", {"graphs": found, "operators": ops})
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
