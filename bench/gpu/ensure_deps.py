"""Install what freeride needs and this machine lacks, from wheels carried in the working tree.

A GPU machine may have no network. ``bench/gpu/fetch_wheels.sh`` (run where there is one) puts
the wheels of the packages a stock CUDA image tends to lack or hold too old into ``.whl/``; this
script compares ``pyproject.toml``'s requirements (runtime and test) with what is installed, installs
the missing or too-old ones from ``.whl/`` into a private directory, and prints the ``export`` line
that puts it first on ``PYTHONPATH``. Standard library only: it runs before anything is installed.

    eval "$(python3 bench/gpu/ensure_deps.py)"
"""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[2]
WHEELS = REPO / ".whl"
TARGET = Path("/tmp/freeride-site")
#: Never replaced from wheels: the machine's own builds match its CUDA.
KEEP = {"torch", "cupy-cuda12x", "cupy-cuda13x", "nvidia-ml-py"}


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def unmet() -> list[str]:
    """Requirements (``name>=x``) not satisfied here, in pyproject's words."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"]) + list(project["optional-dependencies"]["test"])
    out = []
    for req in wanted:
        m = re.match(r"^([A-Za-z0-9_.-]+)\s*(?:>=\s*([0-9.]+))?", req)
        if not m or m.group(1).lower() in KEEP:
            continue
        name, low = m.group(1), m.group(2)
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            out.append(req)
            continue
        if low and _version_tuple(have) < _version_tuple(low):
            out.append(req)
    return out


def main() -> int:
    missing = unmet()
    if not missing:
        print("# every requirement is met", file=sys.stderr)
        return 0
    print(f"# missing or too old here: {', '.join(missing)}", file=sys.stderr)
    wheels = sorted(WHEELS.glob("*.whl"))
    if not wheels:
        print(f"# no wheels in {WHEELS}: run bench/gpu/fetch_wheels.sh where there is a network", file=sys.stderr)
        return 1
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--upgrade", "--target", str(TARGET), *map(str, wheels)], check=True)
    print(f"export PYTHONPATH={TARGET}${{PYTHONPATH:+:$PYTHONPATH}}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
