"""Stop strings: find them in streamed text without ever releasing any part of one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StopScan:
    """The outcome of feeding text to a StopStringMatcher."""

    released: str
    """Text that is now safe to send: it is not, and cannot become, part of a stop string."""
    stopped: bool
    """True when a stop string was found; `released` then ends right before it."""


class StopStringMatcher:
    """Holds back text that might be the beginning of a stop string.

    A stop string can span several tokens, so text is released only up to the first position
    from which the held text could still grow into a stop string.
    """

    def __init__(self, stop_strings: Sequence[str]) -> None:
        self._stops = tuple(s for s in stop_strings if s)
        self._held = ""

    @property
    def held(self) -> str:
        return self._held

    def feed(self, text: str) -> StopScan:
        if not self._stops:
            return StopScan(released=text, stopped=False)
        buffer = self._held + text
        first_match = min((i for i in (buffer.find(s) for s in self._stops) if i >= 0), default=-1)
        if first_match >= 0:
            self._held = ""
            return StopScan(released=buffer[:first_match], stopped=True)
        keep = self._longest_partial_suffix(buffer)
        cut = len(buffer) - keep
        self._held = buffer[cut:]
        return StopScan(released=buffer[:cut], stopped=False)

    def flush(self) -> str:
        """Release the held text at the end of generation (it never completed a stop string)."""
        held, self._held = self._held, ""
        return held

    def _longest_partial_suffix(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:length]):
                    longest = length
                    break
        return longest
