"""Server reflection over every service tokenwire serves, ORCA's included.

The ORCA messages live in a descriptor pool of their own (see `orca_messages`), apart from the
default pool that holds tokenwire.v1, health, reflection and google.rpc (the error details).
gRPC's reflection servicer reads one pool, so it gets a chain that asks each pool in turn;
otherwise the ORCA service is listed but cannot be described, and clients that describe every
listed service (`buf curl --list-methods`) fail.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import grpc
from google.protobuf import descriptor_pool
from grpc_reflection.v1alpha import reflection

from tokenwire.server.api import orca_messages


class PoolChain:
    """The lookups gRPC's reflection servicer makes, answered by the first pool that knows the name."""

    def __init__(self, *pools: Any) -> None:
        self._pools = pools

    def FindFileByName(self, name: str) -> Any:  # noqa: N802 (the DescriptorPool method names)
        return self._first(lambda pool: pool.FindFileByName(name))

    def FindFileContainingSymbol(self, symbol: str) -> Any:  # noqa: N802
        return self._first(lambda pool: pool.FindFileContainingSymbol(symbol))

    def FindMessageTypeByName(self, name: str) -> Any:  # noqa: N802
        return self._first(lambda pool: pool.FindMessageTypeByName(name))

    def FindExtensionByNumber(self, message: Any, number: int) -> Any:  # noqa: N802
        return message.file.pool.FindExtensionByNumber(message, number)

    def FindAllExtensions(self, message: Any) -> Any:  # noqa: N802
        return message.file.pool.FindAllExtensions(message)

    def _first(self, lookup: Callable[[Any], Any]) -> Any:
        for pool in self._pools:
            try:
                return lookup(pool)
            except KeyError:
                continue
        raise KeyError("not in any descriptor pool")


def enable_reflection(server: grpc.aio.Server, service_names: Iterable[str]) -> None:
    """Offer reflection for `service_names` (reflection's own service is added) on `server`."""
    pools = PoolChain(descriptor_pool.Default(), orca_messages.POOL)
    reflection.enable_server_reflection((*service_names, reflection.SERVICE_NAME), server, pool=pools)
