"""Where a loaded tokenwire server spends its time: py-spy samples and per-thread CPU under load.

Starts a server (16 slots, 2 threads), drives a closed loop of N streams with `tokenwire bench`'s
load generator, and meanwhile records the server with `py-spy record` (every thread, raw
collapsed stacks) and reads every thread's CPU time from /proc. Prints, per thread, the CPU
seconds and the functions holding the most samples, and for the engine thread a breakdown of a
decode round: ONNX Runtime's run() against everything the server does around it.

    python benchmarks/profile_server.py [--streams 8] [--seconds 20]

Needs py-spy (pip install py-spy) and permission to trace the server (root, or ptrace allowed).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import subprocess
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import replace
from pathlib import Path

import benchkit
from benchkit import NEW_TOKENS, PROMPT_TOKENS

from tokenwire.client.bench import BenchConfig, LengthDistribution, LoadLevel, run_bench

# Engine-thread categories, matched on the innermost listed function present in a sample's stack.
ENGINE_PARTS = (
    ("ONNX Runtime run() (decode and prefill)", ("run_with_iobinding",)),
    ("sampling: pick_tokens", ("pick_tokens",)),
    ("per-token bookkeeping: Sequence.add_token (detokenize, stop strings)", ("Sequence.add_token",)),
    ("runner around run(): ids, mask, compaction, logits gather", ("SharedKvRunner.decode",)),
    ("runner around run(): prefill binding and logits", ("SharedKvRunner.prefill",)),
    ("event hand-off to the event loop: _flush/_emit", ("Engine._flush", "Engine._emit")),
    ("finishing requests: results, timing, release", ("Engine._finish",)),
    (
        "scheduling: admit, aborts, deadlines, occupancy",
        ("Engine._admit", "Engine._apply_aborts", "Engine._expire_deadlines", "Engine._report_occupancy"),
    ),
)
_FRAME_LOCATION = re.compile(r" \([^()]*\)$")


def parse_raw(path: Path) -> tuple[dict[str, list[tuple[list[str], int]]], dict[int, str]]:
    """py-spy's raw output: one 'thread (TID): NAME;frame;...;frame COUNT' line per distinct stack.

    Returns the stacks per thread name and the Python name of every sampled thread id.
    """
    stacks: dict[str, list[tuple[list[str], int]]] = defaultdict(list)
    names: dict[int, str] = {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        head = re.match(r"^thread \((?:0x)?([0-9a-fA-F]+)\): ?(.*)$", frames[0])
        thread = head.group(2) if head and head.group(2) else frames[0]
        if head:
            names[int(head.group(1))] = thread
        stacks[thread].append(([_FRAME_LOCATION.sub("", f) for f in frames[1:]], int(count)))
    return stacks, names


def cpu_by_thread(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], names: dict[int, str]
) -> list[tuple[str, float]]:
    """CPU seconds each thread used between two readings; threads Python does not know (ONNX
    Runtime's pool, gRPC's core) are grouped under their kernel name."""
    used: dict[str, float] = defaultdict(float)
    for tid, (comm, seconds) in after.items():
        label = names.get(tid, f"native thread '{comm}'")
        used[label] += seconds - before.get(tid, (comm, 0.0))[1]
    return sorted(used.items(), key=lambda item: -item[1])


def top_functions(samples: list[tuple[list[str], int]], count: int = 12) -> list[tuple[str, int]]:
    inclusive: Counter[str] = Counter()
    for frames, weight in samples:
        for frame in set(frames):
            if not frame.startswith(("Thread.", "_bootstrap", "<module>")):
                inclusive[frame] += weight
    return inclusive.most_common(count)


def engine_breakdown(samples: list[tuple[list[str], int]]) -> list[tuple[str, int]]:
    parts: Counter[str] = Counter()
    for frames, weight in samples:
        label = "other (engine loop, locks, logging)"
        # The innermost match wins: run() inside SharedKvRunner.decode counts as run().
        for frame in reversed(frames):
            found = next((name for name, keys in ENGINE_PARTS if any(k in frame for k in keys)), None)
            if found:
                label = found
                break
        parts[label] += weight
    return parts.most_common()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    args = parser.parse_args()
    py_spy = shutil.which("py-spy")
    if py_spy is None:
        benchkit.skip("profile", "py-spy is not installed (pip install py-spy)")
        return

    directory = benchkit.model_dir()
    config = BenchConfig(
        target="",
        levels=(LoadLevel("concurrency", args.streams),),
        prompt_tokens=LengthDistribution(PROMPT_TOKENS, PROMPT_TOKENS),
        max_new_tokens=LengthDistribution(NEW_TOKENS, NEW_TOKENS),
        duration=args.seconds,
        warmup=args.streams,
    )
    with (
        benchkit.ServerProcess(directory, max_batch_size=16) as server,
        tempfile.TemporaryDirectory() as scratch,
    ):
        config = replace(config, target=server.target)
        output = Path(scratch) / "profile.txt"
        before = benchkit.thread_cpu_seconds(server.pid)
        began = time.perf_counter()
        recorder = subprocess.Popen(
            [
                py_spy,
                "record",
                "--pid",
                str(server.pid),
                "--format",
                "raw",
                "--threads",
                "--nonblocking",
                "--rate",
                str(args.rate),
                "--duration",
                str(int(args.seconds)),
                "--output",
                str(output),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        report = asyncio.run(run_bench(config))
        _, errors = recorder.communicate(timeout=120)
        wall = time.perf_counter() - began
        after = benchkit.thread_cpu_seconds(server.pid)
        if recorder.returncode != 0 or not output.exists():
            benchkit.skip("profile", f"py-spy failed: {errors.strip()[-500:]}")
            return
        stacks, names = parse_raw(output)

    level = report.levels[0]
    tokens = level.output_tokens
    print(
        f"\n## Server profile: {args.streams} streams closed loop, {PROMPT_TOKENS}-token prompts, "
        f"{NEW_TOKENS} new tokens, {wall:.0f} s\n"
    )
    print(f"{level.completed} requests, {tokens} tokens, {level.output_tokens_per_second:.1f} tok/s\n")
    cpu_rows = [
        [name, seconds, seconds / tokens * 1e6]
        for name, seconds in cpu_by_thread(before, after, names)
        if seconds > 0.005
    ]
    print(benchkit.markdown_table(["thread", "CPU s", "CPU µs/token"], cpu_rows))
    engine_thread = next((t for t in stacks if t.startswith("engine")), None)
    if engine_thread is not None:
        samples = stacks[engine_thread]
        total = sum(w for _, w in samples)
        # Each decode step yields one token per stream: steps ~ tokens / streams. A sample stands
        # for 1/rate seconds of the thread being busy.
        steps = tokens / args.streams
        seconds_per_sample = 1.0 / args.rate
        print(f"\n### Engine thread ({total} samples while busy)\n")
        rows = [
            [label, f"{100 * weight / total:.1f}%", weight * seconds_per_sample / steps * 1e6]
            for label, weight in engine_breakdown(samples)
        ]
        print(benchkit.markdown_table(["part", "share of busy samples", "≈ µs per decode step"], rows))
    for thread, samples in sorted(stacks.items(), key=lambda item: -sum(w for _, w in item[1])):
        total = sum(w for _, w in samples)
        if total < 20:
            continue
        print(f"\n### Thread {thread}: {total} samples, inclusive share of the top functions\n")
        rows = [[name, f"{100 * weight / total:.1f}%"] for name, weight in top_functions(samples)]
        print(benchkit.markdown_table(["function", "share"], rows))


if __name__ == "__main__":
    main()
