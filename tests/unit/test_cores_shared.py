"""When a ``cpu:N`` manager has no core apart from the training ranks' (it then takes its CPU from training)."""

from __future__ import annotations

from pathlib import Path

import pytest

from freeride._manager.loop import cores_shared_with_training, cores_with_cpu_managers
from freeride.devices import parse_device_name
from freeride.messages import TrainerLayout


def _layout(*devices: str) -> TrainerLayout:
    return TrainerLayout("Schedule1F1B", len(devices), 8, devices, 0)


@pytest.mark.parametrize(("device", "devices", "cores", "shared"), [
    # Stranger trial: two ranks on cores 0 and 1, managers unpinned: iterations of 16 ms took 23-24 ms.
    ("cpu:0", ("cpu:0", "cpu:1"), {0, 1}, {0, 1}),
    ("cpu:1", ("n1/cpu:0", "n1/cpu:1"), {0, 1}, {0, 1}),  # this node's entries
    ("cpu:0", ("cpu:0", "cpu:1"), {0, 1, 2}, set()),  # core 2 is free of ranks
    ("cpu:0", ("cpu:0", "cpu:1"), {2}, set()),  # pinned off the ranks
    ("cpu:0", ("n2/cpu:0", "n2/cpu:1"), {0, 1}, set()),  # another node's ranks
    ("cpu:0", (), {0, 1}, set()),  # a layout that names no devices says nothing of cores
    ("cuda:0", ("cuda:0", "cuda:1"), {0, 1}, set()),  # a GPU's ranks compute on the GPU
    ("cpu:0", ("cpu:0", "cuda:1", "bogus"), {0}, {0}),
])
def test_a_manager_is_said_to_share_its_cores_only_when_every_one_computes_a_stage(
    device: str, devices: tuple[str, ...], cores: set[int], shared: set[int]
) -> None:
    assert cores_shared_with_training(parse_device_name(device), _layout(*devices), "n1", cores) == shared


def test_cores_that_each_have_a_cpu_managers_socket_are_taken_for_ranks_cores(tmp_path: Path) -> None:
    # Verifier: the layouts the adapters report name no devices, so no manager of two unpinned ranks ever warned.
    (tmp_path / "cpu-0.sock").touch()
    (tmp_path / "cpu-1.sock").touch()
    assert cores_with_cpu_managers(tmp_path, {0, 1}) == {0, 1}
    assert cores_with_cpu_managers(tmp_path, {0, 1, 2}) == set()  # core 2 has no manager: likely free
    assert cores_with_cpu_managers(tmp_path, {2}) == set()  # pinned off the ranks
    assert cores_with_cpu_managers(tmp_path, set()) == set()
