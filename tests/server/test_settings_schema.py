"""A setting is declared once, as a dataclass field: its key, flag, variable, kind and bounds
derive from the field."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tokenwire.server.config import ServerSettings
from tokenwire.server.settings_schema import (
    ENGINE,
    NETWORK,
    bound_problems,
    declared_settings,
    setting,
    settings_group,
)


@dataclass(frozen=True)
class Inner:
    wait: float = setting(1.5, "seconds to wait", above=0)
    not_a_setting: int = 3


@dataclass(frozen=True)
class Outer:
    count: int = setting(2, "how many", group=ENGINE, minimum=1)
    mode: Literal["fast", "slow"] = setting("fast", "how", group=ENGINE)
    file: Path | None = setting(None, "where", group=ENGINE, key="input_file")
    inner: Inner = settings_group(Inner, group=NETWORK, prefix="inner_")


def test_a_field_declares_its_key_flag_variable_kind_and_group() -> None:
    declared = {item.key: item for item in declared_settings(Outer)}
    assert sorted(declared) == ["count", "inner_wait", "input_file", "mode"]
    assert declared["count"].flag == "--count" and declared["count"].env == "TOKENWIRE_COUNT"
    assert (declared["count"].kind, declared["count"].default) == ("int", 2)
    assert declared["mode"].choices == ("fast", "slow")
    assert declared["input_file"].kind == "path" and declared["input_file"].optional
    assert declared["input_file"].flag == "--input-file"
    inner = declared["inner_wait"]
    assert (inner.flag, inner.kind, inner.group, inner.path) == (
        "--inner-wait",
        "float",
        NETWORK,
        ("inner", "wait"),
    )


def test_each_value_is_checked_against_its_own_bounds_naming_the_flag() -> None:
    bad = Outer(count=0, mode="medium", inner=Inner(wait=0.0))  # type: ignore[arg-type]
    assert bound_problems(bad, declared_settings(Outer)) == [
        "--count: must be at least 1, got 0",
        "--mode: must be fast or slow, got 'medium'",
        "--inner-wait: must be more than 0 seconds, got 0.0",
    ]
    assert bound_problems(Outer(), declared_settings(Outer)) == []


def test_the_server_declares_every_setting_with_help_and_a_unique_key() -> None:
    declared = declared_settings(ServerSettings)
    keys = [item.key for item in declared]
    assert len(keys) == len(set(keys))
    assert all(item.help for item in declared)
    assert {"max_batch_size", "keepalive_time", "auth_health", "tls_cert", "metrics", "metrics_port"} <= set(
        keys
    )
