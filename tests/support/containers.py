"""Build and run deploy/Containerfile with podman on this machine, with no image registry.

No registry of base images is reachable from where the tests run, so the base image is made from
Debian packages (mmdebstrap, then podman import) and kept in podman's image store under a tag
derived from its recipe: a later run with the same recipe reuses it. The tokenwire image is then
built on that base with podman's layer cache, so its dependency layer is rebuilt only when
pyproject.toml changes.

Podman runs with the runc runtime (crun refuses hybrid cgroup hosts), host networking, and a
containers.conf that sets no default ulimits (raising them is not permitted on these hosts).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[2]
CONTAINERFILE = REPOSITORY / "deploy" / "Containerfile"
TOOLS = ("podman", "runc", "mmdebstrap", "newuidmap")
"""Commands the container test runs (newuidmap, from uidmap, is what podman needs for user
namespaces); the Debian packages that provide them are in the test-packages list."""
DEBIAN_SUITE = "bookworm"
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
"""Debian's system CA bundle, which pip inside the build needs to trust the package index."""
CONTAINERS_CONF = "[containers]\ndefault_ulimits = []\n"
IMAGE = "localhost/tokenwire-test"


def require_tools() -> None:
    """Skip when the container tools cannot be used here; in CI (CI=true) fail instead."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    root = os.geteuid() == 0
    if root and not missing:
        return
    problems = [] if root else ["not running as root (the recipe builds as root)"]
    if missing:
        problems.append(f"missing {', '.join(missing)} (Debian packages podman, runc, mmdebstrap, uidmap)")
    problem = "; ".join(problems)
    if os.environ.get("CI") == "true":
        pytest.fail(f"the container test must run in CI: {problem}")
    if not root and missing:
        pytest.skip(problem)
    pytest.fail(problem)


@dataclass(frozen=True)
class Podman:
    """podman with the settings these hosts need."""

    config_dir: Path

    @classmethod
    def create(cls, directory: Path) -> Podman:
        (directory / "containers.conf").write_text(CONTAINERS_CONF)
        return cls(directory)

    @property
    def environment(self) -> dict[str, str]:
        return {**os.environ, "CONTAINERS_CONF": str(self.config_dir / "containers.conf")}

    def command(self, *args: str) -> list[str]:
        return ["podman", "--runtime", "runc", *args]

    def run(self, *args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            self.command(*args),
            env=self.environment,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and result.returncode != 0:
            failed = f"podman {' '.join(args)} failed ({result.returncode})"
            raise AssertionError(f"{failed}:\n{result.stderr[-4000:]}")
        return result

    def image_id(self, reference: str) -> str | None:
        result = self.run("image", "inspect", "--format", "{{.Id}}", reference, check=False)
        return result.stdout.strip() if result.returncode == 0 else None

    def image_config(self, reference: str, field: str) -> str:
        return self.run("image", "inspect", "--format", "{{json .Config." + field + "}}", reference).stdout

    def popen(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            self.command(*args),
            env=self.environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )


def base_image_recipe() -> str:
    return f"mmdebstrap --variant=minbase --include={','.join(BASE_PACKAGES)} {DEBIAN_SUITE}"


def ensure_base_image(podman: Podman) -> str:
    """The Debian base image, made once per recipe and reused from podman's store after that."""
    key = hashlib.sha256(base_image_recipe().encode()).hexdigest()[:16]
    reference = f"localhost/tokenwire-test-base:{key}"
    if podman.image_id(reference) is not None:
        return reference
    with tempfile.TemporaryDirectory(prefix="tokenwire-base-") as scratch:
        rootfs = Path(scratch) / "rootfs.tar"
        subprocess.run(
            [*base_image_recipe().split(), str(rootfs)],
            check=True,
            capture_output=True,
            timeout=1200,
        )
        podman.run("import", str(rootfs), reference, timeout=600)
    return reference


def pip_index_settings(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """This machine's pip index settings, as PIP_* variables (the Containerfile's build arguments
    have the same names).

    Only network indexes are handed over: file:// locations exist on this machine, not in a
    container.
    """
    settings: dict[str, str] = {}
    for key, variable in (
        ("global.index-url", "PIP_INDEX_URL"),
        ("global.extra-index-url", "PIP_EXTRA_INDEX_URL"),
        ("global.trusted-host", "PIP_TRUSTED_HOST"),
    ):
        value = environ.get(variable) or _pip_config(key)
        kept = " ".join(part for part in value.split() if not part.startswith("file:"))
        if kept:
            settings[variable] = kept
    return settings


def pip_index_build_args() -> list[str]:
    return [
        part for name, value in pip_index_settings().items() for part in ("--build-arg", f"{name}={value}")
    ]


def pip_index_run_options() -> list[str]:
    """`podman run` options that let pip inside the container reach the index as it does here."""
    options = [part for name, value in pip_index_settings().items() for part in ("--env", f"{name}={value}")]
    if CA_BUNDLE.is_file():
        options += ["--volume", f"{CA_BUNDLE}:/run/pip-cert.crt:ro", "--env", "PIP_CERT=/run/pip-cert.crt"]
    return options


def _pip_config(key: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", key],
        capture_output=True,
        text=True,
    )
    return result.stdout.strip() if result.returncode == 0 else ""


def build_image(podman: Podman, base: str, *, tag: str = "latest", build_args: Sequence[str] = ()) -> str:
    """Build deploy/Containerfile on `base` as IMAGE:tag; the image it replaces is removed.

    `build_args` are NAME=VALUE pairs for the Containerfile's build arguments.
    """
    reference = f"{IMAGE}:{tag}"
    previous = podman.image_id(reference)
    secret = ["--secret", f"id=pip-cert,src={CA_BUNDLE}"] if CA_BUNDLE.is_file() else []
    podman.run(
        "build",
        "--network",
        "host",
        "--file",
        str(CONTAINERFILE),
        "--build-arg",
        f"BASE_IMAGE={base}",
        *pip_index_build_args(),
        *(part for pair in build_args for part in ("--build-arg", pair)),
        *secret,
        "--tag",
        reference,
        str(REPOSITORY),
        timeout=1800,
    )
    current = podman.image_id(reference)
    if previous is not None and previous != current:
        podman.run("image", "rm", previous, check=False)
    return reference
