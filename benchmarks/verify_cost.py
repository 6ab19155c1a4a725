"""What verifying drafts costs: a step where every row appends K + 1 tokens (the last accepted
token and K drafts) against a one-token decode step, at batch 1, 2, 4, 8 and 16, on the runner
the server uses (no server, no scheduler).

Speculation pays when a verification step yields more tokens than the steps it replaces would:
one-token decode makes B tokens a step, so a verification step of B rows must average
verify_ms / decode_ms tokens a row (the accepted drafts plus the one it always gains) to break
even. On a CPU a model call is compute-bound as soon as it holds a few dozen positions, so that
ratio grows with K and with the batch. GroupQueryAttention takes several new positions with a
past only at batch size 1, so B rows of several tokens are B model calls.

With --accuracy-levels, the default model is also converted once per MatMulNBits accuracy level
(into a temporary directory) to measure what each costs in decode speed and how far a verified
position's logits are from one-token decode's (greedy tokens with every draft right, against
plain greedy decoding).

    python benchmarks/verify_cost.py [--repetitions 3] [--accuracy-levels 4,1,0]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import benchkit
import numpy as np

from tokenwire.server.models.loader import LoadSettings, load_model
from tokenwire.server.models.runner import ModelRunner, MultiTokenDecode
from tokenwire.server.models.session import SessionSettings

BATCHES = (1, 2, 4, 8, 16)
DRAFTS = tuple(range(1, 9))
CONTEXT = 64  # positions already cached when a step runs
AGREEMENT_TOKENS = 48


def load(directory: Path) -> tuple[ModelRunner, MultiTokenDecode, str]:
    loaded = load_model(
        directory,
        LoadSettings(max_batch_size=16, max_context_length=512, session=SessionSettings(device="cpu")),
    )
    runner = loaded.runner
    if not isinstance(runner, MultiTokenDecode) or not runner.can_decode_runs:
        raise SystemExit(f"{directory} cannot verify drafts")
    return runner, runner, loaded.info.name


def step_costs(
    runner: ModelRunner, verifier: MultiTokenDecode, ids: list[int], repetitions: int
) -> dict[int, dict[int, float]]:
    """Median ms of a step, by batch and by positions per row (1: a decode step)."""
    costs: dict[int, dict[int, float]] = {}
    for rows in BATCHES:
        seqs = list(range(1, rows + 1))
        for seq in seqs:
            runner.prefill(seq, ids[:CONTEXT], start=0)
        runner.decode(seqs, [ids[0]] * rows)
        times: dict[int, list[float]] = {1: [], **{k + 1: [] for k in DRAFTS}}
        for _ in range(repetitions):
            # Side by side in each repetition, so a burst of load hits both sides alike.
            for positions in times:
                began = time.perf_counter()
                if positions == 1:
                    runner.decode(seqs, [ids[1]] * rows)
                else:
                    verifier.decode_runs(seqs, [ids[2 : 2 + positions]] * rows)
                times[positions].append(time.perf_counter() - began)
                for seq in seqs:
                    verifier.rollback(seq, positions)
        costs[rows] = {positions: statistics.median(t) * 1000 for positions, t in times.items()}
        for seq in seqs:
            runner.release(seq)
    return costs


def agreement(runner: ModelRunner, verifier: MultiTokenDecode, ids: list[int]) -> dict[str, float]:
    """Plain greedy decoding against verification with every draft right (plain decoding's own
    next tokens, 4 a step): the first position where their greedy tokens differ, and the largest
    logit difference at the verified positions before it."""
    prompt = ids[:CONTEXT]
    plain = [int(runner.prefill(1, prompt, start=0).argmax())]
    plain_logits = []
    for _ in range(AGREEMENT_TOKENS):
        plain_logits.append(runner.decode([1], [plain[-1]])[0].copy())
        plain.append(int(plain_logits[-1].argmax()))
    runner.release(1)
    runner.prefill(1, prompt, start=0)
    fed = 0  # tokens of `plain` in the cache after the prompt
    largest = 0.0
    diverged = AGREEMENT_TOKENS
    while fed < AGREEMENT_TOKENS and diverged == AGREEMENT_TOKENS:
        run = plain[fed : min(fed + 5, AGREEMENT_TOKENS)]
        (logits,) = verifier.decode_runs([1], [run])
        for row in range(len(run)):
            position = fed + row  # these logits follow plain[position]
            largest = max(largest, float(np.abs(logits[row] - plain_logits[position]).max()))
            if int(logits[row].argmax()) != plain[position + 1]:
                diverged = position + 1
                break
        fed += len(run)
    runner.release(1)
    return {"first_divergence": diverged, "tokens": AGREEMENT_TOKENS, "max_logit_diff": largest}


def accuracy_levels(
    levels: list[int], source: Path, ids: list[int], repetitions: int
) -> dict[int, dict[str, float]]:
    from tokenwire.server.model_tools.convert.gguf_source import read_gguf
    from tokenwire.server.model_tools.convert.llama_graph import GraphOptions, build_llama_graph, save_model

    weights = read_gguf(benchkit.gguf_file())
    with tempfile.TemporaryDirectory() as scratch:
        runners: dict[int, tuple[ModelRunner, MultiTokenDecode]] = {}
        for level in levels:
            # The default model's directory with its graph rebuilt at another accuracy level.
            directory = Path(scratch) / f"level-{level}"
            directory.mkdir()
            for item in source.iterdir():
                if not item.name.startswith("model.onnx"):
                    shutil.copy(item, directory / item.name)
            graph = build_llama_graph(
                weights.config,
                weights.weights,
                GraphOptions(accuracy_level=level),
                external_data=directory / "model.onnx.data",
            )
            save_model(graph, directory / "model.onnx", external_data=False)
            del graph
            runner, verifier, _ = load(directory)
            runners[level] = (runner, verifier)
        results = {level: agreement(runner, verifier, ids) for level, (runner, verifier) in runners.items()}
        benchkit.wait_for_quiet()
        for rows in (1, 8):
            seqs = list(range(1, rows + 1))
            times: dict[int, list[float]] = {level: [] for level in levels}
            for runner, _ in runners.values():
                for seq in seqs:
                    runner.prefill(seq, ids[:CONTEXT], start=0)
                runner.decode(seqs, [ids[0]] * rows)
            for _ in range(repetitions * 3):
                # The levels in turn, so load hits each alike.
                for level, (runner, verifier) in runners.items():
                    began = time.perf_counter()
                    runner.decode(seqs, [ids[1]] * rows)
                    times[level].append(time.perf_counter() - began)
                    for seq in seqs:
                        verifier.rollback(seq, 1)
            for level, (runner, _) in runners.items():
                results[level][f"decode_ms_b{rows}"] = statistics.median(times[level]) * 1000
                for seq in seqs:
                    runner.release(seq)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--accuracy-levels", default="")
    args = parser.parse_args()
    directory = benchkit.model_dir()
    runner, verifier, name = load(directory)
    ids = benchkit.prompt_ids(directory, CONTEXT + 16)
    benchkit.wait_for_quiet()

    costs = step_costs(runner, verifier, ids, args.repetitions)
    print(
        f"\n## A step of K + 1 positions a row against a decode step (median of {args.repetitions}, {name})\n"
    )
    columns = ["batch", "decode ms", *[f"K={k}" for k in DRAFTS]]
    table = [
        [rows, f"{by[1]:.1f}", *[f"{by[k + 1]:.1f} ({by[k + 1] / by[1]:.2f}x)" for k in DRAFTS]]
        for rows, by in costs.items()
    ]
    print(benchkit.markdown_table(columns, table))
    print("\n(each cell: ms of the verification step, and its ratio to the decode step: the tokens a row")
    print("must gain a step, accepted drafts plus one, for speculation to break even)")

    levels = [int(v) for v in args.accuracy_levels.split(",") if v]
    by_level = accuracy_levels(levels, directory, ids, args.repetitions) if levels else {}
    if by_level:
        print("\n## MatMulNBits accuracy level: decode speed and verified logits against one-token decode\n")
        rows_out = [
            [
                level,
                f"{r['decode_ms_b1']:.1f}",
                f"{r['decode_ms_b8']:.1f}",
                f"{r['max_logit_diff']:.2g}",
                "none" if r["first_divergence"] >= r["tokens"] else f"token {int(r['first_divergence'])}",
            ]
            for level, r in by_level.items()
        ]
        print(
            benchkit.markdown_table(
                [
                    "level",
                    "decode ms B=1",
                    "decode ms B=8",
                    "max abs logit diff",
                    f"first greedy divergence ({AGREEMENT_TOKENS} tokens)",
                ],
                rows_out,
            )
        )
    path = benchkit.save_results(
        "verify_cost",
        {
            "model": name,
            "context": CONTEXT,
            "step_ms": {str(rows): {str(p): ms for p, ms in by.items()} for rows, by in costs.items()},
            "accuracy_levels": {str(level): r for level, r in by_level.items()},
        },
    )
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
