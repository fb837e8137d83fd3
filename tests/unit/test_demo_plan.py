"""What the demo runs where, its configuration checks, and the command's answers to bad input."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from freeride._demo.plan import (
    FULL_ITERATIONS,
    QUICK_ITERATIONS,
    DemoConfig,
    demo_devices,
    plan_tasks,
    trainer_model_args,
)
from freeride._demo.run import Layout, trainer_argv
from freeride.cli import EXIT_BAD_INPUT, main
from freeride.errors import ConfigError


def test_quick_is_the_smaller_size_and_iterations_can_be_chosen() -> None:
    full = DemoConfig.make("cpu", None, Path("out"), quick=False)
    quick = DemoConfig.make("cpu", None, Path("out"), quick=True)
    assert (full.iterations, quick.iterations) == (FULL_ITERATIONS, QUICK_ITERATIONS)
    assert quick.standalone_s < full.standalone_s
    assert DemoConfig.make("cpu", 42, Path("out"), quick=True).iterations == 42


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"iterations": 4}, "between 5"),
        ({"iterations": 10**6}, "and 100000"),
        ({"device_kind": "tpu"}, "--device must be one of cpu, cuda"),
        ({"warmup_iterations": -1}, "warm-up"),
        ({"standalone_s": 0.0}, "standalone_s"),
        ({"stop_timeout_s": float("nan")}, "stop_timeout_s"),
    ],
)
def test_a_bad_configuration_is_refused_with_its_reason(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DemoConfig(**kwargs)  # type: ignore[arg-type]


def test_cpu_stages_go_to_the_cores_the_trainer_pins_them_to() -> None:
    assert demo_devices("cpu", cpu_affinity={0, 1, 2, 3}) == ("cpu:0", "cpu:1")
    assert demo_devices("cpu", cpu_affinity={2, 3}) == ("cpu:2", "cpu:3")
    assert demo_devices("cpu", cpu_affinity={0, 5}) == ("cpu:0", "cpu:5")


def test_machines_without_two_cores_are_refused() -> None:
    with pytest.raises(ConfigError, match="needs 2 CPU cores"):
        demo_devices("cpu", cpu_affinity={0})
    # The k-th allowed core, as the trainer pins local rank k: cores {1, 2} are fine.
    assert demo_devices("cpu", cpu_affinity={1, 2}) == ("cpu:1", "cpu:2")


def test_the_cuda_demo_runs_a_real_pipeline_on_two_gpus_and_one_emulated_neighbour_on_one() -> None:
    assert demo_devices("cuda", cuda_count=lambda: 2) == ("cuda:0", "cuda:1")
    assert demo_devices("cuda", cuda_count=lambda: 8) == ("cuda:0", "cuda:1")
    assert demo_devices("cuda", cuda_count=lambda: 1) == ("cuda:0",)
    with pytest.raises(ConfigError, match="no CUDA device is available"):
        demo_devices("cuda", cuda_count=lambda: 0)


def test_the_demo_runs_on_gpus_by_default_where_there_are_any(tmp_path: Path) -> None:
    cpu = DemoConfig.make("auto", None, tmp_path, quick=True, cuda_count=lambda: 0)
    assert (cpu.device_kind, cpu.single_stage) == ("cpu", False)
    one = DemoConfig.make("auto", None, tmp_path, quick=True, cuda_count=lambda: 1)
    assert (one.device_kind, one.single_stage) == ("cuda", True)
    two = DemoConfig.make("auto", None, tmp_path, quick=True, cuda_count=lambda: 2)
    assert (two.device_kind, two.single_stage) == ("cuda", False)
    assert DemoConfig.make("cpu", None, tmp_path, quick=True, cuda_count=lambda: 4).device_kind == "cpu"
    # One GPU: the single-stage trainer of stage 0, reporting to cuda:0's manager; all tasks on cuda:0.
    argv = trainer_argv(one, tmp_path / "iterations.jsonl", "unix:/run/x/{slug}.sock", ("cuda:0",))
    assert argv[1:3] == ["-m", "freeride.workload.single_stage"]
    assert argv[argv.index("--endpoint") + 1] == "unix:/run/x/cuda-0.sock" and "--report" in argv
    assert argv[argv.index("--iteration-log") + 1].endswith("iterations.rank0.jsonl")
    assert {p.device_index for p in plan_tasks("cuda", 1)} == {0}
    assert "torch.distributed.run" in trainer_argv(two, tmp_path / "i.jsonl", None)


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_every_planned_task_takes_its_arguments_and_fits_its_own_memory_estimate(kind: str) -> None:
    plans = plan_tasks(kind, 2)
    assert {p.device_index for p in plans} == {0, 1}
    assert {p.name for p in plans} == {"lstm", "pagerank", "watermark"}
    for plan in plans:
        module, _, name = plan.target.partition(":")
        cls = getattr(importlib.import_module(module), name)
        cls(**plan.args)  # validates the arguments
        estimate = cls.estimate_memory(**plan.args)
        assert estimate is None or estimate <= plan.memory_bytes, plan.name


def test_the_trainer_runs_two_1f1b_stages_and_reports_only_in_the_run_with_side_tasks(tmp_path: Path) -> None:
    config = DemoConfig.make("cpu", 20, tmp_path, quick=True)
    baseline = trainer_argv(config, tmp_path / "it.jsonl", None)
    reported = trainer_argv(config, tmp_path / "it.jsonl", "unix:/s/{slug}.sock")
    assert baseline[baseline.index("--schedule") + 1] == "1f1b"
    assert baseline[baseline.index("--iterations") + 1] == "20"
    assert "--report" not in baseline
    assert reported[-3:] == ["--report", "--endpoint-template", "unix:/s/{slug}.sock"]
    assert baseline[baseline.index("--d-model") + 1] == trainer_model_args("cpu")[1]
    assert "--d-model" in trainer_argv(DemoConfig.make("cuda", 20, tmp_path, quick=True), tmp_path / "x", None)


def test_preparing_the_output_removes_only_what_a_demo_left(tmp_path: Path) -> None:
    layout = Layout(tmp_path)
    (tmp_path / "state-cpu-0").mkdir()
    (tmp_path / "state-cpu-0" / "tasks.sqlite").write_text("old")
    layout.summary.write_text("{}")
    (tmp_path / "mine.txt").write_text("keep")
    layout.prepare(["cpu:0", "cpu:1"])
    assert not (tmp_path / "state-cpu-0").exists() and not layout.summary.exists()
    assert (tmp_path / "mine.txt").read_text() == "keep"


def test_the_command_refuses_bad_input_with_exit_code_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["demo", "--iterations", "1", "--out", str(tmp_path)]) == EXIT_BAD_INPUT
    assert "--iterations must be between" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--device", "tpu"])
    assert exc.value.code == EXIT_BAD_INPUT
    assert not any(tmp_path.iterdir()), "nothing may start or be written before the input is checked"


def test_the_cuda_demo_is_refused_here_with_exit_code_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import freeride._demo.plan as plan

    monkeypatch.setattr(plan, "_cuda_device_count", lambda: 0)  # whatever this machine has
    assert main(["demo", "--device", "cuda", "--quick", "--out", str(tmp_path)]) == EXIT_BAD_INPUT
    assert "needs a GPU, but no CUDA device is available" in capsys.readouterr().err
