"""Generation options the tests share."""

from __future__ import annotations

from tokenwire.client import GenerateOptions, Sampling, Stopping


def greedy(
    max_new_tokens: int, *, stop: tuple[str, ...] = (), timeout: float | None = None
) -> GenerateOptions:
    """Greedy decoding that ignores end-of-sequence, so a test knows how many tokens come (unless
    a stop string or the deadline ends the generation first)."""
    return GenerateOptions(
        sampling=Sampling(temperature=0.0),
        stopping=Stopping(max_new_tokens=max_new_tokens, stop=stop, ignore_eos=True),
        timeout=timeout,
    )
