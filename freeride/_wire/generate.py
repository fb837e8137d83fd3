"""Regenerate the protobuf and gRPC modules from ``proto/``.

Run ``python -m freeride._wire.generate`` after editing a ``.proto`` file, and commit the result.
``--check`` exits 1 (printing what differs) when the committed modules are stale; a test runs it.

The generated modules live in this private package and are imported by exactly one module on each
side (``freeride._wire.convert``); nothing else in freeride sees ``*_pb2``. protoc emits a
top-level ``import freeride_pb2`` in the gRPC module; it is rewritten to a relative import so the
generated code stays inside the package.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import tempfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent.parent
PROTO_DIR = REPO_ROOT / "proto" / "freeride" / "v1"
PROTO_FILE = "freeride.proto"
OUTPUTS = ("freeride_pb2.py", "freeride_pb2.pyi", "freeride_pb2_grpc.py")


def _generate(out_dir: Path) -> dict[str, str]:
    from grpc_tools import protoc  # a build-time tool: imported only here

    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(PROTO_DIR / PROTO_FILE),
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed on {PROTO_DIR / PROTO_FILE}")
    texts = {name: (out_dir / name).read_text() for name in OUTPUTS}
    texts["freeride_pb2_grpc.py"] = texts["freeride_pb2_grpc.py"].replace(
        "import freeride_pb2 as freeride__pb2", "from . import freeride_pb2 as freeride__pb2"
    )
    return texts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed code is stale")
    ns = parser.parse_args(argv)
    if not PROTO_DIR.is_dir():
        print(f"no proto directory at {PROTO_DIR} (run from a source checkout)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        fresh = _generate(Path(tmp))
    stale = []
    for name, text in fresh.items():
        target = PACKAGE_DIR / name
        current = target.read_text() if target.exists() else ""
        if current == text:
            continue
        stale.append(name)
        if ns.check:
            diff = difflib.unified_diff(
                current.splitlines(), text.splitlines(), f"committed/{name}", f"fresh/{name}", lineterm=""
            )
            print("\n".join(list(diff)[:40]))
        else:
            target.write_text(text)
    if ns.check and stale:
        print(f"stale generated code: {', '.join(stale)}; run python -m freeride._wire.generate")
        return 1
    if not ns.check:
        print(f"generated {len(stale)} changed file(s) in {PACKAGE_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
