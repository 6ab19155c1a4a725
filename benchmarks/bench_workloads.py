"""A closed- or open-loop workload of `tokenwire bench`, shared by the benchmarks that compare
servers on the same requests (prefix_cache.py, kv_location.py): fixed prompt and output lengths,
optionally a shared prefix or a multi-turn chat, one warm-up request, a given seed."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from tokenwire.client.bench import BenchConfig, LengthDistribution, LoadLevel, RequestRecord, run_bench


@dataclass(frozen=True)
class Workload:
    name: str
    level: LoadLevel
    prompt: int
    new_tokens: int
    shared_prefix: int = 0
    chat_turns: int = 1
    requests: int | None = None
    duration: float | None = None
    cold_too: bool = False
    """Also run on the servers without the prefix cache (kv_location.py)."""


def run_once(target: str, workload: Workload, seed: int) -> tuple[list[RequestRecord], float]:
    """The workload's requests against `target` once: their records and the output tok/s."""
    config = BenchConfig(
        target=target,
        levels=(workload.level,),
        prompt_tokens=LengthDistribution(workload.prompt, workload.prompt),
        max_new_tokens=LengthDistribution(workload.new_tokens, workload.new_tokens),
        requests=workload.requests,
        duration=workload.duration,
        warmup=1,
        seed=seed,
        shared_prefix_tokens=workload.shared_prefix,
        chat_turns=workload.chat_turns,
    )
    report = asyncio.run(run_bench(config))
    return list(report.records[0]), report.levels[0].output_tokens_per_second
