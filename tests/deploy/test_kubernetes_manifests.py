"""deploy/kubernetes renders, validates against Kubernetes' schemas, and hangs together.

No cluster runs here: each overlay is rendered with `kubectl kustomize`, every built-in object
is validated (strictly: unknown fields fail) against the schemas of KUBERNETES_VERSION by the
kubernetes-validate package, every custom resource with a vendored CRD (tests/deploy/schemas:
InferencePool, InferenceObjective, HTTPRoute) against that CRD's OpenAPI schema, and the
cross-references a cluster would only report at run time (selectors, port names, volumes,
secrets) are checked here. What the manifests rely on in the server itself is tested against a
real server in test_manifests_against_server.py; the inference-gateway overlay's own
cross-references and server behaviour in test_inference_gateway_*.py.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import jsonschema
import kubernetes_validate
import numpy as np
import pytest

from tests.support.crd_schemas import crd_schemas, validate_custom_resource
from tests.support.manifests import (
    GATEWAY_OVERLAY,
    KUBERNETES,
    OVERLAYS,
    Object,
    Rendered,
    load_adapter_rules,
    render,
)
from tokenwire.server.models.shared_kv_runner import SharedKvLayout

KUBERNETES_VERSION = "1.33.0"
"""The Kubernetes release whose schemas the objects must satisfy (gRPC probes and the preStop
sleep action are in it)."""
UNVALIDATED_CUSTOM_RESOURCES = {("monitoring.coreos.com/v1", "PodMonitor")}
"""Kinds of operators with no vendored schema: the cross-reference tests below check them."""
GATEWAY_CUSTOM_RESOURCES = {
    ("inference.networking.k8s.io/v1", "InferencePool"),
    ("llm-d.ai/v1alpha2", "InferenceObjective"),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"),
}
"""The inference gateway's kinds, each validated against its vendored CRD (tests/deploy/schemas)."""


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> Rendered:
    return Rendered(request.param, render(request.param))


def test_every_object_validates_against_the_kubernetes_schemas(rendered: Rendered) -> None:
    kinds = {o["kind"] for o in rendered.objects}
    assert kinds == {
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "PodMonitor",
        "NetworkPolicy",
    }
    for document in rendered.objects:
        validate(document)


def validate(document: Object) -> None:
    """Against Kubernetes' schemas, or a custom resource against its vendored CRD's."""
    kind = (document["apiVersion"], document["kind"])
    if kind in UNVALIDATED_CUSTOM_RESOURCES:
        return
    if kind in GATEWAY_CUSTOM_RESOURCES:
        validate_custom_resource(document)
    else:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)


def test_every_object_of_the_inference_gateway_overlay_validates_against_kubernetes_and_the_crds() -> None:
    gateway = Rendered(GATEWAY_OVERLAY, render(GATEWAY_OVERLAY))
    kinds = {(o["apiVersion"], o["kind"]) for o in gateway.objects}
    assert kinds >= GATEWAY_CUSTOM_RESOURCES
    assert set(crd_schemas()) >= GATEWAY_CUSTOM_RESOURCES
    validated = 0
    for document in gateway.objects:
        validate(document)
        validated += 1
    # The cpu overlay's 8 objects, plus the pool, 3 objectives, the route and the picker's 7.
    assert validated == len(render("cpu")) + 12


@pytest.mark.parametrize(
    ("kind", "path", "value"),
    [
        ("InferencePool", ("spec", "targetPortz"), [{"number": 50051}]),  # a misspelt field
        ("InferencePool", ("spec", "appProtocol"), "grpc"),  # not one of the enum's values
        ("InferencePool", ("spec", "targetPorts"), [{"number": 70000}]),  # not a port
        ("InferencePool", ("spec", "endpointPickerRef", "failureMode"), "FailSoft"),
        ("InferenceObjective", ("spec", "priority"), "high"),  # an integer
        ("InferenceObjective", ("spec", "poolRef", "nmae"), "tokenwire"),
        ("HTTPRoute", ("spec", "rules", 0, "backendRefs", 0, "weigth"), 1),
        ("HTTPRoute", ("spec", "rules", 0, "timeouts", "request"), "forever"),
    ],
)
def test_validation_against_the_crds_would_catch_a_mistake(
    kind: str, path: tuple[str | int, ...], value: object
) -> None:
    gateway = Rendered(GATEWAY_OVERLAY, render(GATEWAY_OVERLAY))
    document = copy.deepcopy(next(o for o in gateway.objects if o["kind"] == kind))
    validate_custom_resource(document)  # as rendered: valid
    *parents, last = path
    node: Any = document
    for step in parents:
        node = node[step]
    node[last] = value
    with pytest.raises(jsonschema.ValidationError):
        validate_custom_resource(document)


def test_validation_would_catch_a_misspelt_field(rendered: Rendered) -> None:
    deployment = rendered.deployment
    broken = {**deployment, "spec": {**deployment["spec"], "replicaz": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(key) == value for key, value in selector.items())


def test_every_selector_picks_the_tokenwire_pods(rendered: Rendered) -> None:
    labels = rendered.pod_labels
    assert selects(rendered.deployment["spec"]["selector"]["matchLabels"], labels)
    services = list(rendered.all("Service"))
    assert {s["metadata"]["name"] for s in services} == {"tokenwire", "tokenwire-headless"}
    for service in services:
        assert selects(service["spec"]["selector"], labels), service["metadata"]["name"]
    assert selects(rendered.one("PodDisruptionBudget")["spec"]["selector"]["matchLabels"], labels)
    assert selects(rendered.one("PodMonitor")["spec"]["selector"]["matchLabels"], labels)
    assert selects(rendered.one("NetworkPolicy")["spec"]["podSelector"]["matchLabels"], labels)
    for spread in rendered.pod["topologySpreadConstraints"]:
        assert selects(spread["labelSelector"]["matchLabels"], labels)
    target = rendered.one("HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", rendered.deployment["metadata"]["name"])


def test_the_headless_service_lists_only_ready_pods(rendered: Rendered) -> None:
    headless = rendered.one("Service", "tokenwire-headless")["spec"]
    assert headless["clusterIP"] == "None"
    assert headless.get("publishNotReadyAddresses", False) is False
    assert rendered.one("Service", "tokenwire")["spec"]["type"] == "ClusterIP"


def test_every_port_reference_names_a_container_port(rendered: Rendered) -> None:
    ports = rendered.container_ports
    assert set(ports) == {"grpc", "metrics", "health"}
    for service in rendered.all("Service"):
        for port in service["spec"]["ports"]:
            assert port["targetPort"] == "grpc"
            assert port["port"] == ports["grpc"]
    (endpoint,) = rendered.one("PodMonitor")["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics"
    assert endpoint["path"] == "/metrics"
    for rule in rendered.one("NetworkPolicy")["spec"]["ingress"]:
        for port in rule["ports"]:
            assert port["port"] in ports
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert rendered.container[probe]["grpc"]["port"] == ports["health"], probe


def test_metrics_port_is_open_to_prometheus_only(rendered: Rendered) -> None:
    policy = rendered.one("NetworkPolicy")["spec"]
    assert policy["policyTypes"] == ["Ingress"]
    metrics_rules = [r for r in policy["ingress"] if any(p["port"] == "metrics" for p in r["ports"])]
    assert len(metrics_rules) == 1
    (source,) = metrics_rules[0]["from"]
    assert source["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
    # The selector of Prometheus pods must not have picked up tokenwire's labels on the way.
    assert not selects(source["podSelector"]["matchLabels"], rendered.pod_labels)
    open_ports = {p["port"] for r in policy["ingress"] if "from" not in r for p in r["ports"]}
    assert open_ports == {"grpc", "health"}


def test_pod_runs_unprivileged_on_a_read_only_root(rendered: Rendered) -> None:
    pod_security = rendered.pod["securityContext"]
    assert pod_security["runAsNonRoot"] is True
    assert pod_security["runAsUser"] == 10001
    assert rendered.pod["automountServiceAccountToken"] is False
    container_security = rendered.container["securityContext"]
    assert container_security["readOnlyRootFilesystem"] is True
    assert container_security["allowPrivilegeEscalation"] is False
    assert container_security["capabilities"]["drop"] == ["ALL"]


def test_the_pod_user_is_the_image_user() -> None:
    containerfile = (KUBERNETES.parent / "Containerfile").read_text()
    (user,) = re.findall(r"^USER (\d+):(\d+)$", containerfile, flags=re.MULTILINE)
    rendered = Rendered("cpu", render("cpu"))
    assert (rendered.pod["securityContext"]["runAsUser"], rendered.pod["securityContext"]["runAsGroup"]) == (
        int(user[0]),
        int(user[1]),
    )


def test_writable_paths_are_volumes_and_secrets_are_mounted_read_only(rendered: Rendered) -> None:
    volumes = {v["name"]: v for v in rendered.pod["volumes"]}
    mounts = {m["mountPath"]: m for m in rendered.container["volumeMounts"]}
    for mount in mounts.values():
        assert mount["name"] in volumes
    assert "emptyDir" in volumes[mounts["/var/cache/tokenwire"]["name"]]
    assert "emptyDir" in volumes[mounts["/tmp"]["name"]]
    env = rendered.env
    secrets = {
        env["TOKENWIRE_AUTH_TOKENS_FILE"]: "tokenwire-auth",
        env["TOKENWIRE_TLS_CERT"]: "tokenwire-tls",
        env["TOKENWIRE_TLS_KEY"]: "tokenwire-tls",
    }
    for path, secret in secrets.items():
        (mount,) = (m for p, m in mounts.items() if path.startswith(p + "/"))
        assert mount["readOnly"] is True
        assert volumes[mount["name"]]["secret"]["secretName"] == secret


def test_the_horizontal_pod_autoscaler_reads_the_adapter_rule_metric(rendered: Rendered) -> None:
    (metric,) = rendered.one("HorizontalPodAutoscaler")["spec"]["metrics"]
    assert metric["type"] == "Pods"
    served = {rule["name"]["as"] for rule in load_adapter_rules()}
    assert metric["pods"]["metric"]["name"] in served
    # The target is half a batch waiting per pod (docs/deploy.md, "Sizing").
    slots = int(rendered.env["TOKENWIRE_MAX_BATCH_SIZE"])
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": str(slots // 2)}


SMOLLM2_135M = SharedKvLayout(
    layers=30,
    kv_heads=3,
    head_dim=64,
    kv_dtype=np.dtype(np.float32),
    past_names=tuple(f"past_key_values.{layer}.{kind}" for layer in range(30) for kind in ("key", "value")),
    present_names=tuple(f"present.{layer}.{kind}" for layer in range(30) for kind in ("key", "value")),
    logits_dtype=np.dtype(np.float32),
)
"""The default model's KV geometry (its genai_config.json: 30 layers, 3 KV heads of 64)."""
SMOLLM2_WEIGHTS = 110 * 2**20
"""Bytes of its converted weights (model.onnx.data)."""


def quantity_bytes(text: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return int(text[: -len(suffix)]) * factor
    return int(text)


def test_cpu_memory_covers_the_kv_cache_and_the_weights() -> None:
    rendered = Rendered("cpu", render("cpu"))
    env = rendered.env
    kv = SMOLLM2_135M.geometry(
        int(env["TOKENWIRE_MAX_BATCH_SIZE"]), int(env["TOKENWIRE_MAX_CONTEXT_LENGTH"])
    ).total_bytes
    assert kv == 8 * 2048 * 30 * 3 * 64 * 2 * 4  # the arithmetic docs/deploy.md writes out
    resources = rendered.container["resources"]
    assert quantity_bytes(resources["requests"]["memory"]) >= kv + SMOLLM2_WEIGHTS
    assert quantity_bytes(resources["limits"]["memory"]) >= quantity_bytes(resources["requests"]["memory"])
    assert env["TOKENWIRE_INTRA_OP_THREADS"] == resources["requests"]["cpu"]


def test_cuda_pods_ask_for_a_gpu_and_run_on_it() -> None:
    rendered = Rendered("cuda", render("cuda"))
    resources = rendered.container["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == "1"
    assert rendered.env["TOKENWIRE_DEVICE"] == "cuda"
    assert rendered.container["image"].endswith("-cuda")
    assert any(t["key"] == "nvidia.com/gpu" for t in rendered.pod["tolerations"])


def objects_named(objects: list[Object]) -> set[tuple[str, str]]:
    return {(o["kind"], o["metadata"]["name"]) for o in objects}


def test_overlays_differ_only_in_the_deployment_and_the_autoscaler_target() -> None:
    cpu, cuda = render("cpu"), render("cuda")
    assert objects_named(cpu) == objects_named(cuda)
    changed = {(o["kind"], o["metadata"]["name"]) for o in cpu if o not in cuda}
    assert changed == {("Deployment", "tokenwire"), ("HorizontalPodAutoscaler", "tokenwire")}
