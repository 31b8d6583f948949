"""Progress bars of ``stare run`` and ``stare train`` (local presets): steps, live reward and entropy, clock, ETA.

The live values are the last finished step's mean reward and mean token entropy (``reward_mean`` and
``stare/entropy`` of its ``metrics.jsonl`` record); the ETA is rich's estimate from the recent step rate.
"""
from __future__ import annotations

import json
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def columns(name_width: int = 16) -> tuple:
    """Name, bar, steps done/total, status (live reward and entropy while training), elapsed, ETA."""
    return (TextColumn(f"[bold cyan]{{task.description:<{name_width}}}"), BarColumn(bar_width=16),
            MofNCompleteColumn(), TextColumn("{task.fields[status]}"), TimeElapsedColumn(), TextColumn("eta"),
            TimeRemainingColumn())


def live_status(rec: dict | None) -> str:
    """'reward 0.81 H 0.42' from a step's metrics record ('training' before the first step)."""
    if not rec or "reward_mean" not in rec:
        return "training"
    from stare.algorithms import upgrade_metric_names

    entropy = upgrade_metric_names(rec).get("stare/entropy")  # older runs wrote "entropy"; none: not logged
    return f"reward {rec['reward_mean']:.2f}" + ("" if entropy is None else f" H {entropy:.2f}")


def last_record(path: Path, tail_bytes: int = 65536) -> tuple[int, dict | None]:
    """(complete lines, the last complete line as a dict) of a metrics.jsonl another process is appending to."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return 0, None
    complete = data[: data.rfind(b"\n") + 1]  # a line still being written is not counted yet
    n = complete.count(b"\n")
    if not n:
        return 0, None
    last = complete[-tail_bytes:].rstrip(b"\n").rsplit(b"\n", 1)[-1]
    try:
        return n, json.loads(last)
    except ValueError:
        return n, None
