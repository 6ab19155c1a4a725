"""Loading the `--lora NAME=PATH` adapters into a model's adapter stacks at start-up.

Each adapter is read from its file (a PEFT directory or a GGUF adapter: model_tools/lora),
checked against the model's LoRA sites and the rank bound before its tensors are read, and
written into a free slot. The first refusal stops the start-up with one line naming the adapter
and the problem (models/adapters.AdapterError).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tokenwire.server.api.registry import ServedAdapter
from tokenwire.server.config import LoraSource
from tokenwire.server.model_tools.lora import AdapterBase, read_adapter
from tokenwire.server.models.adapters import AdapterError
from tokenwire.server.models.loader import LoadedModel


def load_adapters(model: LoadedModel, sources: Sequence[LoraSource]) -> tuple[ServedAdapter, ...]:
    """Read every source into `model`'s stacks; what is served, in load order."""
    if not sources:
        return ()
    stacks = model.adapters
    if stacks is None:
        raise AdapterError(
            f"--lora: model {model.info.name}'s graph takes no LoRA adapters: serve a GGUF file or the "
            "default model (converted with LoRA sites when --lora is given), or a graph built with them"
        )
    base = _adapter_base(model.directory)
    served = []
    for source in sources:
        adapter = read_adapter(
            source.path, stacks.layout, base=base, max_rank=stacks.max_rank, name=source.name
        )
        stacks.load(adapter)
        served.append(
            ServedAdapter(
                name=source.name,
                base=model.info.name,
                rank=adapter.rank,
                source="peft" if source.path.is_dir() else "gguf",
                memory_bytes=stacks.layout.slot_bytes(stacks.max_rank),
            )
        )
    return tuple(served)


def _adapter_base(directory: Path | None) -> AdapterBase:
    """What a GGUF adapter is checked against; an Optimum export names its heads in config.json."""
    if directory is not None and (directory / "genai_config.json").is_file():
        return AdapterBase.from_model_dir(directory)
    config: dict[str, object] = {}
    if directory is not None and (directory / "config.json").is_file():
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    heads = config.get("num_attention_heads", config.get("n_head", 1))
    kv_heads = config.get("num_key_value_heads", heads)
    return AdapterBase(
        architecture=None,
        num_heads=heads if isinstance(heads, int) else 1,
        num_kv_heads=kv_heads if isinstance(kv_heads, int) else 1,
    )
