"""Requests that come through an inference gateway: the caller and the priority its headers name.

The Kubernetes Gateway API Inference Extension's endpoint picker (and llm-d's router built on
it) queues requests fairly by a fairness id, read from a request header, and by the priority of
the objective another header names. tokenwire queues fairly by caller and by priority too, so
that the two schedulers agree, these headers can be read here as well:

- The caller header (`--gateway-caller-header`, x-llm-d-inference-fairness-id for the picker)
  names the caller the request is for. A caller listed in `--gateway-trusted-callers` (the
  gateway's own token, for a gateway that authenticates clients itself) may name any caller of
  the token file, and the request then runs as that caller: its weight, its queue limit, its
  idempotent ids, its metrics. Any other caller may name only itself, so a client whose token
  says one name and whose header says another (and would be queued by the gateway as someone
  else) is refused instead of served. Without the header a request is its token's caller's.
- The objective header (`--gateway-objective-header`, x-llm-d-inference-objective) names the
  request's objective; an objective named after a priority (interactive, default or batch, the
  names the manifests give the InferenceObjectives) sets the request's priority when its body
  leaves it unspecified, and must agree with the body's priority when it does not.

Both are checked on the event loop as a request is admitted: a dictionary lookup each, bounded
by the header's length, which gRPC caps with its metadata size limit.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tokenwire.server.engine.errors import FieldViolation, GenerationError
from tokenwire.server.engine.types import Caller, Priority
from tokenwire.server.metadata import Metadata
from tokenwire.server.settings_schema import setting

FAIRNESS_ID_HEADER = "x-llm-d-inference-fairness-id"
"""The endpoint picker's fairness header (its older name, x-gateway-inference-fairness-id, is
still read by the picker as an alias)."""
OBJECTIVE_HEADER = "x-llm-d-inference-objective"
"""The endpoint picker's objective header (older name: x-gateway-inference-objective)."""

CALLER_MISMATCH = "GATEWAY_CALLER_MISMATCH"
UNKNOWN_CALLER = "GATEWAY_CALLER_UNKNOWN"
PRIORITY_MISMATCH = "GATEWAY_PRIORITY_MISMATCH"

PRIORITY_OBJECTIVES = {priority.name.lower(): priority for priority in Priority}
"""Objective names that stand for a priority: interactive, default, batch."""

_HEADER_NAME = re.compile(r"[0-9a-z_.-]+")
"""gRPC metadata keys: lower case, digits, '_', '-' and '.'; '-bin' keys carry bytes instead."""


def _header_problem(value: str | None) -> str | None:
    if value is None:
        return None
    if not _HEADER_NAME.fullmatch(value) or value.endswith("-bin") or value.startswith("grpc-"):
        return (
            f"{value!r} is not a text header name gRPC passes on: lower-case letters, digits, "
            "'_', '-' and '.', not ending in -bin nor starting with grpc-"
        )
    if value == "authorization":
        return "'authorization' carries the bearer token"
    return None


@dataclass(frozen=True)
class GatewaySettings:
    caller_header: str | None = setting(
        None,
        "request header naming the caller a request is for, as the inference gateway's fairness id "
        f"({FAIRNESS_ID_HEADER}): a caller of --gateway-trusted-callers may name any caller, any other "
        "caller only itself (unset: not read)",
        check=_header_problem,
        metavar="HEADER",
    )
    trusted_callers: str | None = setting(
        None,
        "comma-separated callers of the token file (the gateway's own) whose requests run as the caller "
        "--gateway-caller-header names",
        metavar="NAMES",
    )
    objective_header: str | None = setting(
        None,
        f"request header naming the request's objective ({OBJECTIVE_HEADER}): an objective named "
        "interactive, default or batch sets the priority a request leaves unspecified and must agree "
        "with one it specifies (unset: not read)",
        check=_header_problem,
        metavar="HEADER",
    )

    @property
    def trusted(self) -> frozenset[str]:
        return frozenset(name.strip() for name in (self.trusted_callers or "").split(",") if name.strip())

    def problems(self, callers: Sequence[Caller], *, authenticated: bool) -> list[str]:
        """What is wrong with these settings on a server with `callers` (messages name the flag)."""
        found: list[str] = []
        if self.caller_header is not None and not authenticated:
            found.append(
                "--gateway-caller-header: needs --auth-tokens-file or TOKENWIRE_AUTH_TOKENS "
                "(a header can only be checked against the caller a token proves)"
            )
        if self.trusted and self.caller_header is None:
            found.append("--gateway-trusted-callers: needs --gateway-caller-header")
        known = {caller.name for caller in callers}
        unknown = sorted(self.trusted - known)
        if unknown and authenticated:
            names = ", ".join(unknown)
            found.append(f"--gateway-trusted-callers: no caller of the token file is named {names}")
        if self.caller_header is not None and self.caller_header == self.objective_header:
            found.append("--gateway-objective-header: is also --gateway-caller-header")
        return found


class GatewayHeaders:
    """Reads a request's caller and objective headers against its authenticated caller."""

    def __init__(self, settings: GatewaySettings, callers: Iterable[Caller]) -> None:
        self._caller_header = settings.caller_header
        self._objective_header = settings.objective_header
        self._trusted = settings.trusted
        self._by_name = {caller.name: caller for caller in callers}

    @property
    def active(self) -> bool:
        return self._caller_header is not None or self._objective_header is not None

    def caller(self, authenticated: Caller, metadata: Metadata | None) -> Caller:
        """The caller the request runs as: `authenticated` (its token's), or the one a trusted
        caller names. Raises INVALID_ARGUMENT naming the header when the header may not be honoured."""
        if self._caller_header is None:
            return authenticated
        named = _header(metadata, self._caller_header)
        if not named or named == authenticated.name:
            return authenticated
        if authenticated.name not in self._trusted:
            raise _refusal(
                self._caller_header,
                f"names caller {_shown(named)}, but the request's token is caller {authenticated.name!r}, "
                "which may name only itself",
                CALLER_MISMATCH,
            )
        found = self._by_name.get(named)
        if found is None:
            raise _refusal(
                self._caller_header, f"names {_shown(named)}, no caller of this server", UNKNOWN_CALLER
            )
        return found

    def priority(self, metadata: Metadata | None, body: Priority | None) -> Priority | None:
        """The request's priority: `body` (None: unspecified) or the one its objective names.

        Objectives named otherwise are the gateway's alone and leave the priority as it is.
        Raises INVALID_ARGUMENT naming the header when the objective and `body` disagree."""
        if self._objective_header is None:
            return body
        objective = _header(metadata, self._objective_header)
        if not objective:
            return body
        named = PRIORITY_OBJECTIVES.get(objective.lower())
        if named is None:
            return body
        if body is not None and body is not named:
            raise _refusal(
                self._objective_header,
                f"names objective {_shown(objective)} (priority {named.name}), but the request's priority is "
                f"{body.name}",
                PRIORITY_MISMATCH,
            )
        return named


def _header(metadata: Metadata | None, name: str) -> str | None:
    for key, value in metadata or ():
        if key == name:
            text = value.decode("latin-1") if isinstance(value, bytes) else value
            return text.strip()
    return None


def _shown(value: str) -> str:
    """A header's value in an error: quoted, and short, whatever the client sent."""
    return repr(value if len(value) <= 64 else value[:64] + "…")


def _refusal(header: str, description: str, reason: str) -> GenerationError:
    error = GenerationError.invalid(FieldViolation(header, f"request header {description}"))
    return GenerationError(error.kind, error.message, violations=error.violations, reason=reason)
