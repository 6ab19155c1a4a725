"""What one model call costs by its size: prompt chunks of 8 to 256 tokens, and decode steps of 1
to 16 rows, on the runner the server uses (no server, no scheduler).

Stall-free pacing splits a prompt into chunks small enough to fit beside a decode step. On a CPU
every model call reads all the weights once, whatever its size, so a call costs a fixed part
plus a part per token; the smaller the chunks, the more of a prompt's time goes to the fixed
part. This measures both parts, so the throughput a pacing setting gives up can be read off.

    python benchmarks/chunk_cost.py [--repetitions 7]
"""

from __future__ import annotations

import statistics
import time

import benchkit
import numpy as np

from tokenwire.server.models.loader import LoadSettings, load_model
from tokenwire.server.models.session import SessionSettings

CHUNKS = (8, 16, 32, 64, 128, 256)
ROWS = (1, 8, 16)
CONTEXT = 64  # prompt positions already cached when a chunk or step runs


def main() -> None:
    repetitions = benchkit.command_line(__doc__, repetitions=7).repetitions
    directory = benchkit.model_dir()
    loaded = load_model(
        directory,
        LoadSettings(max_batch_size=16, max_context_length=2048, session=SessionSettings(device="cpu")),
    )
    runner = loaded.runner
    ids = benchkit.prompt_ids(directory, CONTEXT + max(CHUNKS))
    benchkit.wait_for_quiet()

    chunk_ms: dict[int, float] = {}
    for size in CHUNKS:
        times = []
        for _ in range(repetitions):
            runner.prefill(1, ids[:CONTEXT], start=0)
            began = time.perf_counter()
            runner.prefill(1, ids[CONTEXT : CONTEXT + size], start=CONTEXT)
            times.append(time.perf_counter() - began)
            runner.release(1)
        chunk_ms[size] = statistics.median(times) * 1000

    step_ms: dict[int, float] = {}
    for rows in ROWS:
        seqs = list(range(1, rows + 1))
        for seq in seqs:
            runner.prefill(seq, ids[:CONTEXT], start=0)
        runner.decode(seqs, [ids[0]] * rows)  # joins the batch
        times = []
        for _ in range(repetitions):
            began = time.perf_counter()
            runner.decode(seqs, [ids[1]] * rows)
            times.append(time.perf_counter() - began)
        step_ms[rows] = statistics.median(times) * 1000
        for seq in seqs:
            runner.release(seq)

    # Least squares over the chunks: time = fixed + per_token * tokens.
    sizes = np.array(CHUNKS, dtype=float)
    per_token, fixed = np.polyfit(sizes, np.array([chunk_ms[s] for s in CHUNKS]), 1)
    print(f"\n## One model call, by size (median of {repetitions}, {loaded.info.name})\n")
    rows = [[f"prompt chunk of {s}", f"{chunk_ms[s]:.1f}", f"{chunk_ms[s] / s:.2f}"] for s in CHUNKS]
    rows += [[f"decode step of {r} rows", f"{step_ms[r]:.1f}", f"{step_ms[r] / r:.2f}"] for r in ROWS]
    print(benchkit.markdown_table(["call", "ms", "ms per token"], rows))
    print(f"\nfit over the chunks: {fixed:.1f} ms a call + {per_token:.2f} ms a token")
    path = benchkit.save_results(
        "chunk_cost",
        {
            "machine": benchkit.machine_summary(),
            "chunk_ms": chunk_ms,
            "step_ms": step_ms,
            "fixed_ms": fixed,
            "per_token_ms": per_token,
        },
    )
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
