"""A server says at start where its KV cache and the rows kept beside it live, and how big each
is; with the cache on the device nothing is off for want of host memory."""

from __future__ import annotations

import io
import json

from tests.conftest import tiny_settings
from tests.support.servers import serving
from tests.support.tiny_models import TinyModel


async def test_a_server_turns_nothing_off_and_says_where_each_part_of_the_kv_lives(
    each_kv_location: TinyModel, every_log_line: io.StringIO
) -> None:
    settings = tiny_settings(each_kv_location.path, kv_cache=each_kv_location.kv_cache, max_batch_size=4)
    async with serving(settings) as server:
        assert server.registry.default.engine.slots == 4
    messages = [json.loads(line)["message"] for line in every_log_line.getvalue().splitlines()]
    on_device = each_kv_location.kv_cache_location == "device"
    where = "ONNX Runtime memory on cpu" if on_device else "host memory (NumPy)"

    (cache,) = [m for m in messages if "genai layout" in m]
    # The tiny Llama: 512 bytes a position, 4 slots of its 256 positions.
    assert f"KV cache 0.5 MiB ({4 * 256 * 512} bytes) allocated in {where}" in cache
    (prefix,) = [m for m in messages if m.startswith("prefix cache for tiny")]
    assert "up to 256 MiB in host memory" in prefix and f"out of the KV cache ({where})" in prefix
    (preemption,) = [m for m in messages if m.startswith("preemption for tiny")]
    assert "rows wait in host memory, at most 4 at once (up to 0.5 MiB)" in preemption
    assert f"back into a slot of the KV cache ({where})" in preemption
    (forks,) = [m for m in messages if m.startswith("n completions for tiny")]
    assert f"slot to slot in the KV cache ({where})" in forks
    assert not [m for m in messages if " off" in m and "speculative decoding" not in m]
