"""Read a real /metrics endpoint over HTTP and look samples up by name and labels."""

from __future__ import annotations

import asyncio
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Scrape:
    text: str
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float]

    def value(self, name: str, **labels: str) -> float:
        """The sample `name` with exactly these labels (le included for buckets); 0 when absent."""
        return self.samples.get((name, frozenset(labels.items())), 0.0)

    def names(self) -> set[str]:
        return {name for name, _ in self.samples}


def scrape_now(port: int, path: str = "/metrics") -> Scrape:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
        assert response.status == 200
        content_type = response.headers.get("Content-Type", "")
        assert content_type.startswith("text/plain"), content_type
        text = response.read().decode("utf-8")
    samples = {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    return Scrape(text, samples)


async def scrape(port: int, path: str = "/metrics") -> Scrape:
    """Scrape from a worker thread, so the server's event loop in this process keeps running."""
    return await asyncio.to_thread(scrape_now, port, path)
