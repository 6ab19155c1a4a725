"""GGUF file -> ONNX Runtime GenAI-format model directory."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tokenwire.server.model_tools.convert.errors import ConversionError
from tokenwire.server.model_tools.convert.genai_config import MODEL_FILENAME, TokenIds, write_genai_config
from tokenwire.server.model_tools.convert.gguf_source import GgufModel, read_gguf
from tokenwire.server.model_tools.convert.gguf_tokenizer import write_gguf_tokenizer_files
from tokenwire.server.model_tools.convert.llama_graph import (
    ActivationType,
    GraphOptions,
    build_llama_graph,
    save_model,
)
from tokenwire.server.model_tools.convert.lora_graph import LoraOptions

# Called with a short description of the stage that just started and the fraction of the whole
# conversion done before it (0.0 to 1.0; 1.0 once finished).
ProgressCallback = Callable[[str, float], None]

CONVERSION_INFO_FILENAME = "conversion.json"
# Raised whenever the files convert_gguf writes change, so caches of older output are rebuilt.
CONVERTER_VERSION = 3

# Rough share of conversion time per stage, so progress bars move evenly.
_STAGES = (("read GGUF", 0.0), ("write tokenizer", 0.3), ("build graph", 0.35), ("write model", 0.65))


def conversion_is_current(model_dir: Path) -> bool:
    """Whether `model_dir` holds a complete conversion by this version of the converter."""
    try:
        info = json.loads((model_dir / CONVERSION_INFO_FILENAME).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and info.get("converter_version") == CONVERTER_VERSION


@dataclass(frozen=True)
class ConvertedLora:
    """What a converted directory records of its LoRA sites (conversion.json's lora_modules)."""

    architecture: str
    modules: tuple[str, ...] | None
    """The modules asked for, as LoraOptions.modules; None: every projection."""


def converted_lora(model_dir: Path) -> ConvertedLora | None:
    """The LoRA sites `model_dir` was converted with; None when it has none or is no conversion."""
    try:
        info = json.loads((model_dir / CONVERSION_INFO_FILENAME).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict):
        return None
    modules, architecture = info.get("lora_modules"), info.get("architecture")
    if not isinstance(architecture, str):
        return None
    if modules == "all":
        return ConvertedLora(architecture, None)
    if isinstance(modules, list) and all(isinstance(m, str) for m in modules):
        return ConvertedLora(architecture, tuple(modules))
    return None


def convert_gguf(
    gguf_path: Path,
    out_dir: Path,
    *,
    dtype: str = "float32",
    progress: ProgressCallback | None = None,
    lora: LoraOptions | None = None,
) -> Path:
    """Convert a Llama-family GGUF file into `out_dir` and return `out_dir`.

    `dtype` is the activation and KV-cache type: "float32" for CPU, "float16" for CUDA (whose
    GroupQueryAttention needs half precision). Logits are float32 either way. Quantized weights
    keep their GGUF codes and scales exactly. With `lora`, the graph takes per-row LoRA adapters
    on those projections (lora_graph.py; conversion.json records which).
    """
    if dtype not in ("float32", "float16"):
        raise ValueError(f"dtype must be float32 or float16, not {dtype!r}")
    activation: ActivationType = "float16" if dtype == "float16" else "float32"

    def report(stage: int) -> None:
        if progress is not None:
            name, fraction = _STAGES[stage]
            progress(name, fraction)

    started = time.perf_counter()
    report(0)
    source = read_gguf(gguf_path)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConversionError(f"{out_dir} exists and is not a directory")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Everything is written into a scratch directory beside the target and moved into place only
    # when complete, so a refusal or a crash halfway never leaves a partial model behind.
    scratch = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.converting-"))
    try:
        # mkdtemp makes it owner-only; the published model gets the usual permissions.
        umask = os.umask(0)
        os.umask(umask)
        scratch.chmod(0o777 & ~umask)
        _write_conversion(
            source, gguf_path, scratch, GraphOptions(dtype=activation, lora=lora), report, started
        )
        _publish(scratch, out_dir)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if progress is not None:
        progress("done", 1.0)
    return out_dir


def _write_conversion(
    source: GgufModel,
    gguf_path: Path,
    out_dir: Path,
    options: GraphOptions,
    report: Callable[[int], None],
    started: float,
) -> None:
    # The tokenizer first: a vocabulary it cannot rebuild fails before the slow stages.
    report(1)
    vocab = source.vocabulary
    write_gguf_tokenizer_files(out_dir, vocab, model_max_length=source.config.context_length)
    eos = vocab.end_token_ids()
    if not eos:
        raise ConversionError("the GGUF vocabulary names no end-of-sequence token")
    bos = vocab.bos_token_id if vocab.bos_token_id is not None else eos[0]
    pad = vocab.pad_token_id if vocab.pad_token_id is not None else eos[0]
    report(2)
    model_path = out_dir / MODEL_FILENAME
    model = build_llama_graph(
        source.config,
        source.weights,
        options,
        external_data=model_path.with_name(model_path.name + ".data"),
    )
    report(3)
    save_model(model, model_path, external_data=False)
    del model
    write_genai_config(out_dir, source.config, TokenIds(bos=bos, eos=eos, pad=pad), dtype=options.dtype)
    info = {
        "converter_version": CONVERTER_VERSION,
        "source": gguf_path.name,
        "model_name": source.name,
        "architecture": source.architecture,
        "dtype": options.dtype,
        "gguf_tensor_types": source.tensor_types,
        "seconds": round(time.perf_counter() - started, 2),
    }
    if options.lora is not None:
        modules = options.lora.modules
        info["lora_modules"] = "all" if modules is None else sorted(modules)
    (out_dir / CONVERSION_INFO_FILENAME).write_text(json.dumps(info, indent=2))


def _publish(finished: Path, out_dir: Path) -> None:
    """Move a finished conversion to `out_dir`, replacing what was there."""
    if out_dir.exists():
        stale = out_dir.with_name(f".{out_dir.name}.replaced-{os.getpid()}")
        out_dir.rename(stale)
        shutil.rmtree(stale, ignore_errors=True)
    finished.rename(out_dir)
