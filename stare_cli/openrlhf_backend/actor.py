"""STARE in OpenRLHF's Ray policy actor: the one place where stare plugs into OpenRLHF's training (into its
sampling: ``rollouts``).

- ``register`` (in the driver) makes OpenRLHF's ``train_ppo_ray`` create ``StarePolicyModelActor`` wherever it
  creates its ``PolicyModelActor``.
- ``StarePolicyModelActor.init_model_from_pretrained``: after OpenRLHF has built the model, optimizer and trainer,
  ``install`` turns the trainer into a ``StareActorTrainer`` with a ``stare`` attribute (``step.StareStep``) and its
  parsed ``PolicyLoss`` into a ``StarePolicyLoss`` (same settings: clip low/high, dual clip, token-level loss, GSPO,
  importance-sampling correction); when resuming, the controller's state is loaded and the position OpenRLHF's
  trainer restarts at is corrected (``checkpoint.resume_position``: a step that ended its episode).
- ``StarePolicyModelActor.forward`` is OpenRLHF's old-log-prob forward, which also stashes the statistics
  (``stats.Stash.old_log_probs``); ``save_checkpoint`` also writes the controller's state (``checkpoint``).
- ``StareActorTrainer`` overrides OpenRLHF's ``ppo_train`` and ``training_step`` only to hand them to
  ``trainer.stare``.
- ``use_chunked_entropy`` (called by ``install``, so in every policy worker): OpenRLHF's ``Actor.forward(...,
  return_entropy=True)``, the entropy bonus's forward, computes the entropy with
  ``stare.algorithms.entropy_bonus.chunked_entropy`` instead of OpenRLHF's ``compute_entropy``: the same value and
  gradient, with temporaries bounded by a chunk of rows whatever the compiler does (OpenRLHF's ``torch.compile``d
  function made one ``[tokens, V]`` float32 temporary in its forward on the CPU), no compilation, and float32's
  accuracy at any logit offset (docs/openrlhf-backend.md, the entropy bonus under "What the plugin does").
"""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from stare.algorithms import AlgoConfig
from stare.algorithms.entropy_bonus import chunked_entropy

from .argv import SETTINGS_ENV
from .checkpoint import load_stare_state, resume_position, save_stare_state
from .compat import ActorPPOTrainer, merge_mm_train_inputs, models_actor, ppo_actor
from .loss import StarePolicyLoss
from .step import StareStep


def load_settings(environ=None) -> tuple[AlgoConfig, str]:
    """The algorithm settings the driver put into ``STARE_SETTINGS`` (validated), and the run's name."""
    environ = os.environ if environ is None else environ
    raw = environ.get(SETTINGS_ENV)
    if not raw:
        raise RuntimeError(f"{SETTINGS_ENV} is not set: launch OpenRLHF through `stare train` or "
                           "`python -m stare.cli.openrlhf_backend.launch`, which set it for every worker")
    data = json.loads(raw)
    return AlgoConfig(**data["algo"]).validate(), data.get("run", "")


class StareActorTrainer(ActorPPOTrainer):
    """OpenRLHF's ``ActorPPOTrainer`` with STARE (``self.stare``). Never constructed: ``install`` re-classes
    OpenRLHF's own."""

    stare: StareStep

    def ppo_train(self, kl_ctl: float):
        return self.stare.ppo_train(super().ppo_train, kl_ctl)

    def training_step(self, experience, kl_ctl, step, loss_batch_info=None):
        return self.stare.training_step(super().training_step, experience, kl_ctl, step, loss_batch_info)


def use_chunked_entropy() -> None:
    """Point OpenRLHF's ``Actor.forward`` at ``chunked_entropy`` for the entropy it computes with
    ``return_entropy=True`` (every training micro-batch when ``--actor.entropy_coef`` is set).

    ``openrlhf.models.actor`` imported ``compute_entropy`` by name, and ``Actor.forward`` looks that name up in its
    module at each call, so rebinding the module's name is the whole swap (this process only; idempotent).
    ``openrlhf.models.utils.compute_entropy`` itself stays OpenRLHF's."""
    models_actor.compute_entropy = chunked_entropy


def install(actor_host, environ=None) -> StareActorTrainer:
    """Turn an OpenRLHF policy actor's trainer and loss into STARE's (after ``init_model_from_pretrained``), and
    its entropy bonus's entropy into the chunked one (``use_chunked_entropy``)."""
    cfg, _ = load_settings(environ)
    use_chunked_entropy()
    trainer = actor_host.trainer
    trainer.__class__ = StareActorTrainer
    trainer.actor_loss_fn = StarePolicyLoss.from_parsed(trainer.actor_loss_fn, unclipped=cfg.rule.unclipped)
    trainer.stare = StareStep(trainer, cfg)
    return trainer


_BasePolicyActor = ppo_actor.PolicyModelActor.__ray_actor_class__  # the class behind OpenRLHF's remote actor


class StarePolicyModelActor(_BasePolicyActor):
    """OpenRLHF's policy actor (the class behind ``PolicyModelActor``) with STARE installed."""

    def init_model_from_pretrained(self, strategy, pretrain, max_steps=None, vllm_engines=None):
        super().init_model_from_pretrained(strategy, pretrain, max_steps, vllm_engines)
        trainer = install(self)
        args = strategy.args
        if args.ckpt.load_enable:
            tag = load_stare_state(trainer, args.ckpt.path)
            if tag is not None:
                strategy.print(f"STARE: controller state restored from checkpoint {tag}")
            # what the trainer's fit() restarts from (get_checkpoint_states returns it)
            self.checkpoint_states, note = resume_position(self.checkpoint_states or {})
            if note:
                strategy.print(note)

    def forward(self, sequences, action_mask=None, attention_mask=None, packed_seq_lens=None,
                mm_train_inputs_list=None):
        """OpenRLHF's old-log-prob forward (same inputs, same output), which also stashes each sample's
        entropy and Phi for this step's ``ppo_train`` (``stats.Stash.old_log_probs``)."""
        trainer = getattr(self, "trainer", None)
        if not isinstance(trainer, StareActorTrainer):
            return super().forward(sequences, action_mask, attention_mask, packed_seq_lens, mm_train_inputs_list)
        device = torch.cuda.current_device()
        mm_inputs = {}
        if mm_train_inputs_list and getattr(self.actor, "is_vlm", False):
            mm_inputs = merge_mm_train_inputs(mm_train_inputs_list, device)
        self.actor.eval()
        with torch.no_grad():
            action_log_probs = trainer.stare.stash.old_log_probs(sequences.to(device), action_mask.to(device),
                                                                 attention_mask.to(device), **mm_inputs)
        self.actor.train()  # reset model state, as OpenRLHF does
        return action_log_probs.to("cpu")

    def save_checkpoint(self, tag, client_states=None, metric_value=None, metric_key=None):
        super().save_checkpoint(tag, client_states, metric_value, metric_key)
        if not dist.is_initialized() or dist.get_rank() == 0:
            args = self.strategy.args
            save_stare_state(self.trainer, args.ckpt.path, tag, args.ckpt.max_num, client_states)


def register() -> None:
    """Make OpenRLHF's driver create ``StarePolicyModelActor`` wherever it creates ``PolicyModelActor``."""
    import ray

    ppo_actor.PolicyModelActor = ray.remote(num_gpus=1)(StarePolicyModelActor)
