"""Bad input: whatever a client sends, the answer is a documented status and the server keeps serving.

Property-based requests cover every GenerateRequest field, with out-of-range numbers, NaN and
infinities, and arbitrary unicode (control characters, combining marks, right-to-left text, emoji,
NUL) in every string. Raw bytes go through a generic gRPC call with no serializer, so the server
sees exactly what a broken or hostile client would put on the wire. Expected answers: OK or
INVALID_ARGUMENT (with a BadRequest naming a real field); NOT_FOUND when the model field names no
served model and DEADLINE_EXCEEDED when the request set a timeout, because the contract says so.
Never INTERNAL or UNKNOWN, never a crash.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import tiny_settings
from tests.reliability.recovery import assert_recovered
from tokenwire.server.app import TokenwireServer
from tokenwire.v1 import inference_service_pb2 as pb

GENERATE = "/tokenwire.v1.InferenceService/Generate"
STREAM_GENERATE = "/tokenwire.v1.InferenceService/StreamGenerate"
SERVED_MODELS = {"", "tiny"}
TOP_LEVEL_FIELDS = {f.name for f in pb.GenerateRequest.DESCRIPTOR.fields} | {"request"}
CALL_TIMEOUT = 60.0

OK = grpc.StatusCode.OK
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT

CI_EXAMPLES = 120
HEAVY_EXAMPLES = 1000

# -- strategies --------------------------------------------------------------------------------------

any_text = st.text(st.characters(codec="utf-8"), max_size=40)
"""Arbitrary unicode that protobuf can carry (every code point but lone surrogates)."""
some_text = st.text(st.characters(codec="utf-8"), min_size=1, max_size=40)
int32 = st.integers(-(2**31), 2**31 - 1)
float32 = st.floats(width=32)
"""Every float32, NaN and infinities included."""
roles = st.one_of(st.sampled_from(["system", "user", "assistant", "tool"]), any_text)


@st.composite
def generate_requests(draw: st.DrawFn) -> pb.GenerateRequest:
    """Requests whose every field is, independently, usually plausible and sometimes anything at all."""

    def wild() -> bool:
        return draw(st.integers(0, 9)) < 2

    request = pb.GenerateRequest(
        request_id=draw(st.text(min_size=120, max_size=140) if wild() else any_text),
        # Mostly none or a few keys drawn again and again; sometimes anything at all.
        idempotency_key=draw(
            st.one_of(any_text, st.text(min_size=120, max_size=140))
            if wild()
            else st.sampled_from(["", "", "key-1", "key-2"])
        ),
        model=draw(any_text if wild() else st.sampled_from(sorted(SERVED_MODELS))),
        logprobs=draw(st.booleans()),
    )
    request.top_logprobs = draw(int32 if wild() else st.integers(0, 3 if request.logprobs else 0))
    if wild():
        inputs = draw(st.sets(st.sampled_from(["prompt", "messages", "token_ids"]), max_size=3))
    else:
        inputs = {draw(st.sampled_from(["prompt", "messages", "token_ids"]))}
    if "prompt" in inputs:
        request.prompt = draw(any_text if wild() else some_text)
    if "messages" in inputs:
        turns = st.tuples(any_text if wild() else roles, any_text)
        conversation = st.lists(turns, max_size=4) if wild() else st.lists(turns, min_size=1, max_size=4)
        for role, content in draw(conversation):
            request.messages.add(role=role, content=content)
    if "token_ids" in inputs:
        ids = (
            st.lists(int32, max_size=12) if wild() else st.lists(st.integers(0, 511), min_size=1, max_size=12)
        )
        request.token_ids.ids.extend(draw(ids))
        request.token_ids.SetInParent()
    if draw(st.booleans()):
        sampling = request.sampling
        sampling.SetInParent()
        if draw(st.booleans()):
            sampling.temperature = draw(float32 if wild() else st.floats(0, 2, width=32))
        sampling.top_k = draw(int32 if wild() else st.integers(0, 50))
        if draw(st.booleans()):
            sampling.top_p = draw(float32 if wild() else st.floats(0.125, 1, width=32))
        sampling.min_p = draw(float32 if wild() else st.floats(0, 1, width=32))
        if draw(st.booleans()):
            sampling.repetition_penalty = draw(float32 if wild() else st.floats(0.5, 2, width=32))
        if draw(st.booleans()):
            sampling.seed = draw(st.integers(0, 2**64 - 1))
    if draw(st.booleans()):
        stopping = request.stopping
        stopping.SetInParent()
        if draw(st.booleans()):
            stopping.max_new_tokens = draw(int32 if wild() else st.integers(1, 24))
        long_stops = st.text(min_size=250, max_size=300)
        stops = (
            st.lists(st.one_of(any_text, long_stops), max_size=18)
            if wild()
            else st.lists(some_text, max_size=3)
        )
        stopping.stop.extend(draw(stops))
        stopping.ignore_eos = draw(st.booleans())
    if draw(st.integers(0, 9)) < 2:
        request.timeout.seconds = draw(st.integers(-(2**40), 2**40) if wild() else st.integers(0, 30))
        request.timeout.nanos = draw(int32 if wild() else st.integers(0, 999_999_999))
    return request


def allowed_codes(request: pb.GenerateRequest) -> set[grpc.StatusCode]:
    """The statuses the contract allows for this request (one at a time, so never a full queue)."""
    allowed = {OK, INVALID_ARGUMENT}
    if request.model not in SERVED_MODELS:
        allowed.add(grpc.StatusCode.NOT_FOUND)
    if request.HasField("timeout"):
        allowed.add(grpc.StatusCode.DEADLINE_EXCEEDED)
    if request.idempotency_key:
        # Keys are idempotent per caller: one drawn again with another body is ALREADY_EXISTS.
        # A request_id never is: it is a label only.
        allowed.add(grpc.StatusCode.ALREADY_EXISTS)
    return allowed


def check_rich_status(status: status_pb2.Status) -> None:
    """INVALID_ARGUMENT carries a BadRequest whose violations name real GenerateRequest fields."""
    if status.code != INVALID_ARGUMENT.value[0]:
        return
    violations = []
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad_request = error_details_pb2.BadRequest()
            detail.Unpack(bad_request)
            violations.extend(bad_request.field_violations)
    assert violations, f"INVALID_ARGUMENT without a BadRequest: {status.message}"
    for violation in violations:
        if violation.field == "request":  # bytes that do not decode: the request as a whole
            continue
        top = violation.field.split(".")[0].split("[")[0]
        assert top in TOP_LEVEL_FIELDS, f"violation names no field of GenerateRequest: {violation.field}"
        assert violation.description


# -- a server on an event loop of its own, so the property tests can be plain blocking code ---------


class ThreadedServer:
    def __init__(self, model_dir: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="server-loop", daemon=True)
        self._thread.start()
        self.server = TokenwireServer(tiny_settings(model_dir))
        self.run(self.server.start())
        self.run(self.server.load())
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.server.port}")

    def run(self, work: Coroutine[object, object, object], timeout: float = 60.0) -> object:
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(timeout)

    def close(self) -> None:
        self.channel.close()
        self.run(self.server.stop(grace=0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()

    def assert_recovered(self) -> None:
        self.run(assert_recovered(self.server))


@pytest.fixture
def threaded(default_model_dir: Path) -> Iterator[ThreadedServer]:
    served = ThreadedServer(default_model_dir)
    try:
        yield served
        served.assert_recovered()  # after every example: engine empty, SERVING, a full batch runs
    finally:
        served.close()


# -- sending raw bytes -----------------------------------------------------------------------------


def status_of_error(error: grpc.RpcError) -> status_pb2.Status:
    for key, value in error.trailing_metadata() or ():
        if key == "grpc-status-details-bin" and isinstance(value, bytes):
            return status_pb2.Status.FromString(value)
    code: grpc.StatusCode = error.code()
    return status_pb2.Status(code=code.value[0], message=error.details() or "")


def unary_raw(channel: grpc.Channel, payload: bytes) -> status_pb2.Status:
    call = channel.unary_unary(GENERATE, request_serializer=None, response_deserializer=None)
    try:
        call(payload, timeout=CALL_TIMEOUT)
    except grpc.RpcError as error:
        return status_of_error(error)
    return status_pb2.Status(code=0)


def stream_raw(channel: grpc.Channel, payloads: list[bytes]) -> tuple[list[bytes], status_pb2.Status]:
    """Send raw StreamGenerateRequest payloads, half-close, read to the end: (responses, call status)."""
    call = channel.stream_stream(STREAM_GENERATE, request_serializer=None, response_deserializer=None)
    responses: list[bytes] = []
    try:
        for response in call(iter(payloads), timeout=CALL_TIMEOUT):
            responses.append(response)
    except grpc.RpcError as error:
        return responses, status_of_error(error)
    return responses, status_pb2.Status(code=0)


def final_stream_status(responses: list[bytes], request_id: str) -> status_pb2.Status:
    """The status a stream gave one generation: its error event, or OK for `completed`."""
    events = [pb.StreamGenerateResponse.FromString(r) for r in responses]
    mine = [e for e in events if e.request_id == request_id]
    assert mine, f"no event for {request_id!r}: {events}"
    last = mine[-1]
    assert last.WhichOneof("event") in ("completed", "error"), f"stream ended without a last event: {last}"
    return last.error if last.HasField("error") else status_pb2.Status(code=0)


def code_of(status: status_pb2.Status) -> grpc.StatusCode:
    return next(c for c in grpc.StatusCode if c.value[0] == status.code)


# -- property-based requests ------------------------------------------------------------------------


def check_request(channel: grpc.Channel, request: pb.GenerateRequest) -> None:
    allowed = allowed_codes(request)
    unary = unary_raw(channel, request.SerializeToString())
    assert code_of(unary) in allowed, f"unary: {code_of(unary)} {unary.message!r} for {request}"
    check_rich_status(unary)

    message = pb.StreamGenerateRequest(generate=request)
    responses, call_status = stream_raw(channel, [message.SerializeToString()])
    assert call_status.code == 0, f"stream call ended with {code_of(call_status)}: {call_status.message!r}"
    streamed = final_stream_status(responses, request.request_id)
    assert code_of(streamed) in allowed, f"stream: {code_of(streamed)} {streamed.message!r} for {request}"
    check_rich_status(streamed)
    # Same answer both ways (the stream alone requires a request_id; deadlines race by nature).
    if request.request_id and not request.HasField("timeout"):
        assert streamed.code == unary.code, f"unary {code_of(unary)} but stream {code_of(streamed)}"


PROPERTY_SETTINGS = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
}


@settings(max_examples=CI_EXAMPLES, **PROPERTY_SETTINGS)  # type: ignore[arg-type]
@given(request=generate_requests())
def test_any_generate_request_gets_a_documented_status_in_unary_and_stream(
    threaded: ThreadedServer, request: pb.GenerateRequest
) -> None:
    check_request(threaded.channel, request)


@pytest.mark.heavy
@pytest.mark.timeout(1200)
@settings(max_examples=HEAVY_EXAMPLES, **PROPERTY_SETTINGS)  # type: ignore[arg-type]
@given(request=generate_requests())
def test_heavy_any_generate_request_gets_a_documented_status_in_unary_and_stream(
    threaded: ThreadedServer, request: pb.GenerateRequest
) -> None:
    check_request(threaded.channel, request)


# -- raw bytes --------------------------------------------------------------------------------------

UNDECODABLE: dict[str, bytes] = {
    "truncated varint": b"\x48\xff",
    "length past the end": b"\x0a\x10abc",
    "invalid UTF-8 in request_id": b"\x0a\x02\xc3\x28",
    "invalid UTF-8 in prompt": b"\x1a\x02\xff\xfe",
    "invalid UTF-8 in a chat message": b"\x22\x04\x12\x02\xc3\x28",
    "invalid UTF-8 in a stop string": b"\x3a\x04\x12\x02\xc3\x28",
    "field number zero": b"\x00\x01",
    "end-group without a start": b"\x0c",
    "token ids cut mid-varint": b"\x2a\x03\x0a\x01\xff",
    "length of 4 GiB": b"\x52\xff\xff\xff\xff\x0f",
    "groups nested past any limit": b"\x0b" * 2000,
    "garbage": b"\xff" * 64,
}


def decodes(payload: bytes, message: type[pb.GenerateRequest] | type[pb.StreamGenerateRequest]) -> bool:
    try:
        message.FromString(payload)
    except DecodeError:
        return False
    return True


def test_the_malformed_corpus_is_really_undecodable() -> None:
    for name, payload in UNDECODABLE.items():
        assert not decodes(payload, pb.GenerateRequest), name
        assert not decodes(stream_wrapped(payload), pb.StreamGenerateRequest), name


def stream_wrapped(payload: bytes) -> bytes:
    """A StreamGenerateRequest whose `generate` field holds `payload` as a GenerateRequest."""
    return b"\x0a" + _varint(len(payload)) + payload


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


@pytest.mark.parametrize("name", sorted(UNDECODABLE))
def test_undecodable_bytes_are_invalid_argument_and_the_stream_goes_on(
    threaded: ThreadedServer, name: str
) -> None:
    payload = UNDECODABLE[name]
    unary = unary_raw(threaded.channel, payload)
    assert code_of(unary) is INVALID_ARGUMENT
    check_rich_status(unary)
    # On a stream, beside a live generation: the bad message gets its own error event (its
    # request id is unknowable, so it is empty) and the live generation finishes normally.
    live = pb.StreamGenerateRequest(
        generate=pb.GenerateRequest(
            request_id="live",
            prompt="A generation that is live when the bad bytes arrive",
            stopping=pb.StoppingCriteria(max_new_tokens=20, ignore_eos=True),
        )
    )
    responses, status = stream_raw(threaded.channel, [live.SerializeToString(), stream_wrapped(payload)])
    assert status.code == 0
    assert code_of(final_stream_status(responses, "")) is INVALID_ARGUMENT
    assert final_stream_status(responses, "live").code == 0


@st.composite
def wire_bytes(draw: st.DrawFn) -> bytes:
    """Random bytes, or a valid request's bytes with flipped, cut or inserted bytes."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=80))
    payload = bytearray(draw(generate_requests()).SerializeToString())
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(payload)))
        action = draw(st.sampled_from(["flip", "cut", "insert"]))
        if action == "flip" and at < len(payload):
            payload[at] ^= draw(st.integers(1, 255))
        elif action == "cut":
            del payload[at:]
        else:
            payload[at:at] = draw(st.binary(min_size=1, max_size=6))
    return bytes(payload)


def check_wire_bytes(channel: grpc.Channel, payload: bytes) -> None:
    unary = unary_raw(channel, payload)
    if decodes(payload, pb.GenerateRequest):
        request = pb.GenerateRequest.FromString(payload)
        assert code_of(unary) in allowed_codes(request), f"{code_of(unary)} {unary.message!r} for {request}"
        check_rich_status(unary)
    else:
        assert code_of(unary) is INVALID_ARGUMENT, f"undecodable bytes: {code_of(unary)} {unary.message!r}"
        check_rich_status(unary)
    responses, call_status = stream_raw(channel, [stream_wrapped(payload)])
    # A bad message on a stream is that message's failure, never the stream's.
    assert call_status.code == 0, f"{code_of(call_status)} {call_status.message!r}"
    if not decodes(payload, pb.GenerateRequest):
        refused = final_stream_status(responses, "")
        assert code_of(refused) is INVALID_ARGUMENT
        check_rich_status(refused)


@settings(max_examples=CI_EXAMPLES, **PROPERTY_SETTINGS)  # type: ignore[arg-type]
@given(payload=wire_bytes())
def test_any_bytes_on_the_wire_get_a_documented_status_and_the_server_keeps_serving(
    threaded: ThreadedServer, payload: bytes
) -> None:
    check_wire_bytes(threaded.channel, payload)


@pytest.mark.heavy
@pytest.mark.timeout(1200)
@settings(max_examples=HEAVY_EXAMPLES, **PROPERTY_SETTINGS)  # type: ignore[arg-type]
@given(payload=wire_bytes())
def test_heavy_any_bytes_on_the_wire_get_a_documented_status_and_the_server_keeps_serving(
    threaded: ThreadedServer, payload: bytes
) -> None:
    check_wire_bytes(threaded.channel, payload)
