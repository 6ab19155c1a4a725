"""Where `tokenwire serve` takes its settings from: flags, TOKENWIRE_* variables, a TOML file.

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tokenwire.server.config import (
    DEFAULT_METRICS_PORT,
    AuthSettings,
    HealthSettings,
    KeepaliveSettings,
    ModelSource,
    ServerSettings,
    TelemetrySettings,
    TlsSettings,
)
from tokenwire.server.engine.validation import RequestLimits
from tokenwire.server.security import tls
from tokenwire.server.security.auth import AUTH_TOKENS_ENV, TokenFileError, load_tokens
from tokenwire.server.telemetry.exporters import otlp_exporter_installed

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ENV_PREFIX = "TOKENWIRE_"
CONFIG_ENV = "TOKENWIRE_CONFIG"
MODEL_ENV = "TOKENWIRE_MODEL"

Kind = Literal["int", "float", "str", "bool", "path", "choice"]

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_DEFAULTS = ServerSettings()


@dataclass(frozen=True)
class Setting:
    key: str
    """TOML key and argparse destination; the flag and variable derive from it."""
    kind: Kind
    default: object
    help: str
    group: str
    choices: tuple[str, ...] = ()
    optional: bool = False
    """May be unset (None): an empty variable unsets it."""

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.key.upper()


ENGINE = "models and engine"
NETWORK = "network and limits"
SECURITY = "security"
TELEMETRY = "telemetry"
HEALTH = "health"

SETTINGS: tuple[Setting, ...] = (
    Setting(
        "device",
        "choice",
        _DEFAULTS.device,
        "where the model runs; auto picks CUDA when ONNX Runtime has it",
        ENGINE,
        choices=("auto", "cpu", "cuda"),
    ),
    Setting(
        "max_batch_size",
        "int",
        _DEFAULTS.max_batch_size,
        "most sequences decoded together; sizes the KV cache",
        ENGINE,
    ),
    Setting(
        "max_queue_size",
        "int",
        _DEFAULTS.max_queue_size,
        "most requests waiting for a slot; beyond it RESOURCE_EXHAUSTED",
        ENGINE,
    ),
    Setting(
        "max_context_length",
        "int",
        _DEFAULTS.max_context_length,
        "longest sequence (prompt + output) served; sizes the KV cache",
        ENGINE,
    ),
    Setting(
        "prefill_chunk_size",
        "int",
        _DEFAULTS.prefill_chunk_size,
        "prompt tokens per model call, so long prompts do not stall streams",
        ENGINE,
    ),
    Setting(
        "intra_op_threads",
        "int",
        _DEFAULTS.intra_op_threads,
        "ONNX Runtime threads per operator (0: one per core)",
        ENGINE,
    ),
    Setting(
        "max_new_tokens_cap",
        "int",
        _DEFAULTS.limits.max_new_tokens_cap,
        "largest max_new_tokens a request may ask for",
        ENGINE,
    ),
    Setting(
        "default_max_new_tokens",
        "int",
        _DEFAULTS.limits.default_max_new_tokens,
        "max_new_tokens when a request leaves it unset",
        ENGINE,
    ),
    Setting(
        "max_prompt_chars",
        "int",
        _DEFAULTS.limits.max_prompt_chars,
        "longest prompt in characters (all "
        "chat messages together); longer is INVALID_ARGUMENT before tokenizing",
        ENGINE,
    ),
    Setting(
        "max_stop_strings",
        "int",
        _DEFAULTS.limits.max_stop_strings,
        "most stop strings per request; more is INVALID_ARGUMENT",
        ENGINE,
    ),
    Setting("host", "str", _DEFAULTS.host, "address to listen on", NETWORK),
    Setting("port", "int", _DEFAULTS.port, "gRPC port (0 picks one)", NETWORK),
    Setting(
        "drain_timeout",
        "float",
        _DEFAULTS.drain_timeout,
        "seconds live requests get to finish after SIGTERM; then they fail with UNAVAILABLE",
        NETWORK,
    ),
    Setting(
        "max_receive_message_bytes",
        "int",
        _DEFAULTS.max_receive_message_bytes,
        "largest request message; larger is RESOURCE_EXHAUSTED",
        NETWORK,
    ),
    Setting(
        "max_concurrent_streams",
        "int",
        _DEFAULTS.max_concurrent_streams,
        "calls one connection may have open at once (HTTP/2 streams); further calls wait in the client",
        NETWORK,
    ),
    Setting(
        "keepalive_time",
        "float",
        _DEFAULTS.keepalive.time,
        "seconds between the server's keepalive pings, to find dead clients",
        NETWORK,
    ),
    Setting(
        "keepalive_timeout",
        "float",
        _DEFAULTS.keepalive.timeout,
        "seconds a keepalive ping may go unanswered before the connection is closed",
        NETWORK,
    ),
    Setting(
        "keepalive_min_ping_interval",
        "float",
        _DEFAULTS.keepalive.min_ping_interval,
        "seconds clients must leave between their pings; faster pings earn strikes",
        NETWORK,
    ),
    Setting(
        "keepalive_max_ping_strikes",
        "int",
        _DEFAULTS.keepalive.max_ping_strikes,
        "too-fast pings before the connection is closed with GOAWAY too_many_pings (0: never)",
        NETWORK,
    ),
    Setting(
        "keepalive_permit_without_calls",
        "bool",
        _DEFAULTS.keepalive.permit_without_calls,
        "accept keepalive pings on connections without live calls",
        NETWORK,
    ),
    Setting(
        "reflection",
        "bool",
        _DEFAULTS.reflection,
        "offer gRPC server reflection (grpcurl, buf curl); behind the bearer token when authentication is on",
        NETWORK,
    ),
    Setting(
        "auth_tokens_file",
        "path",
        None,
        "file of accepted bearer tokens, one a line (# comments); with it "
        f"or {AUTH_TOKENS_ENV} (comma-separated) every call needs 'authorization: Bearer TOKEN'",
        SECURITY,
        optional=True,
    ),
    Setting(
        "auth_health",
        "bool",
        _DEFAULTS.auth.protect_health,
        "require the bearer token for grpc.health.v1 too (off: load balancers probe without one)",
        SECURITY,
    ),
    Setting(
        "tls_cert",
        "path",
        None,
        "server certificate chain (PEM); with --tls-key enables TLS",
        SECURITY,
        optional=True,
    ),
    Setting("tls_key", "path", None, "server private key (PEM)", SECURITY, optional=True),
    Setting(
        "tls_client_ca",
        "path",
        None,
        "CA certificate (PEM) client certificates must chain to; enables mutual TLS",
        SECURITY,
        optional=True,
    ),
    Setting("metrics", "bool", True, "serve Prometheus metrics over HTTP", TELEMETRY),
    Setting(
        "metrics_port",
        "int",
        DEFAULT_METRICS_PORT,
        "port of the metrics endpoint, path /metrics (0 picks one)",
        TELEMETRY,
    ),
    Setting(
        "metrics_host",
        "str",
        None,
        "address of the metrics endpoint (default: --host)",
        TELEMETRY,
        optional=True,
    ),
    Setting(
        "otlp_endpoint",
        "str",
        None,
        "OTLP/gRPC collector for request spans, e.g. http://localhost:4317 "
        "(unset: no spans are built); OTEL_EXPORTER_OTLP_* variables add headers and certificates",
        TELEMETRY,
        optional=True,
    ),
    Setting(
        "otlp_metrics",
        "bool",
        False,
        "also push metrics to --otlp-endpoint (every 60 s, or OTEL_METRIC_EXPORT_INTERVAL ms)",
        TELEMETRY,
    ),
    Setting(
        "service_name",
        "str",
        _DEFAULTS.telemetry.service_name,
        "service.name of the OpenTelemetry resource",
        TELEMETRY,
    ),
    Setting(
        "log_level",
        "str",
        _DEFAULTS.telemetry.log_level,
        "logging level: DEBUG, INFO, WARNING, ERROR",
        TELEMETRY,
    ),
    Setting(
        "log_format",
        "choice",
        _DEFAULTS.telemetry.log_format,
        "text, or json: one JSON object per line",
        TELEMETRY,
        choices=("text", "json"),
    ),
    Setting(
        "access_log",
        "bool",
        _DEFAULTS.telemetry.access_log,
        "one log line per request (logger tokenwire.access) with its outcome and timings",
        TELEMETRY,
    ),
    Setting(
        "health_queue_high_watermark",
        "int",
        None,
        "report NOT_SERVING on grpc.health.v1 once a model's "
        "queue holds this many requests (unset: never for load)",
        HEALTH,
        optional=True,
    ),
    Setting(
        "health_queue_low_watermark",
        "int",
        None,
        "report SERVING again once every queue is down to this many (default: half the high watermark)",
        HEALTH,
        optional=True,
    ),
)
SETTING_KEYS = frozenset(s.key for s in SETTINGS) | {"model"}


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
        metavar="[NAME=]DIR",
        help="model directory to serve (repeat for several; the first is the default). Without any, the "
        f"default model is pulled once and served from the cache [{MODEL_ENV}]",
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for setting in SETTINGS:
        group = groups.get(setting.group)
        if group is None:
            group = groups[setting.group] = parser.add_argument_group(setting.group)
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
    tokens: tuple[str, ...] = ()
    try:
        tokens = load_tokens(_optional_path(values["auth_tokens_file"]), environ)
    except TokenFileError as error:
        problems.append(str(error))
    if problems:
        raise SettingsError(problems)
    settings = _build(values, models, tokens)
    problems += settings.validate(require_models=False)
    if settings.telemetry.otlp_endpoint and not otlp_exporter_installed():
        problems.append("--otlp-endpoint: the OTLP exporter is not installed: pip install 'tokenwire[otlp]'")
    if not problems:
        problems += tls.problems(settings.tls)
    if problems:
        raise SettingsError(problems)
    return settings


def _build(
    values: Mapping[str, object], models: tuple[ModelSource, ...], tokens: tuple[str, ...]
) -> ServerSettings:
    def integer(key: str) -> int:
        value = values[key]
        assert isinstance(value, int)
        return value

    def optional_integer(key: str) -> int | None:
        value = values[key]
        assert value is None or isinstance(value, int)
        return value

    def number(key: str) -> float:
        value = values[key]
        assert isinstance(value, int | float)
        return float(value)

    def text(key: str) -> str:
        return str(values[key])

    def optional_text(key: str) -> str | None:
        value = values[key]
        return None if value is None else str(value)

    def flag(key: str) -> bool:
        return bool(values[key])

    log_format = text("log_format")
    device = text("device")
    return ServerSettings(
        models=models,
        host=text("host"),
        port=integer("port"),
        max_batch_size=integer("max_batch_size"),
        max_queue_size=integer("max_queue_size"),
        prefill_chunk_size=integer("prefill_chunk_size"),
        max_context_length=integer("max_context_length"),
        device="cuda" if device == "cuda" else "cpu" if device == "cpu" else "auto",
        intra_op_threads=integer("intra_op_threads"),
        drain_timeout=number("drain_timeout"),
        max_receive_message_bytes=integer("max_receive_message_bytes"),
        max_concurrent_streams=integer("max_concurrent_streams"),
        reflection=flag("reflection"),
        limits=RequestLimits(
            max_new_tokens_cap=integer("max_new_tokens_cap"),
            default_max_new_tokens=integer("default_max_new_tokens"),
            max_prompt_chars=integer("max_prompt_chars"),
            max_stop_strings=integer("max_stop_strings"),
        ),
        keepalive=KeepaliveSettings(
            time=number("keepalive_time"),
            timeout=number("keepalive_timeout"),
            min_ping_interval=number("keepalive_min_ping_interval"),
            max_ping_strikes=integer("keepalive_max_ping_strikes"),
            permit_without_calls=flag("keepalive_permit_without_calls"),
        ),
        telemetry=TelemetrySettings(
            metrics_port=integer("metrics_port") if flag("metrics") else None,
            metrics_host=optional_text("metrics_host"),
            otlp_endpoint=optional_text("otlp_endpoint"),
            otlp_metrics=flag("otlp_metrics"),
            service_name=text("service_name"),
            access_log=flag("access_log"),
            log_level=text("log_level"),
            log_format="json" if log_format == "json" else "text",
        ),
        auth=AuthSettings(tokens=tokens, protect_health=flag("auth_health")),
        tls=TlsSettings(
            cert=_optional_path(values["tls_cert"]),
            key=_optional_path(values["tls_key"]),
            client_ca=_optional_path(values["tls_client_ca"]),
        ),
        health=HealthSettings(
            queue_high_watermark=optional_integer("health_queue_high_watermark"),
            queue_low_watermark=optional_integer("health_queue_low_watermark"),
        ),
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


_METAVARS = {
    "host": "ADDRESS",
    "metrics_host": "ADDRESS",
    "port": "PORT",
    "metrics_port": "PORT",
    "otlp_endpoint": "URL",
    "service_name": "NAME",
    "log_level": "LEVEL",
    "max_receive_message_bytes": "BYTES",
}


def _metavar(setting: Setting) -> str | None:
    if setting.choices:
        return None
    named = _METAVARS.get(setting.key)
    return named or {"int": "N", "float": "SECONDS", "path": "FILE", "str": "TEXT"}.get(setting.kind)


def _shown(value: object) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)
