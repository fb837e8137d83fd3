"""The core's language: its config is validated at construction, its policies are named and each is a
class of the policy protocol, and every event type has exactly one handler."""

from __future__ import annotations

import ast
import logging
import sys
import typing
from pathlib import Path

import pytest
from core_sim import MS, Sim

from freeride._manager import core
from freeride._manager.core import POLICIES, CoreConfig, Event, NoteLevel, Tick, scheduler
from freeride._manager.core.policy import FreeridePolicy, ReferencePolicy, SchedulingPolicy, make_policy


@pytest.mark.parametrize(
    "kwargs",
    [
        {"headroom_bytes": -1},
        {"grace_ns": -1},
        {"step_timeout_ns": 0},
        {"stop_timeout_ns": 0},
        {"memory_window_iterations": 0},
        {"margin_ns": 5 * MS, "max_margin_ns": 1 * MS},
    ],
)
def test_config_rejects_negative_zero_or_inconsistent_values(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        CoreConfig(**kwargs)


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="policy"):
        CoreConfig(policy="fastest")


def test_every_event_type_has_exactly_one_handler() -> None:
    assert set(scheduler._HANDLERS) == set(typing.get_args(Event))
    scheduler._check_exhaustive()


def test_an_event_type_without_a_handler_fails_the_import_check(monkeypatch: pytest.MonkeyPatch) -> None:
    handlers = dict(scheduler._HANDLERS)
    del handlers[Tick]
    monkeypatch.setattr(scheduler, "_HANDLERS", handlers)
    with pytest.raises(TypeError, match="missing \\['Tick'\\]"):
        scheduler._check_exhaustive()


def test_an_object_that_is_not_an_event_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="not a core event"):
        Sim().send("tick")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", POLICIES)
def test_each_policy_name_builds_the_policy_of_that_name(name: str) -> None:
    policy = make_policy(CoreConfig(policy=name))
    assert policy.name == name
    assert {FreeridePolicy: "freeride", ReferencePolicy: "paper"}[type(policy)] == name


@pytest.mark.parametrize("policy", [FreeridePolicy, ReferencePolicy])
def test_each_policy_class_has_every_member_of_the_protocol(policy: type) -> None:
    members = {name for name in vars(SchedulingPolicy) if not name.startswith("_")}
    members |= set(SchedulingPolicy.__annotations__)
    has = set(dir(policy(CoreConfig())))
    assert members <= has, members - has


def test_note_levels_are_the_logging_levels_the_loop_logs_them_at() -> None:
    assert (NoteLevel.DEBUG, NoteLevel.INFO, NoteLevel.WARNING) == (logging.DEBUG, logging.INFO, logging.WARNING)


#: What the core may import besides the standard library and itself (docs/architecture.md).
CORE_MAY_IMPORT = {"freeride.states", "freeride.messages", "freeride.units", "freeride.errors",
                   "freeride._estimator"}


def test_the_core_imports_only_the_standard_library_and_shared_leaves() -> None:
    imported: set[str] = set()
    for path in Path(core.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module)
    outside = {
        name for name in imported
        if name.split(".")[0] not in sys.stdlib_module_names and not name.startswith("freeride._manager.core")
    }
    assert outside <= CORE_MAY_IMPORT, outside - CORE_MAY_IMPORT
