"""An innocent streaming client in a process of its own, measuring what other callers cost it.

It streams long greedy generations back to back on one StreamGenerate call and records when
each chunk arrives. Commands on stdin: `start` opens a measuring window, `stop` closes it and
prints one JSON line with the window's figures: the longest and p99 gap between two chunks of one
generation (a stalled event loop or engine shows here at once), the longest time to first token
of the generations started in the window (waiting for a slot shows here), tokens per second and
failures. In a process of its own, an attack the test process runs cannot slow the measuring.

Run as `python -m tests.reliability.innocent_client TARGET [TOKEN]`.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from tokenwire.v1 import inference_service_pb2 as pb
from tokenwire.v1 import inference_service_pb2_grpc as pb_grpc

MAX_NEW_TOKENS = 160


@dataclass
class Window:
    gaps: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    tokens: int = 0
    failures: list[str] = field(default_factory=list)
    opened: float = field(default_factory=time.perf_counter)

    def figures(self) -> dict[str, object]:
        gaps = sorted(self.gaps)
        seconds = time.perf_counter() - self.opened
        return {
            "max_gap": gaps[-1] if gaps else None,
            "p99_gap": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else None,
            "max_ttft": max(self.ttfts) if self.ttfts else None,
            "chunks": len(gaps),
            "tokens": self.tokens,
            "tokens_per_second": self.tokens / seconds if seconds > 0 else 0.0,
            "seconds": seconds,
            "failures": self.failures[:5],
        }


class Recorder:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._window: Window | None = None

    def open(self) -> None:
        with self._lock:
            self._window = Window()

    def close(self) -> dict[str, object]:
        with self._lock:
            window, self._window = self._window, None
        return (window or Window()).figures()

    def chunk(self, gap: float | None, ttft: float | None, tokens: int) -> None:
        """One chunk: `gap` since the previous chunk of its generation, or `ttft` for a first one."""
        with self._lock:
            if self._window is not None:
                if gap is not None:
                    self._window.gaps.append(gap)
                if ttft is not None:
                    self._window.ttfts.append(ttft)
                self._window.tokens += tokens

    def failure(self, text: str) -> None:
        with self._lock:
            if self._window is not None:
                self._window.failures.append(text)


def stream_forever(target: str, token: str | None, recorder: Recorder, ready: threading.Event) -> None:
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    channel = grpc.insecure_channel(target)
    stub = pb_grpc.InferenceServiceStub(channel)
    index = 0
    while True:
        requests: queue.Queue[pb.StreamGenerateRequest | None] = queue.Queue()

        try:
            call = stub.StreamGenerate(feed(requests), metadata=metadata)
            submitted = submit(requests, index)
            last: float | None = None
            for response in call:
                kind = response.WhichOneof("event")
                if kind == "chunk":
                    now = time.perf_counter()
                    first = last is None
                    recorder.chunk(
                        None if last is None else now - last,
                        now - submitted if first else None,
                        len(response.chunk.token_ids),
                    )
                    last = now
                    ready.set()
                elif kind == "error":
                    recorder.failure(f"{response.error.code}: {response.error.message[:200]}")
                if kind in ("completed", "error"):
                    index += 1
                    last = None
                    submitted = submit(requests, index)
        except grpc.RpcError as error:
            recorder.failure(f"call ended: {error.code()}: {str(error.details())[:200]}")
            time.sleep(0.05)  # a fresh call next, not a tight loop against a refusing server
        finally:
            requests.put(None)


def feed(
    requests: queue.Queue[pb.StreamGenerateRequest | None],
) -> Iterator[pb.StreamGenerateRequest]:
    while (message := requests.get()) is not None:
        yield message


def submit(requests: queue.Queue[pb.StreamGenerateRequest | None], index: int) -> float:
    """Send generation `index`; when it was sent."""
    sent = time.perf_counter()
    requests.put(
        pb.StreamGenerateRequest(
            generate=pb.GenerateRequest(
                request_id=f"innocent-{index}",
                prompt="An innocent caller asks about the weather",
                sampling=pb.SamplingParams(temperature=0.0),
                stopping=pb.StoppingCriteria(max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True),
            )
        )
    )
    return sent


def main(argv: list[str]) -> int:
    target = argv[0]
    token = argv[1] if len(argv) > 1 else None
    recorder = Recorder()
    ready = threading.Event()
    threading.Thread(target=stream_forever, args=(target, token, recorder, ready), daemon=True).start()
    if not ready.wait(60):
        print(json.dumps({"error": "no first chunk within 60 s"}), flush=True)
        return 1
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "start":
            recorder.open()
            print(json.dumps({"started": True}), flush=True)
        elif command == "stop":
            print(json.dumps(recorder.close()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
