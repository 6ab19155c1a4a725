"""Four requests of mixed prompt lengths (5, 17, 40, 93 tokens; 64 new tokens each) submitted at
once: tokenwire against ONNX Runtime GenAI's continuous-batching Engine on the same ONNX file.

tokenwire and GenAI take turns (who goes first alternates); figures are medians over the
repetitions: the time until all four are done, and the first-token times (mean and last).

    python benchmarks/mixed_workload.py [--repetitions 5]
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import benchkit
from benchkit import median

HERE = Path(__file__).resolve().parent
PROMPT_LENGTHS = (5, 17, 40, 93)
NEW_TOKENS = 64


def main() -> None:
    repetitions = benchkit.command_line(__doc__, repetitions=5).repetitions

    directory = benchkit.model_dir()
    prompts = [benchkit.prompt_ids(directory, n, offset=11 * i) for i, n in enumerate(PROMPT_LENGTHS)]
    genai_python = benchkit.external_python("TOKENWIRE_BENCH_GENAI_PYTHON", "genai-venv")
    if genai_python is None:
        benchkit.skip(
            "ONNX Runtime GenAI Engine", "no venv with onnxruntime-genai (set TOKENWIRE_BENCH_GENAI_PYTHON)"
        )
    results: dict[str, list[dict[str, Any]]] = {"tokenwire": [], "genai": []}
    with (
        benchkit.temporary_dir(benchkit.genai_model_copy(directory)) as genai_dir,
        benchkit.ServerProcess(directory, max_batch_size=8) as server,
    ):
        genai = (
            benchkit.Worker(genai_python, HERE / "genai_worker.py", str(genai_dir)) if genai_python else None
        )

        def run_tokenwire() -> dict[str, Any]:
            runs = benchkit.run_streams(server.target, prompts, NEW_TOKENS)
            return {
                "total": max(r.total for r in runs),
                "first_token": [r.first_token for r in runs],
                "tokens": [len(r.token_times) for r in runs],
            }

        def run_genai() -> dict[str, Any]:
            assert genai is not None
            return genai.call(op="mixed", prompts=prompts, new_tokens=NEW_TOKENS)

        turns = [("tokenwire", run_tokenwire)] + ([("genai", run_genai)] if genai else [])
        for _, run in turns:
            run()  # warm-up
        for repetition in range(repetitions):
            benchkit.wait_for_quiet()
            for name, run in turns if repetition % 2 == 0 else turns[::-1]:
                outcome = run()
                assert outcome["tokens"] == [NEW_TOKENS] * len(prompts), outcome["tokens"]
                results[name].append(outcome)
        if genai is not None:
            genai.close()

    rows: list[list[object]] = []
    for name, label in (
        ("tokenwire", "tokenwire (4 streams over gRPC)"),
        ("genai", "ONNX Runtime GenAI Engine"),
    ):
        runs = results[name]
        if not runs:
            rows.append([label, "skipped", "-", "-", "-"])
            continue
        rows.append(
            [
                label,
                median([r["total"] for r in runs]),
                median([sum(r["first_token"]) / len(r["first_token"]) for r in runs]),
                median([max(r["first_token"]) for r in runs]),
                " / ".join(
                    f"{median([r['first_token'][i] for r in runs]):.2f}" for i in range(len(PROMPT_LENGTHS))
                ),
            ]
        )
    rows.append(["reference, measured elsewhere: GenAI Engine", 2.3, 1.3, "-", "-"])
    rows.append(["reference, measured elsewhere: slot loop", 1.17, 0.29, "-", "-"])
    print(
        f"\n## Mixed workload: prompts {'/'.join(map(str, PROMPT_LENGTHS))} tokens, {NEW_TOKENS} new each, "
        f"submitted at once, median of {repetitions}\n"
    )
    columns = ["system", "all done s", "first token mean s", "first token last s", "first token per prompt s"]
    print(benchkit.markdown_table(columns, rows))
    path = benchkit.save_results("mixed_workload", {"repetitions": repetitions, "runs": results})
    print(f"\nwrote {path.relative_to(benchkit.REPO)}")


if __name__ == "__main__":
    main()
