"""How a server setting is declared once: a dataclass field whose metadata says how to set it.

A field made with `setting(...)` is a setting of `tokenwire serve`: its flag (`--` and the key
with dashes), its TOKENWIRE_* variable, its TOML key (the key itself), its help line, its kind
(from the field's type: int, float, str, bool, Path, a Literal's choices; `X | None` may be
unset) and its bounds all derive from the field. A field made with `settings_group(...)` holds a
nested settings dataclass whose settings' keys take the group's prefix. Fields made otherwise
are not settings. This module imports nothing of the server, so any layer may declare settings.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

T = TypeVar("T")

Kind = Literal["int", "float", "str", "bool", "path", "choice"]

_METADATA_KEY = "tokenwire.setting"
_NO_DEFAULT: Any = object()

ENGINE = "models and engine"
NETWORK = "network and limits"
SECURITY = "security"
TELEMETRY = "telemetry"
HEALTH = "health"
GROUPS = (ENGINE, NETWORK, SECURITY, TELEMETRY, HEALTH)
"""Help groups, in the order `tokenwire serve --help` shows them."""


@dataclass(frozen=True)
class SettingSpec:
    help: str
    group: str | None
    key: str | None
    minimum: float | None
    above: float | None
    check: Callable[[Any], str | None] | None
    metavar: str | None
    command_default: Any
    switch: tuple[str, str] | None


@dataclass(frozen=True)
class GroupSpec:
    group: str
    prefix: str


@dataclass(frozen=True)
class Setting:
    """One setting as `tokenwire serve` sees it, derived from its field."""

    key: str
    """TOML key and argparse destination; the flag and variable derive from it."""
    kind: Kind
    default: object
    """Default of `tokenwire serve` (the library's, unless the field says otherwise)."""
    help: str
    group: str
    choices: tuple[str, ...] = ()
    optional: bool = False
    """May be unset (None): an empty variable unsets it."""
    path: tuple[str, ...] = ()
    """Attribute path from the root settings object; empty for a setting no field holds."""
    spec: SettingSpec | None = None
    metavar: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    @property
    def env(self) -> str:
        return "TOKENWIRE_" + self.key.upper()


def setting(
    default: T,
    help: str,
    *,
    group: str | None = None,
    key: str | None = None,
    minimum: float | None = None,
    above: float | None = None,
    check: Callable[[Any], str | None] | None = None,
    metavar: str | None = None,
    command_default: Any = _NO_DEFAULT,
    switch: tuple[str, str] | None = None,
) -> T:
    """A settings field.

    group: the help group (a nested field inherits its group's); key: the key when it is not the
    group's prefix and the field's name; minimum / above: the value must be at least / more than
    this; check: returns a problem (without the flag) or None; command_default: the default of
    `tokenwire serve` where it differs from the library's; switch: (key, help) of an on/off
    setting that, when off, leaves this field None.
    """
    spec = SettingSpec(help, group, key, minimum, above, check, metavar, command_default, switch)
    return dataclasses.field(default=default, metadata={_METADATA_KEY: spec})


def settings_group(factory: Callable[[], T], *, group: str, prefix: str = "") -> T:
    """A field holding a nested settings dataclass; its settings' keys start with `prefix`."""
    spec = GroupSpec(group, prefix)
    return dataclasses.field(default_factory=factory, metadata={_METADATA_KEY: spec})


def declared_settings(root: type[Any]) -> tuple[Setting, ...]:
    """Every setting declared on `root` and its settings groups, in declaration order."""
    return tuple(_walk(root, prefix="", group=None, path=()))


def _walk(cls: type[Any], *, prefix: str, group: str | None, path: tuple[str, ...]) -> Iterator[Setting]:
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        spec = field.metadata.get(_METADATA_KEY)
        if isinstance(spec, GroupSpec):
            nested = hints[field.name]
            yield from _walk(nested, prefix=prefix + spec.prefix, group=spec.group, path=(*path, field.name))
        elif isinstance(spec, SettingSpec):
            yield from _declared(field, spec, hints[field.name], prefix, group, (*path, field.name))


def _declared(
    field: dataclasses.Field[Any],
    spec: SettingSpec,
    hint: object,
    prefix: str,
    group: str | None,
    path: tuple[str, ...],
) -> Iterator[Setting]:
    owner = spec.group or group
    if owner is None:
        raise TypeError(f"setting {field.name!r} belongs to no help group")
    kind, choices, optional = _kind(hint)
    default = field.default if spec.command_default is _NO_DEFAULT else spec.command_default
    if spec.switch is not None:
        switch_key, switch_help = spec.switch
        yield Setting(switch_key, "bool", True, switch_help, owner)
        optional = False  # the switch, not an empty value, turns it off
    yield Setting(
        key=spec.key or prefix + field.name,
        kind=kind,
        default=default,
        help=spec.help,
        group=owner,
        choices=choices,
        optional=optional,
        path=path,
        spec=spec,
        metavar=spec.metavar,
    )


def _kind(hint: object) -> tuple[Kind, tuple[str, ...], bool]:
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = [member for member in typing.get_args(hint) if member is not type(None)]
        optional = len(members) < len(typing.get_args(hint))
        (hint,) = members
    if typing.get_origin(hint) is Literal:
        return "choice", tuple(str(choice) for choice in typing.get_args(hint)), optional
    kinds: dict[object, Kind] = {bool: "bool", int: "int", float: "float", str: "str", Path: "path"}
    if hint not in kinds:
        raise TypeError(f"a setting cannot have the type {hint!r}")
    return kinds[hint], (), optional


def value_at(root: object, path: tuple[str, ...]) -> object:
    value = root
    for name in path:
        value = getattr(value, name)
    return value


def bound_problems(root: object, declared: tuple[Setting, ...]) -> list[str]:
    """Problems of each setting's value against its own bounds, choices and check, naming the flag."""
    problems: list[str] = []
    for item in declared:
        if not item.path:
            continue
        value = value_at(root, item.path)
        problem = None if value is None else _bound_problem(item, value)
        if problem is not None:
            problems.append(f"{item.flag}: {problem}")
    return problems


def _bound_problem(item: Setting, value: Any) -> str | None:
    spec = item.spec
    assert spec is not None
    unit = " seconds" if item.kind == "float" else ""
    if spec.minimum is not None and not value >= spec.minimum:
        at_least = ">= 0" if spec.minimum == 0 else f"at least {spec.minimum}"
        return f"must be {at_least}{unit}, got {value}"
    if spec.above is not None and not value > spec.above:
        return f"must be more than {spec.above}{unit}, got {value}"
    if item.choices and value not in item.choices:
        listed = ", ".join(item.choices[:-1]) + " or " + item.choices[-1]
        return f"must be {listed}, got {value!r}"
    return spec.check(value) if spec.check is not None else None


def port_problem(port: int) -> str | None:
    """The check of a TCP port setting."""
    return None if 0 <= port <= 65535 else f"{port} is not a TCP port"
