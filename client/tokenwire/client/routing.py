"""Fleet mode: one client over many replicas, balanced by gRPC itself.

A target that resolves to several addresses (`ipv4:10.0.0.1:50051,10.0.0.2:50051`, or
`dns:///tokenwire-headless.default.svc:50051` for a Kubernetes headless Service) gets one
subchannel per replica, and the service config chooses how calls spread over them:

- `weighted_round_robin` (the default): each replica's weight is its requests per second over
  its utilization, from the ORCA load reports the server sends (out of band on a stream of
  their own, or in each call's trailer), so a slow or backlogged replica gets fewer new calls.
- `round_robin`: every ready replica in turn, whatever its load.

With health checks on, each subchannel watches `grpc.health.v1` for the inference service, and
a replica that reports NOT_SERVING (loading, draining, queue above its high watermark) gets no
new calls until it reports SERVING again. Calls already on it carry on.

grpcio's C-core has all of this built in (checked with grpcio 1.85): `weighted_round_robin`,
its out-of-band ORCA client and the client-side health checks are switched on by the service
config alone (`loadBalancingConfig`, `healthCheckConfig`), with no environment variable and no
channel option beyond `grpc.service_config` (health checks stay off only under
`grpc.inhibit_health_checking`, which the client never sets).

Every generation is one call in fleet mode (`generate` on Generate, or `stream` on
GenerateStream), so each one is placed by the balancer. A stream from `open_stream` stays on the
replica it opened on for as long as it lives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

HEALTH_SERVICE = "tokenwire.v1.InferenceService"
"""The health service name the server reports for its inference service."""

Policy = Literal["weighted_round_robin", "round_robin"]
LoadReports = Literal["out_of_band", "per_call"]


@dataclass(frozen=True)
class Routing:
    """How one client spreads its calls over the replicas its target resolves to."""

    policy: Policy = "weighted_round_robin"
    health_checks: bool = True
    """Send no new calls to a replica whose health is NOT_SERVING."""
    load_reports: LoadReports = "out_of_band"
    """weighted_round_robin's source of weights: a report stream per replica, or call trailers.
    Out of band keeps weights fresh even for a replica that is getting few calls."""
    report_period: float = 1.0
    """Seconds between out-of-band reports (the server sends them no faster than once a second)."""
    blackout_period: float = 2.0
    """Seconds a replica's reports must span before its weight counts (until then: the mean)."""
    weight_update_period: float = 0.5
    """Seconds between recomputations of the weights (gRPC's minimum is 0.1)."""
    weight_expiration_period: float = 60.0
    """Seconds without a report after which a replica's weight is dropped (then: the mean)."""

    def __post_init__(self) -> None:
        if self.policy not in ("weighted_round_robin", "round_robin"):
            raise ValueError(f"policy: {self.policy!r} is neither weighted_round_robin nor round_robin")
        if self.load_reports not in ("out_of_band", "per_call"):
            raise ValueError(f"load_reports: {self.load_reports!r} is neither out_of_band nor per_call")
        for name in ("report_period", "blackout_period", "weight_expiration_period"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be more than 0 seconds")
        if not self.weight_update_period >= 0.1:
            raise ValueError("weight_update_period: must be at least 0.1 seconds")

    def service_config(self) -> dict[str, Any]:
        """The service config entries for this routing (merged with the retry policy's)."""
        config: dict[str, Any] = {"loadBalancingConfig": [{self.policy: self._policy_config()}]}
        if self.health_checks:
            config["healthCheckConfig"] = {"serviceName": HEALTH_SERVICE}
        return config

    def _policy_config(self) -> dict[str, Any]:
        if self.policy == "round_robin":
            return {}
        return {
            "enableOobLoadReport": self.load_reports == "out_of_band",
            "oobReportingPeriod": _duration(self.report_period),
            "blackoutPeriod": _duration(self.blackout_period),
            "weightUpdatePeriod": _duration(self.weight_update_period),
            "weightExpirationPeriod": _duration(self.weight_expiration_period),
        }


def _duration(seconds: float) -> str:
    """A JSON google.protobuf.Duration: decimal seconds with an `s` suffix."""
    return f"{seconds:.9f}".rstrip("0").rstrip(".") + "s"
