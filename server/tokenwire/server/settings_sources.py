"""Where `tokenwire serve` takes its settings from: flags, TOKENWIRE_* variables, a TOML file.

The settings and their flags, variables, keys, help and bounds are declared once, as the fields
of the dataclasses in config.py; this module only reads them from the outside world.

For each setting the first of these that sets it wins: the flag on the command line, its
environment variable (TOKENWIRE_ and the flag's name in capitals with underscores), the
--config file (the flag's name with underscores as the key), the default. Paths in the file
are relative to the file. Every problem is collected and reported at once, each naming the
flag, and the variable or file key when the bad value came from there.

Bearer tokens are deliberately not a setting of this kind: they come from --auth-tokens-file
and TOKENWIRE_AUTH_TOKENS only, never from a flag (visible in `ps`) or the config file.
"""

from __future__ import annotations

import argparse
import difflib
import math
import sys
import typing
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from tokenwire.server.config import LoraSource, ModelSource, ServerSettings
from tokenwire.server.engine.types import Caller
from tokenwire.server.security import tls
from tokenwire.server.security.auth import AUTH_TOKENS_ENV, TokenFileError, load_token_callers
from tokenwire.server.settings_schema import GROUPS, SECURITY, Setting, declared_settings
from tokenwire.server.telemetry.exporters import otlp_exporter_installed

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

CONFIG_ENV = "TOKENWIRE_CONFIG"
MODEL_ENV = "TOKENWIRE_MODEL"

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


AUTH_TOKENS_FILE = Setting(
    "auth_tokens_file",
    "path",
    None,
    "file of accepted bearer tokens, one a line (# comments); with it "
    f"or {AUTH_TOKENS_ENV} (comma-separated) every call needs 'authorization: Bearer TOKEN'",
    SECURITY,
    optional=True,
)
"""Read here into AuthSettings.tokens; no field holds the file's path."""

SETTINGS: tuple[Setting, ...] = (AUTH_TOKENS_FILE, *declared_settings(ServerSettings))
SETTING_KEYS = frozenset(s.key for s in SETTINGS) | {"model", "lora"}


class SettingsError(Exception):
    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = tuple(problems)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every setting as a flag. Flags default to None so that "not given" is visible."""
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help=f"TOML file of settings: the flags' names with underscores as keys, e.g. max_batch_size = 8 "
        f'and model = ["DIR"]; flags and variables override it [{CONFIG_ENV}]',
    )
    parser.add_argument(
        "--model",
        action="append",
        metavar="[NAME=]DIR|FILE.gguf",
        help="model directory, or GGUF file (converted once into the cache), to serve (repeat for several; "
        "the first is the default). Without any, the default model is pulled once and served from the "
        f"cache [{MODEL_ENV}]",
    )
    parser.add_argument(
        "--lora",
        action="append",
        metavar="NAME=PATH",
        help="LoRA adapter to serve on the first model, as NAME: a PEFT adapter directory or a GGUF "
        "adapter file (repeat for several, at most --max-loras); a request picks it by "
        "GenerateRequest.adapter, or the OpenAI model field NAME or BASE:NAME",
    )
    groups = {title: parser.add_argument_group(title) for title in GROUPS}
    for setting in SETTINGS:
        group = groups[setting.group]
        shown = "unset" if setting.default is None else _shown(setting.default)
        help_text = f"{setting.help} [{setting.env}; default {shown}]".replace("%", "%%")
        if setting.kind == "bool":
            group.add_argument(
                setting.flag, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        else:
            group.add_argument(
                setting.flag,
                default=None,
                metavar=_metavar(setting),
                choices=setting.choices or None,
                help=help_text,
            )


def load(args: argparse.Namespace, environ: Mapping[str, str]) -> ServerSettings:
    """Settings from the parsed flags, `environ` and the config file. Raises SettingsError.

    Models may come back empty (the caller serves the default model then); everything else
    is validated.
    """
    problems: list[str] = []
    config_path: Path | None = args.config
    if config_path is None and environ.get(CONFIG_ENV):
        config_path = Path(environ[CONFIG_ENV])
    file_values = _read_config(config_path, problems) if config_path is not None else {}
    base = config_path.parent if config_path is not None else Path()

    values: dict[str, object] = {}
    for setting in SETTINGS:
        flag_value = getattr(args, setting.key, None)
        if flag_value is not None:
            origin, raw, relative_to = setting.flag, flag_value, None
        elif setting.env in environ:
            origin, raw, relative_to = f"{setting.flag} (from {setting.env})", environ[setting.env], None
        elif setting.key in file_values:
            origin, raw, relative_to = (
                f"{setting.flag} (from {setting.key} in {config_path})",
                file_values[setting.key],
                base,
            )
        else:
            values[setting.key] = setting.default
            continue
        try:
            values[setting.key] = _parse(setting, raw, relative_to)
        except ValueError as error:
            problems.append(f"{origin}: {error}")
            values[setting.key] = setting.default
    models = _models(args.model, environ, file_values.get("model"), base, problems)
    loras = _loras(getattr(args, "lora", None), file_values.get("lora"), base, problems)
    tokens: tuple[tuple[str, Caller], ...] = ()
    try:
        tokens = load_token_callers(_optional_path(values["auth_tokens_file"]), environ)
    except TokenFileError as error:
        problems.append(str(error))
    if problems:
        raise SettingsError(problems)
    settings = replace(_build(values, models, tokens), loras=loras)
    problems += settings.validate(require_models=False)
    if settings.telemetry.otlp_endpoint and not otlp_exporter_installed():
        problems.append("--otlp-endpoint: the OTLP exporter is not installed: pip install 'tokenwire[otlp]'")
    if not problems:
        problems += tls.problems(settings.tls)
    if problems:
        raise SettingsError(problems)
    return settings


def _build(
    values: Mapping[str, object], models: tuple[ModelSource, ...], tokens: tuple[tuple[str, Caller], ...]
) -> ServerSettings:
    """The settings object: each declared setting's value put at its field's path."""
    auth = {"tokens": tuple(t for t, _ in tokens), "callers": tuple(c for _, c in tokens)}
    fields: dict[str, Any] = {"models": models, "auth": auth}
    for setting in SETTINGS:
        if not setting.path:
            continue
        value = values[setting.key]
        switch = setting.spec.switch if setting.spec is not None else None
        if switch is not None and not values[switch[0]]:
            value = None
        *groups, name = setting.path
        owner = fields
        for group in groups:
            owner = owner.setdefault(group, {})
        owner[name] = value
    settings: ServerSettings = _instance(ServerSettings, fields)
    return settings


def _instance(cls: type[Any], fields: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    return cls(
        **{
            name: _instance(hints[name], value) if isinstance(value, dict) else value
            for name, value in fields.items()
        }
    )


def _read_config(path: Path, problems: list[str]) -> dict[str, object]:
    try:
        with path.open("rb") as file:
            document = tomllib.load(file)
    except OSError as error:
        problems.append(f"--config: cannot read {path}: {error.strerror or error}")
        return {}
    except tomllib.TOMLDecodeError as error:
        problems.append(f"--config: {path} is not valid TOML: {error}")
        return {}
    for key in document:
        if key not in SETTING_KEYS:
            close = difflib.get_close_matches(key, sorted(SETTING_KEYS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(f"--config: {path} sets {key!r}, which is not a setting{hint}")
    return {key: value for key, value in document.items() if key in SETTING_KEYS}


def _parse(setting: Setting, raw: object, relative_to: Path | None) -> object:
    """The typed value of `raw` (a flag's or variable's text, or a TOML value). Raises ValueError."""
    if isinstance(raw, str):
        raw = raw.strip()
        if setting.optional and raw == "":
            return None
    kind = setting.kind
    if kind == "bool":
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in _TRUE | _FALSE:
            return raw.lower() in _TRUE
        raise ValueError(f"{raw!r} is not true or false")
    if kind == "int":
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        if isinstance(raw, str):
            try:
                return int(raw)
            except ValueError:
                pass
        raise ValueError(f"{raw!r} is not a whole number")
    if kind == "float":
        value: float | None = None
        if isinstance(raw, int | float) and not isinstance(raw, bool):
            value = float(raw)
        elif isinstance(raw, str):
            try:
                value = float(raw)
            except ValueError:
                value = None
        if value is None or not math.isfinite(value):
            raise ValueError(f"{raw!r} is not a number of seconds")
        return value
    if not isinstance(raw, str):
        raise ValueError(f"{raw!r} is not a string")
    if kind == "choice" and raw not in setting.choices:
        raise ValueError(f"{raw!r} is not one of {', '.join(setting.choices)}")
    if kind == "path":
        path = Path(raw).expanduser()
        return relative_to / path if relative_to is not None and not path.is_absolute() else path
    return raw


def _models(
    flags: Sequence[str] | None,
    environ: Mapping[str, str],
    from_file: object,
    base: Path,
    problems: list[str],
) -> tuple[ModelSource, ...]:
    if flags:
        return tuple(_model_source(value, None) for value in flags)
    if environ.get(MODEL_ENV):
        return (_model_source(environ[MODEL_ENV], None),)
    if from_file is None:
        return ()
    entries = [from_file] if isinstance(from_file, str) else from_file
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        problems.append("--model (from model in the config file): must be a string or a list of strings")
        return ()
    return tuple(_model_source(entry, base) for entry in entries)


def _loras(
    flags: Sequence[str] | None, from_file: object, base: Path, problems: list[str]
) -> tuple[LoraSource, ...]:
    """The --lora NAME=PATH values (or the config file's `lora` list of them)."""
    relative_to: Path | None = None
    entries: object = flags
    if not flags:
        if from_file is None:
            return ()
        entries, relative_to = from_file, base
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        problems.append("--lora (from lora in the config file): must be a list of NAME=PATH strings")
        return ()
    found = []
    for entry in entries:
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            problems.append(f"--lora: {entry[:80]!r} is not NAME=PATH")
            continue
        located = Path(path).expanduser()
        if relative_to is not None and not located.is_absolute():
            located = relative_to / located
        found.append(LoraSource(name, located))
    return tuple(found)


def _model_source(value: str, relative_to: Path | None) -> ModelSource:
    """`DIR` or `NAME=DIR`; a directory whose own name has '=' in it is taken whole."""

    def located(text: str) -> Path:
        path = Path(text).expanduser()
        return relative_to / path if relative_to is not None and not path.is_absolute() else path

    name, sep, path = value.partition("=")
    if sep and not located(value).exists():
        return ModelSource(located(path), name)
    return ModelSource(located(value))


def _optional_path(value: object) -> Path | None:
    assert value is None or isinstance(value, Path)
    return value


def _metavar(setting: Setting) -> str | None:
    if setting.choices:
        return None
    named = setting.metavar
    return named or {"int": "N", "float": "SECONDS", "path": "FILE", "str": "TEXT"}.get(setting.kind)


def _shown(value: object) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)
