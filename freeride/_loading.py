"""Resolving ``module:Class`` references to side-task classes and building tasks, with one-line errors; and
where task code runs in a process that must outlive it (the CLI, ``run-task``, ``run_steps``), its ``os._exit()``
made the task's failure (:func:`exit_raises`)."""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import re
import sys
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from freeride._extras import require
from freeride.errors import ConfigError, TaskLoadError
from freeride.task import SideTask

_TARGET_RE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
#: Longer references are refused before they are parsed or echoed in an error.
MAX_TARGET_CHARS = 256


class ProcessExitCalled(SystemExit):
    """The task called ``os._exit(code)`` while it ran in this process (:func:`exit_raises`)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)

    def __str__(self) -> str:
        return (f"the task called os._exit({self.code}): in a worker the process ends there, and the task FAILS "
                f"with exit code {self.code}")


@contextmanager
def exit_raises() -> Iterator[None]:
    """While a task's code runs in this process (``run-task``, :func:`freeride.testing.run_steps`), its
    ``os._exit(code)`` on this thread raises :class:`ProcessExitCalled`, which ends the run as a failure of the
    task. It ended ``run-task`` with the task's exit code and no word (the report never printed), and took a
    test session down the same way. A call from another process (a fork the task made, as multiprocessing's
    children end with ``os._exit``) or another thread ends that process as it asks."""
    real = os._exit
    pid, thread = os.getpid(), threading.get_ident()

    def _exit(code: int) -> None:
        __tracebackhide__ = True  # noqa: F841 (task_location names the task's line, not this one)
        if os.getpid() == pid and threading.get_ident() == thread:
            raise ProcessExitCalled(code)
        real(code)

    os._exit = _exit  # type: ignore[assignment]
    try:
        yield
    finally:
        os._exit = real


def task_location(exc: BaseException) -> str:
    """`` (file:line)`` of the innermost frame of ``exc``'s traceback that is the task's, or ``""``. A stand-in
    that raises on the task's behalf (:func:`exit_raises`) marks its frame with
    ``__tracebackhide__``, pytest's mark, and is skipped: the location named the stand-in's line."""
    frames = [(frame, line) for frame, line in traceback.walk_tb(exc.__traceback__)
              if not frame.f_locals.get("__tracebackhide__")]
    if not frames:
        return ""
    frame, line = frames[-1]
    return f" ({frame.f_code.co_filename}:{line})"


def check_target_syntax(target: str) -> None:
    """Refuse anything but ``dotted.module:Class``: no paths, no calls, no trailing newline.

    ``fullmatch`` rather than ``match`` with ``$``, which would accept a final ``\\n``.
    """
    if isinstance(target, str) and len(target) > MAX_TARGET_CHARS:
        raise TaskLoadError(f"bad task reference: at most {MAX_TARGET_CHARS} characters, got {len(target)}")
    if not isinstance(target, str) or not _TARGET_RE.fullmatch(target):
        raise TaskLoadError(
            f"bad task reference {target!r}: expected package.module:ClassName, e.g. side_tasks.graphs:PageRank"
        )


def load_task_class(target: str, search_path: str = "") -> type[SideTask]:
    """Import ``module:Class`` and check it is a :class:`SideTask` subclass.

    ``search_path`` (a directory) is put first on ``sys.path`` so that a user's own modules next
    to where they submitted resolve.
    """
    check_target_syntax(target)
    module_name, class_name = target.split(":")
    if search_path and search_path not in sys.path:
        sys.path.insert(0, search_path)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # Unknown only if the missing module is the one named (or a parent package of it); a
        # module that exists but imports something missing is a failed import, not an unknown one.
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            where = _where_searched(module_name, search_path)
            raise TaskLoadError(f"unknown module {module_name!r} in {target!r}: {where}") from None
        if module_name.split(".")[0] == "side_tasks" and exc.name:
            require("tasks", f"the bundled task {target}")
        raise TaskLoadError(f"module {module_name!r} failed to import: {exc} (install it here)") from None
    except (Exception, SystemExit, KeyboardInterrupt) as exc:
        # SystemExit and KeyboardInterrupt too: a module that calls sys.exit() at import must not end
        # the importing process (the CLI exited with the module's code and said nothing; a worker
        # died without a record). GeneratorExit cannot come from an import.
        raise TaskLoadError(
            f"module {module_name!r} failed to import: {type(exc).__name__}: {exc}{task_location(exc)}"
        ) from None
    cls = getattr(module, class_name, None)
    if cls is None:
        raise TaskLoadError(f"module {module_name!r} has no class {class_name!r}")
    if not (isinstance(cls, type) and issubclass(cls, SideTask)):
        raise TaskLoadError(f"{target} is not a subclass of freeride.SideTask")
    return cls


def _where_searched(module_name: str, search_path: str) -> str:
    """Where a module was looked for, for the "unknown module" message: the directory searched first,
    then the installed packages."""
    file = module_name.replace(".", "/") + ".py"
    if search_path:
        return f"no {file} in {search_path} (searched first) nor on the Python path"
    return f"no {file} on the Python path"


def construct_task(cls: type[SideTask], target: str, args: dict[str, Any]) -> SideTask:
    """``cls(**args)``, with every way it can fail as one :class:`ConfigError` line.

    Arguments that do not fit the constructor's signature are each named (a misspelt one with the
    closest parameter), with what it takes; a constructor that refuses its values (a missing input
    file, a value out of range: the writing guide asks constructors to check them) is quoted as
    ``Type: message``. ``freeride submit`` (which drops the object: constructors are cheap) and
    ``freeride run-task`` word these the same.
    """
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # not introspectable (a C extension): the call itself will tell
        signature = None
    if signature is not None:
        problems = _argument_problems(signature, args) + _type_problems(cls, args)
        if problems:
            takes = ", ".join(name for name, p in signature.parameters.items()
                              if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)) or "no arguments"
            raise ConfigError(f"arguments do not fit {target}: {'; '.join(problems)} (it takes: {takes})")
    try:
        return cls(**args)
    except (Exception, SystemExit, KeyboardInterrupt) as exc:  # task code: any exit is bad input
        raise ConfigError(f"{target} refused its arguments: {describe_error(exc)}") from None


def estimate_memory(cls: type, target: str, task_args: dict[str, Any]) -> int | None:
    """The class's ``estimate_memory(**task_args)``, its failures as one ConfigError line."""
    try:
        estimate = cls.estimate_memory(**task_args)  # type: ignore[attr-defined]
    except TypeError as exc:
        raise ConfigError(f"arguments do not fit {target}: {describe_error(exc)}") from None
    except (Exception, SystemExit, KeyboardInterrupt) as exc:  # task code: any exit is bad input
        raise ConfigError(f"{target}.estimate_memory raised {describe_error(exc)}") from None
    return int(estimate) if estimate else None


def check_target(target: str, task_args: dict[str, Any], search_path: str) -> int | None:
    """Load ``target`` (``search_path`` first on the path), build it once with ``task_args`` and drop it:
    what ``freeride submit`` checks of a task class. Its ``estimate_memory(**task_args)`` (None: none).
    Raises TaskLoadError or ConfigError, in one line."""
    cls = load_task_class(target, search_path=search_path)
    construct_task(cls, target, task_args)
    return estimate_memory(cls, target, task_args)


def describe_error(exc: BaseException) -> str:
    """``Type: message`` of an exception from task code, whose ``str()`` may itself raise."""
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - task code: its __str__ is as untrusted as the rest
        text = "<unprintable>"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


#: Annotations whose values are checked before the constructor runs, and what they take. Only numbers and
#: booleans: a value the CLI parsed as JSON (``--arg damping=banana`` is text) reached PageRank's range check
#: as "TypeError: '<' not supported between instances of 'float' and 'str'", naming no argument. A ``str``
#: parameter is left alone (``--arg name=5`` parses as a number a task may well take as it comes).
_TYPED: dict[Any, tuple[tuple[type, ...], str]] = {
    float: ((int, float), "a number"),
    int: ((int,), "a whole number"),
    bool: ((bool,), "true or false"),
}


def _type_problems(cls: type, args: dict[str, Any]) -> list[str]:
    """Each argument whose value is not what its parameter's annotation says (:data:`_TYPED` only)."""
    try:
        params = inspect.signature(cls, eval_str=True).parameters
    except Exception:  # noqa: BLE001 - an annotation that does not evaluate here: nothing to check by
        return []
    problems = []
    for key, value in args.items():
        param = params.get(key)
        typed = _TYPED.get(param.annotation) if param is not None else None
        if typed is None:
            continue
        kinds, what = typed
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            problems.append(f"{key!r} must be {what}, got {value!r}")
    return problems


def _argument_problems(signature: inspect.Signature, args: dict[str, Any]) -> list[str]:
    """Every argument that does not fit, each named (with a close match for a misspelt one)."""
    params = signature.parameters
    named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    positional = [n for n, p in params.items() if p.kind == p.POSITIONAL_ONLY]
    problems = []
    for name in positional:
        if params[name].default is params[name].empty:
            problems.append(f"parameter {name!r} is positional-only, and a task is built with keyword arguments: "
                            "this class cannot be submitted as it is")
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        for key in args:
            if key in positional:
                problems.append(f"{key!r} is positional-only (a task is built with keyword arguments)")
            elif key not in named:
                close = difflib.get_close_matches(key, named, n=1)
                problems.append(f"unknown argument {key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    for name in named:
        p = params[name]
        if p.default is p.empty and name not in args:
            problems.append(f"missing required argument {name!r}")
    return problems
