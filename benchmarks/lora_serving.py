"""LoRA adapters served by `tokenwire serve`, side by side in one run on the default model.

1. Time per decode step with 8 greedy streams: the plain graph's server (the bar's base), the
   server of the graph with LoRA sites (on every projection, or on --modules) with every stream
   on the base model, and that server with the 8 streams over 4 adapters (2 each). The step
   time is the streams' median inter-token gap after the first token; the sides alternate for
   --repetitions rounds.
2. Loading an adapter at run time (the admin RPC) while 4 streams decode on the base model:
   the streams' largest inter-token gap with a load in the middle against the same run without.

Adapters are PEFT directories of random rank-R factors on every site of the graph, written into
a temporary directory (no download). The LoRA graph is the default GGUF converted with sites on
the projections --modules names, as `tokenwire serve --lora-modules` takes them (all of them
when left out; `pull_model(lora=...)`, cached beside the plain one).

    python benchmarks/lora_serving.py [--rank 16] [--repetitions 3] [--new-tokens 64]
        [--modules q_proj,v_proj]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import benchkit
import grpc
import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, str(benchkit.REPO))

from tokenwire.server.config import lora_module_list
from tokenwire.server.model_tools.convert.lora_graph import lora_options_for
from tokenwire.server.model_tools.pull import DEFAULT_MODEL, known_model, pull_model
from tokenwire.server.models.adapters import LoraLayout
from tokenwire.server.models.session import SessionSettings, create_session
from tokenwire.v1 import adapter_admin_pb2 as admin_pb
from tokenwire.v1 import adapter_admin_pb2_grpc as admin_grpc
from tokenwire.v1 import inference_service_pb2 as pb
from tokenwire.v1 import inference_service_pb2_grpc as pb_grpc

ADAPTERS = 4
STREAMS = 8


def write_adapters(model_dir: Path, out: Path, rank: int, count: int) -> list[Path]:
    """`count` PEFT adapter directories with random factors on every LoRA site of the graph."""
    session = create_session(model_dir / "model.onnx", SessionSettings(device="cpu"))
    layout = LoraLayout.from_session(session)
    assert layout is not None, f"{model_dir} has no LoRA sites"
    modules = sorted({site.module for site in layout.sites.values()})
    rng = np.random.default_rng(3)
    paths = []
    for n in range(count):
        tensors = {}
        for site in layout.sites.values():
            key = f"base_model.model.model.layers.{site.layer}.{site.module}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, site.in_features)) * 0.01).astype(
                np.float32
            )
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((site.out_features, rank)) * 0.01).astype(
                np.float32
            )
        directory = out / f"adapter-{n}"
        directory.mkdir(parents=True)
        save_file(tensors, str(directory / "adapter_model.safetensors"))
        config = {
            "peft_type": "LORA",
            "r": rank,
            "lora_alpha": rank,
            "target_modules": modules,
            "bias": "none",
        }
        (directory / "adapter_config.json").write_text(json.dumps(config), encoding="utf-8")
        paths.append(directory)
    return paths


async def streams(
    target: str,
    prompts: Sequence[Sequence[int]],
    adapters: Sequence[str],
    new_tokens: int,
    during: Callable[[grpc.aio.Channel], Awaitable[None]] | None = None,
) -> list[list[float]]:
    """Every prompt at once as its own greedy stream (with its adapter); each stream's token
    times. `during`: a coroutine run once every stream has its first token."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        started = asyncio.Event()
        first_tokens = 0

        async def one(ids: Sequence[int], adapter: str) -> list[float]:
            nonlocal first_tokens
            stamps: list[float] = []
            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=list(ids)),
                sampling=pb.SamplingParams(temperature=0.0),
                stopping=pb.StoppingCriteria(max_new_tokens=new_tokens, ignore_eos=True),
                adapter=adapter,
            )
            async for event in stub.GenerateStream(request, timeout=600):
                if event.HasField("chunk") and event.chunk.token_ids:
                    now = time.perf_counter()
                    if not stamps:
                        first_tokens += 1
                        if first_tokens == len(prompts):
                            started.set()
                    stamps.extend(now for _ in event.chunk.token_ids)
            return stamps

        tasks = [asyncio.ensure_future(one(ids, a)) for ids, a in zip(prompts, adapters, strict=True)]
        if during is not None:
            await started.wait()
            await during(channel)
        return list(await asyncio.gather(*tasks))


def gaps(runs: list[list[float]]) -> list[float]:
    """Inter-token gaps once every stream has its first token: each one a decode step (the
    gaps before include the other streams' prefills)."""
    everyone = max(stamps[0] for stamps in runs)
    return [b - a for stamps in runs for a, b in itertools.pairwise(stamps) if a >= everyone]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--modules",
        help="comma-separated projections that get LoRA sites, as --lora-modules takes them "
        "(q_proj,v_proj); every projection if left out",
    )
    args = parser.parse_args()
    names = lora_module_list(args.modules) if args.modules else None
    try:
        sites_on = lora_options_for(known_model(DEFAULT_MODEL).architecture, names)
    except ValueError as error:
        parser.error(f"--modules: {error}")
    plain_dir = pull_model(DEFAULT_MODEL)
    lora_dir = pull_model(DEFAULT_MODEL, lora=sites_on)
    prompts = [benchkit.prompt_ids(plain_dir, 64, offset=i * 7) for i in range(STREAMS)]
    with tempfile.TemporaryDirectory() as work:
        adapter_dirs = write_adapters(lora_dir, Path(work), args.rank, ADAPTERS + 1)
        loras = [f"--lora=a{n}={path}" for n, path in enumerate(adapter_dirs[:ADAPTERS])]
        lora_flags = [
            *loras,
            f"--max-loras={ADAPTERS + 1}",
            f"--max-lora-rank={args.rank}",
            "--prefix-cache-mb=0",
            "--no-metrics",
            "--no-access-log",
        ]
        steps: dict[str, list[float]] = {
            "plain graph, base": [],
            "LoRA graph, base": [],
            "LoRA graph, 4 adapters": [],
        }
        load_gaps: dict[str, list[float]] = {"no load": [], "adapter loaded mid-run": []}
        load_seconds: list[float] = []
        with (
            benchkit.ServerProcess(
                plain_dir,
                max_batch_size=STREAMS,
                extra=["--prefix-cache-mb=0", "--no-metrics", "--no-access-log"],
            ) as plain,
            benchkit.ServerProcess(lora_dir, max_batch_size=STREAMS, extra=lora_flags) as lora,
        ):
            base_only = [""] * STREAMS
            mixed = [f"a{i % ADAPTERS}" for i in range(STREAMS)]
            sides = [
                ("plain graph, base", plain.target, base_only),
                ("LoRA graph, base", lora.target, base_only),
                ("LoRA graph, 4 adapters", lora.target, mixed),
            ]
            for _ in (0, 1):  # warm-up
                for _, target, adapters in sides:
                    asyncio.run(streams(target, prompts, adapters, 8))
            for repetition in range(args.repetitions):
                order = sides if repetition % 2 == 0 else sides[::-1]
                for name, target, adapters in order:
                    benchkit.wait_for_quiet(max_wait=30)
                    runs = asyncio.run(streams(target, prompts, adapters, args.new_tokens))
                    steps[name].append(statistics.median(gaps(runs)))
                four = prompts[:4]
                benchkit.wait_for_quiet(max_wait=30)
                quiet = asyncio.run(streams(lora.target, four, [""] * 4, args.new_tokens))
                load_gaps["no load"].append(max(gaps(quiet)))

                async def load(channel: grpc.aio.Channel, repetition: int = repetition) -> None:
                    admin = admin_grpc.AdapterAdminServiceStub(channel)
                    began = time.perf_counter()
                    name = f"extra{repetition}"
                    await admin.LoadAdapter(
                        admin_pb.LoadAdapterRequest(name=name, path=str(adapter_dirs[-1]))
                    )
                    load_seconds.append(time.perf_counter() - began)
                    await admin.UnloadAdapter(admin_pb.UnloadAdapterRequest(name=name))

                benchkit.wait_for_quiet(max_wait=30)
                loaded = asyncio.run(streams(lora.target, four, [""] * 4, args.new_tokens, during=load))
                load_gaps["adapter loaded mid-run"].append(max(gaps(loaded)))
    base = statistics.median(steps["plain graph, base"])
    sites = "every projection" if sites_on.modules is None else ", ".join(sites_on.modules)
    print(f"rank {args.rank} on {sites}, {STREAMS} streams, {args.repetitions} repetitions")
    print(
        benchkit.markdown_table(
            ["server, streams", "median step (ms)", "step / plain graph"],
            [
                [name, f"{statistics.median(v) * 1e3:.2f}", f"{statistics.median(v) / base:.2f}x"]
                for name, v in steps.items()
            ],
        )
    )
    print(
        benchkit.markdown_table(
            ["4 base streams", "max inter-token gap (ms), median of repetitions", "each repetition (ms)"],
            [
                [name, f"{statistics.median(v) * 1e3:.1f}", ", ".join(f"{x * 1e3:.1f}" for x in v)]
                for name, v in load_gaps.items()
            ],
        )
    )
    print(f"LoadAdapter call: median {statistics.median(load_seconds) * 1e3:.0f} ms")
    benchkit.save_results(
        "lora_serving" if sites_on.modules is None else f"lora_serving_{sites_on.label}",
        {
            "steps": steps,
            "load_gaps": load_gaps,
            "load_seconds": load_seconds,
            "rank": args.rank,
            "modules": "all" if sites_on.modules is None else list(sites_on.modules),
        },
    )


if __name__ == "__main__":
    main()
