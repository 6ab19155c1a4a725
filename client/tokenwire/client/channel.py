"""Channels to a tokenwire server or fleet: retry policy, load balancing, TLS, bearer tokens."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

import grpc

from tokenwire.client.routing import Routing

MAX_MESSAGE_BYTES = 16 * 1024 * 1024


def service_config(routing: Routing | None = None, *, retries: bool = True) -> str:
    """The service config the client applies: the retry policy it ships with (only UNAVAILABLE and
    RESOURCE_EXHAUSTED are retried) unless `retries` is off, and `routing`'s load balancing."""
    config: dict[str, Any] = {}
    if retries:
        text = resources.files("tokenwire.client").joinpath("service_config.json").read_text(encoding="utf-8")
        config.update(json.loads(text))
    if routing is not None:
        config.update(routing.service_config())
    return json.dumps(config, separators=(",", ":"))


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


def channel_options(
    tls: Tls | None, *, retries: bool = True, routing: Routing | None = None
) -> list[tuple[str, object]]:
    options: list[tuple[str, object]] = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.enable_retries", 1 if retries else 0),
    ]
    if retries or routing is not None:
        options.append(("grpc.service_config", service_config(routing, retries=retries)))
    if tls is not None and tls.server_name_override:
        options.append(("grpc.ssl_target_name_override", tls.server_name_override))
    return options


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def aio_channel(
    target: str, tls: Tls | None = None, *, retries: bool = True, routing: Routing | None = None
) -> grpc.aio.Channel:
    options = channel_options(tls, retries=retries, routing=routing)
    if tls is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, tls.credentials(), options=options)


def sync_channel(
    target: str, tls: Tls | None = None, *, retries: bool = True, routing: Routing | None = None
) -> grpc.Channel:
    options = channel_options(tls, retries=retries, routing=routing)
    if tls is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, tls.credentials(), options=options)
