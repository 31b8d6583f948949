"""Run folders: who owns a folder before anything is written to it.

- A training run's folder (``stare train``, one arm of ``stare run``, an OpenRLHF run) holds ``config.yaml``, the
  resolved settings: ``check_run_dir`` says, touching nothing, whether a folder can take a run (a new one, or the
  same run resumed); ``prepare_run_dir`` then creates it.
- A ``stare run`` folder holds ``run.yaml`` (the preset, arms and seeds) and one run folder per arm:
  ``check_run_set_dir`` and ``mark_run_set``.
- ``final_model``: the model a training run left, for ``stare eval --out RUN`` without ``--model``;
  ``saved_checkpoints``: the policies it kept along the way, for ``stare eval --out RUN --checkpoints``.

Every refusal is a ``RunDirError`` (a ValueError; the CLI prints it as one line and exits with code 2) that says
nothing was changed.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import struct
import zipfile
from pathlib import Path

import yaml

from stare.eval.jsonl import read_cut_jsonl

from .folder_lock import without_lock
from .presets import read_config

# the folders of a run, named once: its final model (both engines), an OpenRLHF run's checkpoints and TensorBoard
# logs, and an evaluation of its final model (``eval_dir``)
FINAL = "final"
CKPT = "ckpt"
TENSORBOARD = "tensorboard"
RUN_SET_MARKER = "run.yaml"


def eval_dir(run_dir: Path, bench: str) -> Path:
    """Where ``stare eval --out RUN`` (no --model) and ``stare run`` evaluate a run's final model on ``bench``."""
    return Path(run_dir) / f"eval-{bench}"


class RunDirError(ValueError):
    """The run directory cannot be used as asked (another run there, nothing to resume): exit code 2."""


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename (a reader never sees half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def check_run_dir(run_dir: Path, resolved: dict, resume: bool) -> bool:
    """Check, without touching anything, that ``run_dir`` can take this run.

    Returns True when the directory already holds this run (to be resumed). Raises ``RunDirError`` for another
    preset's or algorithm's run, a run started with other settings, an existing run without ``resume``,
    ``resume`` with nothing to resume, or a non-empty folder that is not a stare run.
    """
    config = run_dir / "config.yaml"
    if config.exists():
        try:
            old = read_config(config)
        except ValueError as exc:
            raise RunDirError(f"{exc}; use another --out (nothing was changed)") from None
        if old.get("preset") != resolved["preset"] or old.get("algo", {}).get("name") != resolved["algo"]["name"]:
            raise RunDirError(
                f"{run_dir} holds a run of preset {old.get('preset')!r} with algorithm "
                f"{old.get('algo', {}).get('name')!r}; use another --out (nothing was changed)")
        if not resume:
            raise RunDirError(f"{run_dir} already holds a run; pass --resume to continue it or use another --out "
                              "(nothing was changed)")
        changed = settings_changed(_comparable(old), _comparable(resolved))
        if changed:
            raise RunDirError(f"{run_dir} was started with other settings ({changed}); resume it with the same "
                              "--set values (see its config.yaml)")
        return True
    if resume:
        raise RunDirError(f"nothing to resume in {run_dir}: no config.yaml there")
    if run_dir.exists() and without_lock(run_dir.iterdir()):
        raise RunDirError(f"{run_dir} is not empty and holds no stare run; use another --out (nothing was changed)")
    return False


# local settings added after runs were made, with the value that gives those runs' behaviour (a folder from before
# them resumes when the new settings equal these)
LOCAL_SETTINGS_BEFORE = {"logits_to_keep": False, "same_batch_entropy": True, "keep_checkpoint_every": 0,
                         "eval_every": 0}


# the settings only ``stare run`` reads (which arms and seeds, which evaluations): nothing one arm's training sees
RUN_SET_SETTINGS = ("algos", "seeds", "benches", "eval_protocol")
# what a run may be resumed with changed, by section of its config: where it computes (a checkpoint saved on a GPU
# resumes on CPU), what stare run does around it (RUN_SET_SETTINGS), which steps' policies it keeps (files only), whether the Ray head it starts has a dashboard (nothing the training sees) and with which
# statistics kernel (the kernels differ only in rounding); folders from before these settings have none of them
RESUMABLE_CHANGES = {"settings": ("device", "ray_dashboard", "keep_checkpoint_every", *RUN_SET_SETTINGS),
                     "algo": ("stats_kernel",)}


def settings_changed(old: dict, new: dict, *, most: int = 3) -> str:
    """The keys whose values differ between two configs, as ``section.key: was OLD, now NEW`` (the first ``most``,
    then how many more); '' when they are equal."""
    diffs = _differences(old, new, "")
    more = f"; and {len(diffs) - most} more" if len(diffs) > most else ""
    return "; ".join(diffs[:most]) + more


_UNSET = object()


def _shown(value) -> str:
    return "unset" if value is _UNSET else repr(value)


def _differences(old: dict, new: dict, prefix: str) -> list[str]:
    out = []
    for key in sorted(set(old) | set(new), key=str):
        a, b = old.get(key, _UNSET), new.get(key, _UNSET)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: was {_shown(a)}, now {_shown(b)}")
    return out


def _comparable(config: dict) -> dict:
    """A run's config less ``RESUMABLE_CHANGES`` and the preset file's record; local settings newer than the
    folder read as ``LOCAL_SETTINGS_BEFORE``."""
    out = {**config, "settings": config.get("settings") or {}}
    out.pop("preset_file", None)  # a preset file may change (a comment, a moved file): the settings decide
    for section, keys in RESUMABLE_CHANGES.items():
        if isinstance(out.get(section), dict):
            out[section] = {k: v for k, v in out[section].items() if k not in keys}
    if config.get("backend") == "local":
        out["settings"] = {**LOCAL_SETTINGS_BEFORE, **out["settings"]}
    if isinstance(out.get("algo"), dict):  # algorithm settings newer than the folder read as their default (each new
        out["algo"] = {**_algo_defaults(), **out["algo"]}  # one is inert there: a rule's own, or a bonus off)
    return out


def _algo_defaults() -> dict:
    """Every algorithm setting's field default (``AlgoConfig``), less ``RESUMABLE_CHANGES``."""
    from dataclasses import MISSING, fields

    from stare.algorithms import AlgoConfig

    return {f.name: f.default for f in fields(AlgoConfig)
            if f.default is not MISSING and f.name not in RESUMABLE_CHANGES["algo"]}


def prepare_run_dir(run_dir: Path, resolved: dict, resume: bool) -> bool:
    """``check_run_dir``, then create the directory and its ``config.yaml`` for a new run."""
    existing = check_run_dir(run_dir, resolved, resume)
    if not existing:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(run_dir / "config.yaml", yaml.safe_dump(resolved, sort_keys=False))
    return existing


def check_run_set_dir(out: Path, preset: str) -> None:
    """A ``stare run`` output folder can take a run of ``preset``: it is new or empty, or it holds a run of the
    same preset (its finished arms are kept, the others resumed or started). ``RunDirError`` otherwise."""
    marker = Path(out) / RUN_SET_MARKER
    if marker.exists():
        try:
            old = read_config(marker)
        except ValueError as exc:
            raise RunDirError(f"{exc}; use another --out (nothing was changed)") from None
        if old.get("preset") != preset:
            raise RunDirError(f"{out} holds a run of preset {old.get('preset')!r}; use another --out "
                              "(nothing was changed)")
    elif Path(out).exists() and without_lock(Path(out).iterdir()):
        raise RunDirError(f"{out} is not empty and holds no stare run; use another --out (nothing was changed)")


def mark_run_set(out: Path, preset: str, arms: list[str], seeds: int) -> None:
    """Create the ``stare run`` folder and its ``run.yaml`` (once: a resumed run keeps the first one)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / RUN_SET_MARKER).exists():
        atomic_write(out / RUN_SET_MARKER, yaml.safe_dump({"preset": preset, "algos": arms, "seeds": seeds}))


def final_model(run_dir: Path) -> Path | None:
    """The final model of the training run in ``run_dir`` (its ``final/`` folder, loadable with from_pretrained),
    or None when ``run_dir`` is not a training run or has not finished."""
    run_dir = Path(run_dir)
    final = run_dir / FINAL
    if (run_dir / "config.yaml").exists() and (final / "config.json").exists():
        return final
    return None


# --- the policies a run kept along the way (stare eval --checkpoints) ----------------------------------------

KEPT = "checkpoints"  # a local run's checkpoints/step-<S>/ (local/trainer.py KEPT, setting keep_checkpoint_every)
OPENRLHF_CKPT = "ckpt"  # an OpenRLHF run's --ckpt.path (argv.build_launch); with --ckpt.save_hf it holds
# global_step<S>_hf/ per save (openrlhf/trainer/ray/ppo_actor.py save_checkpoint, in the pinned OpenRLHF)
_LOCAL_STEP = re.compile(r"step-(\d+)")
_OPENRLHF_STEP = re.compile(r"global_step(\d+)_hf")


def saved_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, model folder) of every policy a training run kept, by step: a local run's ``checkpoints/step-<S>/``
    and an OpenRLHF run's ``ckpt/global_step<S>_hf/`` (its ``best_global_step<S>_hf`` copies are the same steps
    again, left out). Only folders with a ``config.json`` count (a save cut short has none yet)."""
    run_dir = Path(run_dir)
    found: dict[int, Path] = {}
    for parent, pattern in ((run_dir / KEPT, _LOCAL_STEP), (run_dir / OPENRLHF_CKPT, _OPENRLHF_STEP)):
        if not parent.is_dir():
            continue
        for folder in parent.iterdir():
            m = pattern.fullmatch(folder.name)
            if m and (folder / "config.json").is_file():
                found.setdefault(int(m.group(1)), folder)
    return sorted(found.items())


# --- what a resume continues from ---------------------------------------------------------------------------

CHECKPOINT = "checkpoint"  # a local run's checkpoint folder (the local trainer writes it)
METRICS = "metrics.jsonl"


def read_jsonl(path: Path, *, what: str = "line") -> tuple[list[dict], bool]:
    """The records of a JSONL file that a kill may have cut: (records, whether the last line was cut and
    dropped). A line that is not JSON anywhere but at the end is ``RunDirError`` naming the file and the line."""
    return read_cut_jsonl(path, error=RunDirError, is_record=lambda r: isinstance(r, dict),
                          not_a_record="not a JSON object", what=what, skip_blank=True)


def safetensors_problem(path: Path) -> str | None:
    """Why a ``.safetensors`` file cannot be loaded (cut short, a bad header), read from its header alone."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"is {size} bytes, shorter than a header"
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                return f"is cut short ({size} bytes, its header alone says {n + 8})"
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        return f"has a corrupt header ({type(exc).__name__})"
    if size != 8 + n + end:
        return f"is cut short ({size} bytes of the {8 + n + end} its header lists)"
    return None


def torch_zip_problem(path: Path) -> str | None:
    """Why a ``torch.save`` file (a zip archive) cannot be loaded (cut short, no archive), without torch."""
    try:
        size = path.stat().st_size
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                if info.header_offset + info.compress_size > size:
                    return f"is cut short (its entry {info.filename} ends past the file)"
    except (OSError, zipfile.BadZipFile, ValueError) as exc:
        return f"is cut short or corrupt ({str(exc).splitlines()[0] or type(exc).__name__})"
    return None


def checkpoint_problem(folder: Path) -> str | None:
    """The first file of a local checkpoint folder that cannot be loaded, and why; None when it looks whole."""
    config = folder / "config.json"
    try:
        json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        return f"{config} cannot be read ({str(exc).splitlines()[0]})"
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        return f"{folder} holds no model weights (*.safetensors)"
    for w in weights:
        why = safetensors_problem(w)
        if why:
            return f"{w} {why}"
    state = folder / "trainer_state.pt"
    if not state.is_file():
        return f"{state} is missing"
    why = torch_zip_problem(state)
    return f"{state} {why}" if why else None


def check_resumable(run_dir: Path) -> None:
    """A local run folder's ``--resume`` can continue: ``metrics.jsonl`` has no corrupt line but a cut last one
    (which the trainer drops and redoes), and the checkpoint loads. ``RunDirError`` (one line naming the file, and
    the earlier checkpoint to resume from where one is kept) otherwise; nothing is changed either way."""
    run_dir = Path(run_dir)
    metrics = run_dir / METRICS
    if metrics.is_file():
        read_jsonl(metrics, what="step")
    ckpt, old = run_dir / CHECKPOINT, run_dir / (CHECKPOINT + ".old")
    earlier = ""
    if old.is_dir() and checkpoint_problem(old) is None:
        earlier = f"; an earlier checkpoint is kept: rename {old} to {ckpt} and resume again to continue from it"
    if not ckpt.exists():
        if earlier:  # a kill between the two renames of a save: only the earlier checkpoint is whole
            raise RunDirError(f"{ckpt} is missing (a save was cut){earlier}")
        return
    why = checkpoint_problem(ckpt)
    if why:
        raise RunDirError(f"{why}: the checkpoint cannot be resumed from{earlier or f'; remove {ckpt} to start this run again from step 0, or use another --out'} (nothing was changed)")


def remove_unstarted_run(run_dir: Path, existed: bool) -> None:
    """A new run that failed before its first checkpoint: remove what it wrote, so that nothing blocks a corrected
    retry in the same folder (a folder that was there, empty, stays; one made for the run goes)."""
    run_dir = Path(run_dir)
    if (run_dir / CHECKPOINT).exists() or not run_dir.is_dir():
        return
    for child in without_lock(run_dir.iterdir()):  # the lock is its holder's to remove (``folder_lock.hold``)
        if child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)
    if not existed:
        try:
            run_dir.rmdir()
        except OSError:  # the lock is still there: its holder removes the folder it made as it lets go
            pass
