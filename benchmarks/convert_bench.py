"""Measure the GGUF converter against ONNX Runtime GenAI's model builder and llama.cpp.

For each model: size on disk, conversion time and peak RSS of the conversion process,
perplexity on a fixed English passage (against a float32 reference: the same graph built from the
GGUF's dequantized weights, with float32 MatMuls), and greedy decode speed at batch 1 (a
100-token prompt, 128 new tokens, share-buffer IO-binding loop, 2 intra-op threads by default).

    python benchmarks/convert_bench.py [--gguf FILE] [--work DIR]
        [--genai-python VENV/bin/python]     # a venv with onnxruntime-genai, torch, transformers
        [--llamacpp-python VENV/bin/python]  # a venv with llama-cpp-python

Without --gguf the default model is fetched through tokenwire's pull cache. A comparison whose
interpreter is not given (or fails) is reported as skipped. The other interpreters run this same
file with an internal subcommand, so only the standard library, numpy and the package being
measured are imported there.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
PASSAGE = REPO / "tests" / "server" / "models" / "data" / "perplexity_passage.txt"


# --- measurements in this interpreter --------------------------------------------------------


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def perplexity(logits: np.ndarray, ids: list[int]) -> float:
    log_probs = log_softmax(logits[:-1])
    return float(np.exp(-log_probs[np.arange(len(ids) - 1), np.asarray(ids[1:])].mean()))


def mean_kl(reference: np.ndarray, other: np.ndarray) -> float:
    p, q = log_softmax(reference), log_softmax(other)
    return float((np.exp(p) * (p - q)).sum(axis=-1).mean())


class SharedBufferDecoder:
    """Batch-1 greedy decoding with past and present bound to one preallocated KV buffer.

    The decode binding is built once and reused: inputs are OrtValues over numpy arrays that are
    updated in place, the logits output is bound to a preallocated array.
    """

    def __init__(self, model_dir: Path, *, threads: int, max_len: int) -> None:
        import onnxruntime as ort

        self.ort = ort
        config = json.loads((model_dir / "genai_config.json").read_text())["model"]
        decoder = config["decoder"]
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        started = time.perf_counter()
        self.session = ort.InferenceSession(
            str(model_dir / decoder["filename"]), options, providers=["CPUExecutionProvider"]
        )
        self.load_seconds = time.perf_counter() - started
        self.layers = int(decoder["num_hidden_layers"])
        self.vocab = int(config["vocab_size"])
        kv_type = next(i.type for i in self.session.get_inputs() if i.name.startswith("past_key_values"))
        dtype = np.float16 if kv_type == "tensor(float16)" else np.float32
        shape = (1, int(decoder["num_key_value_heads"]), max_len, int(decoder["head_size"]))
        self.cache = [np.zeros(shape, dtype=dtype) for _ in range(2 * self.layers)]
        self.max_len = max_len

    def _bind_cache(self, binding: Any) -> None:
        for layer in range(self.layers):
            for index, kind in enumerate(("key", "value")):
                value = self.ort.OrtValue.ortvalue_from_numpy(self.cache[2 * layer + index])
                binding.bind_ortvalue_input(f"past_key_values.{layer}.{kind}", value)
                binding.bind_ortvalue_output(f"present.{layer}.{kind}", value)

    def prefill(self, ids: list[int]) -> np.ndarray:
        binding = self.session.io_binding()
        binding.bind_output("logits")
        binding.bind_cpu_input("input_ids", np.asarray([ids], dtype=np.int64))
        binding.bind_cpu_input("attention_mask", np.ones((1, len(ids)), dtype=np.int64))
        self._bind_cache(binding)
        self.session.run_with_iobinding(binding)
        logits: np.ndarray = binding.get_outputs()[0].numpy()[0]
        return logits

    def greedy(self, prompt: list[int], new_tokens: int) -> tuple[list[int], float]:
        """Generated ids and decode tokens per second (prefill excluded)."""
        ort = self.ort
        token = int(self.prefill(prompt)[-1].argmax())
        input_ids = np.zeros((1, 1), dtype=np.int64)
        mask = np.zeros((1, self.max_len), dtype=np.int64)
        mask[0, : len(prompt)] = 1
        logits = np.zeros((1, 1, self.vocab), dtype=np.float32)
        binding = self.session.io_binding()
        binding.bind_ortvalue_output("logits", ort.OrtValue.ortvalue_from_numpy(logits))
        binding.bind_ortvalue_input("input_ids", ort.OrtValue.ortvalue_from_numpy(input_ids))
        self._bind_cache(binding)
        masks = [
            ort.OrtValue.ortvalue_from_numpy(mask[:, :n]) for n in range(len(prompt) + 1, self.max_len + 1)
        ]
        generated = [token]
        started = time.perf_counter()
        for step in range(new_tokens - 1):
            input_ids[0, 0] = token
            mask[0, len(prompt) + step] = 1
            binding.bind_ortvalue_input("attention_mask", masks[step])
            self.session.run_with_iobinding(binding)
            token = int(logits[0, 0].argmax())
            generated.append(token)
        seconds = time.perf_counter() - started
        return generated, (new_tokens - 1) / seconds


@dataclass
class Result:
    name: str
    notes: str = ""
    size_bytes: int | None = None
    convert_seconds: float | None = None
    convert_peak_rss: int | None = None
    ppl: float | None = None
    kl: float | None = None
    top1: float | None = None
    decode_tps: list[float] = field(default_factory=list)
    skipped: str | None = None


def model_bytes(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in model_dir.iterdir() if p.name.startswith("model.onnx"))


def score(result: Result, logits: np.ndarray, ids: list[int], reference: np.ndarray | None) -> None:
    result.ppl = perplexity(logits, ids)
    if reference is not None:
        result.kl = mean_kl(reference, logits)
        result.top1 = float(np.mean(reference.argmax(-1) == logits.argmax(-1)))


def measure_quality(
    result: Result, model_dir: Path, ids: list[int], reference: np.ndarray | None, threads: int
) -> np.ndarray:
    result.size_bytes = model_bytes(model_dir)
    logits = SharedBufferDecoder(model_dir, threads=threads, max_len=len(ids)).prefill(ids)
    score(result, logits, ids, reference)
    return logits


def run_child(command: list[str], timeout: float = 3600) -> dict[str, Any]:
    """Run a child process that prints one JSON object on its last stdout line."""
    completed = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if completed.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:4])}... failed:\n{completed.stderr[-3000:]}")
    loaded: dict[str, Any] = json.loads(completed.stdout.strip().splitlines()[-1])
    return loaded


# --- child commands ------------------------------------------------------------------------


def peak_rss_bytes() -> int:
    """This process's peak resident set size.

    /proc's VmHWM starts afresh at exec; getrusage's ru_maxrss would report the parent's size at
    fork if that was larger.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child_convert(gguf: Path, out_dir: Path, dtype: str) -> None:
    from tokenwire.server.model_tools.convert import convert_gguf

    started = time.perf_counter()
    convert_gguf(gguf, out_dir, dtype=dtype)
    seconds = time.perf_counter() - started
    print(json.dumps({"seconds": seconds, "peak_rss": peak_rss_bytes()}))


def child_float_reference(gguf: Path, out_dir: Path, converted: Path) -> None:
    """The same graph with every weight dequantized to float32: the quality reference."""
    from dataclasses import replace

    from tokenwire.server.model_tools.convert import build_llama_graph, read_gguf
    from tokenwire.server.model_tools.convert.genai_config import GENAI_CONFIG_FILENAME
    from tokenwire.server.model_tools.convert.llama_graph import save_model
    from tokenwire.server.model_tools.convert.llama_model import dequantized

    source = read_gguf(gguf)
    w = source.weights
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    layers = tuple(replace(layer, **{n: dequantized(getattr(layer, n)) for n in names}) for layer in w.layers)
    embed = dequantized(w.embed_tokens)
    head = embed if w.lm_head is None else dequantized(w.lm_head)
    weights = replace(w, layers=layers, embed_tokens=embed, lm_head=np.ascontiguousarray(head))
    out_dir.mkdir(parents=True, exist_ok=True)
    save_model(build_llama_graph(source.config, weights), out_dir / "model.onnx", external_data=True)
    shutil.copy(converted / GENAI_CONFIG_FILENAME, out_dir / GENAI_CONFIG_FILENAME)
    print(json.dumps({"ok": True}))


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """The safetensors format: a little-endian u64 header size, a JSON header, then raw data."""
    header: dict[str, Any] = {}
    offset = 0
    for name, array in tensors.items():
        header[name] = {
            "dtype": "F32",
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    with path.open("wb") as file:
        file.write(len(encoded).to_bytes(8, "little"))
        file.write(encoded)
        for array in tensors.values():
            file.write(np.ascontiguousarray(array, dtype="<f4").tobytes())


def child_hf_checkpoint(gguf: Path, hf_dir: Path, converted: Path) -> None:
    """The GGUF's weights dequantized to float32 as a Hugging Face Llama checkpoint.

    ONNX Runtime GenAI's builder reads only float GGUF tensors, so it gets this checkpoint and
    quantizes it to int4 itself: dequantize, then requantize.
    """
    from tokenwire.server.model_tools.convert import read_gguf
    from tokenwire.server.model_tools.convert.llama_model import dequantized

    source = read_gguf(gguf)
    c, vocab, w = source.config, source.vocabulary, source.weights
    hf_dir.mkdir(parents=True, exist_ok=True)
    tensors = {"model.embed_tokens.weight": dequantized(w.embed_tokens)}
    for i, layer in enumerate(w.layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = layer.attn_norm
        tensors[p + "post_attention_layernorm.weight"] = layer.ffn_norm
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors[p + f"self_attn.{name}.weight"] = dequantized(getattr(layer, name))
        for name in ("gate_proj", "up_proj", "down_proj"):
            tensors[p + f"mlp.{name}.weight"] = dequantized(getattr(layer, name))
    tensors["model.norm.weight"] = w.final_norm
    if w.lm_head is not None:
        tensors["lm_head.weight"] = dequantized(w.lm_head)
    write_safetensors(hf_dir / "model.safetensors", tensors)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "num_hidden_layers": c.num_layers,
        "head_dim": c.head_size,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.context_length,
        "vocab_size": c.vocab_size,
        "tie_word_embeddings": w.lm_head is None,
        "hidden_act": "silu",
        "bos_token_id": vocab.bos_token_id,
        "eos_token_id": vocab.eos_token_id,
        "pad_token_id": vocab.pad_token_id,
        "torch_dtype": "float32",
    }
    (hf_dir / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(converted / name, hf_dir / name)
    print(json.dumps({"ok": True}))


def child_llamacpp_logits(gguf: Path, ids_file: Path, threads: int) -> None:
    from llama_cpp import Llama

    ids = json.loads(ids_file.read_text())
    llm = Llama(
        model_path=str(gguf), n_ctx=1024, logits_all=True, verbose=False, n_threads=threads, n_batch=512
    )
    llm.eval(ids)
    np.save(ids_file.with_suffix(".npy"), np.asarray(llm.scores[: len(ids)], dtype=np.float32))
    print(json.dumps({"ok": True}))


def child_llamacpp_speed(
    gguf: Path, ids_file: Path, threads: int, prompt_tokens: int, new_tokens: int
) -> None:
    """One warm-up and one timed greedy decode with llama.cpp's own evaluation loop."""
    from llama_cpp import Llama

    prompt = json.loads(ids_file.read_text())[:prompt_tokens]
    llm = Llama(model_path=str(gguf), n_ctx=512, verbose=False, n_threads=threads, n_threads_batch=threads)
    speed = 0.0
    for _ in range(2):  # the first run warms up
        llm.reset()
        llm.eval(prompt)
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        started = time.perf_counter()
        for _ in range(new_tokens - 1):
            llm.eval([token])
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        speed = (new_tokens - 1) / (time.perf_counter() - started)
    print(json.dumps({"decode_tps": speed}))


# --- orchestration -------------------------------------------------------------------------


def build_genai(
    args: argparse.Namespace, gguf: Path, converted: Path, work: Path, result: Result
) -> Path | None:
    if not args.genai_python:
        result.skipped = "no --genai-python given (a venv with onnxruntime-genai, torch, transformers)"
        return None
    hf_dir = work / "hf-checkpoint"
    started = time.perf_counter()
    run_child([sys.executable, __file__, "_hf-checkpoint", str(gguf), str(hf_dir), str(converted)])
    checkpoint_seconds = time.perf_counter() - started
    out_dir = work / "genai-builder"
    shutil.rmtree(out_dir, ignore_errors=True)
    command = [
        args.genai_python,
        "-m",
        "onnxruntime_genai.models.builder",
        "-m",
        str(hf_dir),
        "-i",
        str(hf_dir),
    ]
    command += ["-o", str(out_dir), "-p", "int4", "-e", "cpu", "-c", str(work / "genai-cache")]
    command += ["--extra_options", "int4_accuracy_level=4"]
    wrapper = (
        "import resource, runpy, sys, time, json\nstarted = time.perf_counter()\n"
        "sys.argv = ['builder', *sys.argv[1:]]"
        "\ntry:\n    runpy.run_module('onnxruntime_genai.models.builder', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')]\n"
        "print(json.dumps({'seconds': time.perf_counter() - started,"
        " 'peak_rss': int(hwm[0].split()[1]) * 1024 if hwm"
        " else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))"
    )
    try:
        measured = run_child([args.genai_python, "-c", wrapper, *command[3:]])
    except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError, OSError) as error:
        result.skipped = f"builder failed: {str(error)[-400:]}"
        return None
    if not (out_dir / "model.onnx").is_file():
        result.skipped = "builder wrote no model.onnx"
        return None
    # From the GGUF: writing the float32 checkpoint counts, the builder's own run dominates.
    result.convert_seconds = checkpoint_seconds + measured["seconds"]
    result.convert_peak_rss = measured["peak_rss"]
    return out_dir


def llamacpp_quality(
    args: argparse.Namespace,
    gguf: Path,
    ids_file: Path,
    ids: list[int],
    reference: np.ndarray,
    result: Result,
) -> bool:
    if not args.llamacpp_python:
        result.skipped = "no --llamacpp-python given (a venv with llama-cpp-python)"
        return False
    try:
        run_child(
            [args.llamacpp_python, __file__, "_llamacpp-logits", str(gguf), str(ids_file), str(args.threads)]
        )
    except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError, OSError) as error:
        result.skipped = f"llama.cpp failed: {str(error)[-400:]}"
        return False
    score(result, np.load(ids_file.with_suffix(".npy")), ids, reference)
    result.size_bytes = gguf.stat().st_size
    return True


def llamacpp_decode_once(args: argparse.Namespace, gguf: Path, ids_file: Path) -> float:
    command = [args.llamacpp_python, __file__, "_llamacpp-speed", str(gguf), str(ids_file), str(args.threads)]
    measured = run_child([*command, str(args.prompt_tokens), str(args.new_tokens)])
    return float(measured["decode_tps"])


def fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def table(results: list[Result], gguf_bytes: int, reference_ppl: float) -> str:
    lines = [
        "| model | size MB (× GGUF) | conversion s | conversion peak RSS MB | perplexity (Δ vs fp32) "
        "| KL vs fp32 | top-1 vs fp32 | decode tok/s median (best) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.skipped:
            lines.append(f"| {r.name} | skipped: {r.skipped} |||||||")
            continue
        size = "–" if r.size_bytes is None else f"{r.size_bytes / 1e6:.1f} ({r.size_bytes / gguf_bytes:.2f}×)"
        ppl = "–" if r.ppl is None else f"{r.ppl:.3f} ({100 * (r.ppl / reference_ppl - 1):+.2f}%)"
        rss = None if r.convert_peak_rss is None else r.convert_peak_rss / 1e6
        tps = "–"
        if r.decode_tps:
            tps = f"{statistics.median(r.decode_tps):.1f} ({max(r.decode_tps):.1f})"
        top1 = None if r.top1 is None else 100 * r.top1
        lines.append(
            f"| {r.name} | {size} | {fmt(r.convert_seconds, '.1f')} | {fmt(rss, '.0f')} | {ppl} "
            f"| {fmt(r.kl, '.4f')} | {fmt(top1, '.1f')}% | {tps} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--gguf", type=Path, help="GGUF file (default: the default model via tokenwire's cache)"
    )
    parser.add_argument("--work", type=Path, help="directory for converted models (default: a temporary one)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--genai-python", help="python of a venv with onnxruntime-genai for the builder comparison"
    )
    parser.add_argument("--llamacpp-python", help="python of a venv with llama-cpp-python")
    parser.add_argument("--float16", action="store_true", help="also convert and measure a float16 export")
    parser.add_argument("--time-reference", action="store_true", help="also time the float32 reference")
    args = parser.parse_args()

    if args.gguf is None:
        from tokenwire.server.model_tools.pull import fetch_gguf

        args.gguf = fetch_gguf(progress=False)
    gguf: Path = args.gguf.resolve()
    work = args.work or Path(tempfile.mkdtemp(prefix="convert-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    from tokenizers import Tokenizer

    results: list[Result] = []
    ours = Result("tokenwire convert_gguf (float32 activations)")
    converted = work / "tokenwire"
    shutil.rmtree(converted, ignore_errors=True)
    measured = run_child([sys.executable, __file__, "_convert", str(gguf), str(converted), "float32"])
    ours.convert_seconds, ours.convert_peak_rss = measured["seconds"], measured["peak_rss"]
    ids = Tokenizer.from_file(str(converted / "tokenizer.json")).encode(PASSAGE.read_text()).ids
    ids_file = work / "passage_ids.json"
    ids_file.write_text(json.dumps(ids))
    print(f"passage: {len(ids)} tokens; GGUF {gguf.stat().st_size / 1e6:.1f} MB", file=sys.stderr)

    # Quality first, one model at a time.
    reference_dir = work / "reference-fp32"
    run_child([sys.executable, __file__, "_reference", str(gguf), str(reference_dir), str(converted)])
    reference = Result("float32 reference (dequantized GGUF weights, same graph)")
    reference_logits = measure_quality(reference, reference_dir, ids, None, args.threads)
    results.append(reference)
    measure_quality(ours, converted, ids, reference_logits, args.threads)
    results.append(ours)
    timed: list[tuple[Result, Path]] = [(ours, converted)]
    if args.time_reference:
        timed.append((reference, reference_dir))

    if args.float16:
        half = Result("tokenwire convert_gguf (float16 activations, run on CPU)")
        half_dir = work / "tokenwire-fp16"
        shutil.rmtree(half_dir, ignore_errors=True)
        measured = run_child([sys.executable, __file__, "_convert", str(gguf), str(half_dir), "float16"])
        half.convert_seconds, half.convert_peak_rss = measured["seconds"], measured["peak_rss"]
        measure_quality(half, half_dir, ids, reference_logits, args.threads)
        results.append(half)
        timed.append((half, half_dir))

    builder = Result("ONNX Runtime GenAI builder (-p int4 -e cpu, from the dequantized GGUF)")
    builder_dir = build_genai(args, gguf, converted, work, builder)
    if builder_dir is not None:
        measure_quality(builder, builder_dir, ids, reference_logits, args.threads)
        timed.append((builder, builder_dir))
    results.append(builder)

    llama = Result("llama.cpp (llama-cpp-python, same GGUF)")
    with_llama = llamacpp_quality(args, gguf, ids_file, ids, reference_logits, llama)
    results.append(llama)

    # Speed: the candidates take turns, so a busy machine slows them all alike.
    prompt = ids[: args.prompt_tokens]
    decoders = []
    for result, model_dir in timed:
        decoder = SharedBufferDecoder(model_dir, threads=args.threads, max_len=len(prompt) + args.new_tokens)
        decoder.greedy(prompt, 8)  # warm-up
        decoders.append((result, decoder))
    for _ in range(args.repeats):
        for result, decoder in decoders:
            result.decode_tps.append(decoder.greedy(prompt, args.new_tokens)[1])
        if with_llama:
            llama.decode_tps.append(llamacpp_decode_once(args, gguf, ids_file))

    reference_ppl = reference.ppl if reference.ppl is not None else float("nan")
    print(
        f"\nGGUF: {gguf.name}, {gguf.stat().st_size / 1e6:.1f} MB; passage {len(ids)} tokens; "
        f"decode: batch 1, {args.threads} threads, {args.prompt_tokens}-token prompt, "
        f"{args.new_tokens} new tokens, "
        f"{args.repeats} runs; CPU: {os.cpu_count()} logical cores\n"
    )
    print(table(results, gguf.stat().st_size, reference_ppl))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1].startswith("_"):
        command, rest = sys.argv[1], sys.argv[2:]
        if command == "_convert":
            child_convert(Path(rest[0]), Path(rest[1]), rest[2])
        elif command == "_reference":
            child_float_reference(Path(rest[0]), Path(rest[1]), Path(rest[2]))
        elif command == "_hf-checkpoint":
            child_hf_checkpoint(Path(rest[0]), Path(rest[1]), Path(rest[2]))
        elif command == "_llamacpp-logits":
            child_llamacpp_logits(Path(rest[0]), Path(rest[1]), int(rest[2]))
        elif command == "_llamacpp-speed":
            child_llamacpp_speed(Path(rest[0]), Path(rest[1]), int(rest[2]), int(rest[3]), int(rest[4]))
        else:
            raise SystemExit(f"unknown internal command {command}")
    else:
        main()
