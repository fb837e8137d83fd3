"""Install what the GPU steps need and this machine lacks, from wheels carried in the working tree.

The lent GPU machine has no network. It has torch, CuPy, grpcio, protobuf, nvidia-ml-py, pytest and
the scientific stack, but not grpcio-health-checking (and its grpcio or protobuf may be older than
freeride's generated code needs). ``bench/gpu/fetch_wheels.sh``, run where there is a network, puts
the wheels pinned in ``bench/gpu/wheels.txt`` (built for the GPU machine's Python) into ``.whl/``;
this script checks :data:`REQUIREMENTS` against what is installed, picks the wheels of what is
missing or too old, with whatever of their own requirements is unmet, installs them into a private
directory and prints the ``export`` line that puts it first on ``PYTHONPATH``. What no GPU step uses
(redis, grpcio-tools, networkx: the cluster queue's and the code generator's tests) is not checked.
Standard library only: it runs before anything is installed.

    eval "$(python3 bench/gpu/ensure_deps.py)"
"""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterable
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WHEELS = REPO / ".whl"
TARGET = Path("/tmp/freeride-site")

#: What the GPU steps import: freeride's runtime requirements (pyproject.toml: the core's and those of the
#: tasks, demo and bench extras) and the test runner's.
#: torch, CuPy and nvidia-ml-py are never replaced from wheels: the machine's builds match its CUDA.
REQUIREMENTS = (
    "grpcio>=1.85.1",
    "grpcio-health-checking>=1.85.1",
    "protobuf>=7.35.1,<8",
    "psutil>=5.9",
    "numpy>=1.24",
    "scipy>=1.11",
    "pillow>=10",
    "prometheus-client>=0.20",
    "matplotlib>=3.8",
    "pytest>=8",
    "pytest-timeout>=2.3",
    "hypothesis>=6.100",
)
#: What only some GPU tests import (the Megatron and DeepSpeed adapters' device-time tests): installed where a
#: carried wheel meets it, else left missing (those tests skip, naming it); never a reason to install nothing.
OPTIONAL = (
    "megatron-core>=0.19.2",
    "deepspeed>=0.19.8",
)

VersionOf = Callable[[str], "str | None"]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def version_tuple(text: str) -> tuple[int, ...]:
    """The release numbers of a version (``8.0dev`` -> (8, 0)); enough for the bounds pinned here."""
    m = re.match(r"\s*(\d+(?:\.\d+)*)", text)
    parts = [int(p) for p in m.group(1).split(".")] if m else [0]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def satisfies(version: str, spec: str) -> bool:
    """Whether ``version`` meets every clause of ``spec`` (``>=1.2,<8``; ``>``, ``<=``, ``==``, ``!=`` too)."""
    have = version_tuple(version)
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        m = re.match(r"(>=|<=|==|!=|>|<|~=)\s*(.+)", clause)
        if not m:
            raise ValueError(f"cannot read the version clause {clause!r}")
        op, want = m.group(1), version_tuple(m.group(2))
        ok = {">=": have >= want, "<=": have <= want, ">": have > want, "<": have < want,
              "==": have == want, "!=": have != want, "~=": have >= want}[op]
        if not ok:
            return False
    return True


def split_requirement(req: str) -> tuple[str, str]:
    """``name`` and its version clauses, markers and extras dropped (``grpcio (>=1.8) ; python_version...``)."""
    req = req.split(";", 1)[0].strip()
    m = re.match(r"^([A-Za-z0-9_.-]+)\s*(?:\[[^\]]*\])?\s*\(?([^)]*)\)?\s*$", req)
    if not m:
        raise ValueError(f"cannot read the requirement {req!r}")
    return canonical(m.group(1)), m.group(2).strip()


def installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def unmet(requirements: Iterable[str] = REQUIREMENTS, version_of: VersionOf = installed_version) -> list[str]:
    """The requirements this machine does not meet (missing, or a version outside the clauses)."""
    out = []
    for req in requirements:
        name, spec = split_requirement(req)
        have = version_of(name)
        if have is None or (spec and not satisfies(have, spec)):
            out.append(req)
    return out


def wheel_name_version(path: Path) -> tuple[str, str]:
    """A wheel's distribution and version, from its file name (``grpcio-1.85.3-cp312-...whl``)."""
    parts = path.name.split("-")
    return canonical(parts[0]), parts[1]


def wheel_requires(path: Path) -> list[str]:
    """A wheel's unconditional ``Requires-Dist`` lines (those behind an ``extra`` marker are left out)."""
    with zipfile.ZipFile(path) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(name).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines()
            if line.startswith("Requires-Dist:") and "extra ==" not in line]


def choose_wheels(wanted: list[str], wheels: list[Path], version_of: VersionOf = installed_version) -> list[Path]:
    """The wheels that meet ``wanted``, and those that meet their own unmet requirements in turn.

    Raises LookupError naming what no carried wheel provides.
    """
    by_name: dict[str, list[Path]] = {}
    for w in wheels:
        by_name.setdefault(wheel_name_version(w)[0], []).append(w)
    chosen: dict[str, Path] = {}
    todo = list(wanted)
    lacking = []
    while todo:
        name, spec = split_requirement(todo.pop())
        if name in chosen:
            if spec and not satisfies(wheel_name_version(chosen[name])[1], spec):
                lacking.append(f"{name}{spec} (the carried {chosen[name].name} does not meet it)")
            continue
        fits = [w for w in by_name.get(name, []) if not spec or satisfies(wheel_name_version(w)[1], spec)]
        if not fits:
            lacking.append(f"{name}{spec}")
            continue
        chosen[name] = max(fits, key=lambda w: version_tuple(wheel_name_version(w)[1]))
        todo.extend(r for r in wheel_requires(chosen[name]) if unmet([r], version_of) and split_requirement(r)[0]
                    not in chosen)
    if lacking:
        raise LookupError(", ".join(sorted(set(lacking))))
    return sorted(chosen.values())


def install(wheels: list[Path], target: Path = TARGET) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", str(target), *map(str, wheels)], check=True)


def ensure(wheel_dir: Path = WHEELS, target: Path = TARGET, version_of: VersionOf = installed_version,
           installer: Callable[[list[Path], Path], None] = install) -> tuple[list[str], list[Path]]:
    """Install what is unmet from ``wheel_dir`` into ``target``: (what was unmet, the wheels installed).

    Raises LookupError when a requirement is unmet and no carried wheel meets it. An unmet
    :data:`OPTIONAL` one is installed only where a wheel of it is carried.
    """
    carried = sorted(wheel_dir.glob("*.whl"))
    names = {wheel_name_version(w)[0] for w in carried}
    missing = unmet(version_of=version_of) + [r for r in unmet(OPTIONAL, version_of)
                                              if split_requirement(r)[0] in names]
    if not missing:
        return [], []
    wheels = choose_wheels(missing, carried, version_of)
    installer(wheels, target)
    return missing, wheels


def main() -> int:
    try:
        missing, wheels = ensure()
    except LookupError as exc:
        print(f"# missing here, and no wheel in {WHEELS} for: {exc}; run bench/gpu/fetch_wheels.sh where there is "
              "a network and carry .whl/", file=sys.stderr)
        return 1
    if not missing:
        print("# every requirement is met", file=sys.stderr)
        return 0
    print(f"# missing or too old here: {', '.join(missing)}; installed {', '.join(w.name for w in wheels)}",
          file=sys.stderr)
    print(f"export PYTHONPATH={TARGET}${{PYTHONPATH:+:$PYTHONPATH}}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
