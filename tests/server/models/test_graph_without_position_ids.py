"""A graph without `position_ids` derives each row's positions from the cache width, so a row the
runner left-pads would decode at shifted positions: in a busy batch of prompts of different
lengths, every generation still gets the tokens it gets alone."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest

from tests.conftest import ServerFactory
from tests.support.options import greedy
from tests.support.polling import wait_until
from tests.support.runners import DelegatingRunner
from tests.support.stepping import StepGate, gated
from tokenwire.client import AsyncClient, Generation
from tokenwire.server.models.loader import LoadedModel

# Different lengths, so joining one batch would pad all but the longest.
PROMPTS = (
    "Hello.",
    "Good morning!",
    "The quick brown fox jumps over the lazy dog",
    "Once upon a time, far aw",
)


class BatchSizes(DelegatingRunner):
    """Records how many sequences each decode step carries."""

    def __init__(self, inner: object, sizes: list[int]) -> None:
        super().__init__(inner)  # type: ignore[arg-type]
        self.sizes = sizes

    def decode(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> np.ndarray:
        self.sizes.append(len(seq_ids))
        return super().decode(seq_ids, token_ids)


@pytest.mark.parametrize("model_layout", ["optimum"])
async def test_a_busy_batch_of_different_lengths_decodes_each_prompt_as_it_decodes_alone(
    start_server: ServerFactory, tiny_model_without_position_ids_dir: Path
) -> None:
    sizes: list[int] = []
    gate = StepGate()
    hold = gated(gate)

    def wrap(model: LoadedModel) -> LoadedModel:
        return hold(replace(model, runner=BatchSizes(model.runner, sizes)))

    model_dir = tiny_model_without_position_ids_dir
    assert "position_ids" not in {i.name for i in onnx.load(str(model_dir / "model.onnx")).graph.input}
    server = await start_server(model_dir=model_dir, wrap_model=wrap, max_batch_size=4)
    engine = server.registry.default.engine
    async with AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client:
        gate.open()
        alone = [await client.generate(prompt, greedy(32)) for prompt in PROMPTS]
        assert max(sizes) == 1
        assert len({g.prompt_tokens for g in alone}) == len(PROMPTS)

        gate.close()  # every request arrives before the first one's first step
        together = [asyncio.ensure_future(client.generate(prompt, greedy(32))) for prompt in PROMPTS]
        await wait_until(lambda: engine.live_count == len(PROMPTS), what="all four requests in the engine")
        gate.open()
        batched: list[Generation] = list(await asyncio.gather(*together))

    assert max(sizes) == len(PROMPTS)  # the four were decoded in one batch
    for prompt, single, busy in zip(PROMPTS, alone, batched, strict=True):
        assert list(busy.token_ids) == list(single.token_ids), prompt
