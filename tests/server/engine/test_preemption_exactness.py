"""Preempted generations on the real tiny models: swapped out and back in, they produce what
they would have produced in their slot all along.

The engine is driven round by round over the real ONNX Runtime runners of both KV layouts. A
generation swapped out mid-way (its KV rows copied aside) and swapped back in must give, greedy,
the same tokens as the same prompt generated alone; on the shared-buffer (GenAI) layout bit for
bit, which the log-probabilities (computed from the raw logits) show.
"""

from __future__ import annotations

from tests.support.real_engine import RealEngine, assert_same_output
from tests.support.tiny_models import TinyModel
from tokenwire.server.engine.engine import EngineConfig
from tokenwire.server.engine.types import Caller

FLOOD = Caller("flood")
QUIET = Caller("quiet")
PROMPTS = {
    name: [(i * 29 + seed * 7) % 400 + 40 for i in range(10 + 9 * seed)] for seed, name in enumerate("abc")
}


def engine(each_runner: TinyModel) -> RealEngine:
    config = EngineConfig(max_batch_size=2, prefix_cache_mb=0, batch_reserved_slots=0)
    return RealEngine(each_runner, config)


def test_a_generation_swapped_out_and_back_in_generates_what_it_would_have_alone(
    each_runner: TinyModel,
) -> None:
    alone = engine(each_runner)
    expected = {name: alone.result(alone.submit(PROMPTS[name], tokens=24, caller=FLOOD)) for name in "ab"}

    busy = engine(each_runner)
    flood = {name: busy.submit(PROMPTS[name], tokens=24, caller=FLOOD) for name in "ab"}
    for _ in range(8):  # both decoding, some tokens in
        busy.engine.run_round()
    quiet = busy.submit(PROMPTS["c"], tokens=6, caller=QUIET)
    busy.engine.run_round()
    assert busy.engine.stats.preemptions == 1
    busy.result(quiet)
    results = {name: busy.result(request_id) for name, request_id in flood.items()}
    assert busy.engine.stats.resumptions == 1

    for name, got in results.items():
        assert_same_output(got, expected[name], busy.layout)
        assert busy.streamed(flood[name]) == list(got.token_ids), "every token streamed once"


def test_a_prompt_swapped_out_mid_prefill_and_back_in_generates_what_it_would_have_alone(
    each_runner: TinyModel,
) -> None:
    # Prompt work is paced at one 16-token chunk a round while anything decodes, so the long
    # prompt is mid-way when the quiet caller's request arrives; the decoding one holds more rows
    # and stays.
    config = EngineConfig(
        max_batch_size=2, prefix_cache_mb=0, batch_reserved_slots=0, prefill_chunk_size=16, stall_free=False
    )
    decoding = [(i * 31) % 400 + 40 for i in range(80)]
    long = [(i * 13 + 5) % 400 + 40 for i in range(120)]
    alone = RealEngine(each_runner, config)
    expected = alone.result(alone.submit(long, tokens=12, caller=FLOOD))

    busy = RealEngine(each_runner, config)
    first = busy.submit(decoding, tokens=30, caller=FLOOD)
    busy.engine.run_round()
    victim = busy.submit(long, tokens=12, caller=FLOOD)
    for _ in range(3):
        busy.engine.run_round()
    quiet = busy.submit(PROMPTS["a"], tokens=4, caller=QUIET)
    busy.engine.run_round()
    assert busy.engine.stats.preemptions == 1
    assert busy.streamed(victim) == [], "preempted before its first token"
    decoded_before = len(busy.streamed(first))
    busy.result(quiet)
    assert len(busy.streamed(first)) > decoded_before, "the decoding one kept its slot"
    busy.result(first)
    got = busy.result(victim)
    assert busy.engine.stats.resumptions == 1

    assert_same_output(got, expected, busy.layout)
    assert busy.streamed(victim) == list(got.token_ids)
    assert busy.engine.stats.prefill_tokens == len(decoding) + len(long) + len(PROMPTS["a"])
