"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: the admin RPC's HTTP routes, with the
bodies vLLM's routes take ({"lora_name", "lora_path"}, and an optional "model"), answered with
the adapter loaded or the bytes freed."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from tokenwire.server.api.adapter_admin import AdapterAdmin, check_load_fields
from tokenwire.server.engine.errors import ErrorKind, FieldViolation, GenerationError

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
ADMIN_PATHS = (LOAD_PATH, UNLOAD_PATH)

_HTTP_FIELDS = {"name": "lora_name", "path": "lora_path"}
"""The admin's field names as this route's body spells them."""


@dataclass(frozen=True)
class AdapterChange:
    model: str
    name: str
    path: str


def parse_adapter_change(body: bytes, *, loading: bool) -> AdapterChange:
    """The body's fields, each a string (lora_path only when loading); refusals name the field."""
    try:
        fields = json.loads(body)
    except (ValueError, RecursionError):
        raise _bad("body", "must be a JSON object") from None
    if not isinstance(fields, dict):
        raise _bad("body", "must be a JSON object")
    wanted = ("model", "lora_name", "lora_path") if loading else ("model", "lora_name")
    unknown = sorted(set(fields) - set(wanted))
    if unknown:
        raise _bad(unknown[0][:64], "is not a field of this route")
    values = {}
    for key in wanted:
        value = fields.get(key, "")
        if not isinstance(value, str):
            raise _bad(key, "must be a string")
        values[key] = value
    if not values["lora_name"]:
        raise _bad("lora_name", "is required")
    change = AdapterChange(values["model"], values["lora_name"], values.get("lora_path", ""))
    if loading:
        try:
            check_load_fields(change.name, change.path)
        except GenerationError as error:
            raise http_named(error) from None
    return change


async def apply_adapter_change(admin: AdapterAdmin, change: AdapterChange, *, loading: bool) -> bytes:
    """Load or unload, answering in JSON; the admin's refusals name this route's fields."""
    try:
        if loading:
            loaded = await admin.load(change.model, change.name, change.path)
            a = loaded.adapter
            return json.dumps(
                {
                    "object": "lora_adapter",
                    "id": a.name,
                    "parent": a.base,
                    "rank": a.rank,
                    "source": a.source,
                    "memory_bytes": a.memory_bytes,
                    "free_slots": loaded.free_slots,
                }
            ).encode()
        unloaded = await admin.unload(change.model, change.name)
    except GenerationError as error:
        raise http_named(error) from None
    return json.dumps(
        {
            "object": "lora_adapter.deleted",
            "id": change.name,
            "freed_bytes": unloaded.freed_bytes,
            "free_slots": unloaded.free_slots,
        }
    ).encode()


def http_named(error: GenerationError) -> GenerationError:
    """`error` with its violations named as this route's body names the fields."""
    violations = tuple(replace(v, field=_HTTP_FIELDS.get(v.field, v.field)) for v in error.violations)
    return GenerationError(
        error.kind, error.message, violations=violations, retry_after=error.retry_after, reason=error.reason
    )


def _bad(field: str, problem: str) -> GenerationError:
    return GenerationError(
        ErrorKind.INVALID_ARGUMENT,
        f"{field}: {problem}",
        violations=(FieldViolation(field, problem),),
        reason="BAD_ADAPTER_REQUEST",
    )
