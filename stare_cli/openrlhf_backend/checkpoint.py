"""The controller's state next to OpenRLHF's checkpoints: ``<ckpt.path>/stare/<tag>.json``.

OpenRLHF's checkpoints hold the model, optimizer and scheduler (DeepSpeed's), not STARE's controller, so the policy
actor writes the controller's state (``StareStep.state_dict``) beside each checkpoint on rank 0 and, when OpenRLHF
resumes, reads back the one whose tag DeepSpeed resumes from.
"""
from __future__ import annotations

import json
import os
from pathlib import Path


def stare_state_dir(ckpt_path: str) -> Path:
    return Path(ckpt_path) / "stare"


def save_stare_state(trainer, ckpt_path: str, tag: str, keep: int) -> Path:
    """Write the controller state of ``trainer.stare`` for checkpoint ``tag``, keep the newest ``keep``."""
    d = stare_state_dir(ckpt_path)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{tag}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(trainer.stare.state_dict(), indent=1))
    os.replace(tmp, path)
    (d / "latest").write_text(tag)
    files = sorted(d.glob("*.json"), key=lambda p: p.stat().st_mtime)
    for old in files[: max(0, len(files) - max(1, keep))]:
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
