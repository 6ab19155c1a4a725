"""Who is calling: each bearer token stands for a named caller, with its queueing weight and limit
and the group it shares cached prompt prefixes with.

The token file keeps its plain form, one token a line, and a line may also name the caller:

    # NAME TOKEN [weight=W] [max_queued=N] [group=GROUP] [adapters=A,B]
    search-frontend  s3cr3t-token-a  weight=4 group=search
    search-backfill  s3cr3t-token-c  group=search
    nightly-reports  s3cr3t-token-b  weight=1 max_queued=8
    plain-token-without-a-name

A token without a name is known as "token-" and the first 8 hex digits of its SHA-256 digest,
so logs, spans and metrics can tell callers apart without ever showing a token. A caller
without a group reuses only the prefixes its own requests cached (engine/prefix_cache.py);
callers of one group reuse each other's. Without authentication every request comes from one
caller, "anonymous", and so from one tenant.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

from tokenwire.server.engine.types import ANONYMOUS, Caller
from tokenwire.server.metadata import Metadata

AUTHORIZATION = "authorization"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MAX_WEIGHT = 1000.0


class TokenLineError(ValueError):
    pass


def default_name(token: str) -> str:
    return "token-" + hashlib.sha256(token.encode()).hexdigest()[:8]


def parse_token_line(line: str) -> tuple[str, Caller]:
    """(token, caller) of one non-comment line. Error messages never quote the token."""
    fields = line.split()
    if len(fields) == 1:
        return fields[0], Caller(default_name(fields[0]))
    name, token, *options = fields
    if not _NAME.fullmatch(name):
        raise TokenLineError(
            f"caller name {name!r} must be 1 to 64 letters, digits, '.', '_' or '-', starting with a letter "
            "or digit"
        )
    weight = 1.0
    max_queued: int | None = None
    group: str | None = None
    adapters: frozenset[str] | None = None
    for option in options:
        key, _, value = option.partition("=")
        try:
            if key == "adapters":
                # The LoRA adapters this caller may ask for (comma-separated; empty: none).
                names = [part for part in value.split(",") if part]
                bad = next((n for n in names if not _NAME.fullmatch(n)), None)
                if bad is not None:
                    raise TokenLineError(
                        f"caller {name!r}: adapter {bad[:80]!r} must be 1 to 64 letters, digits, '.', '_' "
                        "or '-', starting with a letter or digit"
                    )
                adapters = frozenset(names)
            elif key == "group":
                if not _NAME.fullmatch(value):
                    raise TokenLineError(
                        f"caller {name!r}: group {value!r} must be 1 to 64 letters, digits, '.', '_' or '-', "
                        "starting with a letter or digit"
                    )
                group = value
            elif key == "weight":
                weight = float(value)
                if not 0 < weight <= MAX_WEIGHT:
                    raise ValueError
            elif key == "max_queued":
                max_queued = int(value)
                if max_queued < 0:
                    raise ValueError
            else:
                raise TokenLineError(
                    f"caller {name!r}: unknown option {key!r} (weight=, max_queued=, group=, adapters=)"
                )
        except ValueError as error:
            if isinstance(error, TokenLineError):
                raise
            raise TokenLineError(
                f"caller {name!r}: {key} must be a number in (0, {MAX_WEIGHT:g}]"
                if key == "weight"
                else f"caller {name!r}: max_queued must be a whole number >= 0"
            ) from None
    return token, Caller(name, weight=weight, max_queued=max_queued, group=group, adapters=adapters)


class CallerDirectory:
    """Maps an authenticated call's bearer token to its caller. Used after the interceptor has
    accepted the token, so a lookup by value is all it takes."""

    def __init__(self, tokens: Iterable[tuple[str, Caller]] = ()) -> None:
        self._callers = dict(tokens)

    @property
    def authenticated(self) -> bool:
        return bool(self._callers)

    def identify(self, metadata: Metadata | None) -> Caller:
        if not self._callers:
            return ANONYMOUS
        token = bearer_token(metadata)
        # The interceptor refused calls without a valid token; a call reaching here without one
        # (a test calling the servicer directly) is nobody in particular.
        found = self._callers.get(token) if token is not None else None
        return found if found is not None else ANONYMOUS


def bearer_token(metadata: Metadata | None) -> str | None:
    for key, value in metadata or ():
        if key != AUTHORIZATION:
            continue
        text = value.decode("latin-1") if isinstance(value, bytes) else value
        scheme, _, token = text.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        return token.strip()
    return None
