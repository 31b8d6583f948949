"""The OpenRLHF backend: GPU presets run as Ray PPO jobs of the pinned OpenRLHF (``OPENRLHF_VERSION``), with
STARE plugged in.

- ``argv``: preset settings + algorithm -> the exact argument list for ``openrlhf.cli.train_ppo_ray`` and the
  STARE settings that travel to the workers in an environment variable (pure; no OpenRLHF import).
- ``data``: the training prompts file (problem + boxed-answer template + label) written before launch.
- ``reward``: the file OpenRLHF loads through ``--reward.remote_url`` (math-verify on the last boxed answer).
- ``plugin``: the plug-in's public names in one import (checks the OpenRLHF version), from the modules that
  reach into OpenRLHF: ``compat`` (every OpenRLHF name, after the version check), ``loss``, ``stats``, ``step``,
  ``checkpoint`` and ``actor`` (see ``plugin``'s docstring).
- ``launch``: the driver: Ray, plugin registration, then OpenRLHF's own CLI module.
"""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

# The one OpenRLHF release the plugin is written against. Checked by ``compat`` before it imports anything of
# OpenRLHF; here so that the CLI can name the error class without importing OpenRLHF.
OPENRLHF_VERSION = "0.11.2"


class OpenRLHFVersionError(RuntimeError):
    pass


class OpenRLHFMissing(OpenRLHFVersionError):
    """No OpenRLHF at all (``stare.cli.openrlhf_backend.train.install_hint`` says how to get it)."""


def check_openrlhf_version(found: str | None = None) -> str:
    """The installed OpenRLHF version; raises ``OpenRLHFVersionError`` unless it is exactly ``OPENRLHF_VERSION``."""
    if found is None:
        try:
            found = version("openrlhf")
        except PackageNotFoundError:
            raise OpenRLHFMissing(f"OpenRLHF is not installed; this build of stare plugs into "
                                  f"openrlhf=={OPENRLHF_VERSION}") from None
    if found != OPENRLHF_VERSION:
        raise OpenRLHFVersionError(
            f"stare's OpenRLHF plugin is written against openrlhf=={OPENRLHF_VERSION}, found {found}; "
            f"install openrlhf=={OPENRLHF_VERSION} (pip install 'openrlhf=={OPENRLHF_VERSION}')")
    return found
