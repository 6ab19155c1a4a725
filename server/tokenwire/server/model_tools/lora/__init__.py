"""LoRA adapter files: PEFT directories and llama.cpp's GGUF adapters, read and fitted to a graph.

`read_adapter` takes either and returns a models.adapters.LoraAdapter, checked against the
graph's LoRA sites and the rank bound before its tensors are read; every refusal is an
AdapterError of one line naming the adapter and the problem.
"""

from __future__ import annotations

from pathlib import Path

from tokenwire.server.model_tools.lora.gguf_adapter import AdapterBase, read_gguf_adapter
from tokenwire.server.model_tools.lora.peft_adapter import read_peft_adapter
from tokenwire.server.models.adapters import AdapterError, LoraAdapter, LoraLayout


def read_adapter(
    path: Path, layout: LoraLayout, *, base: AdapterBase, max_rank: int, name: str | None = None
) -> LoraAdapter:
    """A PEFT adapter directory or a GGUF adapter file, fitted to `layout`."""
    label = name or path.name
    if path.is_dir():
        return read_peft_adapter(path, layout, max_rank=max_rank, name=label)
    if path.is_file():
        return read_gguf_adapter(path, layout, base=base, max_rank=max_rank, name=name or path.stem)
    raise AdapterError(f"adapter {label}: {path} is neither a PEFT adapter directory nor a GGUF file")


__all__ = ["AdapterBase", "AdapterError", "read_adapter", "read_gguf_adapter", "read_peft_adapter"]
