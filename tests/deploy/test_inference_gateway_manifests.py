"""deploy/kubernetes/overlays/inference-gateway hangs together, as a cluster would find out.

No cluster, gateway or endpoint picker runs here (no cluster binaries or images are reachable),
so the overlay is rendered with `kubectl kustomize` and what its objects say about each other is
checked: the pool selects tokenwire's pods on their gRPC port, its picker reference reaches the
picker's pods, the route sends only calls the picker can place, the picker's configuration
refers only to plugins it declares and reads tokenwire's metrics on tokenwire's metrics port,
the objectives are tokenwire's priorities, and the policies let the gateway and the picker in
and nobody else. Schemas are checked in test_kubernetes_manifests.py; what the overlay relies
on in the server itself (metric names and values under load, the headers) in
test_inference_gateway_against_server.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.support.manifests import GATEWAY_OVERLAY, Object, Rendered, render
from tokenwire.server.engine.types import Priority
from tokenwire.server.security.gateway_headers import (
    FAIRNESS_ID_HEADER,
    OBJECTIVE_HEADER,
    PRIORITY_OBJECTIVES,
)
from tokenwire.v1 import inference_service_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["InferenceService"]
PICKER = "tokenwire-endpoint-picker"
LANDING_WITH_THE_SERVER_STREAMING_RPC = {"GenerateStream"}
"""Routed methods the service may not declare yet: the server-streaming GenerateStream, built
beside this overlay. Every other routed path must name a method of the service."""


@pytest.fixture(scope="module")
def gateway() -> Rendered:
    return Rendered(GATEWAY_OVERLAY, render(GATEWAY_OVERLAY))


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(key) == value for key, value in selector.items())


def picker_deployment(gateway: Rendered) -> Object:
    return gateway.one("Deployment", PICKER)


def picker_container(gateway: Rendered) -> Object:
    (container,) = picker_deployment(gateway)["spec"]["template"]["spec"]["containers"]
    return container


def picker_labels(gateway: Rendered) -> dict[str, str]:
    labels: dict[str, str] = picker_deployment(gateway)["spec"]["template"]["metadata"]["labels"]
    return labels


def picker_config(gateway: Rendered) -> Object:
    (config_map,) = (o for o in gateway.all("ConfigMap") if o["metadata"]["name"].startswith(PICKER))
    (text,) = config_map["data"].values()
    config: Object = yaml.safe_load(text)
    return config


def argument(container: Object, flag: str) -> str:
    arguments: list[str] = container["args"]
    return arguments[arguments.index(flag) + 1]


class TestThePool:
    def test_selects_the_tokenwire_pods_on_their_grpc_port_not_the_picker(self, gateway: Rendered) -> None:
        pool = gateway.one("InferencePool")["spec"]
        servers = gateway.deployment["spec"]["template"]
        assert selects(pool["selector"]["matchLabels"], servers["metadata"]["labels"])
        assert not selects(pool["selector"]["matchLabels"], picker_labels(gateway))
        (container,) = (c for c in servers["spec"]["containers"] if c["name"] == "tokenwire")
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert [p["number"] for p in pool["targetPorts"]] == [ports["grpc"]]
        # gRPC is HTTP/2; the pods serve it in cleartext behind the gateway.
        assert pool["appProtocol"] == "kubernetes.io/h2c"
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert "TOKENWIRE_TLS_CERT" not in env and "TOKENWIRE_TLS_KEY" not in env
        assert env["TOKENWIRE_AUTH_TOKENS_FILE"]  # tokens still decide who calls
        assert "tls" not in {v["name"] for v in servers["spec"]["volumes"]}

    def test_its_picker_reference_reaches_the_pickers_ext_proc_port(self, gateway: Rendered) -> None:
        reference = gateway.one("InferencePool")["spec"]["endpointPickerRef"]
        assert reference.get("kind", "Service") == "Service"
        service = gateway.one("Service", reference["name"])["spec"]
        assert selects(service["selector"], picker_labels(gateway))
        (port,) = (p for p in service["ports"] if p["port"] == reference["port"]["number"])
        assert port["appProtocol"] == "kubernetes.io/h2c"
        container_ports = {p["name"]: p["containerPort"] for p in picker_container(gateway)["ports"]}
        assert port["targetPort"] in container_ports
        # ...and the picker serves its pool.
        container = picker_container(gateway)
        assert argument(container, "--pool-name") == gateway.one("InferencePool")["metadata"]["name"]
        assert argument(container, "--pool-group") == "inference.networking.k8s.io"


class TestTheRoute:
    def test_sends_to_the_pool_the_calls_that_end_their_request_and_no_bidirectional_stream(
        self, gateway: Rendered
    ) -> None:
        (rule,) = gateway.one("HTTPRoute")["spec"]["rules"]
        (backend,) = rule["backendRefs"]
        assert (backend["group"], backend["kind"], backend["name"]) == (
            "inference.networking.k8s.io",
            "InferencePool",
            "tokenwire",
        )
        prefix = f"/{SERVICE.full_name}/"
        routed = set()
        for match in rule["matches"]:
            assert match["path"]["type"] == "Exact"
            assert match["path"]["value"].startswith(prefix)
            routed.add(match["path"]["value"].removeprefix(prefix))
        methods = {m.name: m for m in SERVICE.methods}
        assert routed - set(methods) <= LANDING_WITH_THE_SERVER_STREAMING_RPC
        # The picker reads a request to its end before it picks: a client stream never ends.
        placeable = {name for name, m in methods.items() if not m.client_streaming}
        assert placeable <= routed
        assert "StreamGenerate" not in routed
        # The gateway's timeout would cut generations short of their gRPC deadline.
        assert rule["timeouts"]["request"] == "0s"


class TestThePicker:
    def test_its_configuration_is_the_mounted_file_it_is_told_to_read(self, gateway: Rendered) -> None:
        pod = picker_deployment(gateway)["spec"]["template"]["spec"]
        container = picker_container(gateway)
        path = argument(container, "--config-file")
        (mount,) = (m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
        (volume,) = (v for v in pod["volumes"] if v["name"] == mount["name"])
        (config_map,) = (o for o in gateway.all("ConfigMap") if o["metadata"]["name"].startswith(PICKER))
        assert volume["configMap"]["name"] == config_map["metadata"]["name"]
        assert path.removeprefix(mount["mountPath"] + "/") in config_map["data"]
        config = picker_config(gateway)
        assert (config["apiVersion"], config["kind"]) == ("llm-d.ai/v1alpha1", "EndpointPickerConfig")

    def test_every_plugin_it_refers_to_is_declared(self, gateway: Rendered) -> None:
        config = picker_config(gateway)
        declared = [plugin.get("name", plugin["type"]) for plugin in config["plugins"]]
        assert len(declared) == len(set(declared))
        referred: list[str] = []
        for profile in config["schedulingProfiles"]:
            referred += [plugin["pluginRef"] for plugin in profile["plugins"]]
        referred += [parser["pluginRef"] for parser in config["requestHandler"]["parsers"]]
        for source in config["dataLayer"]["sources"]:
            referred += [source["pluginRef"], *(e["pluginRef"] for e in source["extractors"])]
        flow = config["flowControl"]
        referred += [flow["saturationDetector"]["pluginRef"]]
        referred += [band["fairnessPolicyRef"] for band in flow["priorityBands"]]
        assert set(referred) <= set(declared)
        # The protobuf body is passed through unparsed; flow control is on.
        assert [p["pluginRef"] for p in config["requestHandler"]["parsers"]] == ["passthrough-parser"]
        assert "flowControl" in config["featureGates"]

    def test_it_reads_tokenwires_metric_names_on_the_metrics_port_of_pods_labelled_tokenwire(
        self, gateway: Rendered
    ) -> None:
        config = picker_config(gateway)
        plugins = {p.get("name", p["type"]): p for p in config["plugins"]}
        extractor = plugins["core-metrics-extractor"]["parameters"]
        (engine,) = extractor["engineConfigs"]
        servers = gateway.deployment["spec"]["template"]
        assert servers["metadata"]["labels"][extractor["engineLabelKey"]] == engine["name"]
        assert extractor["defaultEngine"] == engine["name"]
        assert engine["queuedRequestsSpec"] == "tokenwire_engine_queue_depth"
        assert engine["runningRequestsSpec"] == "tokenwire_engine_batch_size"
        assert engine["kvUsageSpec"] == "tokenwire_engine_kv_cache_usage"
        (container,) = (c for c in servers["spec"]["containers"] if c["name"] == "tokenwire")
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        source = plugins["metrics-data-source"]["parameters"]
        assert source["port"] == ports["metrics"]
        assert (source["scheme"], source["path"]) == ("http", "/metrics")
        env = {e["name"]: e.get("value") for e in container["env"]}
        # The server renders a page at most this often; the picker must not read older pages.
        assert float(env["TOKENWIRE_METRICS_CACHE_SECONDS"]) < _seconds(source["interval"])

    def test_its_priority_bands_are_the_objectives_and_the_objectives_are_tokenwires_priorities(
        self, gateway: Rendered
    ) -> None:
        objectives = {o["metadata"]["name"]: o["spec"] for o in gateway.all("InferenceObjective")}
        assert set(objectives) == set(PRIORITY_OBJECTIVES)
        for spec in objectives.values():
            assert spec["poolRef"]["name"] == gateway.one("InferencePool")["metadata"]["name"]
        # The picker serves higher priorities first; tokenwire serves lower Priority values first.
        by_picker = sorted(objectives, key=lambda name: -objectives[name]["priority"])
        by_tokenwire = sorted(objectives, key=lambda name: PRIORITY_OBJECTIVES[name].value)
        assert by_picker == by_tokenwire == ["interactive", "default", "batch"]
        # No objective: priority 0 at the picker, DEFAULT at tokenwire.
        assert objectives["default"]["priority"] == 0 and PRIORITY_OBJECTIVES["default"] is Priority.DEFAULT
        # Batch is the one the picker sheds first (negative priorities).
        assert [name for name, spec in objectives.items() if spec["priority"] < 0] == ["batch"]
        bands = {band["priority"] for band in picker_config(gateway)["flowControl"]["priorityBands"]}
        assert bands == {spec["priority"] for spec in objectives.values()}

    def test_its_role_lets_it_read_the_pool_the_objectives_and_the_pods_and_nothing_more(
        self, gateway: Rendered
    ) -> None:
        pod = picker_deployment(gateway)["spec"]["template"]["spec"]
        binding = gateway.one("RoleBinding", PICKER)
        (subject,) = binding["subjects"]
        assert subject == {"kind": "ServiceAccount", "name": pod["serviceAccountName"]}
        assert gateway.one("ServiceAccount", pod["serviceAccountName"])
        role = gateway.one("Role", binding["roleRef"]["name"])
        granted = {
            (group, resource, verb)
            for rule in role["rules"]
            for group in rule["apiGroups"]
            for resource in rule["resources"]
            for verb in rule["verbs"]
        }
        for group, resource in (
            ("", "pods"),
            ("inference.networking.k8s.io", "inferencepools"),
            ("llm-d.ai", "inferenceobjectives"),
        ):
            assert {(group, resource, verb) for verb in ("get", "list", "watch")} <= granted
        assert {verb for _, _, verb in granted} == {"get", "list", "watch"}
        assert not any(kind == "ClusterRole" for kind in (o["kind"] for o in gateway.objects))

    def test_it_runs_unprivileged_on_a_read_only_root(self, gateway: Rendered) -> None:
        pod = picker_deployment(gateway)["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        security = picker_container(gateway)["securityContext"]
        assert security["readOnlyRootFilesystem"] is True
        assert security["allowPrivilegeEscalation"] is False
        assert security["capabilities"]["drop"] == ["ALL"]
        assert picker_container(gateway)["image"].endswith(":v0.10.0")


class TestTheServersSettings:
    def test_the_pods_read_the_pickers_headers_and_trust_the_gateways_caller(self, gateway: Rendered) -> None:
        env = gateway.env
        assert env["TOKENWIRE_GATEWAY_CALLER_HEADER"] == FAIRNESS_ID_HEADER
        assert env["TOKENWIRE_GATEWAY_OBJECTIVE_HEADER"] == OBJECTIVE_HEADER
        assert env["TOKENWIRE_GATEWAY_TRUSTED_CALLERS"] == "inference-gateway"


class TestTheNetworkPolicies:
    def test_grpc_is_open_only_to_the_gateway_and_metrics_to_prometheus_and_the_picker(
        self, gateway: Rendered
    ) -> None:
        policy = gateway.one("NetworkPolicy", "tokenwire")["spec"]
        by_port = _sources_by_port(policy)
        gateway_pods = {"gateway.networking.k8s.io/gateway-name": "inference-gateway"}
        assert [s["podSelector"]["matchLabels"] for s in by_port["grpc"]] == [gateway_pods]
        assert by_port["health"] == [None]  # the kubelet's probes
        metrics_from = [s["podSelector"]["matchLabels"] for s in by_port["metrics"]]
        assert {"app.kubernetes.io/name": "prometheus"} in metrics_from
        assert any(selects(labels, picker_labels(gateway)) for labels in metrics_from)

    def test_the_pickers_ext_proc_port_is_open_only_to_the_gateway(self, gateway: Rendered) -> None:
        policy = gateway.one("NetworkPolicy", PICKER)["spec"]
        assert selects(policy["podSelector"]["matchLabels"], picker_labels(gateway))
        by_port = _sources_by_port(policy)
        gateway_pods = {"gateway.networking.k8s.io/gateway-name": "inference-gateway"}
        assert [s["podSelector"]["matchLabels"] for s in by_port["grpc"]] == [gateway_pods]
        container_ports = {p["name"] for p in picker_container(gateway)["ports"]}
        assert set(by_port) <= container_ports


def test_the_overlay_changes_the_cpu_overlay_only_where_the_gateway_needs_it(gateway: Rendered) -> None:
    cpu = render("cpu")
    changed = {(o["kind"], o["metadata"]["name"]) for o in cpu if o not in gateway.objects}
    assert changed == {("Deployment", "tokenwire"), ("NetworkPolicy", "tokenwire")}


def _sources_by_port(policy: Object) -> dict[str, list[Any]]:
    """Each port's sources; None for a rule open to everyone."""
    found: dict[str, list[Any]] = {}
    for rule in policy["ingress"]:
        for port in rule["ports"]:
            found.setdefault(port["port"], []).extend(rule.get("from", [None]))
    return found


def _seconds(duration: str) -> float:
    if duration.endswith("ms"):
        return float(duration[:-2]) / 1000
    assert duration.endswith("s"), duration
    return float(duration[:-1])
