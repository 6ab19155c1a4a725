"""Read a PEFT LoRA adapter directory: adapter_config.json and adapter_model.safetensors.

PEFT saves each adapted module's pair as `base_model.model.<module path>.lora_A.weight`
[r, in] and `...lora_B.weight` [out, r], and applies `x @ A.T @ B.T * scale` next to the base
module, with scale `lora_alpha / r` (`lora_alpha / sqrt(r)` with `use_rslora`); `rank_pattern`
and `alpha_pattern` override r and alpha for the modules whose path ends with a pattern key, the
first such key winning, as in PEFT. Only plain LoRA on a decoder layer's projections is served:
a config asking for anything that changes the computation otherwise (DoRA, trained biases,
replaced modules, new tokens) is refused, as is a pickled adapter_model.bin.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenwire.server.model_tools.lora.safetensors_file import SafetensorsError, SafetensorsFile
from tokenwire.server.models.adapters import (
    F32,
    AdapterError,
    LoraAdapter,
    LoraFactor,
    LoraLayout,
    fit_adapter,
)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20

# Config fields whose use changes the computation beyond x @ A.T @ B.T * scale. Each is refused
# unless it is absent or holds its "off" value (false, null, empty).
_UNSUPPORTED_FEATURES = {
    "use_dora": "DoRA",
    "lora_bias": "trained LoRA biases",
    "modules_to_save": "fully trained modules (modules_to_save)",
    "trainable_token_indices": "trained token embeddings",
    "layer_replication": "layer replication",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "use_qalora": "QALoRA",
    "target_parameters": "LoRA on parameters (target_parameters)",
    "arrow_config": "Arrow routing",
}
_TENSOR_NAME = re.compile(r"^base_model\.model\.(?P<path>.+)\.lora_(?P<part>[AB])\.weight$")
# A decoder layer's module: Llama-family `...layers.N.<module>` and GPT-2 `transformer.h.N.<module>`.
_LAYER_MODULE = re.compile(r"^(?:.*\.)?(?:layers|h)\.(?P<layer>\d+)\.(?P<module>[A-Za-z0-9_.]+)$")
# Pattern keys are matched as PEFT does, as a regular expression at the end of a module path;
# only plain dotted names are taken, so no user pattern can make matching slow.
_PLAIN_PATTERN = re.compile(r"^[A-Za-z0-9_.]{1,200}$")


def read_peft_adapter(
    directory: Path, layout: LoraLayout, *, max_rank: int, name: str | None = None
) -> LoraAdapter:
    """The adapter in `directory`, fitted to `layout` (see models/adapters.fit_adapter)."""
    name = name or directory.name
    config = _read_config(directory, name)
    weights_path = directory / WEIGHTS_FILE
    if not weights_path.is_file():
        if (directory / "adapter_model.bin").is_file():
            raise AdapterError(
                f"adapter {name}: holds adapter_model.bin, a pickle, which is not read; save it "
                "with safe_serialization to get adapter_model.safetensors"
            )
        raise AdapterError(f"adapter {name}: {directory} holds no {WEIGHTS_FILE}")
    try:
        weights = SafetensorsFile(weights_path)
    except SafetensorsError as error:
        raise AdapterError(f"adapter {name}: {error}") from None
    return fit_adapter(name, _factors(name, config, weights), layout, max_rank=max_rank)


class _Config:
    """The fields of adapter_config.json that decide the computation, checked."""

    def __init__(self, name: str, raw: dict[str, Any]) -> None:
        def bad(field: str, what: str) -> AdapterError:
            return AdapterError(f"adapter {name}: {CONFIG_FILE}: {field}: {what}")

        peft_type = raw.get("peft_type", "LORA")
        if peft_type != "LORA":
            raise bad("peft_type", f"is {str(peft_type)[:40]!r}; only LORA adapters are served")
        for field, feature in _UNSUPPORTED_FEATURES.items():
            if raw.get(field) not in (None, False, [], {}, ""):
                raise bad(field, f"the adapter uses {feature}, which is not supported")
        if raw.get("bias", "none") != "none":
            raise bad("bias", f"is {str(raw.get('bias'))[:40]!r}; trained biases are not supported")
        self.rank = raw.get("r")
        if not _is_positive_int(self.rank):
            raise bad("r", f"must be a whole number of at least 1, got {str(self.rank)[:40]}")
        self.alpha = raw.get("lora_alpha", self.rank)
        if not _is_number(self.alpha):
            raise bad("lora_alpha", f"must be a number, got {str(self.alpha)[:40]}")
        self.rslora = raw.get("use_rslora", False)
        if not isinstance(self.rslora, bool):
            raise bad("use_rslora", "must be true or false")
        self.rank_pattern = _pattern(raw, "rank_pattern", _is_positive_int, bad)
        self.alpha_pattern = _pattern(raw, "alpha_pattern", _is_number, bad)

    def rank_and_alpha(self, module_path: str) -> tuple[int, float]:
        return (
            int(_match(self.rank_pattern, module_path, self.rank)),
            float(_match(self.alpha_pattern, module_path, self.alpha)),
        )

    def scale(self, rank: int, alpha: float) -> float:
        return alpha / (math.sqrt(rank) if self.rslora else rank)


def _read_config(directory: Path, name: str) -> _Config:
    path = directory / CONFIG_FILE
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise AdapterError(f"adapter {name}: {CONFIG_FILE} is over {MAX_CONFIG_BYTES} bytes")
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AdapterError(f"adapter {name}: {directory} holds no {CONFIG_FILE}") from None
    except (OSError, UnicodeDecodeError, ValueError) as error:
        text = " ".join(str(error).split())[:200]
        raise AdapterError(f"adapter {name}: {CONFIG_FILE} cannot be read as JSON: {text}") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"adapter {name}: {CONFIG_FILE} must hold a JSON object")
    return _Config(name, raw)


def _pattern(
    raw: dict[str, Any],
    field: str,
    valid: Callable[[object], bool],
    bad: Callable[[str, str], AdapterError],
) -> dict[str, Any]:
    value = raw.get(field) or {}
    if not isinstance(value, dict):
        raise bad(field, "must be an object of module pattern -> value")
    for key, entry in value.items():
        if not _PLAIN_PATTERN.match(key):
            raise bad(
                field, f"key {key[:60]!r} is not a plain module name (regular expressions are not taken)"
            )
        if not valid(entry):
            raise bad(field, f"{key}: {str(entry)[:40]} is not a valid value")
    return dict(value)


def _match(patterns: dict[str, Any], module_path: str, default: Any) -> Any:
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module_path):
            return value
    return default


def _factors(name: str, config: _Config, weights: SafetensorsFile) -> list[LoraFactor]:
    pairs: dict[str, dict[str, str]] = {}
    for tensor in weights.tensors:
        match = _TENSOR_NAME.match(tensor)
        if match is None:
            raise AdapterError(f"adapter {name}: tensor {tensor[:120]} is not a LoRA A or B weight")
        pairs.setdefault(match.group("path"), {})[match.group("part")] = tensor
    factors = []
    for path, pair in pairs.items():
        label = f"module {path[:120]}"
        located = _LAYER_MODULE.match(path)
        if located is None:
            raise AdapterError(
                f"adapter {name}: adapts {path[:120]}, which is not a projection inside a decoder layer "
                "(only those take adapters)"
            )
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise AdapterError(f"adapter {name}: {label} has no {missing} weight")
        a, b = weights.tensors[pair["A"]], weights.tensors[pair["B"]]
        if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(
                f"adapter {name}: {label} has lora_A {list(a.shape)} and lora_B {list(b.shape)}, "
                "not [r, in] and [out, r]"
            )
        rank, alpha = config.rank_and_alpha(path)
        if a.shape[0] != rank:
            raise AdapterError(
                f"adapter {name}: {label} has rank {a.shape[0]}, but {CONFIG_FILE} gives it r = {rank}"
            )
        factors.append(
            LoraFactor(
                layer=int(located.group("layer")),
                module=located.group("module"),
                rank=rank,
                in_features=a.shape[1],
                out_features=b.shape[0],
                scale=config.scale(rank, alpha),
                label=label,
                read=_reader(name, weights, pair["A"], pair["B"]),
            )
        )
    return factors


def _reader(name: str, weights: SafetensorsFile, a: str, b: str) -> Callable[[], tuple[F32, F32]]:
    def read() -> tuple[F32, F32]:
        try:
            return weights.read(a), weights.read(b)
        except (OSError, SafetensorsError) as error:
            raise AdapterError(f"adapter {name}: {error}") from None

    return read


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
