"""Load a model directory: detect its layout, build its runner, tokenizer and chat template.

Two layouts are recognised by their files and graph inputs:
- "genai": ONNX Runtime GenAI model-builder output (genai_config.json + GroupQueryAttention),
  served by SharedKvRunner.
- "optimum": a Hugging Face Optimum export (model.onnx with past_key_values inputs, config.json),
  served by OptimumRunner.

A graph with LoRA sites (built with them: model_tools/convert/lora_graph.py) gets its adapter
stacks here, sized by the settings' adapter bounds, empty until adapters are loaded into them.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import onnxruntime as ort

from tokenwire.server.models.adapters import AdapterStacks, LoraLayout
from tokenwire.server.models.hidden_states import expose_hidden_states
from tokenwire.server.models.kv_settings import KvCacheSettings
from tokenwire.server.models.kv_store import open_kv_store
from tokenwire.server.models.optimum_runner import OptimumRunner
from tokenwire.server.models.pooling import Pooling, read_pooling
from tokenwire.server.models.runner import ModelInfo, ModelRunner
from tokenwire.server.models.session import SessionSettings, choose_provider, create_session, ort_device_name
from tokenwire.server.models.shared_kv_runner import SharedKvLayout, SharedKvRunner
from tokenwire.server.text.chat import ChatTemplate, ChatTemplateError
from tokenwire.server.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)


MAX_DECLARED_SIZE = 1 << 24
"""Largest context length, vocabulary or layer size believed from a config file (16M)."""


class ModelDirectoryError(ValueError):
    """A file of the model directory is unusable; the message is one line naming file and field."""


class KvCacheSettingError(ValueError):
    """The KV cache cannot be had as the settings ask; the message names the flags and what would do."""


@dataclass(frozen=True)
class LoadSettings:
    max_batch_size: int = 8
    max_context_length: int = 2048
    """Upper bound on a sequence's length; the preallocated KV cache is sized from it."""
    session: SessionSettings = field(default_factory=SessionSettings)
    max_loras: int = 4
    """Adapter slots of a graph with LoRA sites: the most adapters loaded at once."""
    max_lora_rank: int = 16
    """The largest adapter rank the stacks hold."""
    kv_cache: KvCacheSettings = field(default_factory=KvCacheSettings)


@dataclass(frozen=True)
class LoadedModel:
    info: ModelInfo
    runner: ModelRunner
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None
    adapters: AdapterStacks | None = None
    """The adapter stacks of a graph with LoRA sites; None: the graph takes no adapters."""
    directory: Path | None = None


def detect_format(model_dir: Path) -> str:
    if (model_dir / "genai_config.json").is_file():
        return "genai"
    if (model_dir / "model.onnx").is_file():
        return "optimum"
    raise FileNotFoundError(f"{model_dir} holds neither genai_config.json nor model.onnx")


def load_model(model_dir: Path, settings: LoadSettings, *, name: str | None = None) -> LoadedModel:
    model_dir = model_dir.resolve()
    model_format = detect_format(model_dir)
    tokenizer = Tokenizer.from_file(model_dir / "tokenizer.json")
    tokenizer_config = _read_json(model_dir / "tokenizer_config.json")
    chat_template = _chat_template(model_dir, tokenizer_config)
    common = _Common(
        name=name or model_dir.name,
        settings=settings,
        tokenizer=tokenizer,
        chat_template=chat_template,
        eos_from_tokenizer=frozenset(_named_token_ids(tokenizer, tokenizer_config, "eos_token")),
        device=ort_device_name(choose_provider(settings.session.device)),
        pooling=read_pooling(model_dir),
    )
    if model_format == "genai":
        return _load_genai(model_dir, common)
    return _load_optimum(model_dir, common)


@dataclass(frozen=True)
class _Common:
    """What loading needs whatever the layout."""

    name: str
    settings: LoadSettings
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None
    eos_from_tokenizer: frozenset[int]
    device: str
    pooling: Pooling

    def info(
        self,
        *,
        model_format: str,
        vocab_size: object,
        declared_context: object,
        eos_token_ids: set[int],
        search_defaults: dict[str, Any],
    ) -> ModelInfo:
        limit = self.settings.max_context_length
        context = min(int(declared_context), limit) if isinstance(declared_context, int) else limit
        return ModelInfo(
            name=self.name,
            format=model_format,
            vocab_size=int(vocab_size) if isinstance(vocab_size, int) else self.tokenizer.vocab_size,
            context_length=context,
            eos_token_ids=frozenset(eos_token_ids) | self.eos_from_tokenizer,
            max_batch_size=self.settings.max_batch_size,
            default_temperature=_default_temperature(search_defaults),
            pooling=self.pooling,
        )

    def loaded(
        self, info: ModelInfo, runner: ModelRunner, adapters: AdapterStacks | None, directory: Path
    ) -> LoadedModel:
        return LoadedModel(
            info=info,
            runner=runner,
            tokenizer=self.tokenizer,
            chat_template=self.chat_template,
            adapters=adapters,
            directory=directory,
        )

    def adapter_stacks(self, session: ort.InferenceSession) -> AdapterStacks | None:
        """Empty stacks for a graph with LoRA sites; None for one without."""
        layout = LoraLayout.from_session(session)
        if layout is None:
            return None
        settings = self.settings
        stacks = AdapterStacks(
            layout,
            max_loras=settings.max_loras,
            max_rank=settings.max_lora_rank,
            device=self.device,
            device_id=settings.session.device_id,
        )
        log.info(
            "model %s: %d LoRA sites, adapter stacks %.1f MiB for %d adapters of rank up to %d",
            self.name,
            len(layout.sites),
            stacks.nbytes / 2**20,
            settings.max_loras,
            settings.max_lora_rank,
        )
        return stacks


def _load_genai(model_dir: Path, common: _Common) -> LoadedModel:
    config = _read_json(model_dir / "genai_config.json", required=True)
    model_cfg = _object(config, "model", model_dir / "genai_config.json")
    decoder = _object(model_cfg, "decoder", model_dir / "genai_config.json", prefix="model.")
    _check_sizes(
        model_dir / "genai_config.json", model_cfg, ("context_length", "vocab_size"), prefix="model."
    )
    _check_sizes(
        model_dir / "genai_config.json",
        decoder,
        ("num_hidden_layers", "num_key_value_heads", "num_attention_heads", "head_size", "hidden_size"),
        prefix="model.decoder.",
    )
    settings = common.settings
    graph = _inside(
        model_dir, decoder.get("filename", "model.onnx"), "genai_config.json", "model.decoder.filename"
    )
    exposed = expose_hidden_states(graph)
    session = create_session(graph, settings.session, graph=exposed.model if exposed else None)
    layout = SharedKvLayout.from_session(session, config)
    info = common.info(
        model_format="genai",
        vocab_size=model_cfg.get("vocab_size"),
        declared_context=model_cfg.get("context_length"),
        eos_token_ids=_token_ids(model_cfg.get("eos_token_id")),
        search_defaults=_object(config, "search", model_dir / "genai_config.json"),
    )
    geometry = layout.geometry(settings.max_batch_size, info.context_length)
    _check_kv_bound(geometry.bytes_per_position, info, settings)
    try:
        store = open_kv_store(
            geometry,
            settings.kv_cache.location,
            session,
            device=common.device,
            device_id=settings.session.device_id,
        )
    except ValueError as error:
        raise KvCacheSettingError(str(error)) from error
    except Exception as error:  # ONNX Runtime fails an allocation (device memory) with a RuntimeError
        raise KvCacheSettingError(
            f"--max-batch-size {settings.max_batch_size} x --max-context-length {info.context_length}: "
            f"setting up {geometry.total_bytes / 2**20:.1f} MiB of KV cache on {common.device} "
            f"failed: {error}"
        ) from error
    info = replace(info, kv_cache_bytes=store.allocated_bytes, kv_cache_placement=store.describe())
    adapters = common.adapter_stacks(session)
    runner = SharedKvRunner(
        session,
        info,
        layout,
        store,
        hidden_output=exposed.hidden_output if exposed else None,
        adapters=adapters,
    )
    info = runner.info
    log.info(
        "model %s: genai layout, context %d, KV cache %.1f MiB (%d bytes) allocated in %s "
        "(--kv-cache-location %s) for %d slots; its rows move by %s",
        info.name,
        info.context_length,
        info.kv_cache_bytes / 2**20,
        info.kv_cache_bytes,
        info.kv_cache_placement,
        store.location,
        settings.max_batch_size,
        "ONNX Runtime on the same device" if store.location == "device" else "NumPy",
    )
    return common.loaded(info, runner, adapters, model_dir)


def _load_optimum(model_dir: Path, common: _Common) -> LoadedModel:
    config = _read_json(model_dir / "config.json")
    generation = _read_json(model_dir / "generation_config.json")
    context_keys = ("max_position_embeddings", "n_positions", "n_ctx", "seq_length")
    _check_sizes(
        model_dir / "config.json",
        config,
        (*context_keys, "vocab_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"),
    )
    exposed = expose_hidden_states(model_dir / "model.onnx")
    session = create_session(
        model_dir / "model.onnx", common.settings.session, graph=exposed.model if exposed else None
    )
    info = common.info(
        model_format="optimum",
        vocab_size=config.get("vocab_size"),
        declared_context=next((config[k] for k in context_keys if isinstance(config.get(k), int)), None),
        eos_token_ids=_token_ids(generation.get("eos_token_id")) | _token_ids(config.get("eos_token_id")),
        search_defaults=generation,
    )
    info = replace(info, kv_cache_placement=f"ONNX Runtime memory on {common.device}")
    adapters = common.adapter_stacks(session)
    runner = OptimumRunner(
        session,
        info,
        common.device,
        hidden_output=exposed.hidden_output if exposed else None,
        adapters=adapters,
    )
    _check_kv_bound(runner.kv_bytes_per_token(), info, common.settings)
    log.info(
        "model %s: optimum layout, context %d, KV cache grows per step in %s (the model's own "
        "outputs; --kv-cache-location applies to the genai layout)",
        info.name,
        info.context_length,
        info.kv_cache_placement,
    )
    return common.loaded(runner.info, runner, adapters, model_dir)


def _check_kv_bound(bytes_per_position: int, info: ModelInfo, settings: LoadSettings) -> None:
    """Refuse settings whose slots of full context would need more KV cache than --kv-cache-mb,
    saying what would fit; before the cache is allocated."""
    limit = settings.kv_cache.limit_bytes
    slots, positions = settings.max_batch_size, info.context_length
    needed = bytes_per_position * slots * positions
    if limit is None or needed <= limit:
        return
    capped = ", the model's own context" if positions < settings.max_context_length else ""
    mb = settings.kv_cache.mb
    fitting_positions = limit // (bytes_per_position * slots)
    fitting_slots = limit // (bytes_per_position * positions)
    shorter = (
        f"{slots} slots of {fitting_positions} positions (--max-context-length {fitting_positions})"
        if fitting_positions > 0
        else f"not one position for each of {slots} slots"
    )
    fewer = (
        f"{fitting_slots} slots of {positions} positions (--max-batch-size {fitting_slots})"
        if fitting_slots > 0
        else f"no slot of {positions} positions"
    )
    raise KvCacheSettingError(
        f"--kv-cache-mb {mb}: --max-batch-size {slots} slots of {positions} positions "
        f"(--max-context-length{capped}) need {needed / 2**20:.1f} MiB of KV cache for {info.name} "
        f"({bytes_per_position / 2**10:.1f} KiB a position); {mb} MiB holds {shorter}, or {fewer}; "
        f"or raise --kv-cache-mb to {-(-needed // 2**20)}"
    )


def _read_json(path: Path, *, required: bool = False) -> dict[str, Any]:
    if not path.is_file() and not required:
        return {}
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ModelDirectoryError(f"{path}: cannot be read as JSON: {_one_line(error)}") from error
    if not isinstance(loaded, dict):
        if required:
            raise ModelDirectoryError(f"{path}: must hold a JSON object")
        return {}
    return loaded


def _object(config: dict[str, Any], key: str, path: Path, *, prefix: str = "") -> dict[str, Any]:
    value = config.get(key, {})
    if not isinstance(value, dict):
        raise ModelDirectoryError(f"{path}: {prefix}{key}: must be a JSON object")
    return value


def _check_sizes(path: Path, config: dict[str, Any], keys: tuple[str, ...], *, prefix: str = "") -> None:
    """Each of `keys` that is present must be a whole number from 1 to MAX_DECLARED_SIZE: a
    negative or absurd size would otherwise surface only when requests fail, or size memory."""
    for key in keys:
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_DECLARED_SIZE:
            shown = repr(value)[:40]
            raise ModelDirectoryError(
                f"{path}: {prefix}{key}: must be a whole number from 1 to {MAX_DECLARED_SIZE}, got {shown}"
            )


def _inside(model_dir: Path, name: object, file: str, field: str) -> Path:
    """`name` from a config file as a path in the model directory; refused when it is not a plain
    relative path that stays inside (an absolute path, or one climbing out with "..")."""
    text = str(name)
    relative = Path(text)
    if not text or relative.is_absolute() or ".." in relative.parts or "\x00" in text:
        raise ModelDirectoryError(
            f"{model_dir / file}: {field}: {text[:80]!r} is not a file inside the model directory"
        )
    return model_dir / relative


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())[:200]


def _token_ids(value: object) -> set[int]:
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int)}
    return set()


def _token_text(value: object) -> str | None:
    # tokenizer_config.json stores special tokens either as strings or as AddedToken objects.
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _named_token_ids(tokenizer: Tokenizer, tokenizer_config: dict[str, Any], key: str) -> set[int]:
    text = _token_text(tokenizer_config.get(key))
    found = tokenizer.token_to_id(text) if text else None
    return set() if found is None else {found}


def _default_temperature(search: dict[str, Any]) -> float:
    if not search.get("do_sample", False):
        return 0.0
    return float(search.get("temperature", 1.0))


def _chat_template(model_dir: Path, tokenizer_config: dict[str, Any]) -> ChatTemplate | None:
    source = tokenizer_config.get("chat_template")
    if isinstance(source, list):  # several named templates: use the default one
        source = next(
            (t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None
        )
    template_file = model_dir / "chat_template.jinja"
    origin = model_dir / "tokenizer_config.json"
    if not isinstance(source, str) and template_file.is_file():
        source, origin = template_file.read_text(encoding="utf-8"), template_file
    if not isinstance(source, str) or not source.strip():
        return None
    try:
        template = ChatTemplate(
            source,
            bos_token=_token_text(tokenizer_config.get("bos_token")) or "",
            eos_token=_token_text(tokenizer_config.get("eos_token")) or "",
        )
        template.check_budget()  # a template over budget on a small conversation is never served
    except ChatTemplateError as error:
        raise ModelDirectoryError(f"{origin}: chat_template: {_one_line(error)}") from error
    return template
