"""--kv-cache-mb bounds the KV cache: slots of full context that do not fit are refused before
anything is allocated, naming the flags and what would fit; what is allocated is reported."""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from tests.support.serve_process import serve_refused
from tests.support.tiny_models import TinyModel
from tokenwire.server.models.kv_settings import KvCacheSettings
from tokenwire.server.models.loader import KvCacheSettingError, LoadedModel, load_model
from tokenwire.server.models.runner import KvRowAccess

CONTEXT = 256
"""The tiny models' own context length."""


def position_bytes(model: TinyModel) -> int:
    runner = model.runner(max_batch_size=1, max_context_length=CONTEXT)
    assert isinstance(runner, KvRowAccess)
    return runner.kv_bytes_per_token()


def load_bounded(model: TinyModel, *, slots: int, mb: int) -> LoadedModel:
    settings = model.load_settings(max_batch_size=slots, max_context_length=CONTEXT)
    settings = replace(settings, kv_cache=KvCacheSettings(location=model.kv_cache_location, mb=mb))
    return load_model(model.path, settings)


def test_slots_of_full_context_over_the_bound_are_refused_saying_what_would_fit(
    each_runner: TinyModel,
) -> None:
    per_position = position_bytes(each_runner)
    limit = 2**20
    slots = 2 * limit // (per_position * CONTEXT) + 1  # twice what 1 MiB holds, and more
    needed = per_position * slots * CONTEXT

    with pytest.raises(KvCacheSettingError) as refused:
        load_bounded(each_runner, slots=slots, mb=1)

    message = str(refused.value)
    assert message.startswith(f"--kv-cache-mb 1: --max-batch-size {slots} slots of {CONTEXT} positions")
    assert f"(--max-context-length) need {needed / 2**20:.1f} MiB of KV cache" in message
    fitting_positions = limit // (per_position * slots)
    fitting_slots = limit // (per_position * CONTEXT)
    shorter = f"{slots} slots of {fitting_positions} positions (--max-context-length {fitting_positions})"
    assert f"1 MiB holds {shorter}" in message
    assert f"or {fitting_slots} slots of {CONTEXT} positions (--max-batch-size {fitting_slots})" in message
    # What it says would fit does.
    assert (
        per_position * slots * fitting_positions <= limit and per_position * fitting_slots * CONTEXT <= limit
    )
    load_bounded(each_runner, slots=fitting_slots, mb=1)


def test_a_cache_within_the_bound_loads_and_the_log_reports_the_bytes_allocated(
    each_kv_location: TinyModel, caplog: pytest.LogCaptureFixture
) -> None:
    per_position = position_bytes(each_kv_location)
    exactly = 2**20 // (per_position * CONTEXT)  # the slots that fill 1 MiB to the byte
    with caplog.at_level(logging.INFO, logger="tokenwire.server.models.loader"):
        loaded = load_bounded(each_kv_location, slots=exactly, mb=1)

    assert loaded.info.kv_cache_bytes == exactly * CONTEXT * per_position == 2**20
    where = "ONNX Runtime memory on cpu" if each_kv_location.kv_cache_location == "device" else "host memory"
    assert loaded.info.kv_cache_placement.startswith(where)
    # This load's line: the load runs on this thread (a server another test left loading could
    # log its own model's line meanwhile, in the whole suite's process).
    lines = [
        r.getMessage()
        for r in caplog.records
        if "KV cache" in r.getMessage() and r.thread == threading.get_ident()
    ]
    assert len(lines) == 1, lines
    (line,) = lines
    assert f"KV cache 1.0 MiB ({2**20} bytes) allocated in {where}" in line
    assert f"(--kv-cache-location {each_kv_location.kv_cache_location}) for {exactly} slots" in line


def test_serve_refuses_a_kv_cache_mb_too_small_and_says_what_would_fit(tiny_llama_dir: Path) -> None:
    finished = serve_refused(tiny_llama_dir, "--max-batch-size", "32", "--kv-cache-mb", "1")
    assert finished.returncode == 1
    assert "serving on" not in finished.stdout
    (line,) = [line for line in finished.stderr.splitlines() if "--kv-cache-mb 1:" in line]
    # The tiny Llama: 512 bytes a position, so 32 slots of its 256 positions need 4 MiB.
    assert (
        "--max-batch-size 32 slots of 256 positions (--max-context-length, the model's own context)" in line
    )
    assert "need 4.0 MiB of KV cache" in line
    assert "1 MiB holds 32 slots of 64 positions (--max-context-length 64)" in line
    assert "or 8 slots of 256 positions (--max-batch-size 8); or raise --kv-cache-mb to 4" in line
