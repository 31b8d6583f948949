"""OpenRLHF runs for ``stare compare``: TensorBoard event files read into the same ``Run`` records as a local run.

OpenRLHF writes its training scalars as ``train/<key>`` against the global step (this project's STARE plugin adds
``train/stare/<key>``) into ``events.out.tfevents.*`` files, in a folder named after the run. Each folder that holds
event files is one run (several files in one folder, as after a restart, are one run; for a step logged twice the
later value wins). ``TB_TAGS`` says which tag feeds which metric; a metric whose tags are all absent stays absent,
so its cells are blank. The run's settings (algorithm, target band, model) come from a ``config.yaml`` in the
event folder or one of its two parents, when there is one; without it the algorithm and band share are blank.
OpenRLHF's in-training evaluation (``--eval.dataset``, the GPU setting ``eval_every``) logs
``eval/eval_<datasource>_pass1`` (the mean reward of its n samples per prompt: avg@n with this project's 0/1
reward) and ``eval/eval_<datasource>_pass<n>``: ``eval_curves`` reads them as accuracy-over-training curves
(``<datasource>_in_training``, n from the pass<n> tag), the same curves as a local run's ``eval_every`` and as
``stare eval --checkpoints`` (``Run.curves``). A run's benchmark columns come from ``stare eval`` outputs
(``eval-<bench>/summary.json``) next to its config.yaml.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

from ..presets import read_config
from .runs import TELEMETRY_COLUMNS

# metric key (as in a local run's metrics.jsonl) -> TensorBoard tags, in order of preference: the first tag the run
# logged at all is used for every step (STARE's batch entropy of the old policy before OpenRLHF's entropy_loss).
TB_TAGS: dict[str, tuple[str, ...]] = {
    "stare/entropy": ("train/stare/entropy", "train/entropy_loss"),
    "reward_mean": ("train/reward",),
    "response_length": ("train/response_length",),
    "stare/target": ("train/stare/target",),
    "stare/gate_on": ("train/stare/gate", "train/stare/gate_on"),  # the plugin's ControllerState.as_metrics: gate_on
    "stare/w": ("train/stare/w",),
    "stare/m": ("train/stare/m",),
    # the rest of the selection telemetry (``runs.TELEMETRY_COLUMNS``, the token rules' own included): each as
    # train/<key>; runs written before the rename logged boosted_raise_share
    "stare/boosted_phi_pos_share": ("train/stare/boosted_phi_pos_share", "train/stare/boosted_raise_share"),
}
TB_TAGS.update({t.key: (f"train/{t.key}",) for t in TELEMETRY_COLUMNS if t.key not in TB_TAGS})

EVENT_GLOB = "events.out.tfevents.*"
CONFIG_DEPTH = 2  # config.yaml is looked for in the event folder and this many folders above it


def event_dirs(path: Path) -> list[Path]:
    """Folders at or below ``path`` that hold TensorBoard event files, sorted."""
    path = Path(path)
    return sorted({f.parent for f in path.rglob(EVENT_GLOB) if f.is_file()})


def _accumulator():
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        raise ValueError("reading OpenRLHF TensorBoard logs needs the tensorboard package (pip install tensorboard)") \
            from None
    return EventAccumulator


def read_scalars(folder: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} for every scalar in the event files directly in ``folder`` (all points, no sampling)."""
    accumulator = _accumulator()(str(folder), size_guidance={"scalars": 0})
    try:
        accumulator.Reload()
    except Exception as exc:  # noqa: BLE001 - a corrupt or foreign file
        raise ValueError(f"{folder}: cannot read its TensorBoard event files ({type(exc).__name__}: {exc})") from None
    out: dict[str, dict[int, float]] = {}
    for tag in accumulator.Tags().get("scalars", []):
        points: dict[int, float] = {}
        for event in sorted(accumulator.Scalars(tag), key=lambda e: e.wall_time):  # the later write of a step wins
            points[int(event.step)] = float(event.value)
        out[tag] = points
    return out


def find_config(folder: Path) -> Path | None:
    """The run's config.yaml: in ``folder`` or up to ``CONFIG_DEPTH`` folders above it."""
    for candidate in [folder, *list(folder.parents)[:CONFIG_DEPTH]]:
        if (candidate / "config.yaml").is_file():
            return candidate / "config.yaml"
    return None


def _config(path: Path | None) -> dict:
    if path is None:
        return {"algo": {}}
    data = read_config(path)  # ValueError naming the file
    if not isinstance(data.get("algo"), dict):
        data["algo"] = {}
    return data


# openrlhf/trainer/ppo_trainer.py compute_eval_metrics (the pinned OpenRLHF): eval_{ds}_pass1, eval_{ds}_pass{n} (n > 1),
# written by logging_utils.py TensorboardLogger.log_eval under eval/
_EVAL_PASS = re.compile(r"eval/eval_(.+)_pass(\d+)")


def eval_curves(scalars: dict[str, dict[int, float]]) -> dict[str, dict]:
    """OpenRLHF's in-training evaluation as curves: datasource -> ``<ds>_in_training`` with each step's pass1 (no
    interval: OpenRLHF logs none) and n, the samples per prompt (from its pass<n> tag)."""
    found: dict[str, dict[int, int]] = {}
    for tag in scalars:
        m = _EVAL_PASS.fullmatch(tag)
        if m:
            found.setdefault(m.group(1), {})[int(m.group(2))] = 1
    curves = {}
    for ds, passes in sorted(found.items()):
        if 1 not in passes:
            continue
        n = max(passes)  # pass1 alone: one sample per prompt
        points = {step: {"value": v, "ci_low": None, "ci_high": None, "k": n}
                  for step, v in scalars[f"eval/eval_{ds}_pass1"].items() if math.isfinite(v)}
        if points:
            curves[f"{ds}_in_training"] = {"label": f"{ds} (in training)", "points": points}
    return curves


def load_tb_run(folder: Path):
    """A ``Run`` (as ``runs`` defines; ``algo`` None without a config.yaml) from the event files in
    ``folder``; ValueError when none of ``TB_TAGS``' tags is there."""
    from .runs import Run

    folder = Path(folder)
    scalars = read_scalars(folder)
    records: dict[int, dict] = {}
    for key, tags in TB_TAGS.items():
        tag = next((t for t in tags if t in scalars), None)
        if tag is None:
            continue
        for step, value in scalars[tag].items():
            if math.isfinite(value):
                records.setdefault(step, {"step": step})[key] = value
    curves = eval_curves(scalars)
    if not records:
        known = sorted({t for tags in TB_TAGS.values() for t in tags})
        raise ValueError(f"{folder}: its TensorBoard logs have none of the tags stare compare reads "
                         f"({', '.join(known)}); found {', '.join(sorted(scalars)) or 'no scalars'}")
    config_path = find_config(folder)
    config = _config(config_path)
    algo = config["algo"].get("name") if isinstance(config["algo"].get("name"), str) else None
    seed = (config.get("settings") or {}).get("seed") if isinstance(config.get("settings"), dict) else None
    return Run(path=folder, algo=algo, seed=seed, config=config, metrics=[records[s] for s in sorted(records)],
               eval=None, curves=curves)


def run_root(folder: Path) -> Path:
    """Where a TensorBoard run's own files live: the folder of its config.yaml, else the event folder."""
    config_path = find_config(Path(folder))
    return config_path.parent if config_path else Path(folder)
