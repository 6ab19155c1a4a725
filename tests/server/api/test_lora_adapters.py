"""LoRA adapters served per request by a real server: each adapter's greedy tokens and
log-probabilities equal transformers + PEFT's, alone and with three adapters and the base model
decoded in one step.

The tiny models of each layout, built with LoRA sites, and three PEFT adapters per layout come
from test_lora_matches_peft.py (its `layout` fixture and PEFT references); here they are served
with `--lora NAME=PATH` and asked for over gRPC with GenerateRequest.adapter. Tolerances are the
float models' own (2e-4 for the Llama graph, 1e-4 for the tiny GPT); log-probabilities cross the
wire as float32, whose rounding at these magnitudes is under 1e-6.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace

import grpc
import numpy as np
import pytest

from tests.conftest import tiny_settings
from tests.server.model_tools import test_lora_matches_peft as stage_one
from tests.server.model_tools.test_lora_matches_peft import MAX_RANK, STEPS, Layout
from tests.support.polling import wait_until
from tests.support.servers import serving
from tests.support.stepping import GatedRunner, StepGate
from tokenwire.server.config import LoraSource
from tokenwire.server.models.loader import LoadedModel
from tokenwire.server.models.runner import ModelRunner
from tokenwire.v1 import inference_service_pb2 as pb
from tokenwire.v1 import inference_service_pb2_grpc as pb_grpc

layout = stage_one.layout
"""The tiny model of each layout with three PEFT adapters and their references, built once per module."""

NAMES = ("a0", "a1", "a2")
TOP = 5


def _settings(layout: Layout, **overrides: object):  # type: ignore[no-untyped-def]
    loras = tuple(LoraSource(name, path) for name, path in zip(NAMES, layout.adapter_dirs, strict=True))
    overrides.setdefault("prefix_cache_mb", 0)  # outputs computed, never copied, unless a test asks
    return tiny_settings(layout.model_dir, loras=loras, max_loras=3, max_lora_rank=MAX_RANK, **overrides)


def _request(layout: Layout, prompt: int, adapter: int | None) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=layout.prompts[prompt]),
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_new_tokens=STEPS, ignore_eos=True),
        logprobs=True,
        top_logprobs=TOP,
        adapter="" if adapter is None else NAMES[adapter],
    )


def _assert_matches_peft(
    layout: Layout, response: pb.GenerateResponse, adapter: int | None, prompt: int
) -> None:
    expected_tokens, expected_logprobs = layout.reference(adapter, prompt)
    what = f"{layout.name}, adapter {adapter}, prompt {prompt}"
    assert list(response.token_ids) == expected_tokens, what
    assert len(response.logprobs) == STEPS, what
    for step, item in enumerate(response.logprobs):
        row = expected_logprobs[step]
        assert item.token_id == expected_tokens[step]
        np.testing.assert_allclose(
            item.logprob, row[item.token_id], atol=layout.tolerance, rtol=0, err_msg=what
        )
        top = sorted(item.top_logprobs, key=lambda t: -t.logprob)
        expected_top = np.argsort(-row)[:TOP]
        np.testing.assert_allclose(
            [t.logprob for t in top], row[expected_top], atol=layout.tolerance, rtol=0, err_msg=what
        )


async def test_each_adapter_served_alone_gives_peft_s_greedy_tokens_and_logprobs(layout: Layout) -> None:
    async with (
        serving(_settings(layout)) as server,
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        stub = pb_grpc.InferenceServiceStub(channel)
        for adapter in (0, 1, 2, None):
            response = await stub.Generate(_request(layout, 0, adapter))
            _assert_matches_peft(layout, response, adapter, 0)


class _RecordingGate(GatedRunner):
    """Holds decode steps at the gate and records the adapter slots of each step's rows."""

    def __init__(self, inner: ModelRunner, gate: StepGate) -> None:
        super().__init__(inner, gate)
        self.steps: list[tuple[int, ...]] = []

    def decode(
        self, seq_ids: Sequence[int], token_ids: Sequence[int], *, adapters: Sequence[int] | None = None
    ) -> np.ndarray:
        self.steps.append(tuple(adapters or ()))
        return super().decode(seq_ids, token_ids, adapters=adapters)


async def test_three_adapters_and_the_base_in_one_decode_step_each_give_peft_s_result(layout: Layout) -> None:
    gate = StepGate()
    recorder: list[_RecordingGate] = []

    def wrap(model: LoadedModel) -> LoadedModel:
        recorder.append(_RecordingGate(model.runner, gate))
        return replace(model, runner=recorder[0])

    rows: list[int | None] = [2, None, 0, 1]
    async with (
        serving(_settings(layout), wrap_model=wrap) as server,
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        stub = pb_grpc.InferenceServiceStub(channel)
        runner = recorder[0]
        calls = [
            asyncio.ensure_future(stub.Generate(_request(layout, prompt, adapter)))
            for prompt, adapter in enumerate(rows)
        ]
        # The first decode step is held until all four requests are in the engine: the rows not
        # prefilled yet are the next round's prompts, and its decode step has all four rows.
        engine = server.registry.default.engine
        await wait_until(
            lambda: gate.waiting == 1 and engine.live_count == len(rows), what="all four requests"
        )
        gate.open()
        responses = await asyncio.gather(*calls)
    slots = {server_slot for step in runner.steps for server_slot in step}
    assert any(len(step) == len(rows) and len(set(step)) == len(rows) for step in runner.steps), runner.steps
    assert 0 in slots and len(slots) == len(rows)
    for prompt, (adapter, response) in enumerate(zip(rows, responses, strict=True)):
        _assert_matches_peft(layout, response, adapter, prompt)


@pytest.mark.parametrize("layout", ["genai"], indirect=True)
async def test_the_prefix_cache_shares_kv_within_an_adapter_never_across_adapters(layout: Layout) -> None:
    prompt = [(i * 37 + 11) % 400 + 40 for i in range(40)]  # two full 16-token blocks and 8 more

    def asked(adapter: str) -> pb.GenerateRequest:
        return pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=prompt),
            sampling=pb.SamplingParams(temperature=0.0),
            stopping=pb.StoppingCriteria(max_new_tokens=4, ignore_eos=True),
            adapter=adapter,
        )

    async with (
        serving(_settings(layout, prefix_cache_mb=16)) as server,
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        stub = pb_grpc.InferenceServiceStub(channel)
        first = await stub.Generate(asked("a0"))
        other_adapter = await stub.Generate(asked("a1"))
        base = await stub.Generate(asked(""))
        same_adapter = await stub.Generate(asked("a0"))
        base_again = await stub.Generate(asked(""))
    assert first.usage.cached_prompt_tokens == 0
    assert other_adapter.usage.cached_prompt_tokens == 0
    assert base.usage.cached_prompt_tokens == 0
    assert same_adapter.usage.cached_prompt_tokens >= 32  # at least its two full blocks
    assert base_again.usage.cached_prompt_tokens == same_adapter.usage.cached_prompt_tokens
    assert list(same_adapter.token_ids) == list(first.token_ids)
