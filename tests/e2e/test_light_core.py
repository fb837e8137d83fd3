"""The core (``pip install freeride``) runs without the extras: the manager, the CLI, the client and the
trainer's reporter load none of torch, NumPy, SciPy, matplotlib or Pillow; and a command that needs an
extra says which, in one line, where that extra is missing.

A missing extra is emulated in a subprocess by a finder first on ``sys.meta_path`` that answers
``ModuleNotFoundError`` for it (and its submodules), as Python does for a package that is not installed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import TESTS_DIR, cpu_devices
from daemons import socket_path, start_daemon, stop_daemon

from freeride._extras import EXTRA_MODULES

HEAVY = ("torch", "numpy", "scipy", "matplotlib", "PIL")
REPO = TESTS_DIR.parent

#: Each core import path, as a user or a process of freeride reaches it.
CORE_PATHS = {
    "manager": "from freeride._cli.manager import run; from freeride._manager.daemon import Manager",
    "cli": "from freeride.cli import build_parser; build_parser()",
    "client": "from freeride import ControlClient, TaskSpec; import freeride._wire.client",
    "reporter": "from freeride.training import BubbleReporter; from freeride.training.reporter import BubbleReporter",
    "worker runtime": "import freeride._worker.runtime",
    "side-task API": "from freeride import SideTask, TaskContext; import freeride.testing",
}


def _loaded_after(code: str, *, blocked: tuple[str, ...] = (), cwd: Path = REPO) -> tuple[int, list[str], str]:
    """Run ``code`` in a fresh interpreter; its exit code, the heavy modules it loaded, and its stderr."""
    script = textwrap.dedent(f"""
        import json, sys

        class _NotInstalled:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {blocked!r}:
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
                return None

        sys.meta_path.insert(0, _NotInstalled())
        code = 0
        try:
            exec({code!r})
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        print(json.dumps([m for m in {HEAVY!r} if sys.modules.get(m) is not None]))
        sys.exit(code)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=cwd, timeout=120)
    loaded = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else []
    return proc.returncode, loaded, proc.stderr


@pytest.mark.parametrize("path", sorted(CORE_PATHS))
def test_core_import_paths_load_no_heavy_library(path: str) -> None:
    code, loaded, err = _loaded_after(CORE_PATHS[path])
    assert code == 0, err
    assert loaded == [], f"importing the {path} loads {loaded}"


@pytest.mark.e2e
def test_a_serving_manager_and_the_cli_commands_against_it_load_no_heavy_library(tmp_path: Path) -> None:
    """Past imports: a real manager with a trainer stream and a command task, and every query command."""
    sock = socket_path("light")
    device = cpu_devices(1)[0]
    proc = start_daemon(sock, tmp_path / "state", device=device)
    try:
        ep = ["--device", device, "--endpoint", f"unix:{sock}"]
        commands = [["submit", "--memory", "16MiB", *ep, "--command", "--", "sleep", "30"], ["ls", "--all", *ep],
                    ["show", "sleep-1", *ep], ["stats", *ep], ["bubbles", "--endpoint", f"unix:{sock}"],
                    ["top", "--once", *ep], ["health", *ep], ["drain", *ep]]
        stream = f"""
from freeride.training import BubbleReporter
import time
r = BubbleReporter(device={device!r}, stage=0, rank=0, endpoint="unix:{sock}")
now = time.monotonic_ns()
r.bubble_start(0, 0, "test", predicted_ns=5_000_000, start_ns=now)
r.bubble_end(0, 0, end_ns=now + 1_000_000)
r.close()
"""
        code, loaded, err = _loaded_after(stream)
        assert (code, loaded) == (0, []), err
        for argv in commands:
            code, loaded, err = _loaded_after(f"import sys; from freeride.cli import main; sys.exit(main({argv!r}))")
            assert code == 0, (argv, err)
            assert loaded == [], f"freeride {' '.join(argv)} loads {loaded}"
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        for library in ("libtorch", "_multiarray_umath", "scipy", "matplotlib", "PIL"):
            assert library not in maps, f"the manager process mapped {library}"
    finally:
        stop_daemon(proc)


def _one_line_naming(err: str, extra: str, torch_missing: bool = False) -> None:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert f"pip install 'freeride[{extra}]'" in lines[0], err
    assert "Traceback" not in err
    if torch_missing:  # torch's own build first: the extra's bare torch requirement pulls a CUDA build of GBs
        assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in lines[0], err


def test_the_demo_without_its_extra_says_which_in_one_line() -> None:
    code, _, err = _loaded_after("import sys; from freeride.cli import main; sys.exit(main(['demo', '--quick']))",
                                 blocked=("matplotlib",))
    assert code == 2
    _one_line_naming(err, "demo")
    assert "matplotlib" in err


def test_plan_plot_without_matplotlib_says_which_extra_before_sweeping(tmp_path: Path) -> None:
    argv = ["plan", "--stages", "2", "--sweep", "--layers", "4", "--hidden", "64", "--heads", "4", "--seq-len", "32",
            "--vocab", "128", "--device-memory", "8GiB", "--plot", str(tmp_path / "f.png")]
    code, _, err = _loaded_after(f"import sys; from freeride.cli import main; sys.exit(main({argv!r}))",
                                 blocked=("matplotlib",))
    assert code == 2
    _one_line_naming(err, "demo")
    assert not (tmp_path / "f.png").exists()


@pytest.mark.parametrize("command", ["submit", "run-task"])
def test_a_bundled_task_without_the_tasks_extra_says_which_in_one_line(command: str) -> None:
    argv = [command, "side_tasks.graphs:PageRank", "--arg", "graph=rmat:6", "--memory", "64MiB",
            *(["--seconds", "1"] if command == "run-task" else ["--endpoint", "unix:/nonexistent/none.sock"])]
    code, _, err = _loaded_after(f"import sys; from freeride.cli import main; sys.exit(main({argv!r}))",
                                 blocked=EXTRA_MODULES["tasks"])
    assert code == 2
    _one_line_naming(err, "tasks", torch_missing=True)


def test_a_task_of_ones_own_missing_a_library_says_what_is_missing(tmp_path: Path) -> None:
    (tmp_path / "needs_torch.py").write_text("import torch\nfrom freeride import SideTask\n"
                                             "class T(SideTask):\n    def step(self): pass\n")
    argv = ["run-task", "needs_torch:T", "--memory", "64MiB", "--seconds", "1"]
    code, _, err = _loaded_after(f"import sys; from freeride.cli import main; sys.exit(main({argv!r}))",
                                 blocked=("torch",), cwd=tmp_path)
    assert code == 2
    assert err.strip().count("\n") == 0 and "No module named 'torch'" in err, err


@pytest.mark.parametrize("argv", [
    ["submit", "--queue", "redis://localhost:1/0", "--memory", "16MiB", "--command", "--", "true"],
    ["ls", "--queue", "redis://localhost:1/0"],
])
def test_the_cluster_queue_without_its_extra_says_which_in_one_line(argv: list[str]) -> None:
    code, _, err = _loaded_after(f"import sys; from freeride.cli import main; sys.exit(main({argv!r}))",
                                 blocked=("redis",))
    assert code == 2
    _one_line_naming(err, "cluster")


def test_the_bench_command_without_its_extra_says_which_in_one_line() -> None:
    code, _, err = _loaded_after("import sys; from freeride.cli import main; sys.exit(main(['bench', '--', 'true']))",
                                 blocked=("scipy",))
    assert code == 2
    _one_line_naming(err, "bench")


def test_measure_intervals_without_scipy_say_which_extra() -> None:
    code, _, err = _loaded_after("from freeride import measure\n"
                                 "try:\n    measure.t_interval([1.0, 2.0, 3.0])\n"
                                 "except Exception as exc:\n    print(type(exc).__name__, exc, file=sys.stderr)\n",
                                 blocked=("scipy",))
    assert code == 0
    assert err.startswith("MissingExtra") and "pip install 'freeride[bench]'" in err, err
