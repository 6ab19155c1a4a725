"""Loading and unloading LoRA adapters while serving: what both edges call, and the gRPC service.

The work itself (reading files, writing the stacks, waiting for an adapter's requests) is done by
an AdapterAdmin the app wires in (adapter_loading.py); the edges only convert and authorize.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import grpc

from tokenwire.server.api import convert, errors
from tokenwire.server.api.registry import ServedAdapter
from tokenwire.server.engine.errors import ErrorKind, FieldViolation, GenerationError
from tokenwire.server.engine.types import Caller
from tokenwire.server.security.callers import CallerDirectory
from tokenwire.v1 import adapter_admin_pb2 as admin_pb
from tokenwire.v1 import adapter_admin_pb2_grpc as admin_grpc

MAX_PATH_CHARACTERS = 4096
ADAPTER_ADMIN_SERVICE = admin_pb.DESCRIPTOR.services_by_name["AdapterAdminService"].full_name


@dataclass(frozen=True)
class AdapterLoaded:
    adapter: ServedAdapter
    free_slots: int


@dataclass(frozen=True)
class AdapterUnloaded:
    freed_bytes: int
    free_slots: int


class AdapterAdmin(Protocol):
    async def load(self, model: str, name: str, path: str) -> AdapterLoaded:
        """Read `path` into a free slot of `model` (empty: the default model) as `name`.
        Raises GenerationError naming the field."""
        ...

    async def unload(self, model: str, name: str) -> AdapterUnloaded:
        """Refuse new requests for `name` at once, wait for its live requests, free its slot.
        Cancelled (a deadline), the slot is freed in the background once they end."""
        ...


def check_may_manage(caller: Caller) -> None:
    """Only a caller given every adapter manages them: an allow-list says it is a tenant."""
    if caller.adapters is not None:
        raise GenerationError(
            ErrorKind.PERMISSION_DENIED,
            f"caller {caller.name} may not load or unload adapters: its token line limits its adapters",
            reason="ADAPTER_ADMIN_NOT_ALLOWED",
        )


def check_load_fields(name: str, path: str) -> None:
    """The path's bound, before anything reads it (the name is checked by the admin)."""
    if not path or len(path) > MAX_PATH_CHARACTERS:
        raise GenerationError(
            ErrorKind.INVALID_ARGUMENT,
            f"path: must be 1 to {MAX_PATH_CHARACTERS} characters",
            violations=(FieldViolation("path", f"must be 1 to {MAX_PATH_CHARACTERS} characters"),),
        )


class AdapterAdminServicer(admin_grpc.AdapterAdminServiceServicer):
    def __init__(self, admin: AdapterAdmin, callers: CallerDirectory) -> None:
        self._admin = admin
        self._callers = callers

    async def LoadAdapter(  # noqa: N802
        self, request: admin_pb.LoadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb.LoadAdapterResponse:
        try:
            check_may_manage(self._callers.identify(context.invocation_metadata()))
            check_load_fields(request.name, request.path)
            loaded = await self._admin.load(request.model, request.name, request.path)
        except GenerationError as error:
            await errors.abort(context, error)
            raise  # abort never returns
        return admin_pb.LoadAdapterResponse(
            adapter=convert.adapter_info(loaded.adapter), free_slots=loaded.free_slots
        )

    async def UnloadAdapter(  # noqa: N802
        self, request: admin_pb.UnloadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb.UnloadAdapterResponse:
        try:
            check_may_manage(self._callers.identify(context.invocation_metadata()))
            unloaded = await self._admin.unload(request.model, request.name)
        except GenerationError as error:
            await errors.abort(context, error)
            raise
        return admin_pb.UnloadAdapterResponse(
            freed_bytes=unloaded.freed_bytes, free_slots=unloaded.free_slots
        )


def add_adapter_admin_service(servicer: AdapterAdminServicer, server: grpc.aio.Server) -> None:
    admin_grpc.add_AdapterAdminServiceServicer_to_server(servicer, server)
