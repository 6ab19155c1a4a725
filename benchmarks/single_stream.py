"""One stream, side by side: ONNX Runtime GenAI's Generator, a minimal ONNX Runtime loop, tokenwire.

Same ONNX file, 2 intra-op threads, the same ~100-token prompt, 128 greedy new tokens. They
are run in turn (the order rotates every repetition) and each figure is the median over the
repetitions. tokenwire is measured twice: streaming (as a client sees it) and unary Generate (the
server's own timing, with no per-token message on the wire), which separates the cost of
streaming from the rest. Also: tokenwire's time to first token at idle against the raw prefill.

    python benchmarks/single_stream.py [--repetitions 5]

GenAI runs in a separate venv (default /tmp/genai-venv, or $TOKENWIRE_BENCH_GENAI_PYTHON);
without it those figures are skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import benchkit
from benchkit import NEW_TOKENS, THREADS, median
from ort_loop import RawLoop, generate, prefill_seconds

HERE = Path(__file__).resolve().parent


def main() -> None:
    repetitions = benchkit.command_line(__doc__, repetitions=5).repetitions

    directory = benchkit.model_dir()
    ids = benchkit.prompt_ids(directory)
    raw = RawLoop(directory, threads=THREADS, slots=1, max_len=len(ids) + NEW_TOKENS + 1)
    genai_python = benchkit.external_python("TOKENWIRE_BENCH_GENAI_PYTHON", "genai-venv")
    results: dict[str, list[dict[str, float]]] = {"genai": [], "raw": [], "tokenwire": [], "unary": []}
    prefill: list[float] = []

    with benchkit.temporary_dir(benchkit.genai_model_copy(directory)) as genai_dir:
        genai = (
            benchkit.Worker(genai_python, HERE / "genai_worker.py", str(genai_dir)) if genai_python else None
        )
        if genai is None:
            benchkit.skip(
                "ONNX Runtime GenAI", "no venv with onnxruntime-genai (set TOKENWIRE_BENCH_GENAI_PYTHON)"
            )
        with benchkit.ServerProcess(directory, max_batch_size=1) as server:

            def run_genai() -> dict[str, float]:
                assert genai is not None
                times = genai.call(op="generate", ids=ids, new_tokens=NEW_TOKENS)["token_times"]
                return _figures(times)

            def run_raw() -> dict[str, float]:
                run = generate(raw, [ids], NEW_TOKENS)
                # A batch-1 loop's tokens come one per step; only the totals are needed here.
                return {
                    "ttft": run["prefill_all"],
                    "decode_rate": (NEW_TOKENS - 1) / run["decode"],
                    "total": run["total"],
                }

            def run_tokenwire() -> dict[str, float]:
                streamed = benchkit.run_streams(server.target, [ids], NEW_TOKENS)[0]
                figures = _figures(streamed.token_times)
                figures["server_ttft"] = streamed.server_first_token
                figures["server_prefill"] = streamed.server_prefill
                return figures

            def run_unary() -> dict[str, float]:
                return benchkit.run_unary(server.target, ids, NEW_TOKENS)

            systems: list[tuple[str, Callable[[], dict[str, float]]]] = [
                ("raw", run_raw),
                ("tokenwire", run_tokenwire),
                ("unary", run_unary),
            ]
            if genai is not None:
                systems.insert(0, ("genai", run_genai))
            for _, run in systems:  # warm-up: first-call allocations and page faults
                run()
            for repetition in range(repetitions):
                benchkit.wait_for_quiet()
                shift = repetition % len(systems)
                for name, run in systems[shift:] + systems[:shift]:
                    results[name].append(run())
                prefill.append(prefill_seconds(raw, ids))
        if genai is not None:
            genai.close()

    _report(results, prefill, repetitions, len(ids))


def _figures(token_times: list[float]) -> dict[str, float]:
    return {
        "ttft": token_times[0],
        "decode_rate": (len(token_times) - 1) / (token_times[-1] - token_times[0]),
        "total": token_times[-1],
    }


def _pair_ratio(runs: list[dict[str, float]], reference: list[dict[str, float]]) -> float:
    # Runs of the same repetition were back to back: the median of their ratios cancels most of
    # the machine's drift between repetitions.
    return median([r["decode_rate"] / g["decode_rate"] for r, g in zip(runs, reference, strict=True)])


def _report(
    results: dict[str, list[dict[str, float]]], prefill: list[float], repetitions: int, prompt: int
) -> None:
    names = {
        "genai": "ONNX Runtime GenAI Generator",
        "raw": "minimal ONNX Runtime loop (IO binding)",
        "tokenwire": "tokenwire, 1 stream over gRPC",
        "unary": "tokenwire, unary Generate (server-side timing)",
    }
    reference = "genai" if results["genai"] else "raw"
    rows: list[list[object]] = []
    for key, label in names.items():
        runs = results[key]
        if not runs:
            rows.append([label, "skipped", "-", "-", "-", "-"])
            continue
        rate = median([r["decode_rate"] for r in runs])
        total = median([r["total"] for r in runs])
        rows.append(
            [
                label,
                median([r["ttft"] for r in runs]) * 1000,
                rate,
                total,
                NEW_TOKENS / total,
                f"{_pair_ratio(runs, results[reference]):.3f}",
            ]
        )
    print(
        f"\n## One stream: prompt {prompt} tokens, {NEW_TOKENS} new tokens, greedy, {THREADS} threads, "
        f"median of {repetitions}\n"
    )
    print(
        benchkit.markdown_table(
            ["system", "TTFT ms", "decode tok/s", "total s", "end-to-end tok/s", f"decode vs {reference}"],
            rows,
        )
    )
    tokenwire = results["tokenwire"]
    raw_prefill = median(prefill)
    idle_ttft = median([r["ttft"] for r in tokenwire])
    server_ttft = median([r["server_ttft"] for r in tokenwire])
    print("\n## Time to first token at idle\n")
    print(
        benchkit.markdown_table(
            ["figure", "ms"],
            [
                ["raw prefill of the prompt (in process)", raw_prefill * 1000],
                ["tokenwire TTFT, client-measured", idle_ttft * 1000],
                ["tokenwire TTFT, server-measured (from receipt)", server_ttft * 1000],
                [
                    "tokenwire prefill, server-measured",
                    median([r["server_prefill"] for r in tokenwire]) * 1000,
                ],
                ["client TTFT minus raw prefill", (idle_ttft - raw_prefill) * 1000],
            ],
        )
    )
    ratio = _pair_ratio(tokenwire, results[reference])
    print("\n## Targets\n")
    target_rows = [
        [
            f"one stream >= 0.95x {names[reference]} (decode tok/s)",
            "met" if ratio >= 0.95 else "missed",
            f"{ratio:.3f}x",
        ],
        [
            "TTFT at idle <= raw prefill + 10 ms",
            "met" if idle_ttft <= raw_prefill + 0.010 else "missed",
            f"{(idle_ttft - raw_prefill) * 1000:+.1f} ms",
        ],
    ]
    print(benchkit.markdown_table(["target", "result", "measured"], target_rows))
    path = benchkit.save_results(
        "single_stream",
        {
            "repetitions": repetitions,
            "prompt_tokens": prompt,
            "new_tokens": NEW_TOKENS,
            "runs": results,
            "raw_prefill": prefill,
        },
    )
    print(f"\nwrote {path.relative_to(benchkit.REPO)}")


if __name__ == "__main__":
    main()
