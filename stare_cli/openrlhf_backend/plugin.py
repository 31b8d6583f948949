"""STARE inside OpenRLHF 0.11.2: the one module that reaches into OpenRLHF's internals.

Upgrading OpenRLHF means reading this file against the new version and changing ``OPENRLHF_VERSION``.
Importing it on any other version fails with a message that says so.

How it plugs in (one seam: OpenRLHF's Ray policy actor):

- ``StarePolicyModelActor`` subclasses the class behind OpenRLHF's ``PolicyModelActor``. After OpenRLHF has
  built the model, optimizer and trainer, it turns the trainer into a ``StareActorTrainer`` and the trainer's
  parsed ``PolicyLoss`` into a ``StarePolicyLoss`` (same settings: clip low/high, dual clip, token-level
  loss, GSPO, importance-sampling correction), and loads the controller's state when resuming.
- ``StareActorTrainer.ppo_train`` runs once per RL step over the step's whole replay buffer *before* any
  update: one no-grad forward of the (still old) policy gives each response token's entropy and Phi in
  chunks (``stare.algorithms.entropy_sensitivity``; never OpenRLHF's full-vocabulary entropy with
  gradient), the controller is updated once from the batch entropy all-reduced over the data-parallel group
  (so every rank takes the same decision), and ``stare_token_weights`` selects tokens over the whole step's
  batch from the old log-probs (exact across ranks via its distributed selection). Then OpenRLHF's own
  ``ppo_train`` runs; ``training_step`` looks up each micro-batch's weights by a per-sample id carried in
  ``experience.info`` and hands them to the loss. With ``scope: micro_batch`` the weights are instead chosen
  inside each micro-batch (the reference implementation's rule).
- ``StarePolicyLoss`` multiplies each token's loss by its weight. Every term of OpenRLHF's per-token loss
  (-min(r A, clip(r) A), the dual-clip bound c A, the IS-correction factor) is positively homogeneous in the
  advantage A, so the loss of A * w is exactly w times the loss of A for w > 0, with the same clip
  statistics: scaling the advantage is how the weight is applied, without re-implementing OpenRLHF's loss.
  Weights of None (gate off, or a baseline) call OpenRLHF's loss unchanged.
- Telemetry goes into the status dict ``fit`` returns, which OpenRLHF logs as ``train/<key>`` (W&B,
  TensorBoard): the names of ``stare.algorithms.METRICS``, from ``stare_step``, the block the local engine runs
  too (all but ``stare/entropy_change_same_batch``, which would cost a second forward over the buffer).
- The controller's state is written next to OpenRLHF's checkpoints (``<ckpt.path>/stare/<tag>.json``) and
  read back when OpenRLHF resumes from that tag.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from . import OPENRLHF_VERSION, OpenRLHFVersionError, check_openrlhf_version  # noqa: F401 (re-exported)

check_openrlhf_version()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from openrlhf.models import PolicyLoss  # noqa: E402
from openrlhf.trainer.ppo_utils.experience import make_experience_batch  # noqa: E402
from openrlhf.trainer.ray import ppo_actor as _ppo_actor  # noqa: E402

from stare.algorithms import (  # noqa: E402
    AlgoConfig,
    EntropyStats,
    StepMemory,
    entropy_sensitivity,
    reweight_stats,
    stare_step,
    stare_token_weights,
)

from .argv import SETTINGS_ENV  # noqa: E402

ActorPPOTrainer = _ppo_actor.ActorPPOTrainer
_BasePolicyActor = _ppo_actor.PolicyModelActor.__ray_actor_class__
UID_KEY = "stare_uid"  # per-sample id carried through OpenRLHF's collation in experience.info


def load_settings(environ=None) -> tuple[AlgoConfig, str]:
    """The algorithm settings the driver put into ``STARE_SETTINGS`` (validated)."""
    environ = os.environ if environ is None else environ
    raw = environ.get(SETTINGS_ENV)
    if not raw:
        raise RuntimeError(f"{SETTINGS_ENV} is not set: launch OpenRLHF through `stare train` or "
                           "`python -m stare.cli.openrlhf_backend.launch`, which set it for every worker")
    data = json.loads(raw)
    return AlgoConfig(**data["algo"]).validate(), data.get("run", "")


# --------------------------------------------------------------------------------------------------
# The loss
# --------------------------------------------------------------------------------------------------


class StarePolicyLoss(PolicyLoss):
    """OpenRLHF's ``PolicyLoss`` with a per-token weight (``token_weights``, set per micro-batch)."""

    token_weights: torch.Tensor | None = None

    @classmethod
    def from_parsed(cls, loss: PolicyLoss) -> "StarePolicyLoss":
        """The same loss with every setting OpenRLHF parsed (a copy of its attributes)."""
        new = cls.__new__(cls)
        new.__dict__.update(loss.__dict__)
        new.token_weights = None
        return new

    def forward(self, log_probs, old_log_probs, advantages, action_mask=None, *args, **kwargs):
        w = self.token_weights
        if w is not None:
            if w.shape != advantages.shape:
                raise ValueError(f"STARE weights {tuple(w.shape)} do not match the advantages {tuple(advantages.shape)}")
            # w > 0 holds by construction (W, M and damp are validated > 0); no host read here, the loss
            # runs once per micro-batch and must not synchronise
            advantages = advantages * w.to(device=advantages.device, dtype=advantages.dtype)
        return super().forward(log_probs, old_log_probs, advantages, action_mask, *args, **kwargs)


# --------------------------------------------------------------------------------------------------
# The trainer: once-per-step selection and controller
# --------------------------------------------------------------------------------------------------


def _pad_rows(rows: list[torch.Tensor], width: int, fill=0) -> torch.Tensor:
    out = torch.full((len(rows), width), fill, dtype=rows[0].dtype, device=rows[0].device)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out


class StareActorTrainer(ActorPPOTrainer):
    """OpenRLHF's ``ActorPPOTrainer`` with STARE. Never constructed: ``install`` re-classes OpenRLHF's own."""

    def stare_setup(self, cfg: AlgoConfig) -> None:
        self.stare_cfg = cfg
        self.stare_controller = cfg.make_controller()
        self.stare_state = None  # this step's ControllerState
        self.stare_prev = {"entropy": None, "forecast": None}  # for the measured-vs-predicted change
        # uid -> (weights row: global scope with the gate on, phi row: micro_batch scope), on the device
        self._stare_rows: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]] = {}

    # ---- distributed helpers --------------------------------------------------------------------
    def _stare_group(self):
        if not (dist.is_available() and dist.is_initialized()):
            return None
        mesh = getattr(self.strategy, "ds_device_mesh", None)
        return mesh["dp"].get_group() if mesh is not None else dist.group.WORLD

    def _stare_all_reduce(self, t: torch.Tensor, op=None) -> torch.Tensor:
        group = self._stare_group()
        if group is not None:
            dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=group)
        return t

    def _stare_device(self) -> torch.device:
        return next(self.actor.model.parameters()).device

    # ---- the old policy's entropy and Phi, in one no-grad pass ----------------------------------
    @torch.no_grad()
    def _stare_old_policy_stats(self, items) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(entropy, phi) per buffer item over its action positions, from the current (= old) policy, on the
        training device."""
        groups: list[list[int]] = []
        if self.args.train.dynamic_batch_enable:
            # Token-budget groups, by length so padding stays small. The logits come back padded to
            # [B, T_max, V] next to the packed copy, so each group's B x T_max is held to half the budget:
            # the peak then stays near that of OpenRLHF's own packed forward at the full budget.
            budget = max(1, int(self.args.train.max_tokens_per_gpu) // 2)
            longest = 0
            for i in sorted(range(len(items)), key=lambda j: int(items[j].sequences.shape[0])):
                n = int(items[i].sequences.shape[0])
                if groups and (len(groups[-1]) + 1) * max(longest, n) <= budget:
                    groups[-1].append(i)
                    longest = max(longest, n)
                else:
                    groups.append([i])
                    longest = n
        else:
            size = max(1, int(self.micro_train_batch_size))
            groups = [list(range(i, min(i + size, len(items)))) for i in range(0, len(items), size)]
        device = self._stare_device()
        # ZeRO-3 gathers parameters inside forward: every rank must run the same number of forwards.
        n_passes = int(self._stare_all_reduce(torch.tensor([len(groups)], device=device), dist.ReduceOp.MAX
                                              if dist.is_available() else None).item())
        out: list = [None] * len(items)
        was_training = self.actor.training
        self.actor.eval()
        try:
            for p in range(n_passes):
                if not groups:  # nothing on this rank (OpenRLHF's own step would not run either)
                    break
                idx = groups[min(p, len(groups) - 1)]  # past the end: repeat the last one, for lockstep
                exp = make_experience_batch([items[i] for i in idx], self.args.ds.packing_samples)
                exp.to_device(device)
                output = self.actor(exp.sequences, None, attention_mask=exp.attention_mask, return_output=True,
                                    allgather_logits=True, ring_attn_group=self.strategy.ring_attn_group)
                width = exp.action_mask.shape[1]
                logits = output["logits"][:, :-1][:, -width:]  # already at the rollout temperature
                actions = exp.sequences[:, 1:][:, -width:]
                stats = entropy_sensitivity(logits, actions)
                del output, logits
                if p >= len(groups):
                    continue  # a padding pass for collective lockstep
                for row, i in enumerate(idx):
                    n = items[i].action_mask.shape[0]
                    out[i] = (stats.entropy[row, :n], stats.phi[row, :n])
        finally:
            self.actor.train(was_training)
        return out

    # ---- once per step --------------------------------------------------------------------------
    def stare_prepare_step(self) -> dict[str, float]:
        """Entropy, controller and (global scope) weights for the step in the replay buffer; telemetry."""
        cfg = self.stare_cfg
        items = self.replay_buffer.items
        for uid, item in enumerate(items):
            item.info[UID_KEY] = uid
        device = self._stare_device()
        stats = self._stare_old_policy_stats(items)
        self._stare_rows = {}
        if items:
            width = max(it.action_mask.shape[0] for it in items)
            mask = _pad_rows([it.action_mask.to(device) for it in items], width, 0).bool()
            logp = _pad_rows([it.action_log_probs.to(device).float() for it in items], width, 0.0)
            adv = _pad_rows([it.advantages.to(device).float() for it in items], width, 0.0)
            ent = _pad_rows([s[0] for s in stats], width, 0.0)
            phi = _pad_rows([s[1] for s in stats], width, 0.0)
        else:  # a rank with an empty buffer still joins every collective in stare_step
            mask = torch.zeros(1, 1, dtype=torch.bool, device=device)
            logp = adv = ent = phi = torch.zeros(1, 1, device=device)
        # the shared once-per-step block: batch entropy all-reduced, controller, (global scope) weights exact
        # across ranks, telemetry; with scope micro_batch the weights are chosen in _stare_batch_weights
        step = stare_step(self.stare_controller, cfg, logp, adv, mask, EntropyStats(ent, -logp, phi),
                          memory=StepMemory(**self.stare_prev), group=self._stare_group())
        self.stare_state = step.state
        self.stare_prev = step.memory.as_dict()
        weights = step.weights

        keep_phi = cfg.scope == "micro_batch"
        for uid, item in enumerate(items):
            n = item.action_mask.shape[0]
            self._stare_rows[uid] = (weights[uid, :n] if weights is not None else None,
                                     phi[uid, :n] if keep_phi else None)
        return step.metrics

    def _stare_batch_weights(self, experience, uids) -> torch.Tensor | None:
        """This micro-batch's weights [B, A] (None: every weight is 1)."""
        state = self.stare_state
        if self.stare_controller is None or state is None or not state.gate_on or uids is None:
            return None
        width = experience.action_mask.shape[1]
        device = experience.action_mask.device
        uids = [int(u) for u in uids.tolist()]
        if self.stare_cfg.scope == "global":
            rows = [self._stare_rows[u][0] for u in uids]
            if any(r is None for r in rows):
                return None
            return _pad_rows([r.to(device) for r in rows], width, 1.0)
        # the reference's rule: select inside this micro-batch only
        phi = _pad_rows([self._stare_rows[u][1].to(device) for u in uids], width, 0.0)
        weights = stare_token_weights(experience.action_log_probs.detach().float(),
                                      experience.advantages.float(), experience.action_mask, phi=phi,
                                      **self.stare_cfg.selection_kwargs(), **state.weight_kwargs())
        experience.info["stare/micro_batch_mean_weight"] = reweight_stats(
            weights, experience.advantages, experience.action_mask)["mean_weight"]
        return weights

    # ---- OpenRLHF's entry points ----------------------------------------------------------------
    def ppo_train(self, kl_ctl: float):
        metrics = self.stare_prepare_step()
        try:
            status = super().ppo_train(kl_ctl)
        finally:
            self._stare_rows = {}
        status.update(metrics)
        return status

    def training_step(self, experience, kl_ctl, step, loss_batch_info=None):
        uids = experience.info.pop(UID_KEY, None)
        self.actor_loss_fn.token_weights = self._stare_batch_weights(experience, uids)
        try:
            return super().training_step(experience, kl_ctl, step, loss_batch_info)
        finally:
            self.actor_loss_fn.token_weights = None

    # ---- controller state next to OpenRLHF's checkpoints -------------------------------------------
    def stare_state_dict(self) -> dict:
        return {"controller": None if self.stare_controller is None else self.stare_controller.state_dict(),
                "prev": self.stare_prev, "algo": self.stare_cfg.name}

    def stare_load_state_dict(self, state: dict) -> None:
        if state.get("algo") != self.stare_cfg.name:
            raise ValueError(f"the checkpoint's STARE state is for {state.get('algo')!r}, this run is "
                             f"{self.stare_cfg.name!r}")
        if self.stare_controller is not None and state.get("controller") is not None:
            self.stare_controller.load_state_dict(state["controller"])
        self.stare_prev = dict(state.get("prev") or {"entropy": None, "forecast": None})


def stare_state_dir(ckpt_path: str) -> Path:
    return Path(ckpt_path) / "stare"


def save_stare_state(trainer: StareActorTrainer, ckpt_path: str, tag: str, keep: int) -> Path:
    """Write the controller state for checkpoint ``tag`` (rank 0 only), keep the newest ``keep``."""
    d = stare_state_dir(ckpt_path)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{tag}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(trainer.stare_state_dict(), indent=1))
    os.replace(tmp, path)
    (d / "latest").write_text(tag)
    files = sorted(d.glob("*.json"), key=lambda p: p.stat().st_mtime)
    for old in files[: max(0, len(files) - max(1, keep))]:
        old.unlink(missing_ok=True)
    return path


def load_stare_state(trainer: StareActorTrainer, ckpt_path: str) -> str | None:
    """Restore the controller state that matches the DeepSpeed checkpoint OpenRLHF resumes from."""
    d = stare_state_dir(ckpt_path)
    latest_ds = Path(ckpt_path) / "_actor" / "latest"  # DeepSpeed's tag file
    tag = latest_ds.read_text().strip() if latest_ds.exists() else None
    if tag is None and (d / "latest").exists():
        tag = (d / "latest").read_text().strip()
    if tag is None or not (d / f"{tag}.json").exists():
        return None
    trainer.stare_load_state_dict(json.loads((d / f"{tag}.json").read_text()))
    return tag


def install(actor_host, environ=None) -> StareActorTrainer:
    """Turn an OpenRLHF policy actor's trainer and loss into STARE's (after ``init_model_from_pretrained``)."""
    cfg, _ = load_settings(environ)
    trainer = actor_host.trainer
    trainer.__class__ = StareActorTrainer
    trainer.actor_loss_fn = StarePolicyLoss.from_parsed(trainer.actor_loss_fn)
    trainer.stare_setup(cfg)
    return trainer


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

    def save_checkpoint(self, tag, client_states=None, metric_value=None, metric_key=None):
        super().save_checkpoint(tag, client_states, metric_value, metric_key)
        if not dist.is_initialized() or dist.get_rank() == 0:
            args = self.strategy.args
            save_stare_state(self.trainer, args.ckpt.path, tag, args.ckpt.max_num)


def register() -> None:
    """Make OpenRLHF's driver create ``StarePolicyModelActor`` wherever it creates ``PolicyModelActor``."""
    import ray

    _ppo_actor.PolicyModelActor = ray.remote(num_gpus=1)(StarePolicyModelActor)
