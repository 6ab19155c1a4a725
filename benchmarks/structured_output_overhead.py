"""What a response format costs per token at batch 8: the same 8 concurrent generations with and
without a JSON Schema, side by side on one server.

Starts a server with the default model (8 slots, 2 threads) and, for each repetition, runs 8
concurrent greedy generations of 128 new tokens from the 100-token passage twice, once as free
text and once constrained to a schema whose shortest valid output is longer than 128 tokens (an
object holding an array of at least 20 strings), in alternating order. For each run it reports
the server-measured mean time per output token over the 8 generations; the overhead is the
constrained figure over the free one, per repetition, then the median.

    python benchmarks/structured_output_overhead.py [--repetitions 5]
"""

from __future__ import annotations

import asyncio
import json
import statistics

import benchkit

from tokenwire.client import AsyncClient, GenerateOptions, Generation, ResponseFormat, Sampling, Stopping

BATCH = 8
NEW_TOKENS = 128
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "sentences": {"type": "array", "items": {"type": "string"}, "minItems": 20},
    },
    "required": ["title", "sentences"],
    "additionalProperties": False,
}


def _options(constrained: bool) -> GenerateOptions:
    return GenerateOptions(
        sampling=Sampling(temperature=0.0),
        stopping=Stopping(max_new_tokens=NEW_TOKENS, ignore_eos=not constrained),
        response_format=ResponseFormat(json_schema=json.dumps(SCHEMA)) if constrained else None,
    )


async def _run(client: AsyncClient, ids: list[list[int]], constrained: bool) -> float:
    results: list[Generation] = await asyncio.gather(
        *(client.generate(prompt, _options(constrained), deadline=600) for prompt in ids)
    )
    per_token = [r.timing.time_per_output_token for r in results if r.timing.time_per_output_token]
    return statistics.fmean(per_token) * 1000


async def _compare(target: str, ids: list[list[int]], repetitions: int) -> dict[str, list[float]]:
    found: dict[str, list[float]] = {"free": [], "constrained": []}
    async with AsyncClient(target, retries=False) as client:
        await _run(client, ids, False)  # warm-up, and the schema's compilation
        await _run(client, ids, True)
        for repetition in range(repetitions):
            benchkit.wait_for_quiet()
            order = (False, True) if repetition % 2 == 0 else (True, False)
            for constrained in order:
                found["constrained" if constrained else "free"].append(await _run(client, ids, constrained))
    return found


def main() -> None:
    repetitions = benchkit.command_line(__doc__, repetitions=5).repetitions
    directory = benchkit.model_dir()
    ids = [benchkit.prompt_ids(directory, offset=i) for i in range(BATCH)]
    with benchkit.ServerProcess(directory, max_batch_size=BATCH) as server:
        found = asyncio.run(_compare(server.target, ids, repetitions))
    ratios = [c / f for c, f in zip(found["constrained"], found["free"], strict=True)]
    rows = [
        ["free text", f"{benchkit.median(found['free']):.2f}"],
        ["JSON Schema", f"{benchkit.median(found['constrained']):.2f}"],
        ["overhead (median of per-repetition ratios)", f"{(benchkit.median(ratios) - 1) * 100:+.1f}%"],
    ]
    print(
        f"\n## Response format overhead: {BATCH} concurrent greedy generations, {NEW_TOKENS} new tokens, "
        f"median of {repetitions}\n"
    )
    print(benchkit.markdown_table(["", "ms per output token (server)"], rows))
    path = benchkit.save_results(
        "structured_output_overhead",
        {"machine": benchkit.machine_summary(), "ms_per_token": found, "ratios": ratios},
    )
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
