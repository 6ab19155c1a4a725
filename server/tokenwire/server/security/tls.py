"""TLS and mutual TLS for the gRPC port.

The files are checked with the standard library's ssl module before the server starts, so a
key that does not match its certificate, or a CA file that is not PEM, stops `tokenwire serve`
with a message naming the flag instead of failing every handshake later.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from tokenwire.server.settings_schema import setting


@dataclass(frozen=True)
class TlsSettings:
    cert: Path | None = setting(None, "server certificate chain (PEM); with --tls-key enables TLS")
    key: Path | None = setting(None, "server private key (PEM)")
    client_ca: Path | None = setting(
        None, "CA certificate (PEM) client certificates must chain to; enables mutual TLS"
    )

    @property
    def enabled(self) -> bool:
        return self.cert is not None


def problems(tls: TlsSettings) -> list[str]:
    """What is wrong with the configured certificate, key and client CA (none when TLS is off)."""
    found: list[str] = []
    if tls.cert is None or tls.key is None:
        return found
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(tls.cert, tls.key)
    except (OSError, ssl.SSLError) as error:
        found.append(
            f"--tls-cert/--tls-key: {tls.cert} and {tls.key} are not a PEM certificate and its key: {error}"
        )
    if tls.client_ca is not None:
        try:
            context.load_verify_locations(cafile=tls.client_ca)
        except (OSError, ssl.SSLError) as error:
            found.append(f"--tls-client-ca: {tls.client_ca} is not a PEM CA certificate: {error}")
    return found


def server_credentials(tls: TlsSettings) -> grpc.ServerCredentials:
    """Credentials for add_secure_port; with a client CA, clients must present a certificate it signed."""
    assert tls.cert is not None and tls.key is not None, "TLS is not configured"
    client_ca = tls.client_ca.read_bytes() if tls.client_ca is not None else None
    return grpc.ssl_server_credentials(
        [(tls.key.read_bytes(), tls.cert.read_bytes())],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )
