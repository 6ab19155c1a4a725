"""Channels to a tokenwire server: retry policy, TLS, bearer tokens."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources

import grpc

MAX_MESSAGE_BYTES = 16 * 1024 * 1024


def service_config() -> str:
    """The retry policy the client ships with: only UNAVAILABLE and RESOURCE_EXHAUSTED are retried."""
    text = resources.files("tokenwire.client").joinpath("service_config.json").read_text(encoding="utf-8")
    return json.dumps(json.loads(text))  # compact, and proves it parses


@dataclass(frozen=True)
class Tls:
    """TLS settings: a CA to trust and, for mutual TLS, the client's own certificate and key (PEM)."""

    root_certificates: bytes | None = None
    certificate_chain: bytes | None = None
    private_key: bytes | None = None
    server_name_override: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.root_certificates,
            private_key=self.private_key,
            certificate_chain=self.certificate_chain,
        )


def channel_options(tls: Tls | None, *, retries: bool = True) -> list[tuple[str, object]]:
    options: list[tuple[str, object]] = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.enable_retries", 1 if retries else 0),
    ]
    if retries:
        options.append(("grpc.service_config", service_config()))
    if tls is not None and tls.server_name_override:
        options.append(("grpc.ssl_target_name_override", tls.server_name_override))
    return options


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def aio_channel(target: str, tls: Tls | None = None, *, retries: bool = True) -> grpc.aio.Channel:
    options = channel_options(tls, retries=retries)
    if tls is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, tls.credentials(), options=options)


def sync_channel(target: str, tls: Tls | None = None, *, retries: bool = True) -> grpc.Channel:
    options = channel_options(tls, retries=retries)
    if tls is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, tls.credentials(), options=options)
