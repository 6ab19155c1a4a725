"""What one StreamGenerate call may hold: live generations, queue places, unsent output, and for
how long output may wait unread.

A stream multiplexes many generations on one call, so without these one call could take every
slot and queue place of the server, or pile up output for a client that does not read. Beyond
each limit the call's new generations are refused with RESOURCE_EXHAUSTED naming it (reason
STREAM_GENERATIONS_LIMIT or STREAM_QUEUE_LIMIT); past the unsent-output bound the call's
generations are stopped and the call ends with RESOURCE_EXHAUSTED (reason STREAM_BACKLOG).

A client that reads nothing would otherwise keep its generations' slots until their output adds
up to that bound, which small chunks take long to do: once a response has waited unread for
the unread-output timeout, every live generation of the call is stopped (its slot freed at the
next decode step) with an error event, RESOURCE_EXHAUSTED reason STREAM_OUTPUT_UNREAD, and new
generations are refused with it until the client reads again. The call itself stays open.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenwire.server.settings_schema import setting

MIB = 1024 * 1024


@dataclass(frozen=True)
class StreamLimits:
    max_generations_per_stream: int = setting(
        32,
        "most generations one StreamGenerate call may have live (running or queued; a request "
        "with n completions counts n); more is RESOURCE_EXHAUSTED (STREAM_GENERATIONS_LIMIT)",
        minimum=1,
    )
    max_queued_per_stream: int | None = setting(
        None,
        "most queue places one StreamGenerate call may hold (a request with n completions takes n); "
        "more is RESOURCE_EXHAUSTED (STREAM_QUEUE_LIMIT) (default: half of --max-queue-size, at least 1)",
        minimum=1,
    )
    max_unsent_bytes_per_stream: int = setting(
        MIB,
        "most bytes of responses one StreamGenerate call may have waiting for its client to read; "
        "past it the call's generations stop and the call ends with RESOURCE_EXHAUSTED (STREAM_BACKLOG)",
        minimum=1,
        metavar="BYTES",
    )

    unread_output_timeout: float = setting(
        5.0,
        "seconds a StreamGenerate call's output may wait for its client to read it; past it the "
        "call's generations stop with RESOURCE_EXHAUSTED (STREAM_OUTPUT_UNREAD), freeing their "
        "slots, and new ones are refused until it reads again (0: no such bound)",
        minimum=0,
        metavar="SECONDS",
    )

    def queued_per_stream(self, max_queue_size: int) -> int:
        if self.max_queued_per_stream is not None:
            return self.max_queued_per_stream
        return max(1, max_queue_size // 2)
