"""The telemetry settings group: metrics endpoint, traces, logs and the access log.

Declared next to its owner; the server's settings (config.py) hold it as a group.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from tokenwire.server.settings_schema import port_problem, setting

DEFAULT_METRICS_PORT = 9464

LogFormat = Literal["text", "json"]


def _log_level_problem(level: str) -> str | None:
    if isinstance(logging.getLevelName(level.upper()), int):
        return None
    return f"{level!r} is not DEBUG, INFO, WARNING or ERROR"


@dataclass(frozen=True)
class TelemetrySettings:
    metrics_port: int | None = setting(
        None,
        "port of the metrics endpoint, path /metrics (0 picks one)",
        check=port_problem,
        metavar="PORT",
        command_default=DEFAULT_METRICS_PORT,
        switch=("metrics", "serve Prometheus metrics over HTTP"),
    )
    """None: no endpoint (the library's default; `tokenwire serve` serves one)."""
    metrics_host: str | None = setting(
        None,
        "address of the metrics endpoint (default: --host; 127.0.0.1 when gRPC needs TLS or a token "
        "and the endpoint asks for neither)",
        metavar="ADDRESS",
    )
    metrics_auth: bool = setting(
        False, "require the gRPC bearer token on the metrics endpoint too (Authorization: Bearer)"
    )
    metrics_tls: bool = setting(
        False, "serve the metrics endpoint over TLS with --tls-cert/--tls-key (and --tls-client-ca)"
    )
    metrics_cache_seconds: float = setting(
        1.0,
        "seconds a rendered metrics page is reused, so frequent scrapes cost no rendering (0: never)",
        minimum=0,
    )
    otlp_endpoint: str | None = setting(
        None,
        "OTLP/gRPC collector for request spans, e.g. http://localhost:4317 "
        "(unset: no spans are built); OTEL_EXPORTER_OTLP_* variables add headers and certificates",
        metavar="URL",
    )
    otlp_metrics: bool = setting(
        False, "also push metrics to --otlp-endpoint (every 60 s, or OTEL_METRIC_EXPORT_INTERVAL ms)"
    )
    service_name: str = setting(
        "tokenwire",
        "service.name of the OpenTelemetry resource",
        check=lambda name: None if name else "must not be empty",
        metavar="NAME",
    )
    log_level: str = setting(
        "INFO", "logging level: DEBUG, INFO, WARNING, ERROR", check=_log_level_problem, metavar="LEVEL"
    )
    log_format: LogFormat = setting("text", "text, or json: one JSON object per line")
    access_log: bool = setting(
        True, "one log line per request (logger tokenwire.access) with its outcome and timings"
    )
