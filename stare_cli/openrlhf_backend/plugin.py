"""STARE inside the pinned OpenRLHF (``OPENRLHF_VERSION``): the plug-in's public names, in one import.

Importing this module checks the installed OpenRLHF version (``compat``) and imports OpenRLHF's trainer, which is how
``stare train`` checks the training stack before it starts. The code lives in one module per job, each importing
OpenRLHF's names from ``compat`` only:

- ``compat``: every name taken from OpenRLHF, after the version check (upgrading OpenRLHF starts there);
- ``loss``: ``StarePolicyLoss``, OpenRLHF's loss with a weight and a KL-Cov penalty per token;
- ``stats``: each sample's entropy and Phi from OpenRLHF's own old-log-prob forward, stashed by a key of its tokens,
  found again (or exchanged between ranks, or recomputed in lockstep) once per step;
- ``step``: ``StareStep``, the trainer's ``stare`` attribute: the controller and the once-per-step block (the
  controller update, the weights over the whole step, telemetry), and each micro-batch's weights for the loss;
- ``checkpoint``: the controller's state beside OpenRLHF's checkpoints;
- ``actor``: OpenRLHF's Ray policy actor and trainer with STARE installed;
- ``rollouts`` and ``engine``: seeded rollouts (the ``seeded_rollouts`` setting): OpenRLHF's trainer actor, whose
  samples generator seeds every request and hands a step's groups on in draw order, and its vLLM engine actor, which
  gives each sample of a group its own seed.

``register`` (in the driver, before OpenRLHF's ``train_ppo_ray`` runs) makes OpenRLHF build all three actors as
stare's.
"""
from __future__ import annotations

from . import OPENRLHF_VERSION, OpenRLHFVersionError, check_openrlhf_version  # noqa: F401
from . import compat  # noqa: F401  (the version check, before any OpenRLHF import)
from . import actor, rollouts
from .actor import StareActorTrainer, StarePolicyModelActor, install, load_settings  # noqa: F401
from .checkpoint import load_stare_state, save_stare_state, stare_state_dir  # noqa: F401
from .engine import StareRolloutActor  # noqa: F401
from .loss import StarePolicyLoss  # noqa: F401
from .rollouts import StarePPOTrainer, StareSamplesGenerator  # noqa: F401
from .step import UID_KEY, StareStep  # noqa: F401


def register() -> None:
    """Make OpenRLHF's driver create stare's policy actor (``actor.register``), trainer actor and vLLM engine actor
    (``rollouts.register``) wherever it creates its own."""
    actor.register()
    rollouts.register()
