"""A caller measuring its time to first token, in a process of its own, while others attack.

It asks for short generations (GenerateStream, a few tokens), one every THINK_SECONDS after the
last ended (a caller, not a load generator: it leaves the machine's cores to the server and the
attackers), and records, for each, the time from sending it to its first chunk. Commands on
stdin: `start` opens a measuring window, `stop` closes it and prints one JSON line with the
window's first-token times (seconds) and failures. In a process of its own, an attack the test
process runs cannot slow the measuring.

Run as `python -m tests.reliability.ttft_client TARGET TOKEN`.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import grpc

from tokenwire.v1 import inference_service_pb2 as pb
from tokenwire.v1 import inference_service_pb2_grpc as pb_grpc

THINK_SECONDS = 0.01
REQUEST = pb.GenerateRequest(
    prompt="A caller who only wants the first word of an answer asks what the weather will be like",
    sampling=pb.SamplingParams(temperature=0.0),
    stopping=pb.StoppingCriteria(max_new_tokens=2, ignore_eos=True),
)


class Window:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = False
        self.ttfts: list[float] = []
        self.failures: list[str] = []

    def open(self) -> None:
        with self._lock:
            self._open, self.ttfts, self.failures = True, [], []

    def close(self) -> dict[str, object]:
        with self._lock:
            self._open = False
            return {"ttfts": self.ttfts, "failures": self.failures[:5]}

    def record(self, ttft: float | None, failure: str | None) -> None:
        with self._lock:
            if not self._open:
                return
            if ttft is not None:
                self.ttfts.append(ttft)
            if failure is not None:
                self.failures.append(failure)


def ask_forever(target: str, token: str, window: Window, ready: threading.Event) -> None:
    stub = pb_grpc.InferenceServiceStub(grpc.insecure_channel(target))
    metadata = (("authorization", f"Bearer {token}"),)
    while True:
        sent = time.perf_counter()
        first: float | None = None
        try:
            for response in stub.GenerateStream(REQUEST, metadata=metadata, timeout=30):
                kind = response.WhichOneof("event")
                if kind == "chunk" and first is None:
                    first = time.perf_counter() - sent
                elif kind == "error":
                    window.record(None, f"{response.error.code}: {response.error.message[:200]}")
            window.record(first, None if first is not None else "no chunk")
            ready.set()
            time.sleep(THINK_SECONDS)
        except grpc.RpcError as error:
            window.record(None, f"call ended: {error.code()}: {str(error.details())[:200]}")
            time.sleep(0.05)  # not a tight loop against a refusing server


def main(argv: list[str]) -> int:
    window = Window()
    ready = threading.Event()
    threading.Thread(target=ask_forever, args=(argv[0], argv[1], window, ready), daemon=True).start()
    if not ready.wait(60):
        print(json.dumps({"error": "no answer within 60 s"}), flush=True)
        return 1
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "start":
            window.open()
            print(json.dumps({"started": True}), flush=True)
        elif command == "stop":
            print(json.dumps(window.close()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
