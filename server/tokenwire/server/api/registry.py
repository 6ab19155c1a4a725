"""The served models by name, each with its engine, request validator and loaded model files."""

from __future__ import annotations

from dataclasses import dataclass

from tokenwire.server.engine.engine import Engine
from tokenwire.server.engine.errors import ErrorKind, GenerationError
from tokenwire.server.engine.validation import RequestValidator
from tokenwire.server.models.loader import LoadedModel


@dataclass(frozen=True)
class ServedModel:
    model: LoadedModel
    engine: Engine
    validator: RequestValidator

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
