"""Every name stare takes from OpenRLHF, in one place, imported only after the version check.

Upgrading OpenRLHF starts here: change ``OPENRLHF_VERSION`` (in ``stare.cli.openrlhf_backend``, with pyproject.toml and
the Dockerfile: a test keeps them equal), then read each name below against the new release, and the modules that use
it. On any other installed version, importing this module raises ``OpenRLHFVersionError`` saying which one is wanted.

Each name is imported from its module on first use. The agent (``stare.cli.agent.python_agent``) runs inside vLLM's
rollout actor, where OpenRLHF keeps its trainer (and DeepSpeed) out; importing ``AgentInstanceBase`` from here imports
``openrlhf.utils.agent`` only, while the trainer side gets the trainer's modules when it asks for their names.
"""
from __future__ import annotations

import importlib

from . import OPENRLHF_VERSION, OpenRLHFVersionError, check_openrlhf_version  # noqa: F401 (re-exported)

check_openrlhf_version()

# the module ``launch`` runs as ``__main__`` (OpenRLHF's Ray PPO driver)
TRAIN_MODULE = "openrlhf.cli.train_ppo_ray"

# name -> (module, attribute); attribute None: the module itself
_NAMES = {
    # loss.py: OpenRLHF's policy loss, and its aggregation for KL-Cov's term
    "PolicyLoss": ("openrlhf.models", "PolicyLoss"),
    "aggregate_loss": ("openrlhf.models", "aggregate_loss"),
    # stats.py: the statistics' forward reads the logits the way Actor.forward lays them out (packing, ring
    # attention), and the extra pass collates buffer items as ppo_train does
    "unpad_and_slice_tensor": ("openrlhf.models.ring_attn_utils", "unpad_and_slice_tensor"),
    "get_tensor_in_current_ring_attn_rank": ("openrlhf.models.ring_attn_utils", "get_tensor_in_current_ring_attn_rank"),
    "gather_and_pad_tensor": ("openrlhf.models.ring_attn_utils", "gather_and_pad_tensor"),
    "make_experience_batch": ("openrlhf.trainer.ppo_utils.experience", "make_experience_batch"),
    # actor.py: the trainer, and the module whose ``PolicyModelActor`` the actor subclasses and ``register`` replaces
    "ppo_actor": ("openrlhf.trainer.ray.ppo_actor", None),
    "ActorPPOTrainer": ("openrlhf.trainer.ray.ppo_actor", "ActorPPOTrainer"),
    "merge_mm_train_inputs": ("openrlhf.trainer.ray.ppo_actor", "merge_mm_train_inputs"),
    # actor.py: the module of OpenRLHF's ``Actor``, whose forward calls ``compute_entropy`` by this module's global
    # name (the entropy bonus); ``use_chunked_entropy`` points that name at stare's chunked version
    "models_actor": ("openrlhf.models.actor", None),
    # rollouts.py: the single-controller trainer (a Ray actor) that owns the SamplesGenerator, which draws the
    # prompts and sends each to a vLLM engine; engine.py: the module of the rollout engine actor (``RolloutRayActor``,
    # created by ``create_vllm_engines`` by this module's global name, which ``rollouts.register`` replaces)
    "ppo_trainer": ("openrlhf.trainer.ppo_trainer", None),
    "SamplesGenerator": ("openrlhf.trainer.ppo_utils.samples_generator", "SamplesGenerator"),
    "vllm_engine": ("openrlhf.trainer.ray.vllm_engine", None),
    # agent/python_agent.py: the multi-turn agent's base classes
    "AgentInstanceBase": ("openrlhf.utils.agent", "AgentInstanceBase"),
    "MultiTurnAgentExecutor": ("openrlhf.utils.agent", "MultiTurnAgentExecutor"),
}


# Keys of the ``client_states`` dict that ``PPOTrainer.fit`` (openrlhf/trainer/ppo_trainer.py) saves with every
# checkpoint and restarts from, and the key of the prompt loader's state (torchdata's ``StatefulDataLoader``, the
# loader ``DeepspeedStrategy.setup_dataloader`` builds) that says the loader ran dry. checkpoint.resume_position reads
# them to start a resumed run where the uninterrupted one goes on (docs/openrlhf-backend.md, "Resume").
CLIENT_EPISODE = "episode"
CLIENT_GLOBAL_STEP = "global_step"
CLIENT_CONSUMED_PROMPTS = "total_consumed_prompts"
CLIENT_LOADER_STATE = "data_loader_state_dict"
LOADER_FINISHED = "_iterator_finished"


def __getattr__(name: str):
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _NAMES[name]
    value = importlib.import_module(module)
    if attribute is not None:
        value = getattr(value, attribute)
    globals()[name] = value  # later look-ups skip this function
    return value
