"""What LoRA sites cost a decode step of the default model, side by side in one run: the plain
graph, the graph with sites whose rows all use slot 0 (no adapter), and the same graph with four
adapters of rank R spread over the rows.

The default GGUF is converted twice into a temporary directory (plain, and with sites on
--modules, default all projections); the three graphs decode in turn, one step each, so a busy
machine slows all three alike. Reported: the minimum and median step time over the steps after a
warm-up, and each one's minimum over the plain graph's. No server, no scheduler: the graphs are
bound as the GenAI runner binds them (tests/server/model_tools/shared_buffer_driver.py).

    python benchmarks/lora_sites_cost.py [--rows 8] [--rank 16] [--steps 60] [--modules self_attn.q_proj,...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import benchkit
import numpy as np

sys.path.insert(0, str(benchkit.REPO))

from tests.server.model_tools.shared_buffer_driver import SharedBufferDriver
from tokenwire.server.model_tools.convert import convert_gguf
from tokenwire.server.model_tools.convert.lora_graph import LoraOptions
from tokenwire.server.models.adapters import AdapterStacks, LoraFactor, LoraLayout, fit_adapter

ADAPTERS = 4
PROMPT = 64
WARMUP = 5


def random_adapters(layout: LoraLayout, rank: int, stacks: AdapterStacks) -> None:
    rng = np.random.default_rng(1)
    for n in range(ADAPTERS):
        factors = []
        for site in layout.sites.values():
            a = (rng.standard_normal((rank, site.in_features)) * 0.01).astype(np.float32)
            b = (rng.standard_normal((site.out_features, rank)) * 0.01).astype(np.float32)
            factors.append(
                LoraFactor(
                    site.layer,
                    site.module,
                    rank,
                    site.in_features,
                    site.out_features,
                    1.0,
                    "",
                    lambda a=a, b=b: (a, b),
                )
            )
        stacks.load(fit_adapter(f"adapter-{n}", factors, layout, max_rank=rank))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--modules", help="comma-separated module paths; all projections if left out")
    args = parser.parse_args()
    modules = tuple(args.modules.split(",")) if args.modules else None
    with tempfile.TemporaryDirectory() as work:
        gguf = benchkit.gguf_file()
        plain_dir = convert_gguf(gguf, Path(work) / "plain")
        lora_dir = convert_gguf(gguf, Path(work) / "lora", lora=LoraOptions(modules))

        def driver(model: Path) -> SharedBufferDriver:
            return SharedBufferDriver(
                model, slots=args.rows, max_len=PROMPT + args.steps + 1, threads=args.threads
            )

        plain, unused, mixed = driver(plain_dir), driver(lora_dir), driver(lora_dir)
        layout = LoraLayout.from_session(unused.session)
        assert layout is not None
        stacks = AdapterStacks(layout, max_loras=ADAPTERS, max_rank=args.rank)
        random_adapters(layout, args.rank, stacks)
        unused.adapters = mixed.adapters = stacks
        runs = {
            "plain graph": (plain, [0] * args.rows),
            "sites, every row slot 0": (unused, [0] * args.rows),
            f"sites, {ADAPTERS} adapters of rank {args.rank}": (
                mixed,
                [1 + i % ADAPTERS for i in range(args.rows)],
            ),
        }
        rng = np.random.default_rng(0)
        for run, slots in runs.values():
            for row, slot in enumerate(slots):
                run.prefill(row, [int(t) for t in rng.integers(10, 1000, PROMPT)], adapter=slot)
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.steps):
            for name, (run, slots) in runs.items():
                started = time.perf_counter()
                run.decode([11] * args.rows, adapters=slots if run.adapters else None)
                times[name].append(time.perf_counter() - started)
    print(f"{len(layout.sites)} sites, stacks {stacks.nbytes / 2**20:.1f} MiB, batch {args.rows}")
    print("| graph | min step (ms) | median step (ms) | min / plain min |")
    print("| --- | --- | --- | --- |")
    base = min(times["plain graph"][WARMUP:])
    for name, measured in times.items():
        kept = measured[WARMUP:]
        low, middle = min(kept) * 1e3, statistics.median(kept) * 1e3
        print(f"| {name} | {low:.2f} | {middle:.2f} | {min(kept) / base:.2f}x |")


if __name__ == "__main__":
    main()
