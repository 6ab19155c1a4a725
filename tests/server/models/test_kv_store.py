"""The KV stores: rows copied out of a slot, into one and across, touching nothing else, whether
the cache is ONNX Runtime memory moved by ONNX Runtime (device) or NumPy memory (host)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from tokenwire.server.models.kv_copy import KvGeometry
from tokenwire.server.models.kv_settings import KvCacheLocation
from tokenwire.server.models.kv_store import DeviceKvStore, HostKvStore, KvStore, open_kv_store
from tokenwire.server.models.runner import ModelRunnerError
from tokenwire.server.models.session import SessionSettings, create_session

LOCATIONS: tuple[KvCacheLocation, ...] = ("device", "host")


@pytest.fixture(scope="module")
def session(tiny_llama_dir: Path) -> ort.InferenceSession:
    """A CPU session whose execution provider the device store's copy graphs run on."""
    return create_session(tiny_llama_dir / "model.onnx", SessionSettings(device="cpu", intra_op_threads=1))


def geometry(dtype: type[np.floating] = np.float32) -> KvGeometry:
    return KvGeometry(tensors=4, slots=3, kv_heads=2, positions=16, head_dim=8, dtype=np.dtype(dtype))


def store_at(location: KvCacheLocation, shape: KvGeometry, session: ort.InferenceSession) -> KvStore:
    return open_kv_store(shape, location, session, device="cpu", device_id=0)


def random_rows(shape: KvGeometry, count: int, seed: int) -> np.ndarray:
    values = np.random.default_rng(seed).standard_normal(
        (shape.tensors, shape.kv_heads, count, shape.head_dim)
    )
    return values.astype(shape.dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("location", LOCATIONS)
def test_rows_go_into_a_slot_out_of_it_and_across_exactly_and_nothing_else_changes(
    location: KvCacheLocation, dtype: type[np.floating], session: ort.InferenceSession
) -> None:
    shape = geometry(dtype)
    store = store_at(location, shape, session)
    first, second = random_rows(shape, 5, seed=1), random_rows(shape, 4, seed=2)
    # The cache's memory is not cleared (positions past a sequence's length are never read), so
    # what must stay untouched is compared with what was there before.
    before = {slot: store.read(slot, 0, shape.positions) for slot in range(shape.slots)}

    assert store.write(1, [first, second]) == 9  # two blocks, as a prefix-cache hit hands them over
    joined = np.concatenate([first, second], axis=2)
    assert np.array_equal(store.read(1, 0, 9), joined)
    assert np.array_equal(store.read(1, 3, 7), joined[:, :, 3:7])
    assert np.array_equal(store.read(1, 9, 16), before[1][:, :, 9:], equal_nan=True), "past the rows"
    for slot in (0, 2):
        assert np.array_equal(store.read(slot, 0, 16), before[slot], equal_nan=True)

    store.move(1, 2, 6)
    assert np.array_equal(store.read(2, 0, 6), joined[:, :, :6])
    assert np.array_equal(store.read(2, 6, 16), before[2][:, :, 6:], equal_nan=True)
    assert np.array_equal(store.read(1, 0, 9), joined), "the source keeps its rows"
    assert np.array_equal(store.read(0, 0, 16), before[0], equal_nan=True)
    assert store.read(1, 4, 4).shape == (shape.tensors, shape.kv_heads, 0, shape.head_dim)


@pytest.mark.parametrize("location", LOCATIONS)
def test_rows_read_out_are_the_caller_s_own_copy(
    location: KvCacheLocation, session: ort.InferenceSession
) -> None:
    shape = geometry()
    store = store_at(location, shape, session)
    rows = random_rows(shape, 6, seed=3)
    store.write(0, [rows])
    read = store.read(0, 0, 6)
    store.write(0, [random_rows(shape, 6, seed=4)])  # the slot is overwritten
    assert np.array_equal(read, rows)


@pytest.mark.parametrize("location", LOCATIONS)
def test_rows_of_another_shape_are_refused(location: KvCacheLocation, session: ort.InferenceSession) -> None:
    shape = geometry()
    store = store_at(location, shape, session)
    wrong = np.zeros((shape.tensors + 1, shape.kv_heads, 3, shape.head_dim), dtype=shape.dtype)
    with pytest.raises(ModelRunnerError, match="do not fit this cache"):
        store.write(0, [wrong])


def test_the_device_store_is_onnx_runtime_memory_and_the_host_store_numpy_memory(
    session: ort.InferenceSession,
) -> None:
    shape = geometry()
    device, host = store_at("device", shape, session), store_at("host", shape, session)
    assert isinstance(device, DeviceKvStore) and isinstance(host, HostKvStore)
    assert device.describe() == "ONNX Runtime memory on cpu" and host.describe() == "host memory (NumPy)"
    assert device.allocated_bytes == host.allocated_bytes == shape.total_bytes == 4 * 3 * 2 * 16 * 8 * 4
    assert len(device.pointers) == len(host.pointers) == shape.tensors


def test_a_host_cache_for_a_model_on_a_gpu_is_refused_naming_the_flag(session: ort.InferenceSession) -> None:
    # Refused before anything is allocated: no GPU is needed to see it.
    with pytest.raises(ValueError, match="--kv-cache-location host: the model runs on cuda"):
        open_kv_store(geometry(), "host", session, device="cuda", device_id=0)
