"""STARE's part of OpenRLHF's actor trainer: ``trainer.stare``, the controller and the once-per-step block.

``StareStep.ppo_train`` runs once per RL step over the step's whole replay buffer *before* any update: it finds
every sample's old-policy statistics (``stats.Stash``), then runs ``stare_step`` (``stare.algorithms``), the block
the local engine runs too: the controller is updated once from the batch entropy all-reduced over the data-parallel
group (so every rank takes the same decision), and the weights are selected over the whole step's batch from the
old log-probs (exact across ranks via its distributed selection). Then OpenRLHF's own ``ppo_train`` runs, and
``training_step`` looks up each micro-batch's weights by a per-sample id carried in ``experience.info`` and hands
them to the loss. With ``scope: micro_batch`` the weights are instead chosen inside each micro-batch (the reference
implementation's rule).

The entropy baselines (``cfg.rule``, the registered token rule: clip-cov, kl-cov, 80-20) run ``stare_step`` every step whatever the
telemetry setting (80-20 and entropy-adv read the stashed entropy; Clip-Cov and KL-Cov with telemetry off read only log-probs and
advantages). Clip-Cov's random choice uses a generator per rank and step (any rule with ``random``), seeded from ``--train.seed``, the rank
and the step count (saved with the controller state). KL-Cov's coefficients travel per sample like the weights.

An entropy bonus (``cfg.entropy_bonus``: entropy-adaptive) is OpenRLHF's own ``--actor.entropy_coef`` term (the
current policy's entropy, aggregated as the policy loss): the launch turns it on and ``prepare_step`` sets the
coefficient the step's ``EntropyCoef`` gives, once per step, before any micro-batch; the coefficient's state is
saved with the controller's.

With seeded rollouts (the ``seeded_rollouts`` setting, on by default), ``seed_update_order`` seeds torch's generators
from the run's seed, the rank and the step count before OpenRLHF's ``ppo_train`` draws the order of the step's
micro-batches (its ``DataLoader``'s shuffle draws from torch's global generator), so that a resumed run updates in
the uninterrupted run's order (docs/openrlhf-backend.md, "Resume").

Telemetry goes into the status dict ``ppo_train`` returns, which OpenRLHF logs as ``train/<key>`` (W&B,
TensorBoard): the names of ``stare.algorithms.METRICS``, from ``stare_step`` (all but
``stare/entropy_change_same_batch``, which would cost a second forward over the buffer).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from stare.algorithms import (
    AlgoConfig,
    EntropyStats,
    StepMemory,
    clip_cov_seed,
    entropy_bonus_metrics,
    reweight_stats,
    stare_step,
    stare_token_weights,
)

from .seeds import order_seed, run_seed, seeded_rollouts_on
from .stats import Stash, dp_group, model_device, needed_stats

UID_KEY = "stare_uid"  # per-sample id carried through OpenRLHF's collation in experience.info


def pad_rows(rows: list[torch.Tensor], width: int, fill=0) -> torch.Tensor:
    """[len(rows), width]: row i is ``rows[i]`` (1-D, at most ``width`` long) followed by ``fill``."""
    out = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=fill)  # one op, not one per row
    if out.shape[1] < width:
        out = torch.nn.functional.pad(out, (0, width - out.shape[1]), value=fill)
    return out


class StareStep:
    """STARE on one OpenRLHF ``ActorPPOTrainer`` (its ``stare`` attribute): the settings, the controller, the
    statistics stash, this step's rows, and the step count."""

    def __init__(self, trainer, cfg: AlgoConfig):
        self.trainer, self.cfg = trainer, cfg
        self.controller = cfg.make_controller()
        # the entropy bonus's coefficient (None: no bonus); each step's value goes to OpenRLHF's own
        # --actor.entropy_coef, which its training_step subtracts times the current policy's entropy
        self.entropy_coef = cfg.make_entropy_coef()
        self.state = None  # this step's ControllerState
        self.prev = {"entropy": None, "forecast": None}  # for the measured-vs-predicted change
        # uid -> (weights row: global scope with the gate on, phi row: micro_batch scope), on the device
        self.rows: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
        # the entropy baselines' token rule (clip-cov, kl-cov, 80-20): uid -> KL-Cov coefficients row
        self.penalty_rows: dict[int, torch.Tensor] = {}
        # steps so far (restored with the checkpoint), which seeds Clip-Cov's per-step generator
        self.steps = 0
        self.stash = Stash(trainer, cfg)

    # ---- around OpenRLHF's ppo_train and training_step ------------------------------------------------------------
    def ppo_train(self, openrlhf_ppo_train, kl_ctl):
        """OpenRLHF's ``ppo_train`` (``openrlhf_ppo_train``), after this step's block; its status with the block's
        telemetry."""
        try:
            metrics = self.prepare_step()
            self.seed_update_order()
            status = openrlhf_ppo_train(kl_ctl)
        finally:
            self.rows = {}
            self.penalty_rows = {}
            self.stash.clear()  # the weights change now: no stashed row may outlive this step
            self.steps += 1
        status.update(metrics)
        if self.entropy_coef is not None:  # the bonus beside the policy loss, in OpenRLHF's own aggregation
            bonus = self.entropy_coef.applied * float(status.get("entropy_loss", 0.0))
            status.update(entropy_bonus_metrics(float(status.get("policy_loss", 0.0)), bonus))
        if metrics and needed_stats(self.cfg)[0]:
            report = self.stash.report
            status["stare/stash_recomputed"] = float(report["recomputed"])
            status["stare/stash_exchanged"] = float(report["exchanged"])
        return status

    def training_step(self, openrlhf_training_step, experience, kl_ctl, step, loss_batch_info=None):
        """OpenRLHF's ``training_step`` (``openrlhf_training_step``) on one micro-batch, with the micro-batch's
        weights and KL-Cov coefficients on the loss."""
        loss = self.trainer.actor_loss_fn
        uids = experience.info.pop(UID_KEY, None)
        loss.token_weights = self.batch_weights(experience, uids)
        loss.token_penalty = self.batch_penalty(experience, uids)
        try:
            return openrlhf_training_step(experience, kl_ctl, step, loss_batch_info)
        finally:
            loss.token_weights = None
            loss.token_penalty = None

    # ---- once per step ----------------------------------------------------------------------------------------------
    def prepare_step(self) -> dict[str, float]:
        """Entropy, controller and (global scope) weights for the step in the replay buffer; telemetry."""
        cfg = self.cfg
        items = self.trainer.replay_buffer.items
        for uid, item in enumerate(items):
            item.info[UID_KEY] = uid
        device = model_device(self.trainer.actor)
        self.rows = {}
        self.penalty_rows = {}
        need_ent, need_phi = needed_stats(cfg)
        rule = cfg.rule.active  # an entropy baseline's token rule runs whatever the telemetry
        if not need_ent and not rule:  # a baseline with telemetry off: nothing to compute
            return {}
        # the old policy's statistics (none for Clip-Cov / KL-Cov with telemetry off: their rules read log-probs)
        stats = self.stash.step_stats(items) if need_ent else None
        if items:
            width = max(it.action_mask.shape[0] for it in items)
            mask = pad_rows([it.action_mask.to(device) for it in items], width, 0).bool()
            logp = pad_rows([it.action_log_probs.to(device).float() for it in items], width, 0.0)
            adv = pad_rows([it.advantages.to(device).float() for it in items], width, 0.0)
            ent = pad_rows([s[0] for s in stats], width, 0.0) if need_ent else None
            phi = pad_rows([s[1] for s in stats], width, 0.0) if need_phi else None
        else:  # a rank with an empty buffer still joins every collective in stare_step
            mask = torch.zeros(1, 1, dtype=torch.bool, device=device)
            logp = adv = torch.zeros(1, 1, device=device)
            ent = torch.zeros(1, 1, device=device) if need_ent else None
            phi = torch.zeros(1, 1, device=device) if need_phi else None
        # the shared once-per-step block: batch entropy all-reduced, controller, (global scope) weights exact
        # across ranks, telemetry; with scope micro_batch the weights are chosen in batch_weights
        step = stare_step(self.controller, cfg, logp, adv, mask, EntropyStats(ent, -logp, phi),
                          memory=StepMemory(**self.prev), group=dp_group(self.trainer.strategy),
                          generator=self.generator(), entropy_coef=self.entropy_coef)
        self.state = step.state
        if step.entropy_coef is not None:  # OpenRLHF's training_step reads it for every micro-batch of the step
            self.trainer.args.actor.entropy_coef = step.entropy_coef
        self.prev = step.memory.as_dict()
        weights = step.weights

        keep_phi = cfg.scope == "micro_batch"
        for uid, item in enumerate(items):
            n = item.action_mask.shape[0]
            self.rows[uid] = (weights[uid, :n] if weights is not None else None,
                              phi[uid, :n] if keep_phi and phi is not None else None)
            if step.penalty is not None:
                self.penalty_rows[uid] = step.penalty[uid, :n]
        return step.metrics

    def seed_update_order(self) -> int | None:
        """With seeded rollouts, seed torch's generators (``torch.manual_seed``: the CPU's and every GPU's) with
        ``seeds.order_seed(run seed, rank, step count)`` right before OpenRLHF's ``ppo_train``, whose ``DataLoader``
        shuffles the step's samples into micro-batches with a seed drawn from torch's global generator. That generator
        is seeded once per process (``launch.seed_worker``), so a resumed run's policy actor, a new process, drew
        another order than the uninterrupted run's at the same step: the same samples, accumulated in other
        micro-batches and optimizer steps (measured on the CPU loop: the resumed step 3's gradient norm 0.441 against
        0.356, its policy loss -0.03674 against -0.03649, from identical rollouts). The step count is restored with
        the controller state. Returns the seed (None: seeded rollouts off, torch's generator left alone)."""
        if not seeded_rollouts_on():
            return None
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        seed = order_seed(run_seed(self.trainer.args), rank, self.steps)
        torch.manual_seed(seed)
        return seed

    def generator(self) -> torch.Generator | None:
        """Clip-Cov's random choice among its candidates: a generator of this rank for this step, seeded from the
        run's seed (``--train.seed``), the rank and the step count, so a run (and a resumed run) reproduces."""
        if not self.cfg.rule.random:
            return None
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        seed = int(getattr(self.trainer.args.train, "seed", 0) or 0)
        return torch.Generator(device=model_device(self.trainer.actor)).manual_seed(
            clip_cov_seed(seed, rank, self.steps))

    # ---- per micro-batch --------------------------------------------------------------------------------------------
    def batch_weights(self, experience, uids) -> torch.Tensor | None:
        """This micro-batch's weights [B, A] (None: every weight is 1)."""
        state = self.state
        rule = self.cfg.rule.active  # a baseline's 0/1 mask, chosen over the whole step
        if uids is None or not rule and (self.controller is None or state is None or not state.gate_on):
            return None
        width = experience.action_mask.shape[1]
        device = experience.action_mask.device
        uids = [int(u) for u in uids.tolist()]
        if rule or self.cfg.scope == "global":
            rows = [self.rows[u][0] for u in uids]
            if any(r is None for r in rows):
                return None
            return pad_rows([r.to(device) for r in rows], width, 1.0)
        # the reference's rule: select inside this micro-batch only
        phi_rows = [self.rows[u][1] for u in uids]  # None: Phi was not needed (telemetry, selection)
        phi = None if any(r is None for r in phi_rows) else pad_rows([r.to(device) for r in phi_rows], width, 0.0)
        weights = stare_token_weights(experience.action_log_probs.detach().float(),
                                      experience.advantages.float(), experience.action_mask, phi=phi,
                                      **self.cfg.selection_kwargs(), **state.weight_kwargs())
        experience.info["stare/micro_batch_mean_weight"] = reweight_stats(
            weights, experience.advantages, experience.action_mask)["mean_weight"]
        return weights

    def batch_penalty(self, experience, uids) -> torch.Tensor | None:
        """This micro-batch's KL-Cov coefficients [B, A] (None: no penalty), 0 on padding."""
        if uids is None or not self.penalty_rows:
            return None
        rows = [self.penalty_rows[int(u)].to(experience.action_mask.device) for u in uids.tolist()]
        return pad_rows(rows, experience.action_mask.shape[1], 0.0)

    # ---- what a checkpoint keeps (checkpoint.py writes and reads the files) ------------------------------------------
    def state_dict(self) -> dict:
        return {"controller": None if self.controller is None else self.controller.state_dict(),
                "entropy_coef": None if self.entropy_coef is None else self.entropy_coef.state_dict(),
                "prev": self.prev, "algo": self.cfg.name, "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        if state.get("algo") != self.cfg.name:
            raise ValueError(f"the checkpoint's STARE state is for {state.get('algo')!r}, this run is "
                             f"{self.cfg.name!r}")
        if self.controller is not None and state.get("controller") is not None:
            self.controller.load_state_dict(state["controller"])
        if self.entropy_coef is not None and state.get("entropy_coef") is not None:
            self.entropy_coef.load_state_dict(state["entropy_coef"])
        self.prev = dict(state.get("prev") or {"entropy": None, "forecast": None})
        self.steps = int(state.get("steps", 0))  # absent in states written before it
