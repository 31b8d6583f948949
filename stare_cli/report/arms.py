"""Arms: the runs that differ only in their seed, grouped, ordered and labelled, one definition for every table
and plot of the comparison.

An arm is the runs of one algorithm with the same preset, settings (but the seed) and algorithm settings; a repeat
of a seed starts an arm of its own. Arms come in the registry's order (``stare algos``), an algorithm's swept arms
(``stare run --sweep``) after its others by key and value, then runs without a known algorithm.
"""
from __future__ import annotations

import json
from pathlib import Path

from stare.algorithms import ALGORITHMS

from ..sweep import arm_sweep as arm_sweep_of
from .runs import Run, run_band


def _arm_key(run: Run) -> str:
    """What makes two runs seeds of one arm: the same algorithm, preset, settings (but the seed) and algorithm
    settings. Runs without an algorithm (OpenRLHF logs without config.yaml) are each their own arm."""
    if run.algo is None:
        return f"path:{run.path}"
    settings = {k: v for k, v in (run.config.get("settings") or {}).items() if k != "seed"}
    return json.dumps([run.algo, run.config.get("preset"), settings, run.config.get("algo")], sort_keys=True,
                      default=str)


def algo_rank(algo: str | None) -> int:
    """Position of an algorithm in the registry's order; unknown names and None come after every known one."""
    names = list(ALGORITHMS)
    return names.index(algo) if algo in names else len(names)


def group_arms(runs: list[Run]) -> list[list[Run]]:
    """The runs grouped into arms (see ``_arm_key``), in the registry's algorithm order, then first-seen order."""
    arms: dict[str, list[list[Run]]] = {}
    for r in runs:
        groups = arms.setdefault(_arm_key(r), [])
        # a run with the same settings and seed as one already in the arm (a repeat, e.g. `stare train` of an
        # arm `stare run` also trained) is not another seed: it starts an arm of its own
        home = next((g for g in groups if all(x.seed != r.seed for x in g)), None)
        if home is None:
            groups.append([r])
        else:
            home.append(r)
    flat = [g for groups in arms.values() for g in groups]
    return sorted(flat, key=_arm_order)  # sorted() is stable


def _arm_order(group: list[Run]) -> tuple:
    """The registry's algorithm order; an algorithm's arms of a sweep after its others, by their swept keys and then
    values (numbers by value, anything else by its text), so stare run and stare compare list them alike."""
    swept = arm_sweep(group)
    values = tuple(sorted((k, 0, v, "") if isinstance(v, (int, float)) and not isinstance(v, bool)
                          else (k, 1, 0, str(v)) for k, v in (swept[1].items() if swept else ())))
    return algo_rank(group[0].algo), swept is not None, values


def arm_sweep(group: list[Run]) -> tuple[str, dict] | None:
    """(``algo[KEY=V,...]``, {KEY: value}) of an arm of a ``stare run --sweep`` (``stare.cli.sweep.arm_sweep``: its
    folder's name, checked against the config), else None."""
    return arm_sweep_of(group[0].path, group[0].config, group[0].algo)


def arm_labels(arms: list[list[Run]]) -> list[str]:
    """One label per arm: the algorithm's name (``algo[KEY=V]`` for an arm of a sweep), with the arm's folder
    added when two arms share a name."""
    names = [(arm_sweep(group) or (group[0].algo or "openrlhf",))[0] for group in arms]
    labels = []
    for name, group in zip(names, arms):
        if names.count(name) == 1:
            labels.append(name)
        else:
            where = Path(group[0].path) if len(group) == 1 else Path(group[0].path).parent
            labels.append(f"{name} ({where})")
    return labels


def common(values):
    """The value all of them share, or the distinct values joined with '/' (None when there are none)."""
    distinct = list(dict.fromkeys(v for v in values if v is not None))
    if len(distinct) == 1:
        return distinct[0]
    return "/".join(map(str, distinct)) if distinct else None


def reference_band(runs: list[Run]) -> tuple[float, float] | None:
    """The band of the first arm with a band controller, else of the first run that names one."""
    banded = [r for r in runs if r.config["algo"].get("stare") and r.config["algo"].get("controller") == "band"]
    for r in banded + runs:
        if run_band(r):
            return run_band(r)
    return None
