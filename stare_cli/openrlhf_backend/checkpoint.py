"""What a resumed OpenRLHF run starts from: the controller's state beside OpenRLHF's checkpoints
(``<ckpt.path>/stare/<tag>.json``), and the position in the prompt stream that OpenRLHF restarts at.

OpenRLHF's checkpoints hold the model, optimizer and scheduler (DeepSpeed's), not STARE's controller, so the policy
actor writes the controller's state (``StareStep.state_dict``) beside each checkpoint on rank 0 and, when OpenRLHF
resumes, reads back the one whose tag DeepSpeed resumes from.

``resume_position`` corrects the episode the pinned OpenRLHF restarts at when the saved step was the one that emptied
the prompt loader (with dynamic filtering, the usual case at the end of an episode); see its docstring.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from . import compat


def stare_state_dir(ckpt_path: str) -> Path:
    return Path(ckpt_path) / "stare"


def save_stare_state(trainer, ckpt_path: str, tag: str, keep: int, client_states: dict | None = None) -> Path:
    """Write the controller state of ``trainer.stare`` for checkpoint ``tag`` (just saved by OpenRLHF), and keep the
    states of exactly the checkpoints OpenRLHF kept: its rotation (``DeepspeedStrategy.save_ckpt``) is its own,
    keeping ``max_num`` of them by metric first and age second, and protecting ``best*`` ones, so the newest
    ``keep`` states could belong to checkpoints it deleted while the ones it kept lose theirs. Without DeepSpeed
    checkpoints (no ``_actor/``), the newest ``keep``. With ``client_states`` (what OpenRLHF's trainer saves with the
    checkpoint), also where in the prompts the run is (``position``), for ``stare train --resume`` to say before it
    starts."""
    d = stare_state_dir(ckpt_path)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{tag}.json"
    tmp = path.with_suffix(".json.tmp")
    state = trainer.stare.state_dict()
    if client_states:
        state["position"] = position(client_states)
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, path)
    (d / "latest").write_text(tag)
    ds_dir = Path(ckpt_path) / "_actor"  # DeepSpeed's checkpoints, one folder per tag
    if ds_dir.is_dir():
        kept = {p.name for p in ds_dir.iterdir() if p.is_dir()}  # the new tag among them: it was just saved
        stale = [p for p in d.glob("*.json") if p.stem not in kept]
    else:
        files = sorted(d.glob("*.json"), key=lambda p: p.stat().st_mtime)
        stale = files[: max(0, len(files) - max(1, keep))]
    for old in stale:
        old.unlink(missing_ok=True)
    return path


def load_stare_state(trainer, ckpt_path: str) -> str | None:
    """Restore into ``trainer.stare`` the controller state that matches the DeepSpeed checkpoint OpenRLHF resumes
    from; its tag, or None when there is none."""
    d = stare_state_dir(ckpt_path)
    latest_ds = Path(ckpt_path) / "_actor" / "latest"  # DeepSpeed's tag file
    tag = latest_ds.read_text().strip() if latest_ds.exists() else None
    if tag is None and (d / "latest").exists():
        tag = (d / "latest").read_text().strip()
    if tag is None or not (d / f"{tag}.json").exists():
        return None
    trainer.stare.load_state_dict(json.loads((d / f"{tag}.json").read_text()))
    return tag


def position(client_states: dict) -> dict:
    """Where a checkpoint stands in the prompts: its step, OpenRLHF's episode (counted from 0), the prompts drawn
    so far, and whether the step ended its episode (the prompt loader ran dry inside it)."""
    loader = client_states.get(compat.CLIENT_LOADER_STATE) or {}
    return {"global_step": client_states.get(compat.CLIENT_GLOBAL_STEP),
            "episode": client_states.get(compat.CLIENT_EPISODE),
            "prompts_consumed": client_states.get(compat.CLIENT_CONSUMED_PROMPTS),
            "episode_ended": loader.get(compat.LOADER_FINISHED)}


def describe_resume(ckpt_path, seeded_rollouts: bool = True) -> str:
    """One line for ``stare train --resume``, before anything starts: the checkpoint OpenRLHF will load and where
    it stands, and what becomes of the rollouts of a step that had not reached its checkpoint: drawn again with
    the same seeds (``seeded_rollouts``, ``rollouts``), or sampled anew (off)."""
    tag_file = Path(ckpt_path) / "_actor" / "latest"  # DeepSpeed's
    if not tag_file.exists():
        return "no OpenRLHF checkpoint yet: training starts from step 0"
    tag = tag_file.read_text().strip()
    line = f"resuming from checkpoint {tag}"
    state_file = stare_state_dir(ckpt_path) / f"{tag}.json"
    try:
        pos = json.loads(state_file.read_text()).get("position") or {}
    except (OSError, ValueError):
        pos = {}
    if pos.get("episode") is not None:
        line += f" (episode {pos['episode'] + 1}, {pos['prompts_consumed']} prompts drawn"
        line += "; the episode had ended, so the next one starts)" if pos.get("episode_ended") else ")"
    if seeded_rollouts:
        return line + ("; a step past it is trained again from the same prompts with the same rollout seeds (the same "
                       "rollouts where the engine's arithmetic repeats: docs/openrlhf-backend.md, Resume)")
    return line + ("; a step past it is trained again from the same prompts, its rollouts sampled anew "
                   "(seeded_rollouts is off)")


def resume_position(states: dict) -> tuple[dict, str | None]:
    """The ``client_states`` OpenRLHF's ``PPOTrainer.fit`` should restart from, and a line saying what was changed
    (None: nothing).

    ``fit`` saves, after each step, the episode the step ran in and the prompt loader's state. When the loader ran
    dry inside that step (with dynamic filtering, a filtered group's replacement draw finds no prompt left), the
    step was the episode's last: the uninterrupted loop leaves the episode right after saving. The saved episode is
    still that one, so a resumed ``fit`` runs it again, and the loader, loaded in its finished state, serves it a
    whole new pass over the prompts: one episode too many, with the learning-rate schedule and the controller one
    episode further along at every later step. The position to resume at is the next episode, with the loader
    state as saved: torchdata's loader, loaded finished, starts its next pass from the shuffling generator the
    finished pass left, which is the pass the uninterrupted run draws next.

    A checkpoint whose loader had not run dry (the episode's end was found by the next step's first draw, which
    saves nothing) is right as it is. A loader state without the finished flag (another loader) is left alone,
    and said so.
    """
    loader = states.get(compat.CLIENT_LOADER_STATE) or {}
    if not loader:
        return states, None
    if compat.LOADER_FINISHED not in loader:
        return states, (f"STARE: cannot tell whether checkpoint step {states.get(compat.CLIENT_GLOBAL_STEP)} ended "
                        f"its episode (the prompt loader's state has no {compat.LOADER_FINISHED!r}); resuming "
                        "where OpenRLHF saved, which may repeat an episode")
    if not loader[compat.LOADER_FINISHED]:
        return states, None
    episode = states[compat.CLIENT_EPISODE]
    fixed = {**states, compat.CLIENT_EPISODE: episode + 1}
    return fixed, (f"STARE: checkpoint step {states.get(compat.CLIENT_GLOBAL_STEP)} was the last of episode "
                   f"{episode + 1} (its prompts ran out inside the step); resuming at episode {episode + 2}")
