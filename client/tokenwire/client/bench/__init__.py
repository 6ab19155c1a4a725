"""Load generation and reporting for tokenwire servers (`tokenwire bench`).

from tokenwire.client.bench import BenchConfig, LoadLevel, run_bench
report = await run_bench(BenchConfig("localhost:50051", (LoadLevel("concurrency", 4),), requests=16))
"""

from tokenwire.client.bench.load import BenchConfig, BenchReport, LengthDistribution, Progress, run_bench
from tokenwire.client.bench.stats import LevelSummary, LoadLevel, RequestRecord, Summary, percentile

__all__ = [
    "BenchConfig",
    "BenchReport",
    "LengthDistribution",
    "LevelSummary",
    "LoadLevel",
    "Progress",
    "RequestRecord",
    "Summary",
    "percentile",
    "run_bench",
]
