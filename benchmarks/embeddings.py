"""What an embedding costs on the default model, beside a prefill of the same tokens.

One `tokenwire serve` (prefix cache off, so no prompt is answered from an earlier one's KV): for
each count of inputs (1, 8, 32) and input length (16 and 128 tokens, distinct passages), one
Embed RPC with all the inputs, against the same inputs sent as that many concurrent Generate calls
with max_new_tokens 1 (each a prefill and one sampled token). The two take turns within each
repetition (the order alternates); figures are medians over repetitions of the wall time of the
whole set, with embeddings per second and the median of the per-repetition ratios.

    python benchmarks/embeddings.py [--repetitions 5]
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import benchkit
import grpc

from tokenwire.v1 import inference_service_pb2 as pb
from tokenwire.v1 import inference_service_pb2_grpc as pb_grpc

COUNTS = (1, 8, 32)
LENGTHS = (16, 128)


async def _embed(stub: pb_grpc.InferenceServiceStub, inputs: Sequence[Sequence[int]]) -> float:
    request = pb.EmbedRequest(inputs=[pb.EmbedInput(token_ids=pb.TokenIds(ids=ids)) for ids in inputs])
    began = time.perf_counter()
    reply = await stub.Embed(request)
    spent = time.perf_counter() - began
    assert len(reply.embeddings) == len(inputs)
    return spent


async def _prefill(stub: pb_grpc.InferenceServiceStub, inputs: Sequence[Sequence[int]]) -> float:
    requests = [
        pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=ids),
            sampling=pb.SamplingParams(temperature=0.0),
            stopping=pb.StoppingCriteria(max_new_tokens=1, ignore_eos=True),
        )
        for ids in inputs
    ]
    began = time.perf_counter()
    await asyncio.gather(*(stub.Generate(request) for request in requests))
    return time.perf_counter() - began


async def measure(target: str, repetitions: int) -> dict[str, list[float]]:
    directory = benchkit.model_dir()
    found: dict[str, list[float]] = {}
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        inputs = {
            (count, length): [benchkit.prompt_ids(directory, length, offset=i * 7) for i in range(count)]
            for count in COUNTS
            for length in LENGTHS
        }
        await _embed(stub, inputs[(1, 16)])  # warm both paths before anything is timed
        await _prefill(stub, inputs[(1, 16)])
        for repetition in range(repetitions):
            benchkit.wait_for_quiet()
            for (count, length), batch in inputs.items():
                pair = (("embed", _embed), ("prefill", _prefill))
                for name, run in pair if repetition % 2 == 0 else pair[::-1]:
                    found.setdefault(f"{name}/{count}/{length}", []).append(await run(stub, batch))
    return found


def main() -> None:
    repetitions = benchkit.command_line(__doc__, repetitions=5).repetitions
    with benchkit.ServerProcess(
        benchkit.model_dir(), max_batch_size=32, extra=("--prefix-cache-mb", "0")
    ) as server:
        found = asyncio.run(measure(server.target, repetitions))
    rows = []
    for count in COUNTS:
        for length in LENGTHS:
            embed = found[f"embed/{count}/{length}"]
            prefill = found[f"prefill/{count}/{length}"]
            ratios = [e / p for e, p in zip(embed, prefill, strict=True)]
            e, p = benchkit.median(embed), benchkit.median(prefill)
            rows.append(
                [
                    count,
                    length,
                    f"{e * 1000:.1f}",
                    f"{count / e:.1f}",
                    f"{p * 1000:.1f}",
                    f"{benchkit.median(ratios):.2f}x",
                ]
            )
    print(f"\n## Embeddings against a prefill of the same tokens, median of {repetitions}\n")
    header = [
        "inputs",
        "tokens each",
        "Embed (ms)",
        "embeddings/s",
        "Generate max 1 (ms)",
        "Embed / Generate",
    ]
    print(benchkit.markdown_table(header, rows))
    path = benchkit.save_results("embeddings", {"seconds": found, "machine": benchkit.machine_summary()})
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
