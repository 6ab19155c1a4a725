"""Settings of the OpenAI-compatible HTTP listener, declared next to the edge that owns them."""

from __future__ import annotations

from dataclasses import dataclass

from tokenwire.server.settings_schema import setting


def _port_problem(port: int) -> str | None:
    return None if 0 <= port <= 65535 else f"{port} is not a TCP port"


@dataclass(frozen=True)
class HttpSettings:
    port: int | None = setting(
        None,
        "port of the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models) on "
        "the same engines, tokens and TLS as gRPC (unset: off; 0 picks one)",
        check=_port_problem,
        metavar="PORT",
    )
    """None: no HTTP listener."""
    max_connections: int = setting(
        1024,
        "most HTTP connections (and requests in them) open at once; beyond it a new one gets 503",
        minimum=1,
    )
    body_timeout: float = setting(
        10.0,
        "seconds a client has, from its request's headers, to send the whole body; slower is 408",
        above=0,
    )
    keepalive_timeout: float = setting(5.0, "seconds an idle HTTP keep-alive connection stays open", above=0)
    header_timeout: float = setting(
        10.0,
        "seconds a client has, from its connection (or a request's first byte after the first), to "
        "send a request's whole head; slower is 408 and the connection closed",
        above=0,
    )
    max_head_bytes: int = setting(
        64 * 1024,
        "most bytes of a request's head (request line and headers), and of its chunk framing and "
        "trailers; more is 431 (413 for trailers) and the connection closed",
        minimum=1024,
    )
    max_headers: int = setting(
        100, "most headers in a request; more is 431 and the connection closed", minimum=1
    )
    max_url_bytes: int = setting(
        8 * 1024, "most bytes of a request's URL; longer is 414 and the connection closed", minimum=64
    )

    @property
    def enabled(self) -> bool:
        return self.port is not None
