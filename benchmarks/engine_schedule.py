"""The engine's schedule and its Python cost, with no model: one checkout against another.

A real server's closed loops move by tens of percent with this machine's load, which hides
whether an engine change altered what runs. This drives the engine alone (`Engine.run_round`,
as the scheduler tests do) on the tests' fixed-logits runner:

- **schedule**: closed loops of 8 and 16 streams (100-token prompts, 128 new tokens, 16 slots)
  on a manual clock where a decode step costs 20 ms and a prompt token 1.8 ms (the default
  model's costs on this machine). The simulated seconds, decode steps, prefill calls and TTFT
  follow only from the scheduler's decisions, so two engines that plan alike print the same line.
- **Python cost**: wall time per decode step on a runner that costs nothing, at 1, 8 and 16 rows:
  what the engine itself adds to every step.

    python benchmarks/engine_schedule.py --baseline ../tokenwire-OLD

runs this file against each checkout (the baseline through PYTHONPATH, as the other
`--baseline` benchmarks do) and prints both.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
PROMPT_TOKENS = 100
NEW_TOKENS = 128
SLOTS = 16
REQUESTS = 48


def _engine_parts():  # type: ignore[no-untyped-def]
    # Imported here: under --baseline the parent only starts the children.
    from tests.support.fake_runner import FixedLogitsRunner, ManualClock
    from tokenwire.server.engine.engine import Engine, EngineConfig
    from tokenwire.server.engine.types import Completed, Failed, GenerationRequest, StopConditions
    from tokenwire.server.model_tools.tiny_tokenizer import build_byte_level_tokenizer
    from tokenwire.server.sampling.params import SamplingParams
    from tokenwire.server.text.tokenizer import Tokenizer

    return (
        FixedLogitsRunner,
        ManualClock,
        Engine,
        EngineConfig,
        (Completed, Failed),
        GenerationRequest,
        StopConditions,
        SamplingParams,
        Tokenizer(build_byte_level_tokenizer(300)),
    )


def closed_loop(streams: int) -> str:
    """One closed loop on the manual clock; a line of what the schedule did."""
    runner_type, clock_type, engine_type, config_type, endings, request_type, stop, sampling, tokenizer = (
        _engine_parts()
    )
    token = tokenizer.encode("a", add_special_tokens=False)[0]
    clock = clock_type()
    runner = runner_type(
        vocab_size=tokenizer.vocab_size,
        token=token,
        slots=SLOTS,
        context_length=4096,
        clock=clock,
        step_seconds=0.020,
        prefill_token_seconds=0.0018,
    )
    config = config_type(max_batch_size=SLOTS, max_queue_size=64, prefill_chunk_size=256)
    engine = engine_type(runner, tokenizer, config, clock=clock)
    finished: list[int] = []
    first_token_at: list[float] = []
    submitted = 0

    def submit() -> None:
        nonlocal submitted
        sent, seen = clock(), [False]

        def sink(event: object) -> None:
            if type(event).__name__ == "TokensGenerated" and not seen[0]:
                seen[0] = True
                first_token_at.append(clock() - sent)
            if isinstance(event, endings):
                finished.append(1)

        request = request_type(
            request_id=f"r{submitted}",
            model="fake",
            prompt_ids=(token,) * PROMPT_TOKENS,
            sampling=sampling(),
            stopping=stop(max_new_tokens=NEW_TOKENS),
            received_at=sent,
            deadline=None,
        )
        submitted += 1
        engine.submit(request, sink)

    start = clock()
    for _ in range(streams):
        submit()
    while len(finished) < REQUESTS:
        before = len(finished)
        engine.run_round()
        for _ in range(len(finished) - before):  # each finished stream sends its next request
            submit()
    seconds = clock() - start
    return (
        f"{streams} streams: {seconds:.3f} s simulated for {REQUESTS} requests "
        f"({REQUESTS * NEW_TOKENS / seconds:.1f} tok/s), TTFT p50 "
        f"{statistics.median(first_token_at) * 1000:.1f} ms, {len(runner.decodes)} decode steps, "
        f"{sum(call.tokens for call in runner.prefills)} prompt tokens in "
        f"{len(runner.prefills)} prefill calls"
    )


def step_cost(rows: int, repetitions: int = 5, steps: int = 300) -> str:
    """Median wall milliseconds the engine spends per decode step around a runner that costs nothing."""
    runner_type, _, engine_type, config_type, _, request_type, stop, sampling, tokenizer = _engine_parts()
    token = tokenizer.encode("a", add_special_tokens=False)[0]
    samples = []
    for _ in range(repetitions):
        runner = runner_type(vocab_size=49152, token=token, slots=SLOTS, context_length=4096)
        engine = engine_type(
            runner, tokenizer, config_type(max_batch_size=SLOTS, max_queue_size=64, prefill_chunk_size=256)
        )
        for index in range(rows):
            request = request_type(
                request_id=f"r{index}",
                model="fake",
                prompt_ids=(token,) * PROMPT_TOKENS,
                sampling=sampling(),
                stopping=stop(max_new_tokens=steps),
                received_at=time.monotonic(),
                deadline=None,
            )
            engine.submit(request, lambda event: None)
        began = time.perf_counter()
        while len(runner.decodes) < steps - 1:
            engine.run_round()
        samples.append((time.perf_counter() - began) / len(runner.decodes) * 1000)
    return f"{rows} rows: {statistics.median(samples):.3f} ms a step (engine Python, 49,152-entry logits)"


def report() -> None:
    for streams in (8, 16):
        print("  schedule, " + closed_loop(streams))
    for rows in (1, 8, 16):
        print("  cost, " + step_cost(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="another checkout to run the same measures in")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        report()
        return
    for label, root in (("this checkout", HERE), ("baseline", args.baseline)):
        if root is None:
            continue
        root = root.resolve()
        print(f"{label} ({root.name}):", flush=True)
        path = os.pathsep.join(str(root / part) for part in (".", "server", "client"))
        subprocess.run(
            [sys.executable, __file__, "--child"],
            check=True,
            cwd=root,
            env={**os.environ, "PYTHONPATH": path},
        )


if __name__ == "__main__":
    main()
