"""Typed server settings.

These are the settings of one server as a library object. `tokenwire serve` fills them from
flags, TOKENWIRE_* variables and a TOML file (settings_sources.py); where the two defaults
differ (the metrics endpoint), the library default is the one that opens nothing extra, so an
embedding application or a test does not bind ports it did not ask for.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tokenwire.server.engine.validation import RequestLimits
from tokenwire.server.models.session import Device

DEFAULT_PORT = 50051
DEFAULT_METRICS_PORT = 9464

LogFormat = Literal["text", "json"]


@dataclass(frozen=True)
class ModelSource:
    path: Path
    name: str | None = None
    """Name clients use; defaults to the directory's name."""


@dataclass(frozen=True)
class KeepaliveSettings:
    """HTTP/2 keepalive: the server's own pings, and how often clients may ping it."""

    time: float = 60.0
    """Seconds between the server's pings on a connection with live calls (finds dead peers)."""
    timeout: float = 20.0
    """Seconds to wait for a ping's answer before closing the connection."""
    min_ping_interval: float = 10.0
    """Clients may ping at most this often (seconds); faster pings earn strikes."""
    max_ping_strikes: int = 2
    """Pings that come too fast before the connection is closed with GOAWAY (too_many_pings)."""
    permit_without_calls: bool = True
    """Accept (and send) keepalive pings on connections with no live call."""


@dataclass(frozen=True)
class TelemetrySettings:
    metrics_port: int | None = None
    """Port of the Prometheus /metrics endpoint; None: no endpoint; 0 picks a free port."""
    metrics_host: str | None = None
    """Address the metrics endpoint listens on; None: the gRPC host."""
    otlp_endpoint: str | None = None
    """OTLP/gRPC collector (http://host:4317 for plaintext); None: no traces are built at all."""
    otlp_metrics: bool = False
    """Also push metrics to the OTLP endpoint."""
    service_name: str = "tokenwire"
    access_log: bool = True
    """One log line per request, with its outcome and timings."""
    log_level: str = "INFO"
    log_format: LogFormat = "text"


@dataclass(frozen=True)
class AuthSettings:
    tokens: tuple[str, ...] = field(default=(), repr=False)
    """Accepted bearer tokens; empty: authentication is off. Never shown in a repr or a log."""
    protect_health: bool = False
    """Require a token for grpc.health.v1 too (load balancers usually probe without one)."""

    @property
    def enabled(self) -> bool:
        return bool(self.tokens)


@dataclass(frozen=True)
class TlsSettings:
    cert: Path | None = None
    """Server certificate chain (PEM)."""
    key: Path | None = None
    """Server private key (PEM)."""
    client_ca: Path | None = None
    """CA (PEM) that client certificates must chain to; set: mutual TLS is required."""

    @property
    def enabled(self) -> bool:
        return self.cert is not None


@dataclass(frozen=True)
class HealthSettings:
    queue_high_watermark: int | None = None
    """Report NOT_SERVING once a model's queue holds this many requests; None: never for load."""
    queue_low_watermark: int | None = None
    """Report SERVING again once every queue is down to this; None: half the high watermark."""

    @property
    def low_watermark(self) -> int | None:
        if self.queue_high_watermark is None:
            return None
        if self.queue_low_watermark is None:
            return self.queue_high_watermark // 2
        return self.queue_low_watermark


@dataclass(frozen=True)
class ServerSettings:
    models: tuple[ModelSource, ...] = ()
    host: str = "0.0.0.0"
    port: int = DEFAULT_PORT
    max_batch_size: int = 8
    max_queue_size: int = 64
    prefill_chunk_size: int = 256
    max_context_length: int = 2048
    device: Device = "auto"
    intra_op_threads: int = 0
    drain_timeout: float = 30.0
    max_receive_message_bytes: int = 4 * 1024 * 1024
    max_concurrent_streams: int = 256
    """HTTP/2 streams (calls) one connection may have open; further calls wait in the client."""
    reflection: bool = True
    limits: RequestLimits = field(default_factory=RequestLimits)
    keepalive: KeepaliveSettings = field(default_factory=KeepaliveSettings)
    telemetry: TelemetrySettings = field(default_factory=TelemetrySettings)
    auth: AuthSettings = field(default_factory=AuthSettings)
    tls: TlsSettings = field(default_factory=TlsSettings)
    health: HealthSettings = field(default_factory=HealthSettings)

    def validate(self, *, require_models: bool = True) -> list[str]:
        """Problems with these settings, as messages naming the flag."""
        problems: list[str] = []
        if require_models and not self.models:
            problems.append("--model: at least one model directory is needed")
        problems += _check_port("--port", self.port)
        for flag, value in (
            ("--max-batch-size", self.max_batch_size),
            ("--prefill-chunk-size", self.prefill_chunk_size),
            ("--max-context-length", self.max_context_length),
            ("--max-receive-message-bytes", self.max_receive_message_bytes),
            ("--max-concurrent-streams", self.max_concurrent_streams),
            ("--max-new-tokens-cap", self.limits.max_new_tokens_cap),
            ("--default-max-new-tokens", self.limits.default_max_new_tokens),
            ("--max-prompt-chars", self.limits.max_prompt_chars),
        ):
            if value < 1:
                problems.append(f"{flag}: must be at least 1, got {value}")
        for flag, count in (
            ("--max-queue-size", self.max_queue_size),
            ("--intra-op-threads", self.intra_op_threads),
            ("--max-stop-strings", self.limits.max_stop_strings),
            ("--keepalive-max-ping-strikes", self.keepalive.max_ping_strikes),
        ):
            if count < 0:
                problems.append(f"{flag}: must be >= 0, got {count}")
        for flag, seconds in (
            ("--drain-timeout", self.drain_timeout),
            ("--keepalive-min-ping-interval", self.keepalive.min_ping_interval),
        ):
            if not seconds >= 0:
                problems.append(f"{flag}: must be >= 0 seconds, got {seconds}")
        for flag, seconds in (
            ("--keepalive-time", self.keepalive.time),
            ("--keepalive-timeout", self.keepalive.timeout),
        ):
            if not seconds > 0:
                problems.append(f"{flag}: must be more than 0 seconds, got {seconds}")
        if self.limits.default_max_new_tokens > self.limits.max_new_tokens_cap:
            problems.append(
                f"--default-max-new-tokens: {self.limits.default_max_new_tokens} is above "
                f"--max-new-tokens-cap {self.limits.max_new_tokens_cap}"
            )
        for source in self.models:
            if not source.path.is_dir():
                problems.append(f"--model: {source.path} is not a directory")
        problems += self._telemetry_problems()
        problems += self._tls_problems()
        problems += self._health_problems()
        return problems

    def _telemetry_problems(self) -> list[str]:
        telemetry = self.telemetry
        problems: list[str] = []
        if telemetry.metrics_port is not None:
            problems += _check_port("--metrics-port", telemetry.metrics_port)
            if telemetry.metrics_port != 0 and telemetry.metrics_port == self.port:
                problems.append(f"--metrics-port: {telemetry.metrics_port} is also the gRPC --port")
        if telemetry.otlp_metrics and not telemetry.otlp_endpoint:
            problems.append("--otlp-metrics: needs --otlp-endpoint")
        if not isinstance(logging.getLevelName(telemetry.log_level.upper()), int):
            problems.append(f"--log-level: {telemetry.log_level!r} is not DEBUG, INFO, WARNING or ERROR")
        if telemetry.log_format not in ("text", "json"):
            problems.append(f"--log-format: must be text or json, got {telemetry.log_format!r}")
        if not telemetry.service_name:
            problems.append("--service-name: must not be empty")
        return problems

    def _tls_problems(self) -> list[str]:
        tls = self.tls
        problems: list[str] = []
        if (tls.cert is None) != (tls.key is None):
            problems.append("--tls-cert and --tls-key: give both or neither")
        if tls.client_ca is not None and tls.cert is None:
            problems.append("--tls-client-ca: mutual TLS needs --tls-cert and --tls-key too")
        files = (("--tls-cert", tls.cert), ("--tls-key", tls.key), ("--tls-client-ca", tls.client_ca))
        for flag, path in files:
            if path is not None and not path.is_file():
                problems.append(f"{flag}: {path} is not a readable file")
        return problems

    def _health_problems(self) -> list[str]:
        health = self.health
        high = health.queue_high_watermark
        if high is None:
            if health.queue_low_watermark is not None:
                return ["--health-queue-low-watermark: needs --health-queue-high-watermark"]
            return []
        problems: list[str] = []
        if not 1 <= high <= self.max_queue_size:
            problems.append(
                f"--health-queue-high-watermark: must be between 1 and --max-queue-size "
                f"({self.max_queue_size}), got {high}"
            )
        low = health.low_watermark
        if low is not None and not 0 <= low < high:
            problems.append(
                f"--health-queue-low-watermark: must be at least 0 and below the high watermark ({high}), "
                f"got {low}"
            )
        return problems


def _check_port(flag: str, port: int) -> list[str]:
    return [] if 0 <= port <= 65535 else [f"{flag}: {port} is not a TCP port"]
