"""``freeride bubbles``: what the managers saw of the training job's bubbles, per stage and slot.

    freeride bubbles [--devices cpu:0,cpu:1 | --endpoint unix:/p.sock] [--json]

One row per (device, stage, slot): whether the schedule model lists the slot (``model``) or the
trainer learned it from waits that recur where the model has none (``learned``: stage imbalance,
communication; see ``freeride.training.learned_slots``), how many times the bubble occurred, its
measured length (p50 / p90 / p99 / max), the trainer's predicted length, the prediction error
(|predicted - real| / real, p50 / p90) and the least free device memory reported in it. A count marked ``*``
holds bubbles that ended while other trainer ranks shared the device (a line under the device's rows says how
many): one rank's waits there, which are not the device's idle time nor in ``stats``' bubble time. A footer per
device gives the bubble time per iteration and stage, modelled and learned apart: the sum of its slots' mean
lengths (what ``stats`` adds up; a stranger read a sum of medians as less than half of it where lengths
varied), the sum of their medians in brackets; a last line says what the prediction is. Without
``--devices`` or ``--endpoint`` it asks every manager whose socket is in the per-user runtime
directory.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import Any

from freeride._cli.tasks import cannot_run_here, uncomputed_as_null
from freeride._wire.client import ControlClient
from freeride.devices import parse_device_name
from freeride.endpoints import TOKEN_ENV, Endpoint, default_endpoint, parse_endpoint, read_token, runtime_dir
from freeride.errors import ConfigError, ManagerUnavailable
from freeride.messages import BubbleSlotStats
from freeride.units import format_size


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bubbles",
        help="show the bubbles each manager saw: count, length percentiles, free memory, prediction error",
        description="Per (stage, slot) bubble statistics from the managers of the job's devices.",
    )
    parser.add_argument("--devices", default=None, help="comma-separated devices, e.g. cpu:0,cpu:1")
    parser.add_argument("--device", action="append", default=[], help="a device (repeatable)")
    parser.add_argument("--endpoint", default=None, help="one manager's endpoint (unix:/p.sock or tcp://h:p)")
    parser.add_argument("--token-file", default=None, help=f"token for a TCP endpoint (else ${TOKEN_ENV})")
    parser.add_argument("--timeout-s", type=float, default=5.0, help="per-manager RPC timeout")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--summary", action="store_true",
                        help="one line per device (slots, measured, bubble time per iteration per stage) instead "
                             "of a row per slot: a schedule of many micro-batches has hundreds of slots")
    parser.set_defaults(func=run)


def _targets(args: argparse.Namespace) -> list[tuple[str, Endpoint]]:
    devices: list[str] = list(args.device)
    if args.devices:
        devices += [d for d in args.devices.split(",") if d.strip()]
    if args.endpoint:
        if devices:
            raise ConfigError("give either --endpoint or --devices, not both")
        endpoint = parse_endpoint(args.endpoint)
        return [(_endpoint_label(endpoint), endpoint)]
    if devices:
        return [(str(parse_device_name(d)), default_endpoint(d)) for d in devices]
    found = sorted(runtime_dir(create=False).glob("*.sock")) if runtime_dir(create=False).is_dir() else []
    targets = []
    for sock in found:
        kind, _, index = sock.stem.partition("-")
        if kind in ("cpu", "cuda") and index.isdigit():
            targets.append((f"{kind}:{index}", Endpoint("unix", str(sock))))
    if not targets:
        raise ManagerUnavailable(
            f"no manager sockets in {runtime_dir(create=False)}; give --devices or --endpoint "
            "(start managers with `freeride manager --device ...` or `freeride launch`)"
        )
    return targets


def _endpoint_label(endpoint: Endpoint) -> str:
    """The label of a manager given by ``--endpoint``, until it says which device it manages."""
    return f"<{endpoint}>"


def collect(
    targets: list[tuple[str, Endpoint]], token: str | None, timeout_s: float
) -> tuple[dict[str, list[BubbleSlotStats]], dict[str, str]]:
    """Slot statistics per device, and an error line for each manager that did not answer."""
    stats: dict[str, list[BubbleSlotStats]] = {}
    errors: dict[str, str] = {}
    for name, endpoint in targets:
        try:
            with ControlClient(endpoint, token=token, timeout_s=timeout_s) as client:
                slots = sorted(client.bubbles(), key=lambda s: (s.stage, s.rank, s.slot))
                if name == _endpoint_label(endpoint):  # named by its endpoint: show its device
                    name = client.stats().device
                stats[name] = slots
        except ManagerUnavailable as exc:
            errors[name] = _not_here(name) or str(exc)
    return stats, errors


def _not_here(name: str) -> str:
    """Why no manager can run on device ``name`` on this machine, as the line that names it, or "" (where one
    could, or a manager named by its endpoint: the advice to start one stands)."""
    why = "" if name.startswith("<") else cannot_run_here(name)
    return f"no manager answers, and none can run on {name} here: {why}" if why else ""


#: Under the table: what ``pred`` is, so that its distance from p50 reads as intended (a stranger took it for a
#: broken predictor).
PRED_LEGEND = ("pred: the trainer's prediction, by default the 10th percentile of the slot's last 16 lengths (low: "
               "a grant cut to it rarely outlives the wait); err: |pred - real| / real")


#: After the count of a device's bubbles measured while its ranks shared it (``BubbleSlotStats.shared``).
SHARED_NOTE = ("of these bubbles ended while other trainer ranks shared the device: one rank's waits, not the "
               "device's idle time (not in `stats`' bubble time)")


def _ms(value: float) -> str:
    return f"{value:.2f}" if value < 100 else f"{value:.0f}"


#: The footer's figure: the sums of the slots' mean lengths, their medians' in brackets.
PER_ITERATION = "bubble time per iteration, mean (median)"


def _pct(value: float) -> str:
    return f"{value:.1f}%"


def bubble_time_per_stage(slots: list[BubbleSlotStats]) -> dict[int, tuple[float, float, float, float]]:
    """Per model stage, in order, the bubble time per iteration (ms) of its modelled and of its learned slots:
    ``(modelled mean, learned mean, modelled median, learned median)``, each the sum of its slots' mean or
    p50 lengths (a slot comes once an iteration)."""
    per_stage: dict[int, list[float]] = {}
    for s in slots:
        sums = per_stage.setdefault(s.stage, [0.0, 0.0, 0.0, 0.0])
        sums[1 if s.learned else 0] += s.length_mean_ms
        sums[3 if s.learned else 2] += s.length_ms.p50
    return {k: (sums[0], sums[1], sums[2], sums[3]) for k, sums in sorted(per_stage.items())}


def summary_doc(slots: list[BubbleSlotStats]) -> dict[str, Any]:
    """``--summary --json``: a device's slots counted, and its bubble time per iteration per stage (the sums of
    the slots' means; ``..._median``: of their medians, the only figure before)."""
    return {"slots": len(slots), "measured": sum(1 for s in slots if s.count),
            "learned": sum(1 for s in slots if s.learned), "shared": sum(s.shared for s in slots),
            "bubble_ms_per_iteration": {str(k): {"modelled": m, "learned": learned, "modelled_median": m50,
                                                 "learned_median": learned50}
                                        for k, (m, learned, m50, learned50) in bubble_time_per_stage(slots).items()}}


def render(stats: dict[str, list[BubbleSlotStats]], errors: dict[str, str], summary: bool = False) -> str:
    """The human table (``summary``: only each device's summary line)."""
    header = (
        f"{'device':<8} {'stage':>5} {'rank':>4} {'slot':>6} {'source':<7} {'kind':<10} {'count':>6} "
        f"{'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'max ms':>8} {'pred ms':>8} "
        f"{'err p50':>7} {'err p90':>7} {'min free':>9}"
    )
    lines = [] if summary else [header]
    for device, slots in stats.items():
        if not slots:
            lines.append(f"{device:<8} (no bubbles reported yet)")
            continue
        for s in () if summary else slots:
            free = format_size(s.min_free_memory_bytes) if s.min_free_memory_bytes >= 0 else "?"
            if s.count:
                figures = (f"{_ms(s.length_ms.p50):>8} {_ms(s.length_ms.p90):>8} {_ms(s.length_ms.p99):>8} "
                           f"{_ms(s.length_ms.max):>8} {_ms(s.predicted_ms.p50):>8} "
                           f"{_pct(s.abs_error_pct.p50):>7} {_pct(s.abs_error_pct.p90):>7}")
            else:  # started, but no end measured yet (or only lost ones): nothing to show, not zeros
                figures = f"{'-':>8} {'-':>8} {'-':>8} {'-':>8} {'-':>8} {'-':>7} {'-':>7}"
            lines.append(
                f"{device:<8} {s.stage:>5} {s.rank:>4} {s.slot:>6} {'learned' if s.learned else 'model':<7} "
                f"{s.kind:<10} {str(s.count) + ('*' if s.shared else ''):>6} {figures} {free:>9}"
            )
        shared = sum(s.shared for s in slots)
        per_stage = bubble_time_per_stage(slots)
        per = ", ".join(
            f"stage {k}: {_ms(m)} ms ({_ms(m50)})" + (f" + {_ms(learned)} ms ({_ms(learned50)}) learned"
                                                      if learned or learned50 else "")
            for k, (m, learned, m50, learned50) in per_stage.items()
        )
        if summary:
            counted = summary_doc(slots)
            lines.append(f"{device:<8} {counted['slots']} slots ({counted['measured']} measured, "
                         f"{counted['learned']} learned); {PER_ITERATION}: {per}"
                         + (f"; {shared} {SHARED_NOTE}" if shared else ""))
        else:
            lines.append(f"{'':<8} {PER_ITERATION}: {per}")
            if shared:
                lines.append(f"{'':<8} *: {shared} {SHARED_NOTE}")
    for device, message in errors.items():
        lines.append(f"{device:<8} unavailable: {message}")
    if not summary and any(stats.values()):
        lines.append(PRED_LEGEND)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if not 0 < args.timeout_s < float("inf"):  # 0 or less read as "no manager answers" (exit 3) from serving ones
        raise ConfigError(f"--timeout-s must be a positive number of seconds, got {args.timeout_s:g}")
    targets = _targets(args)
    token = read_token(args.token_file)
    stats, errors = collect(targets, token, args.timeout_s)
    if not stats:
        if all(endpoint.kind == "unix" and _not_here(name) for name, endpoint in targets):
            # Every device named is one this host lacks, and a unix socket's manager would be on this host: the
            # devices are the bad input (exit 2, as the README says), not a manager that is down (3).
            raise ConfigError("; ".join(errors.values()))
        raise ManagerUnavailable("; ".join(errors.values()))
    if args.json:
        doc = {
            "devices": {d: summary_doc(slots) if args.summary else [asdict(s) for s in slots]
                        for d, slots in stats.items()},
            "unavailable": errors,
        }
        json.dump(uncomputed_as_null(doc), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(render(stats, errors, summary=args.summary))
    return 1 if errors else 0

