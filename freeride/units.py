"""Parsing and printing of sizes and durations, with clear errors."""

from __future__ import annotations

import re

from freeride.errors import ConfigError

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str | int, what: str = "size") -> int:
    """Parse ``"2GiB"``, ``"512MB"``, ``"1.5g"`` or a plain byte count into bytes (> 0).

    ``what`` names the value in errors (``"--memory"``).
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        if str(text).strip().startswith("-"):
            raise ConfigError(f"{what} must be positive, got {text!r}")
        match = _SIZE_RE.match(str(text))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _SIZE_UNITS:
            raise ConfigError(
                f"cannot parse {what} {text!r}: use a number with an optional unit "
                "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 2GiB or 512MB"
            )
        value = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise ConfigError(f"{what} must be positive, got {text!r}")
    return value


def format_size(num_bytes: int | float) -> str:
    """Render bytes in binary units, e.g. ``1.5 GiB``; negative means unknown."""
    if num_bytes < 0:
        return "-"
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def counts_steps(unit: str) -> bool:
    """Whether a task's progress unit is its steps (``steps``, or none said): where it is not, a step count never
    stands for its progress."""
    return unit in ("", "steps")


def format_progress(progress: float, steps: int, unit: str) -> str:
    """A task's progress in its unit, the steps where it reports none: whole numbers plainly, others to two
    decimals, and past ten million in three significant figures (``1.79e+20 bytes``: its twenty-one digits
    widened every table a task was in). ``-`` before any step: a task's unit is known only once a worker says
    it, so a queued task read "0 steps" whatever it counts in. No progress in a unit of the task's own is ``-``
    too, whatever its steps: they are not its unit (a task that never parked read "29 numbers" for 1,450,000)."""
    if not progress and (not steps or not counts_steps(unit)):
        return "-"
    value = progress if progress else float(steps)
    if abs(value) >= 1e7:
        return f"{value:.3g} {unit or 'steps'}"
    return (f"{value:.0f}" if value == int(value) else f"{value:.2f}") + f" {unit or 'steps'}"


def format_steps(count: int) -> str:
    """``1 step``, ``19 steps``: a count of finished steps, which no reader counts differently (``step 19``
    read as the nineteenth where it was the twentieth)."""
    return f"{count} step" if count == 1 else f"{count} steps"


def format_rate(per_s: float) -> str:
    """A rate per second: whole numbers from 100 up, with thousands grouped (``30,412``), else three significant
    figures. A stranger read ``3e+04 iterations/s`` for 30.6k: too coarse to compare with their own timing."""
    if abs(per_s) >= 100:
        return f"{per_s:,.0f}"
    return f"{per_s:.3g}"


def format_ms(value_ms: float) -> str:
    """Render a duration in milliseconds with sensible precision."""
    if value_ms <= 0:
        return "-"
    if value_ms < 1:
        return f"{value_ms * 1000:.0f} us"
    if value_ms < 1000:
        return f"{value_ms:.1f} ms"
    return f"{value_ms / 1000:.2f} s"


def format_mib(num_bytes: int | float) -> str:
    """Whole MiB (``"150 MiB"``), the unit of memory caps in messages; :func:`format_size` below 1 MiB."""
    return f"{num_bytes / 2**20:.0f} MiB" if abs(num_bytes) >= 2**20 else format_size(num_bytes)


def format_mib_apart(used: int | float, cap: int | float) -> tuple[str, str]:
    """``used`` and ``cap`` as :func:`format_mib` gives them, with as many decimals as tell them apart (bytes
    at worst): "used 64 MiB, over its limit of 64 MiB" read as no excess at all."""
    for decimals in (0, 1, 2):
        if min(abs(used), abs(cap)) >= 2**20:
            a, b = f"{used / 2**20:.{decimals}f} MiB", f"{cap / 2**20:.{decimals}f} MiB"
        else:
            a, b = format_mib(used), format_mib(cap)
        if a != b or used == cap:
            return a, b
    return f"{int(used)} B", f"{int(cap)} B"


def memory_limit_hint(steps: int, *, host: bool = False) -> str:
    """What a MEMORY_LIMIT message adds, worded alike by the manager and ``run-task`` (``steps``: the steps it had
    finished): libraries load in setup or the first step, so a task over its cap before its second step finished
    is told where to import them (``host``: its host memory, on a device whose own memory is capped apart); one
    over it later grew while stepping (a stranger's task that leaked 2 MiB a step was told to import its libraries
    at module level). The manager said "grew over 3 steps" where ``run-task`` said 4 of the same task (the one it
    was in counted): both count finished steps now."""
    if steps >= 2:
        return f" (it grew while stepping, after {format_steps(steps)}: what it keeps across steps counts)"
    if host:
        return " (what setup or its first step allocates counts, libraries loaded there too)"
    # A stranger's first step allocated 1.5 GiB at once and was told only of imports.
    return (" (what setup or its first step allocates counts, and so do libraries first imported there: import "
            "them at module level)")


def over_device_text(memory_bytes: int, device: object, total_bytes: int) -> str:
    """Why a cap over the device's whole memory is refused, worded alike by ``submit`` and ``run-task`` (which
    ran a 1 TiB cap on a 24 GiB host that ``submit`` refused)."""
    return (f"memory {format_size(memory_bytes)} is more than {device} has in all ({format_size(total_bytes)}): the "
            "task could never be placed")


def format_p99_ms(value_ms: float | None) -> str:
    """A latency percentile as the reports print it: ``1.69 ms``, or ``-`` where none was measured (None: a
    distribution with no sample read 0.00 ms, as if measured)."""
    return "-" if value_ms is None else f"{value_ms:.2f} ms"
