"""Where the local engine computes: the ``device`` run setting (``cpu`` | ``cuda`` | ``auto``).

``cpu`` is every local preset's default: CPU arithmetic is deterministic, so the README's ``tiny-cpu`` figures
reproduce bit for bit and a resumed run ends exactly like an uninterrupted one. ``cuda`` trains, samples and
evaluates on the first visible GPU (results are close to, not bit-identical with, the CPU ones); ``auto`` is
``cuda`` when a GPU is visible and ``cpu`` otherwise. The choices are checked when the settings are resolved
(``stare.cli.presets``); whether a GPU is visible is checked by the CLI before any folder is written.
"""
from __future__ import annotations

import torch

from ..local_schema import DEVICES  # the names live with the settings' schema (which imports no torch)
DEFAULT = "cpu"  # run folders written before the setting existed ran on CPU


class DeviceError(ValueError):
    """The device a run asks for is not there (the CLI prints one line and exits with code 2)."""


def engine_device(settings: dict) -> torch.device:
    """The torch device of a local run's ``settings`` (``auto`` resolved on this machine)."""
    name = settings.get("device", DEFAULT)
    if name not in DEVICES:
        raise DeviceError(f"setting device: unknown value {name!r}; valid choices: {', '.join(DEVICES)}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise DeviceError("setting device: 'cuda' but no GPU is visible to torch (torch "
                          f"{torch.__version__}, CUDA build {torch.version.cuda or 'none'}); valid choices: "
                          f"{', '.join(DEVICES)} (cpu runs here)")
    return torch.device(name)
