"""Typed server settings, each declared once.

These are the settings of one server as a library object. `tokenwire serve` fills them from
flags, TOKENWIRE_* variables and a TOML file (settings_sources.py); where the two defaults
differ (the metrics endpoint), the library default is the one that opens nothing extra, so an
embedding application or a test does not bind ports it did not ask for.

To add a setting, add one field made with `setting(default, help, ...)` to the dataclass it
belongs to (settings_schema.py says how): its flag, TOKENWIRE_* variable, TOML key, help line
and bounds derive from that field. Only a rule between settings needs a line in `validate`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from tokenwire.server.api.stream_limits import StreamLimits
from tokenwire.server.engine.config import EngineConfig
from tokenwire.server.engine.format_cache import FormatLimits
from tokenwire.server.engine.types import Caller
from tokenwire.server.engine.validation import RequestLimits
from tokenwire.server.models.kv_settings import KvCacheSettings
from tokenwire.server.models.runtime_check import Device
from tokenwire.server.openai_api.settings import HttpSettings
from tokenwire.server.security.callers import default_name
from tokenwire.server.security.gateway_headers import GatewaySettings
from tokenwire.server.security.tls import TlsSettings
from tokenwire.server.settings_schema import (
    ENGINE,
    HEALTH,
    NETWORK,
    SECURITY,
    TELEMETRY,
    bound_problems,
    declared_settings,
    port_problem,
    setting,
    settings_group,
)
from tokenwire.server.telemetry.settings import DEFAULT_METRICS_PORT, LogFormat, TelemetrySettings

__all__ = [
    "DEFAULT_METRICS_PORT",
    "DEFAULT_PORT",
    "AuthSettings",
    "EngineConfig",
    "HealthSettings",
    "KeepaliveSettings",
    "LogFormat",
    "ModelSource",
    "ServerSettings",
    "TelemetrySettings",
    "TlsSettings",
]

DEFAULT_PORT = 50051


@dataclass(frozen=True)
class ModelSource:
    path: Path
    """A converted model directory, or a .gguf file (`tokenwire serve` converts it first)."""
    name: str | None = None
    """Name clients use; defaults to the directory's name (a GGUF file's: its name without .gguf)."""


ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
"""What an adapter may be called: no ':' (the OpenAI edge's `base:adapter`), at most 64 characters."""


@dataclass(frozen=True)
class LoraSource:
    """One `--lora NAME=PATH`: a PEFT adapter directory or a GGUF adapter file, served as NAME."""

    name: str
    path: Path


ALL_PROJECTIONS = "all"
"""--lora-modules' default: LoRA sites on every projection."""


def lora_module_list(value: str) -> tuple[str, ...]:
    """The names of a --lora-modules value, comma-separated; blanks between commas are skipped."""
    return tuple(name.strip() for name in value.split(",") if name.strip())


def _lora_modules_problem(value: str) -> str | None:
    names = lora_module_list(value)
    if not names:
        return (
            f"{value!r} names no module: give projections such as q_proj,v_proj, or "
            f"{ALL_PROJECTIONS} (every projection, the default)"
        )
    if ALL_PROJECTIONS in names and len(names) > 1:
        return f"{ALL_PROJECTIONS} is every projection already: give it alone, or name projections"
    return None


def is_gguf_file(path: Path) -> bool:
    """A model given as a GGUF file, which `tokenwire serve` converts (once) before it serves it."""
    return path.suffix.lower() == ".gguf" and path.is_file()


@dataclass(frozen=True)
class KeepaliveSettings:
    """HTTP/2 keepalive: the server's own pings, and how often clients may ping it."""

    time: float = setting(60.0, "seconds between the server's keepalive pings, to find dead clients", above=0)
    timeout: float = setting(
        20.0, "seconds a keepalive ping may go unanswered before the connection is closed", above=0
    )
    min_ping_interval: float = setting(
        10.0, "seconds clients must leave between their pings; faster pings earn strikes", minimum=0
    )
    max_ping_strikes: int = setting(
        2, "too-fast pings before the connection is closed with GOAWAY too_many_pings (0: never)", minimum=0
    )
    permit_without_calls: bool = setting(True, "accept keepalive pings on connections without live calls")


@dataclass(frozen=True)
class AuthSettings:
    tokens: tuple[str, ...] = field(default=(), repr=False)
    """Accepted bearer tokens; empty: authentication is off. Never shown in a repr or a log.
    Not a setting of the usual kind: see settings_sources.py."""
    callers: tuple[Caller, ...] = field(default=(), repr=False)
    """The caller each of `tokens` stands for, in the same order; empty: each token is its own
    caller, named by its digest (security/callers.py)."""
    protect_health: bool = setting(
        False,
        "require the bearer token for grpc.health.v1 too (off: load balancers probe without one)",
        key="auth_health",
    )

    @property
    def enabled(self) -> bool:
        return bool(self.tokens)

    def token_callers(self) -> tuple[tuple[str, Caller], ...]:
        if self.callers:
            return tuple(zip(self.tokens, self.callers, strict=True))
        return tuple((token, Caller(default_name(token))) for token in self.tokens)


@dataclass(frozen=True)
class HealthSettings:
    port: int | None = setting(
        None,
        "port of a second listener, always plaintext and without tokens, that serves only grpc.health.v1 "
        "(for Kubernetes gRPC probes, which speak neither TLS nor tokens; 0 picks one)",
        check=port_problem,
        metavar="PORT",
    )
    """None: health is served on the gRPC port only."""
    queue_high_watermark: int | None = setting(
        None,
        "report NOT_SERVING on grpc.health.v1 once a model's "
        "queue holds this many requests (unset: never for load)",
    )
    queue_low_watermark: int | None = setting(
        None,
        "report SERVING again once every queue is down to this many (default: half the high watermark)",
    )

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
    """Not a setting of the usual kind (NAME=DIR, repeatable): see settings_sources.py."""
    loras: tuple[LoraSource, ...] = ()
    """LoRA adapters served on the first model (--lora NAME=PATH, repeatable): see settings_sources.py."""
    max_loras: int = setting(
        4,
        "adapter slots of a model with LoRA sites: the most adapters loaded at once (each --lora takes one)",
        group=ENGINE,
        minimum=1,
    )
    max_lora_rank: int = setting(
        16, "largest LoRA adapter rank served; sizes the adapter stacks", group=ENGINE, minimum=1
    )
    lora_modules: str = setting(
        ALL_PROJECTIONS,
        "projections that get LoRA sites when --lora converts a GGUF or the default model, "
        "comma-separated as PEFT's target_modules names them (q_proj,v_proj or self_attn.q_proj); "
        "adapters may adapt only these, and each site costs every decode step some time "
        f"({ALL_PROJECTIONS}: every projection)",
        group=ENGINE,
        check=_lora_modules_problem,
        metavar="NAMES",
    )
    device: Device = setting(
        "auto", "where the model runs; auto picks CUDA when ONNX Runtime has it", group=ENGINE
    )
    max_context_length: int = setting(
        2048, "longest sequence (prompt + output) served; sizes the KV cache", group=ENGINE, minimum=1
    )
    result_retention: float = setting(
        300.0,
        "seconds a finished generation stays retrievable by a retry with the same caller and "
        "idempotency_key (0: results are not kept; a retry still joins a running generation)",
        group=ENGINE,
        minimum=0,
    )
    result_retention_mb: int = setting(
        64, "memory for kept results, in MiB; the oldest go first", group=ENGINE, minimum=0
    )
    intra_op_threads: int = setting(
        0, "ONNX Runtime threads per operator (0: one per core)", group=ENGINE, minimum=0
    )
    engine: EngineConfig = settings_group(EngineConfig, group=ENGINE)
    kv_cache: KvCacheSettings = settings_group(KvCacheSettings, group=ENGINE, prefix="kv_cache_")
    limits: RequestLimits = settings_group(RequestLimits, group=ENGINE)
    formats: FormatLimits = settings_group(FormatLimits, group=ENGINE, prefix="format_")
    host: str = setting("0.0.0.0", "address to listen on", group=NETWORK, metavar="ADDRESS")
    port: int = setting(
        DEFAULT_PORT, "gRPC port (0 picks one)", group=NETWORK, check=port_problem, metavar="PORT"
    )
    drain_timeout: float = setting(
        30.0,
        "seconds live requests get to finish after SIGTERM; then they fail with UNAVAILABLE",
        group=NETWORK,
        minimum=0,
    )
    max_receive_message_bytes: int = setting(
        1024 * 1024,
        "largest request message; larger is RESOURCE_EXHAUSTED before it is decoded (decoding holds the "
        "event loop about 0.1 s per MiB of tiny entries)",
        group=NETWORK,
        minimum=1,
        metavar="BYTES",
    )
    max_concurrent_streams: int = setting(
        256,
        "calls one connection may have open at once (HTTP/2 streams); further calls wait in the client",
        group=NETWORK,
        minimum=1,
    )
    max_connection_age: float = setting(
        300.0,
        "seconds after which the server asks a client connection to go (HTTP/2 GOAWAY, gRFC A9; gRPC "
        "adds up to 10% jitter): its calls finish, and the client's next call opens a new connection, "
        "which a DNS name or an L4 balancer may send to a new replica (0: connections never age)",
        group=NETWORK,
        minimum=0,
    )
    max_connection_age_grace: float = setting(
        3600.0,
        "seconds the calls of an aged connection get to finish before it is closed under them; longer "
        "than the longest generation (--max-new-tokens-cap tokens at 0.5 s a step is 34 minutes)",
        group=NETWORK,
        minimum=0,
    )
    stream: StreamLimits = settings_group(StreamLimits, group=NETWORK)
    http: HttpSettings = settings_group(HttpSettings, group=NETWORK, prefix="http_")
    keepalive: KeepaliveSettings = settings_group(KeepaliveSettings, group=NETWORK, prefix="keepalive_")
    reflection: bool = setting(
        True,
        "offer gRPC server reflection (grpcurl, buf curl); behind the bearer token when authentication is on",
        group=NETWORK,
    )
    auth: AuthSettings = settings_group(AuthSettings, group=SECURITY)
    tls: TlsSettings = settings_group(TlsSettings, group=SECURITY, prefix="tls_")
    gateway: GatewaySettings = settings_group(GatewaySettings, group=SECURITY, prefix="gateway_")
    telemetry: TelemetrySettings = settings_group(TelemetrySettings, group=TELEMETRY)
    health: HealthSettings = settings_group(HealthSettings, group=HEALTH, prefix="health_")
    load_report_min_interval: float = setting(
        1.0,
        "fewest seconds between the ORCA load reports of one out-of-band stream "
        "(xds.service.orca.v3.OpenRcaService); a client asking for less gets this",
        group=HEALTH,
        minimum=0.01,
    )

    @property
    def lora_module_names(self) -> tuple[str, ...] | None:
        """The projections --lora-modules names; None: every projection."""
        names = lora_module_list(self.lora_modules)
        return None if names == (ALL_PROJECTIONS,) else names

    def validate(self, *, require_models: bool = True) -> list[str]:
        """Problems with these settings, as messages naming the flag."""
        problems: list[str] = []
        if require_models and not self.models:
            problems.append("--model: at least one model directory is needed")
        problems += bound_problems(self, declared_settings(ServerSettings))
        if self.limits.default_max_new_tokens > self.limits.max_new_tokens_cap:
            problems.append(
                f"--default-max-new-tokens: {self.limits.default_max_new_tokens} is above "
                f"--max-new-tokens-cap {self.limits.max_new_tokens_cap}"
            )
        for source in self.models:
            if not (source.path.is_dir() or is_gguf_file(source.path)):
                problems.append(f"--model: {source.path} is neither a model directory nor a .gguf file")
        problems += self._lora_problems()
        if self.kv_cache.location == "host" and self.device == "cuda":
            problems.append(
                "--kv-cache-location: host keeps the KV cache in host memory, which a model on "
                "--device cuda would copy to the GPU and back every step; use device"
            )
        problems += self._telemetry_problems()
        problems += self._tls_problems()
        problems += self._health_problems()
        problems += self.gateway.problems(
            [caller for _, caller in self.auth.token_callers()], authenticated=self.auth.enabled
        )
        problems += self._http_problems()
        return problems

    def _lora_problems(self) -> list[str]:
        problems: list[str] = []
        chosen = self.lora_module_names is not None and _lora_modules_problem(self.lora_modules) is None
        if chosen and not self.loras:
            problems.append(
                "--lora-modules: needs --lora (only a model converted for --lora adapters gets LoRA sites)"
            )
        if len(self.loras) > self.max_loras:
            problems.append(f"--lora: {len(self.loras)} adapters given, over --max-loras {self.max_loras}")
        seen: set[str] = set()
        for source in self.loras:
            if not ADAPTER_NAME.match(source.name):
                problems.append(
                    f"--lora: adapter name {source.name[:80]!r} must be 1 to 64 letters, digits, '.', '_' "
                    "or '-', starting with a letter or digit"
                )
            elif source.name in seen:
                problems.append(f"--lora: two adapters are named {source.name!r}")
            seen.add(source.name)
            if not (source.path.is_dir() or source.path.is_file()):
                problems.append(
                    f"--lora: {source.name}={source.path} is neither a PEFT adapter directory nor a file"
                )
        return problems

    def _http_problems(self) -> list[str]:
        port = self.http.port
        if port in (None, 0):
            return []
        taken = (
            ("--port", self.port),
            ("--metrics-port", self.telemetry.metrics_port),
            ("--health-port", self.health.port),
        )
        return [f"--http-port: {port} is also the {flag}" for flag, other in taken if other == port]

    def _telemetry_problems(self) -> list[str]:
        telemetry = self.telemetry
        problems: list[str] = []
        if telemetry.metrics_port not in (None, 0) and telemetry.metrics_port == self.port:
            problems.append(f"--metrics-port: {telemetry.metrics_port} is also the gRPC --port")
        if telemetry.metrics_auth and not self.auth.enabled:
            problems.append("--metrics-auth: needs --auth-tokens-file or TOKENWIRE_AUTH_TOKENS")
        if telemetry.metrics_tls and not self.tls.enabled:
            problems.append("--metrics-tls: needs --tls-cert and --tls-key")
        if telemetry.otlp_metrics and not telemetry.otlp_endpoint:
            problems.append("--otlp-metrics: needs --otlp-endpoint")
        return problems

    @property
    def metrics_address(self) -> str:
        """Where the metrics endpoint listens: --metrics-host, else somewhere no more open than gRPC.

        When gRPC needs TLS or a token and the endpoint asks for neither, an endpoint on --host
        would hand anyone who reaches the gRPC port what the gRPC port keeps from them (model
        names, traffic), so it listens on loopback unless --metrics-host says otherwise.
        """
        telemetry = self.telemetry
        if telemetry.metrics_host:
            return telemetry.metrics_host
        grpc_closed = self.auth.enabled or self.tls.enabled
        endpoint_closed = telemetry.metrics_auth or telemetry.metrics_tls
        return "127.0.0.1" if grpc_closed and not endpoint_closed else self.host

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
        problems: list[str] = []
        if health.port not in (None, 0):
            for flag, taken in (("--port", self.port), ("--metrics-port", self.telemetry.metrics_port)):
                if health.port == taken:
                    problems.append(f"--health-port: {health.port} is also the {flag}")
        high = health.queue_high_watermark
        if high is None:
            if health.queue_low_watermark is not None:
                problems.append("--health-queue-low-watermark: needs --health-queue-high-watermark")
            return problems
        if not 1 <= high <= self.engine.max_queue_size:
            problems.append(
                f"--health-queue-high-watermark: must be between 1 and --max-queue-size "
                f"({self.engine.max_queue_size}), got {high}"
            )
        low = health.low_watermark
        if low is not None and not 0 <= low < high:
            problems.append(
                f"--health-queue-low-watermark: must be at least 0 and below the high watermark ({high}), "
                f"got {low}"
            )
        return problems
