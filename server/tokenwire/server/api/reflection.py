"""Server reflection over every service tokenwire serves, ORCA's included, as v1 and v1alpha.

gRPC's reflection v1 (`grpc.reflection.v1.ServerReflection`) is v1alpha renamed: the same
messages, field for field, so the same bytes on the wire. grpcio-reflection serves only v1alpha,
so one servicer answers both names: v1 calls are decoded and encoded with the v1alpha classes,
and v1's own schema (for clients that describe it) is v1alpha's file with the package renamed.
Clients that ask v1 first (buf curl, grpcurl from 1.8.8, grpc-java) get v1; older ones, v1alpha.

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
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2

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


V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
_V1ALPHA_PACKAGE = reflection_pb2.DESCRIPTOR.package


def v1_pool() -> descriptor_pool.DescriptorPool:
    """A pool holding `grpc/reflection/v1/reflection.proto`: v1alpha's file under v1's name."""
    file = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(file)
    file.name = "grpc/reflection/v1/reflection.proto"
    file.package = V1_PACKAGE
    file.ClearField("options")  # v1alpha's language options name v1alpha packages
    old, new = f".{_V1ALPHA_PACKAGE}.", f".{V1_PACKAGE}."
    for message in file.message_type:
        for message_field in message.field:
            if message_field.type_name.startswith(old):
                message_field.type_name = new + message_field.type_name.removeprefix(old)
    for service in file.service:
        for method in service.method:
            method.input_type = new + method.input_type.removeprefix(old)
            method.output_type = new + method.output_type.removeprefix(old)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return pool


def enable_reflection(server: grpc.aio.Server, service_names: Iterable[str]) -> None:
    """Offer reflection v1 and v1alpha for `service_names` (and for themselves) on `server`."""
    pools = PoolChain(descriptor_pool.Default(), orca_messages.POOL, v1_pool())
    servicer = reflection.aio.ReflectionServicer(
        (*service_names, V1_SERVICE_NAME, reflection.SERVICE_NAME), pool=pools
    )
    method = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    for name in (V1_SERVICE_NAME, reflection.SERVICE_NAME):
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": method}),)
        )
