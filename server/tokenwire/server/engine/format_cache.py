"""Response formats compiled on worker threads, with a time bound, and kept for reuse.

Compiling a format can take from a millisecond to seconds, so it happens neither on the event
loop nor on the engine thread: `prepare` hands back a future that a worker completes. Each
request waits at most `timeout` seconds for its format; past that it is refused while the
worker, bounded by the library's own fuel limits, finishes in the background (its result still
serves later requests with the same format). Identical formats share one compilation, and the
most recently used results, failures included, are kept.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass

from tokenwire.server.engine.errors import ErrorKind, FieldViolation, GenerationError
from tokenwire.server.sampling.constraint import CompiledFormat, FormatCompiler, FormatError
from tokenwire.server.sampling.params import ResponseFormat
from tokenwire.server.settings_schema import setting


@dataclass(frozen=True)
class FormatLimits:
    timeout: float = setting(
        5.0,
        "seconds a request's response format may take to compile; longer is INVALID_ARGUMENT",
        above=0,
    )
    cache_size: int = setting(64, "compiled response formats kept for reuse", minimum=1)
    max_pending: int = setting(
        16, "response formats waiting to compile; beyond it RESOURCE_EXHAUSTED", minimum=1
    )
    workers: int = setting(1, "threads compiling response formats", minimum=1)


class FormatCache:
    def __init__(self, compiler: FormatCompiler, limits: FormatLimits | None = None) -> None:
        self._compiler = compiler
        self._limits = limits or FormatLimits()
        self._pool = ThreadPoolExecutor(max_workers=self._limits.workers, thread_name_prefix="format-compile")
        self._lock = threading.Lock()
        self._compiled: OrderedDict[ResponseFormat, Future[CompiledFormat]] = OrderedDict()
        self._pending = 0
        self.compilations = 0
        """Formats compiled so far (cache misses), for tests and telemetry."""

    @property
    def limits(self) -> FormatLimits:
        return self._limits

    def prepare(self, response_format: ResponseFormat) -> Future[CompiledFormat]:
        """A future of the compiled format. It fails with a GenerationError naming
        `response_format` when the format is invalid or does not compile within the time bound.
        Raises GenerationError at once when too many compilations are waiting."""
        with self._lock:
            shared = self._compiled.get(response_format)
            if shared is not None:
                self._compiled.move_to_end(response_format)
            else:
                if self._pending >= self._limits.max_pending:
                    raise GenerationError(
                        ErrorKind.RESOURCE_EXHAUSTED,
                        f"{self._pending} response formats are waiting to compile; retry shortly",
                        retry_after=self._limits.timeout,
                        reason="FORMAT_COMPILER_BUSY",
                    )
                self._pending += 1
                self.compilations += 1
                shared = self._pool.submit(self._compile, response_format)
                self._compiled[response_format] = shared
                while len(self._compiled) > self._limits.cache_size:
                    self._compiled.popitem(last=False)
        if shared.done():
            return shared
        # This request's own view: completed by the compilation or by its deadline, whichever
        # comes first, so a slow compilation refuses the request without blocking anyone.
        mine: Future[CompiledFormat] = Future()
        timer = threading.Timer(self._limits.timeout, _expire, (mine, response_format, self._limits.timeout))
        timer.daemon = True

        def settle(done: Future[CompiledFormat]) -> None:
            timer.cancel()
            _copy(done, mine)

        shared.add_done_callback(settle)
        timer.start()
        return mine

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, response_format: ResponseFormat) -> CompiledFormat:
        try:
            return self._compiler.compile(response_format)
        except FormatError as error:
            raise invalid_format(response_format, str(error)) from None
        finally:
            with self._lock:
                self._pending -= 1


def invalid_format(response_format: ResponseFormat, reason: str) -> GenerationError:
    field = response_format.field or f"response_format.{response_format.kind.value}"
    return GenerationError.invalid(FieldViolation(field, reason))


def _expire(future: Future[CompiledFormat], response_format: ResponseFormat, timeout: float) -> None:
    error = invalid_format(response_format, f"took longer than {timeout:g}s to compile; simplify the format")
    _settle(future, error)


def _copy(source: Future[CompiledFormat], target: Future[CompiledFormat]) -> None:
    error = source.exception()
    _settle(target, error if error is not None else source.result())


def _settle(future: Future[CompiledFormat], outcome: CompiledFormat | BaseException) -> None:
    # The timer and the compilation race to settle the request's future; the first one wins.
    with contextlib.suppress(InvalidStateError):
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
