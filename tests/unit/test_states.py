"""The task lifecycle: allowed transitions, terminal and resident states."""

from __future__ import annotations

import pytest

from freeride.errors import InvalidTransition
from freeride.states import TaskState, check_transition

S = TaskState
TERMINAL = [S.FINISHED, S.FAILED, S.CANCELLED]
RESIDENT = [S.STARTING, S.PARKED, S.RUNNING, S.FROZEN]

ALLOWED = {
    (S.SUBMITTED, S.STARTING),
    (S.STARTING, S.PARKED),
    (S.PARKED, S.RUNNING),
    (S.RUNNING, S.PARKED),
    (S.RUNNING, S.FROZEN),
    (S.FROZEN, S.RUNNING),
    (S.PARKED, S.FINISHED),
    (S.RUNNING, S.FINISHED),
    (S.FROZEN, S.FINISHED),  # its finish crossed the freeze
    (S.EVICTED, S.SUBMITTED),
    *((s, S.EVICTED) for s in RESIDENT),
    *((s, S.FAILED) for s in [S.SUBMITTED, *RESIDENT, S.EVICTED]),
    *((s, S.CANCELLED) for s in [S.SUBMITTED, *RESIDENT, S.EVICTED]),
}


@pytest.mark.parametrize("old", list(S))
@pytest.mark.parametrize("new", list(S))
def test_check_transition_allows_exactly_the_documented_lifecycle(old: TaskState, new: TaskState) -> None:
    if (old, new) in ALLOWED:
        check_transition("t", old, new)
    else:
        with pytest.raises(InvalidTransition, match=f"{old.value} -> {new.value}"):
            check_transition("t", old, new)


@pytest.mark.parametrize("old", TERMINAL)
def test_terminal_states_cannot_be_left(old: TaskState) -> None:
    assert old.is_terminal
    for new in S:
        with pytest.raises(InvalidTransition):
            check_transition("t", old, new)


def test_terminal_and_resident_sets() -> None:
    assert {s for s in S if s.is_terminal} == set(TERMINAL)
    assert {s for s in S if s.is_resident} == set(RESIDENT)


def test_invalid_transition_message_names_the_task() -> None:
    with pytest.raises(InvalidTransition, match="task pagerank-3"):
        check_transition("pagerank-3", S.FINISHED, S.RUNNING)
