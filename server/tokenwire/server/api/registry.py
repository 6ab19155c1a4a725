"""The served models by name, each with its engine, request validator, loaded model files and
LoRA adapters."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from tokenwire.server.engine.engine import Engine
from tokenwire.server.engine.errors import ErrorKind, GenerationError
from tokenwire.server.engine.validation import RequestValidator
from tokenwire.server.models.loader import LoadedModel


@dataclass(frozen=True)
class ServedAdapter:
    """A LoRA adapter served on a model, as ListModels and /v1/models describe it."""

    name: str
    base: str
    rank: int
    source: str
    """"peft" or "gguf": the format it was read from."""
    memory_bytes: int
    """What its slot of the adapter stacks takes."""


class AdapterCatalog:
    """The adapters a model serves now, in load order. Loads and unloads at run time change it
    (on the event loop); `names` is the live set the model's request validator checks against."""

    def __init__(self, adapters: Iterable[ServedAdapter] = ()) -> None:
        self._by_name = {adapter.name: adapter for adapter in adapters}
        self.names: set[str] = set(self._by_name)

    def __iter__(self) -> Iterator[ServedAdapter]:
        return iter(tuple(self._by_name.values()))

    def __len__(self) -> int:
        return len(self._by_name)

    def get(self, name: str) -> ServedAdapter | None:
        return self._by_name.get(name)

    def add(self, adapter: ServedAdapter) -> None:
        self._by_name[adapter.name] = adapter
        self.names.add(adapter.name)

    def remove(self, name: str) -> ServedAdapter:
        self.names.discard(name)
        return self._by_name.pop(name)


@dataclass(frozen=True)
class ServedModel:
    model: LoadedModel
    engine: Engine
    validator: RequestValidator
    adapters: AdapterCatalog = field(default_factory=AdapterCatalog)

    @property
    def name(self) -> str:
        return self.model.info.name


class ModelRegistry:
    """Resolves GenerateRequest.model to a served model; the first one added is the default."""

    def __init__(self) -> None:
        self._models: dict[str, ServedModel] = {}

    def add(self, served: ServedModel) -> None:
        if served.name in self._models:
            raise ValueError(f"two models are named {served.name!r}")
        self._models[served.name] = served

    def route(self, model: str, adapter: str) -> tuple[str, str]:
        """(model, adapter) for a request that names an adapter where a model goes, as vLLM's
        OpenAI edge takes it: `base:adapter`, or an adapter's name alone. A name that is a model's
        is that model; anything else is left for `resolve` and the validator to refuse."""
        if adapter or not model or model in self._models:
            return model, adapter
        base, sep, named = model.partition(":")
        if sep and base in self._models:
            return base, named
        for served in self._models.values():
            if served.adapters.get(model) is not None:
                return served.name, model
        return model, adapter

    def resolve(self, name: str) -> ServedModel:
        if not name:
            return self.default
        found = self._models.get(name)
        if found is None:
            served = ", ".join(sorted(self._models)) or "none"
            raise GenerationError(
                ErrorKind.NOT_FOUND,
                f"model {name!r} is not served here (served: {served})",
                reason="MODEL_NOT_FOUND",
            )
        return found

    @property
    def default(self) -> ServedModel:
        if not self._models:
            raise GenerationError(ErrorKind.UNAVAILABLE, "no model is loaded yet", reason="LOADING")
        return next(iter(self._models.values()))

    def all(self) -> list[ServedModel]:
        return list(self._models.values())
