"""Regenerate the Python code for the wire contract: `python scripts/generate_proto.py`.

Writes protobuf messages, gRPC stubs and their .pyi type stubs for proto/tokenwire/v1 into
client/tokenwire/v1. With --check it generates into a scratch folder and fails when the committed
files differ, so a contract change without regenerated code cannot land.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
OUTPUT_ROOT = ROOT / "client"
PACKAGE = Path("tokenwire") / "v1"


def generate(out_root: Path) -> None:
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / PACKAGE).glob("*.proto"))
    command = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--mypy_out={out_root}",
        f"--mypy_grpc_out={out_root}",
        *protos,
    ]
    # protoc-gen-mypy lives beside this interpreter; make sure protoc finds it.
    env_path = str(Path(sys.executable).parent)
    env = dict(os.environ, PATH=env_path + os.pathsep + os.environ.get("PATH", ""))
    subprocess.run(command, check=True, cwd=PROTO_ROOT, env=env)
    init = out_root / PACKAGE / "__init__.py"
    init.write_text('"""Generated protobuf and gRPC code for tokenwire.v1. Do not edit."""\n')


def generated_files(root: Path) -> list[Path]:
    return sorted(p.relative_to(root) for p in (root / PACKAGE).glob("*") if p.is_file())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the committed code is stale")
    args = parser.parse_args()
    if not args.check:
        target = OUTPUT_ROOT / PACKAGE
        for old in target.glob("*_pb2*"):
            old.unlink()
        generate(OUTPUT_ROOT)
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        scratch_root = Path(scratch)
        generate(scratch_root)
        fresh = generated_files(scratch_root)
        committed = [p for p in generated_files(OUTPUT_ROOT) if p.suffix in {".py", ".pyi"}]
        stale = [str(p) for p in fresh if not (OUTPUT_ROOT / p).exists()]
        stale += [str(p) for p in committed if p not in fresh]
        stale += [
            str(p)
            for p in fresh
            if (OUTPUT_ROOT / p).exists()
            and not filecmp.cmp(scratch_root / p, OUTPUT_ROOT / p, shallow=False)
        ]
        if stale:
            print("generated code is stale; run `python scripts/generate_proto.py`:", *stale, sep="\n  ")
            return 1
        shutil.rmtree(scratch_root / PACKAGE, ignore_errors=True)
    print("generated code is up to date")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
