"""Prompt-lookup speculative decoding, on and off, side by side on the default model.

Two `tokenwire serve` processes of the same build, one with `--speculative-tokens K` and one
with 0 (both batch 8, 2 intra-op threads), and ONNX Runtime GenAI's `Generator` on the same
model file where a venv with it exists. Workloads, each a chat-templated request, greedy, ending
at EOS or `--new-tokens`:

- input-grounded: rewrite a passage, extract its sentences, edit a function (the answer copies
  long runs of the prompt, which is where drafts are accepted);
- free chat: a story from a one-line request (drafts rarely match).

Single stream: each workload on each system in turn (the order rotates every repetition), the
decode rate as the client sees it (tokens after the first over the time since the first).
GenAI generates, on the same prompt ids, as many tokens as tokenwire with speculation off did.
Then 8 concurrent streams (two of each workload) per server, aggregate tokens per second of
wall time, on and off alternating.

    python benchmarks/speculative.py [--repetitions 3] [--tokens 4] [--new-tokens 160]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import benchkit
from benchkit import PASSAGE, THREADS, median

HERE = Path(__file__).resolve().parent

CODE = """def summarize(values):
    total = 0
    count = 0
    for value in values:
        if value is None:
            continue
        total += value
        count += 1
    if count == 0:
        return 0.0
    average = total / count
    print("total", total, "count", count, "average", average)
    return average
"""

WORKLOADS = {
    "rewrite": (
        "grounded",
        f"Rewrite the following passage, correcting nothing and keeping every sentence:\n\n{PASSAGE}",
    ),
    "extract": (
        "grounded",
        f"Copy out every sentence of this passage that mentions the keeper or the lamp:\n\n{PASSAGE}",
    ),
    "code edit": (
        "grounded",
        "Rename the variable `total` to `running_sum` in this function and return the whole "
        f"function:\n\n```python\n{CODE}```",
    ),
    "free chat": ("chat", "Write a short story about a robot who learns to paint."),
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=4, help="--speculative-tokens of the 'on' server")
    parser.add_argument("--max-batch", type=int, default=2, help="--speculative-max-batch of the 'on' server")
    parser.add_argument("--new-tokens", type=int, default=160)
    args = parser.parse_args()

    directory = benchkit.model_dir()
    prompts = {name: _chat_ids(directory, text) for name, (_, text) in WORKLOADS.items()}
    genai_python = benchkit.external_python("TOKENWIRE_BENCH_GENAI_PYTHON", "genai-venv")
    single: dict[str, dict[str, list[dict[str, Any]]]] = {
        name: {"on": [], "off": [], "genai": []} for name in WORKLOADS
    }
    aggregate: dict[str, list[float]] = {"on": [], "off": []}
    load: list[float] = []

    on_flags = ["--speculative-tokens", str(args.tokens), "--speculative-max-batch", str(args.max_batch)]
    with (
        benchkit.temporary_dir(benchkit.genai_model_copy(directory)) as genai_dir,
        benchkit.ServerProcess(directory, max_batch_size=8, extra=[*on_flags, "--metrics-port", "0"]) as on,
        benchkit.ServerProcess(
            directory, max_batch_size=8, extra=["--speculative-tokens", "0", "--no-metrics"]
        ) as off,
    ):
        genai = (
            benchkit.Worker(genai_python, HERE / "genai_worker.py", str(genai_dir)) if genai_python else None
        )
        if genai is None:
            benchkit.skip(
                "ONNX Runtime GenAI", "no venv with onnxruntime-genai (set TOKENWIRE_BENCH_GENAI_PYTHON)"
            )
        servers = {"on": on, "off": off}
        startup = next((line for line in on.log if "speculative decoding" in line), "")
        # Warm-up: first-call allocations, and the GenAI lengths (what speculation off generates).
        lengths = {}
        for name, ids in prompts.items():
            _stream(on.target, [ids], args.new_tokens)
            lengths[name] = len(_stream(off.target, [ids], args.new_tokens)[0]["tokens"])
        for repetition in range(args.repetitions):
            load.append(os.getloadavg()[0])
            for name, ids in prompts.items():
                systems = ["on", "off", "genai"] if genai is not None else ["on", "off"]
                shift = repetition % len(systems)
                for system in systems[shift:] + systems[:shift]:
                    if system == "genai":
                        assert genai is not None
                        times = genai.call(op="generate", ids=ids, new_tokens=lengths[name])["token_times"]
                        single[name]["genai"].append({"rate": (len(times) - 1) / (times[-1] - times[0])})
                    else:
                        single[name][system].append(
                            _stream(servers[system].target, [ids], args.new_tokens)[0]
                        )
            crowd = [ids for ids in prompts.values() for _ in range(2)]
            for system in ("on", "off") if repetition % 2 == 0 else ("off", "on"):
                began = time.perf_counter()
                runs = _stream(servers[system].target, crowd, args.new_tokens)
                aggregate[system].append(sum(len(r["tokens"]) for r in runs) / (time.perf_counter() - began))
        if genai is not None:
            genai.close()
        metrics_on = _draft_counters(on)

    _report(single, aggregate, load, args, startup, metrics_on)


def _chat_ids(directory: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    from tokenwire.server.text.chat import ChatTemplate, ChatTurn

    config = json.loads((directory / "tokenizer_config.json").read_text())
    template = ChatTemplate(config["chat_template"])
    rendered = template.render([ChatTurn("user", text)])
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    return list(tokenizer.encode(rendered, add_special_tokens=False).ids)


def _stream(target: str, prompts: Sequence[Sequence[int]], new_tokens: int) -> list[dict[str, Any]]:
    return benchkit._run(_streams(target, prompts, new_tokens))


async def _streams(target: str, prompts: Sequence[Sequence[int]], new_tokens: int) -> list[dict[str, Any]]:
    from tokenwire.client import AsyncClient, Chunk, Completed, GenerateOptions, Sampling, Stopping

    options = GenerateOptions(
        sampling=Sampling(temperature=0.0), stopping=Stopping(max_new_tokens=new_tokens)
    )
    client = benchkit._clients.get(target)
    if client is None:
        client = benchkit._clients[target] = AsyncClient(target, retries=False)

    async def one(ids: Sequence[int]) -> dict[str, Any]:
        sent = time.perf_counter()
        stamps: list[float] = []
        tokens: list[int] = []
        async for event in client.stream(list(ids), options, deadline=600):
            if isinstance(event, Chunk) and event.token_ids:
                now = time.perf_counter() - sent
                stamps.extend(now for _ in event.token_ids)
                tokens.extend(event.token_ids)
            elif isinstance(event, Completed):
                rate = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0
                return {"rate": rate, "tokens": tokens, "ttft": stamps[0] if stamps else 0.0}
        raise RuntimeError("stream ended without completing")

    return list(await asyncio.gather(*(one(ids) for ids in prompts)))


def _draft_counters(server: benchkit.ServerProcess) -> dict[str, float]:
    """The 'on' server's draft counters from its Prometheus endpoint, when it logged one."""
    import re
    import urllib.request

    port = next(
        (m.group(1) for line in server.log if (m := re.search(r"metrics on \S+?://[^/]+:(\d+)/", line))), None
    )
    if port is None:
        return {}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    found: dict[str, float] = {}
    for name in ("tokenwire_engine_draft_tokens_total", "tokenwire_engine_accepted_draft_tokens_total"):
        values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name)]
        if values:
            found[name] = sum(values)
    return found


def _report(
    single: dict[str, dict[str, list[dict[str, Any]]]],
    aggregate: dict[str, list[float]],
    load: list[float],
    args: argparse.Namespace,
    startup: str,
    metrics: dict[str, float],
) -> None:
    rows: list[list[object]] = []
    summary: dict[str, dict[str, float]] = {}
    for name, runs in single.items():
        on, off, genai = runs["on"], runs["off"], runs["genai"]
        # Runs of one repetition were back to back: the median of their ratios cancels most drift.
        vs_off = median([a["rate"] / b["rate"] for a, b in zip(on, off, strict=True)])
        vs_genai = median([a["rate"] / b["rate"] for a, b in zip(on, genai, strict=True)]) if genai else None
        off_vs_genai = (
            median([a["rate"] / b["rate"] for a, b in zip(off, genai, strict=True)]) if genai else None
        )
        same = all(a["tokens"] == off[0]["tokens"] for a in on)
        summary[name] = {"on_vs_off": vs_off, "on_vs_genai": vs_genai or 0.0}
        rows.append(
            [
                f"{name} ({WORKLOADS[name][0]})",
                len(off[0]["tokens"]),
                median([r["rate"] for r in on]),
                median([r["rate"] for r in off]),
                median([r["rate"] for r in genai]) if genai else "-",
                f"{vs_off:.2f}x",
                f"{vs_genai:.2f}x" if vs_genai is not None else "-",
                f"{off_vs_genai:.2f}x" if off_vs_genai is not None else "-",
                "yes" if same else "no",
            ]
        )
    print(
        f"\n## One stream, speculation on (K={args.tokens}) and off, median of {args.repetitions}, "
        f"{THREADS} threads, load average {min(load):.1f}-{max(load):.1f}\n"
    )
    print(
        benchkit.markdown_table(
            [
                "workload",
                "tokens",
                "on tok/s",
                "off tok/s",
                "GenAI tok/s",
                "on / off",
                "on / GenAI",
                "off / GenAI",
                "same tokens",
            ],
            rows,
        )
    )
    ratio = median([a / b for a, b in zip(aggregate["on"], aggregate["off"], strict=True)])
    print("\n## 8 streams (two of each workload), aggregate tokens/s\n")
    print(
        benchkit.markdown_table(
            ["server", "tok/s (median)", "on / off"],
            [["on", median(aggregate["on"]), f"{ratio:.3f}x"], ["off", median(aggregate["off"]), "1"]],
        )
    )
    if metrics:
        drafted = metrics.get("tokenwire_engine_draft_tokens_total", 0.0)
        accepted = metrics.get("tokenwire_engine_accepted_draft_tokens_total", 0.0)
        print(f"\n'on' server: {accepted:.0f} of {drafted:.0f} draft tokens accepted")
    print(f"\nstart-up: {startup}")
    path = benchkit.save_results(
        "speculative",
        {
            "repetitions": args.repetitions,
            "speculative_tokens": args.tokens,
            "speculative_max_batch": args.max_batch,
            "new_tokens": args.new_tokens,
            "load_average": load,
            "single": {
                name: {
                    system: [{k: v for k, v in r.items() if k != "tokens"} for r in runs_]
                    for system, runs_ in runs.items()
                }
                for name, runs in single.items()
            },
            "tokens": {
                name: {s: [len(r.get("tokens", [])) for r in runs[s]] for s in ("on", "off")}
                for name, runs in single.items()
            },
            "summary": summary,
            "aggregate_8_streams": aggregate,
            "aggregate_ratio": ratio,
            "draft_counters": metrics,
        },
    )
    print(f"\nwrote {path.relative_to(benchkit.REPO)}")


if __name__ == "__main__":
    main()
