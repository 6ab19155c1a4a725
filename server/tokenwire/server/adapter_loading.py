"""Loading LoRA adapters into a model's adapter stacks: the `--lora NAME=PATH` ones at start-up,
and loads and unloads while serving (the admin RPC and its HTTP routes).

Each adapter is read from its file (a PEFT directory or a GGUF adapter: model_tools/lora),
checked against the model's LoRA sites and the rank bound before its tensors are read, and
written into a free slot. At start-up the first refusal stops the server with one line naming
the adapter and the problem (models/adapters.AdapterError).

While serving, the file is read and the slot written on a worker thread: a free slot is read by
no row of a running step, so the engine steps on meanwhile. An unload first takes the name away
from new requests, then waits for the requests running with it to finish (they are never cut
short), then zeroes and frees the slot; a caller that stops waiting leaves that to finish in the
background.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path

from tokenwire.server.api.adapter_admin import AdapterLoaded, AdapterUnloaded
from tokenwire.server.api.registry import ModelRegistry, ServedAdapter, ServedModel
from tokenwire.server.config import ADAPTER_NAME, LoraSource
from tokenwire.server.engine.errors import ErrorKind, FieldViolation, GenerationError
from tokenwire.server.model_tools.convert.converter import converted_lora
from tokenwire.server.model_tools.convert.lora_graph import PROJECTIONS, short_name, short_names
from tokenwire.server.model_tools.lora import AdapterBase, read_adapter
from tokenwire.server.models.adapters import FUSED_MODULES, AdapterError, AdapterStacks, UnsitedModuleError
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
    return tuple(_load_one(model, stacks, source.name, source.path) for source in sources)


def _load_one(model: LoadedModel, stacks: AdapterStacks, name: str, path: Path) -> ServedAdapter:
    """Read one adapter file and write it into a free slot (raises AdapterError or OSError)."""
    base = _adapter_base(model.directory)
    try:
        adapter = read_adapter(path, stacks.layout, base=base, max_rank=stacks.max_rank, name=name)
    except UnsitedModuleError as error:
        raise AdapterError(_with_chosen_sites(error, model.directory)) from None
    stacks.load(adapter)
    return ServedAdapter(
        name=name,
        base=model.info.name,
        rank=adapter.rank,
        source="peft" if path.is_dir() else "gguf",
        memory_bytes=stacks.layout.slot_bytes(stacks.max_rank),
    )


def _with_chosen_sites(error: UnsitedModuleError, directory: Path | None) -> str:
    """The refusal of an adapter for a module without a site, saying so when --lora-modules left
    the site out (the conversion records the modules it was asked for)."""
    recorded = converted_lora(directory) if directory is not None else None
    if recorded is None or recorded.modules is None:
        return str(error)
    chosen = ",".join(short_names(recorded.modules))
    advice = ""
    if error.module in PROJECTIONS or error.module in FUSED_MODULES:
        advice = f": add {short_name(error.module)} to --lora-modules to serve this adapter"
    return f"{error}; the model was converted with LoRA sites only for --lora-modules {chosen}{advice}"


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


class RuntimeAdapters:
    """The AdapterAdmin of a running server (api/adapter_admin.py): loads and unloads on the
    registry's models, one at a time."""

    def __init__(self, registry: ModelRegistry) -> None:
        self._registry = registry
        self._changing = asyncio.Lock()
        self._unloading: set[tuple[str, str]] = set()
        self._background: set[asyncio.Task[None]] = set()

    async def load(self, model: str, name: str, path: str) -> AdapterLoaded:
        served = self._registry.resolve(model)
        stacks = _stacks_of(served)
        if not ADAPTER_NAME.match(name):
            raise _invalid(
                "name", "must be 1 to 64 letters, digits, '.', '_' or '-', starting with a letter or digit"
            )
        async with self._changing:
            if served.adapters.get(name) is not None or (served.name, name) in self._unloading:
                raise GenerationError(
                    ErrorKind.ALREADY_EXISTS,
                    f"adapter {name!r} is already served on model {served.name} (or still unloading)",
                    violations=(FieldViolation("name", "an adapter of that name is served"),),
                    reason="ADAPTER_EXISTS",
                )
            if len(stacks.names) >= stacks.max_loras:
                raise GenerationError(
                    ErrorKind.RESOURCE_EXHAUSTED,
                    f"model {served.name}: all {stacks.max_loras} adapter slots are taken (--max-loras)",
                    violations=(FieldViolation("name", "no adapter slot is free: unload one first"),),
                    reason="ADAPTER_SLOTS_FULL",
                )
            try:
                adapter = await asyncio.to_thread(_load_one, served.model, stacks, name, Path(path))
            except (AdapterError, OSError, ValueError) as error:
                raise _invalid("path", str(error)) from None
            served.adapters.add(adapter)
            return AdapterLoaded(adapter, free_slots=stacks.max_loras - len(stacks.names))

    async def unload(self, model: str, name: str) -> AdapterUnloaded:
        served = self._registry.resolve(model)
        stacks = _stacks_of(served)
        async with self._changing:
            adapter = served.adapters.get(name)
            if adapter is None:
                raise GenerationError(
                    ErrorKind.NOT_FOUND,
                    f"adapter {name[:80]!r} is not served on model {served.name}",
                    violations=(FieldViolation("name", "no adapter of that name is served"),),
                    reason="ADAPTER_NOT_FOUND",
                )
            # From here no new request may name it; the live ones finish first.
            served.adapters.remove(name)
            served.engine.retire_adapter(name)
            self._unloading.add((served.name, name))
        retiring = asyncio.create_task(self._free_slot(served, stacks, name))
        self._background.add(retiring)
        retiring.add_done_callback(self._background.discard)
        await asyncio.shield(retiring)
        return AdapterUnloaded(adapter.memory_bytes, free_slots=stacks.max_loras - len(stacks.names))

    async def _free_slot(self, served: ServedModel, stacks: AdapterStacks, name: str) -> None:
        try:
            await served.engine.wait_adapter_unused(name)
            await asyncio.to_thread(stacks.unload, name)
        finally:
            served.engine.restore_adapter(name)
            self._unloading.discard((served.name, name))


def _stacks_of(served: ServedModel) -> AdapterStacks:
    stacks = served.model.adapters
    if stacks is None:
        raise _invalid("model", f"model {served.name}'s graph has no LoRA sites: it takes no adapters")
    return stacks


def _invalid(field: str, problem: str) -> GenerationError:
    return GenerationError(
        ErrorKind.INVALID_ARGUMENT,
        f"{field}: {problem}",
        violations=(FieldViolation(field, problem),),
        reason="BAD_ADAPTER",
    )
