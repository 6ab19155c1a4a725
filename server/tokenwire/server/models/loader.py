"""Load a model directory: detect its layout, build its runner, tokenizer and chat template.

Two layouts are recognised by their files and graph inputs:
- "genai": ONNX Runtime GenAI model-builder output (genai_config.json + GroupQueryAttention),
  served by SharedKvRunner.
- "optimum": a Hugging Face Optimum export (model.onnx with past_key_values inputs, config.json),
  served by OptimumRunner.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import onnxruntime as ort

from tokenwire.server.models.optimum_runner import OptimumRunner
from tokenwire.server.models.runner import ModelInfo, ModelRunner
from tokenwire.server.models.session import SessionSettings, choose_provider, create_session, ort_device_name
from tokenwire.server.models.shared_kv_runner import SharedKvLayout, SharedKvRunner, read_genai_config
from tokenwire.server.text.chat import ChatTemplate
from tokenwire.server.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadSettings:
    max_batch_size: int = 8
    max_context_length: int = 2048
    """Upper bound on a sequence's length; the preallocated KV cache is sized from it."""
    session: SessionSettings = field(default_factory=SessionSettings)


@dataclass(frozen=True)
class LoadedModel:
    info: ModelInfo
    runner: ModelRunner
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None


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

    def info(
        self,
        *,
        model_format: str,
        session: ort.InferenceSession,
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
            execution_provider=session.get_providers()[0],
        )

    def loaded(self, info: ModelInfo, runner: ModelRunner) -> LoadedModel:
        return LoadedModel(
            info=info, runner=runner, tokenizer=self.tokenizer, chat_template=self.chat_template
        )


def _load_genai(model_dir: Path, common: _Common) -> LoadedModel:
    config = read_genai_config(model_dir)
    model_cfg: dict[str, Any] = dict(config.get("model", {}))  # type: ignore[call-overload]
    decoder: dict[str, Any] = model_cfg.get("decoder", {})
    settings = common.settings
    session = create_session(model_dir / str(decoder.get("filename", "model.onnx")), settings.session)
    layout = SharedKvLayout.from_session(session, config)
    info = common.info(
        model_format="genai",
        session=session,
        vocab_size=model_cfg.get("vocab_size"),
        declared_context=model_cfg.get("context_length"),
        eos_token_ids=_token_ids(model_cfg.get("eos_token_id")),
        search_defaults=dict(config.get("search", {})),  # type: ignore[call-overload]
    )
    info = replace(info, kv_cache_bytes=layout.cache_bytes(settings.max_batch_size, info.context_length))
    runner = SharedKvRunner(
        session,
        info,
        layout,
        slots=settings.max_batch_size,
        max_len=info.context_length,
        device=common.device,
        device_id=settings.session.device_id,
    )
    log.info(
        "model %s: genai layout, context %d, KV cache %.1f MiB preallocated for %d slots",
        info.name,
        info.context_length,
        info.kv_cache_bytes / 2**20,
        settings.max_batch_size,
    )
    return common.loaded(info, runner)


def _load_optimum(model_dir: Path, common: _Common) -> LoadedModel:
    config = _read_json(model_dir / "config.json")
    generation = _read_json(model_dir / "generation_config.json")
    session = create_session(model_dir / "model.onnx", common.settings.session)
    context_keys = ("max_position_embeddings", "n_positions", "n_ctx", "seq_length")
    info = common.info(
        model_format="optimum",
        session=session,
        vocab_size=config.get("vocab_size"),
        declared_context=next((config[k] for k in context_keys if isinstance(config.get(k), int)), None),
        eos_token_ids=_token_ids(generation.get("eos_token_id")) | _token_ids(config.get("eos_token_id")),
        search_defaults=generation,
    )
    log.info("model %s: optimum layout, context %d (KV cache grows per step)", info.name, info.context_length)
    return common.loaded(info, OptimumRunner(session, info, common.device))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    loaded = json.loads(path.read_text(encoding="utf-8"))
    return loaded if isinstance(loaded, dict) else {}


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
    if not isinstance(source, str) and template_file.is_file():
        source = template_file.read_text(encoding="utf-8")
    if not isinstance(source, str) or not source.strip():
        return None
    return ChatTemplate(
        source,
        bos_token=_token_text(tokenizer_config.get("bos_token")) or "",
        eos_token=_token_text(tokenizer_config.get("eos_token")) or "",
    )


def available_providers() -> list[str]:
    return list(ort.get_available_providers())
