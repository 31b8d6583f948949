"""STARE inside OpenRLHF 0.11.2: the one module that reaches into OpenRLHF's internals.

Upgrading OpenRLHF means reading this file against the new version and changing ``OPENRLHF_VERSION``.
Importing it on any other version fails with a message that says so.

How it plugs in (one seam: OpenRLHF's Ray policy actor):

- ``StarePolicyModelActor`` subclasses the class behind OpenRLHF's ``PolicyModelActor``. After OpenRLHF has
  built the model, optimizer and trainer, it turns the trainer into a ``StareActorTrainer`` and the trainer's
  parsed ``PolicyLoss`` into a ``StarePolicyLoss`` (same settings: clip low/high, dual clip, token-level
  loss, GSPO, importance-sampling correction), and loads the controller's state when resuming.
- ``StarePolicyModelActor.forward`` is OpenRLHF's old-log-prob forward; from the same logits (read by a
  one-shot forward hook on the model, in the model's dtype, before OpenRLHF's float32 copy) it computes each
  response token's entropy (and Phi when needed) on the action rows only (``stare.algorithms.
  entropy_sensitivity``; never OpenRLHF's full-vocabulary entropy) and stashes them per sample, keyed
  by a hash of the sample's unpadded token ids and mask. ``StareActorTrainer.ppo_train`` runs once per RL step
  over the step's whole replay buffer *before* any update: it looks the rows up (fetching rows other
  data-parallel ranks stashed; an extra no-grad forward only for samples found nowhere, in lockstep), the
  controller is updated once from the batch entropy all-reduced over the data-parallel group (so every rank
  takes the same decision), and ``stare_token_weights`` selects tokens over the whole step's batch from the
  old log-probs (exact across ranks via its distributed selection). Then OpenRLHF's own
  ``ppo_train`` runs; ``training_step`` looks up each micro-batch's weights by a per-sample id carried in
  ``experience.info`` and hands them to the loss. With ``scope: micro_batch`` the weights are instead chosen
  inside each micro-batch (the reference implementation's rule).
- ``StarePolicyLoss`` multiplies each token's loss by its weight. Every term of OpenRLHF's per-token loss
  (-min(r A, clip(r) A), the dual-clip bound c A, the IS-correction factor) is positively homogeneous in the
  advantage A, so the loss of A * w is exactly w times the loss of A for w > 0, with the same clip
  statistics: scaling the advantage is how the weight is applied, without re-implementing OpenRLHF's loss.
  Weights of None (gate off, or a baseline) call OpenRLHF's loss unchanged.
- The entropy baselines (``cfg.token_rule``: clip-cov, kl-cov, 80-20) run ``stare_step`` every step whatever the
  telemetry setting (80-20 reads the stashed entropy; Clip-Cov / KL-Cov with telemetry off read only log-probs
  and advantages). Clip-Cov's and 80-20's 0/1 masks are weights like STARE's (A * 0 gives a token loss of 0 in
  every branch, and the token stays in OpenRLHF's denominators, as in the local engine's ``policy_loss``).
  Clip-Cov's random choice uses a generator per rank and step, seeded from ``--train.seed``, the rank and the
  step count (saved with the controller state). KL-Cov: ``StarePolicyLoss`` is OpenRLHF's loss with clip range
  (-inf, inf) and no dual clip (every clip branch inactive), plus ``c * |logp - old_logp|`` aggregated by
  OpenRLHF's own ``aggregate_loss`` with the same arguments (token- or sequence-level, global counts), the
  coefficients carried per sample like the weights. The IS-correction factor, when on, multiplies OpenRLHF's
  term only.
- Telemetry goes into the status dict ``fit`` returns, which OpenRLHF logs as ``train/<key>`` (W&B,
  TensorBoard): the names of ``stare.algorithms.METRICS``, from ``stare_step``, the block the local engine runs
  too (all but ``stare/entropy_change_same_batch``, which would cost a second forward over the buffer).
- The controller's state is written next to OpenRLHF's checkpoints (``<ckpt.path>/stare/<tag>.json``) and
  read back when OpenRLHF resumes from that tag.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
from pathlib import Path

from . import OPENRLHF_VERSION, OpenRLHFVersionError, check_openrlhf_version  # noqa: F401 (re-exported)
from .compat import (  # the version check, then OpenRLHF's names
    PolicyLoss,
    aggregate_loss,
    gather_and_pad_tensor,
    get_tensor_in_current_ring_attn_rank,
    make_experience_batch,
    unpad_and_slice_tensor,
)
from .compat import ppo_actor as _ppo_actor

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from stare.algorithms import (  # noqa: E402
    AlgoConfig,
    EntropyStats,
    StepMemory,
    clip_cov_seed,
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
    """OpenRLHF's ``PolicyLoss`` with a per-token weight (``token_weights``) and a per-token KL coefficient
    (``token_penalty``, KL-Cov), both set per micro-batch."""

    token_weights: torch.Tensor | None = None
    token_penalty: torch.Tensor | None = None

    @classmethod
    def from_parsed(cls, loss: PolicyLoss, *, unclipped: bool = False) -> "StarePolicyLoss":
        """The same loss with every setting OpenRLHF parsed (a copy of its attributes).

        ``unclipped`` (KL-Cov): OpenRLHF's own loss with every clip branch inactive: clip range (-inf, inf), so
        ``ratio.clamp`` is the identity and ``-min(r A, clamp(r) A)`` is ``-r A`` (the clip ratio it reports is
        0), and no dual clip. The log-ratio's +-20 clamp (a numerical guard, not a clip) stays."""
        new = cls.__new__(cls)
        new.__dict__.update(loss.__dict__)
        new.token_weights = None
        new.token_penalty = None
        if unclipped:
            new.clip_eps_low = new.clip_eps_high = math.inf
            new.dual_clip = None
        return new

    def forward(self, log_probs, old_log_probs, advantages, action_mask=None, *args, **kwargs):
        w = self.token_weights
        if w is not None:
            if w.shape != advantages.shape:
                raise ValueError(f"STARE weights {tuple(w.shape)} do not match the advantages {tuple(advantages.shape)}")
            # w >= 0 holds by construction (W, M and damp are validated > 0; the baselines' masks are 0/1); no host
            # read here, the loss runs once per micro-batch and must not synchronise
            advantages = advantages * w.to(device=advantages.device, dtype=advantages.dtype)
        out = super().forward(log_probs, old_log_probs, advantages, action_mask, *args, **kwargs)
        c = self.token_penalty
        if c is None:
            return out
        if c.shape != log_probs.shape:
            raise ValueError(f"KL-Cov coefficients {tuple(c.shape)} do not match the log-probs "
                             f"{tuple(log_probs.shape)}")
        # KL-Cov's term c * |log p - log p_old|, aggregated by OpenRLHF's own aggregate_loss with the arguments
        # its loss got (token- or sequence-level, global counts, dp_size): aggregation is linear in the
        # per-token loss, so this is the aggregate of (OpenRLHF's per-token loss + the term)
        call = _LOSS_SIGNATURE.bind(self, log_probs, old_log_probs, advantages, action_mask, *args, **kwargs)
        call.apply_defaults()
        a = call.arguments
        term = c.to(device=log_probs.device, dtype=log_probs.dtype) * (log_probs - old_log_probs).abs()
        penalty = aggregate_loss(term, action_mask, token_level_loss=self.token_level_loss, dp_size=a["dp_size"],
                                 batch_num_tokens=a["batch_num_tokens"], global_batch_size=a["global_batch_size"])
        return (out[0] + penalty, *out[1:])


_LOSS_SIGNATURE = inspect.signature(PolicyLoss.forward)


# --------------------------------------------------------------------------------------------------
# The trainer: once-per-step selection and controller
# --------------------------------------------------------------------------------------------------


def _pad_rows(rows: list[torch.Tensor], width: int, fill=0) -> torch.Tensor:
    """[len(rows), width]: row i is ``rows[i]`` (1-D, at most ``width`` long) followed by ``fill``."""
    out = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=fill)  # one op, not one per row
    if out.shape[1] < width:
        out = torch.nn.functional.pad(out, (0, width - out.shape[1]), value=fill)
    return out


def _sample_keys(sequences: torch.Tensor, attention: torch.Tensor) -> list[tuple[bytes, int]]:
    """``_sample_key`` of every row of a batch [B, T] (CPU tensors): one reduction and one conversion for the
    whole batch, then a hash per row."""
    if sequences.shape[1] == 0:
        return [_sample_key(sequences[b], attention[b]) for b in range(sequences.shape[0])]
    right_pads = attention.flip(1).argmax(1).tolist()  # per row, as in _sample_key (first maximum)
    seq_np = sequences.to(torch.int64).numpy()
    attn_np = attention.to(torch.int64).numpy()
    out = []
    for b, right_pad in enumerate(right_pads):
        n = attention.shape[1] - right_pad
        out.append((_key_digest(seq_np[b, :n], attn_np[b, :n]), right_pad))
    return out


def _sample_key(sequence: torch.Tensor, attention: torch.Tensor) -> tuple[bytes, int]:
    """(key, right padding) of one sample [T]: a hash of its token ids and attention mask without the right
    padding, which is what OpenRLHF's ``remove_padding_in_sequences`` leaves in the replay buffer (the same
    count: the position of the last attended token from the end)."""
    right_pad = int(attention.flip(0).argmax()) if attention.numel() else 0
    n = attention.shape[0] - right_pad
    return _key_digest(sequence[:n].to(torch.int64).numpy(), attention[:n].to(torch.int64).numpy()), right_pad


def _key_digest(token_ids, attention) -> bytes:
    """The stash key of one sample: a hash of its unpadded token ids and attention mask (int64 numpy arrays)."""
    h = hashlib.blake2b(digest_size=20)
    h.update(token_ids.tobytes())
    h.update(attention.tobytes())
    return h.digest()


class StareActorTrainer(ActorPPOTrainer):
    """OpenRLHF's ``ActorPPOTrainer`` with STARE. Never constructed: ``install`` re-classes OpenRLHF's own."""

    def stare_setup(self, cfg: AlgoConfig) -> None:
        self.stare_cfg = cfg
        self.stare_controller = cfg.make_controller()
        self.stare_state = None  # this step's ControllerState
        self.stare_prev = {"entropy": None, "forecast": None}  # for the measured-vs-predicted change
        # uid -> (weights row: global scope with the gate on, phi row: micro_batch scope), on the device
        self._stare_rows: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
        # sample key -> (version, entropy row, phi row or None), filled by OpenRLHF's old-log-prob forward
        # (``stare_old_log_probs``); only rows of the current version (no update since) are ever used
        self._stare_stash: dict[bytes, tuple[int, torch.Tensor, torch.Tensor | None]] = {}
        self._stare_version = 0  # bumped after every ppo_train (the weights change there)
        self.stare_stash_report = {"stashed": 0, "exchanged": 0, "recomputed": 0}
        # the entropy baselines' token rule (clip-cov, kl-cov, 80-20): uid -> KL-Cov coefficients row, and the
        # count of steps so far (restored with the checkpoint), which seeds Clip-Cov's per-step generator
        self._stare_penalty_rows: dict[int, torch.Tensor] = {}
        self.stare_steps = 0

    def _stare_needs(self) -> tuple[bool, bool]:
        """(entropy, phi): which per-token statistics this run needs from the old policy."""
        cfg = self.stare_cfg
        need_phi = cfg.needs_phi or cfg.telemetry == "full"
        return cfg.needs_entropy or need_phi, need_phi

    def _stare_generator(self) -> torch.Generator | None:
        """Clip-Cov's random choice among its candidates: a generator of this rank for this step, seeded from the
        run's seed (``--train.seed``), the rank and the step count, so a run (and a resumed run) reproduces."""
        if self.stare_cfg.token_rule != "clip-cov":
            return None
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        seed = int(getattr(self.args.train, "seed", 0) or 0)
        return torch.Generator(device=self._stare_device()).manual_seed(
            clip_cov_seed(seed, rank, self.stare_steps))

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

    # ---- the statistics from OpenRLHF's own old-log-prob forward, stashed per sample ---------------
    @torch.no_grad()
    def _stare_forward_stats(self, sequences, action_mask, attention_mask, need_phi=None, **mm_inputs):
        """OpenRLHF's actor forward with action log-probs (``Actor.forward``, the call its policy actor makes
        for the old log-probs) and, from the same logits, each action position's entropy and Phi.

        Returns (action_log_probs [B, A], entropy [B, A], phi [B, A] or None), zero where ``action_mask`` is.
        The statistics are taken by a one-shot forward hook on the model, from its logits as it returns them:
        before ``Actor.forward`` copies them to float32 and divides them by the temperature (in place), so the
        kernel reads the model's own dtype (bf16 on GPUs: half the bytes of that copy) while the logits are
        still in cache, and applies the temperature itself. The logits are only read, never changed, so
        OpenRLHF's log-probs stay its own. Action rows only, each run of consecutive action rows a contiguous
        view (no copy of [B, T, V]); with packing (and ring attention) on this rank's packed rows, then
        gathered and unpadded the way ``Actor.forward`` unpads its log-probs.
        """
        if need_phi is None:
            need_phi = self._stare_needs()[1]
        ring = self.strategy.ring_attn_group
        batch, seqlen = sequences.shape
        width = action_mask.shape[1]
        # which logits row predicts an action token: row t predicts token t + 1 (Actor.forward's roll)
        grid = torch.zeros(batch, seqlen, dtype=torch.long, device=sequences.device)
        grid[:, seqlen - 1 - width: seqlen - 1] = action_mask.long()
        if self.actor.packing_samples:
            # the same packing (and ring slice) as the model's input: one call, as Actor.forward makes it
            _, _, actions, pad_len, indices = unpad_and_slice_tensor(sequences, attention_mask, ring)
            rows = grid.reshape(-1)[indices].view(1, -1)
            if ring is not None:
                rows, _ = get_tensor_in_current_ring_attn_rank(rows, ring, 0)
        else:
            rows, actions = grid, torch.roll(sequences, shifts=-1, dims=1)
        rows, actions = rows.reshape(-1).bool(), actions.reshape(-1)
        # runs of consecutive action rows (statistics are per row, so runs may span samples)
        edges = torch.diff(rows.to(torch.int8), prepend=rows.new_zeros(1, dtype=torch.int8),
                           append=rows.new_zeros(1, dtype=torch.int8)).nonzero().view(-1).tolist()
        temperature = float(self.actor.temperature)  # what Actor.forward divides the logits by
        kernel = self.stare_cfg.stats_kernel
        taken = {}

        def take_stats(module, args, output):
            logits = output["logits"]
            flat = logits.reshape(-1, logits.shape[-1])  # the model's own [*, V] output: contiguous, so a view
            if flat.shape[0] != rows.shape[0]:
                raise RuntimeError(f"STARE: the model returned {flat.shape[0]} logits rows, expected "
                                   f"{rows.shape[0]} (OpenRLHF {OPENRLHF_VERSION}'s Actor.forward layout)")
            ent = torch.zeros(rows.shape[0], dtype=torch.float32, device=logits.device)
            phi = torch.zeros_like(ent) if need_phi else None
            for start, end in zip(edges[0::2], edges[1::2]):
                st = entropy_sensitivity(flat[start:end], actions[start:end], temperature=temperature,
                                         kernel=kernel, with_phi=phi is not None)
                ent[start:end] = st.entropy
                if phi is not None:
                    phi[start:end] = st.phi
            taken["stats"] = (ent, phi)

        handle = self.actor.model.register_forward_hook(take_stats)
        try:
            log_probs = self.actor(sequences, action_mask, attention_mask, ring_attn_group=ring, **mm_inputs)
        finally:
            handle.remove()
        if "stats" not in taken:
            raise RuntimeError(f"STARE: OpenRLHF's Actor.forward did not call its model (OpenRLHF {OPENRLHF_VERSION} "
                               "does); the entropy statistics could not be taken")
        out = []
        for t in taken.pop("stats"):
            if t is not None:
                if self.actor.packing_samples:
                    t = gather_and_pad_tensor(t.view(1, -1), ring, pad_len, indices, batch, seqlen)
                t = t.view(batch, seqlen)[:, :-1][:, -width:]
            out.append(t)
        return log_probs, out[0], out[1]

    @torch.no_grad()
    def stare_old_log_probs(self, sequences, action_mask, attention_mask, **mm_inputs) -> torch.Tensor:
        """What OpenRLHF's ``PolicyModelActor.forward`` returns (the old log-probs, on the device), with each
        sample's entropy (and Phi) stashed for this step's ``ppo_train``, keyed by the sample's token ids and
        mask without right padding (what the replay buffer keeps)."""
        need_ent, need_phi = self._stare_needs()
        if not need_ent:
            return self.actor(sequences, action_mask, attention_mask, ring_attn_group=self.strategy.ring_attn_group,
                              **mm_inputs)
        log_probs, ent, phi = self._stare_forward_stats(sequences, action_mask, attention_mask, need_phi,
                                                        **mm_inputs)
        width = action_mask.shape[1]
        for b, (key, right_pad) in enumerate(_sample_keys(sequences.cpu(), attention_mask.cpu())):
            n = max(0, width - right_pad)
            # views into this call's [B, T] statistics (small, float32), not copies
            self._stare_stash[key] = (self._stare_version, ent[b, :n], None if phi is None else phi[b, :n])
        return log_probs

    def _stare_step_stats(self, items) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(entropy, phi) per buffer item: from the stash, else from the other data-parallel ranks' stashes
        (dynamic batching re-deals samples), else from the extra pass (in lockstep over the ranks)."""
        device = self._stare_device()
        need_phi = self._stare_needs()[1]
        out: list = [None] * len(items)
        keys = []
        for i, item in enumerate(items):
            key, _ = _sample_key(item.sequences.cpu(), item.attention_mask.cpu())
            keys.append(key)
            hit = self._stare_stash.get(key)
            if hit is not None and hit[0] == self._stare_version and (hit[2] is not None or not need_phi):
                out[i] = self._stare_fit(hit[1], hit[2], item, device)
        report = {"stashed": len(self._stare_stash), "exchanged": 0, "recomputed": 0}
        missing = [i for i, r in enumerate(out) if r is None]
        # one small all-reduce decides, on every rank alike, whether any rank misses a sample
        any_missing = self._stare_all_reduce(torch.tensor([len(missing)], device=device),
                                             dist.ReduceOp.MAX if dist.is_available() else None)
        if int(any_missing.item()) > 0:
            group = self._stare_group()
            if group is not None and dist.get_world_size(group) > 1:
                got = self._stare_exchange([keys[i] for i in missing], group, need_phi)
                for i in missing:
                    if keys[i] in got:
                        ent, phi = got[keys[i]]
                        out[i] = self._stare_fit(ent, phi, items[i], device)
                        report["exchanged"] += 1
                missing = [i for i in missing if out[i] is None]
            # the extra pass for what is still missing; every rank joins (it all-reduces its pass count)
            spare = items[0] if items else None
            recomputed = self._stare_old_policy_stats([items[i] for i in missing], spare=spare)
            for i, r in zip(missing, recomputed):
                out[i] = r
            report["recomputed"] = len(missing)
        self.stare_stash_report = report
        return out

    def _stare_exchange(self, wanted_keys, group, need_phi):
        """Rows other ranks stashed for the keys this rank misses (two all-gathers of small objects)."""
        world = dist.get_world_size(group)
        wanted = [None] * world
        dist.all_gather_object(wanted, wanted_keys, group=group)
        offer = {}
        for keys in wanted:
            for key in keys or ():
                hit = self._stare_stash.get(key)
                if key not in offer and hit is not None and hit[0] == self._stare_version \
                        and (hit[2] is not None or not need_phi):
                    offer[key] = (hit[1].cpu(), None if hit[2] is None else hit[2].cpu())
        offers = [None] * world
        dist.all_gather_object(offers, offer, group=group)
        mine = set(wanted_keys)
        got = {}
        for o in offers:
            for key, rows in (o or {}).items():
                if key in mine:
                    got.setdefault(key, rows)
        return got

    @staticmethod
    def _stare_fit(ent, phi, item, device):
        n = item.action_mask.shape[0]
        if ent.shape[0] != n:
            raise RuntimeError(f"STARE: a stashed row has {ent.shape[0]} action positions, the buffer's sample {n}")
        return ent.to(device), None if phi is None else phi.to(device)

    def _stare_stash_clear(self) -> None:
        """After the update: no row computed before it may ever be used."""
        self._stare_stash = {}
        self._stare_version += 1

    # ---- the old policy's entropy and Phi, in one no-grad pass ----------------------------------
    @torch.no_grad()
    def _stare_old_policy_stats(self, items, spare=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(entropy, phi) per buffer item over its action positions, from the current (= old) policy, on the
        training device: the extra pass, for the items OpenRLHF's old-log-prob forward did not stash.

        Every rank runs the same number of forwards (ZeRO-3 gathers parameters inside them); a rank with
        nothing to compute while others do runs padding passes on ``spare`` (any of its buffer items)."""
        groups: list[list[int]] = []
        if self.args.train.dynamic_batch_enable:
            # Token-budget groups, by length so padding stays small; each group's padded B x T_max is held to
            # half the budget, so its logits (padded when not packing) stay within what OpenRLHF's own forward
            # holds at the full budget.
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
                if groups:
                    idx = groups[min(p, len(groups) - 1)]  # past the end: repeat the last one, for lockstep
                    batch = [items[i] for i in idx]
                elif spare is not None:  # nothing to recompute here, but other ranks do: keep lockstep
                    idx, batch = [], [spare]
                else:  # an empty buffer on this rank (OpenRLHF's own step would not run either)
                    break
                exp = make_experience_batch(batch, self.args.ds.packing_samples)
                exp.to_device(device)
                _, ent, phi = self._stare_forward_stats(exp.sequences, exp.action_mask, exp.attention_mask)
                if p >= len(groups):
                    continue  # a padding pass for collective lockstep
                for row, i in enumerate(idx):
                    n = items[i].action_mask.shape[0]
                    out[i] = (ent[row, :n], None if phi is None else phi[row, :n])
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
        self._stare_rows = {}
        self._stare_penalty_rows = {}
        need_ent, need_phi = self._stare_needs()
        rule = cfg.token_rule != "none"  # an entropy baseline's token rule runs whatever the telemetry
        if not need_ent and not rule:  # a baseline with telemetry off: nothing to compute
            return {}
        # the old policy's statistics (none for Clip-Cov / KL-Cov with telemetry off: their rules read log-probs)
        stats = self._stare_step_stats(items) if need_ent else None
        if items:
            width = max(it.action_mask.shape[0] for it in items)
            mask = _pad_rows([it.action_mask.to(device) for it in items], width, 0).bool()
            logp = _pad_rows([it.action_log_probs.to(device).float() for it in items], width, 0.0)
            adv = _pad_rows([it.advantages.to(device).float() for it in items], width, 0.0)
            ent = _pad_rows([s[0] for s in stats], width, 0.0) if need_ent else None
            phi = _pad_rows([s[1] for s in stats], width, 0.0) if need_phi else None
        else:  # a rank with an empty buffer still joins every collective in stare_step
            mask = torch.zeros(1, 1, dtype=torch.bool, device=device)
            logp = adv = torch.zeros(1, 1, device=device)
            ent = torch.zeros(1, 1, device=device) if need_ent else None
            phi = torch.zeros(1, 1, device=device) if need_phi else None
        # the shared once-per-step block: batch entropy all-reduced, controller, (global scope) weights exact
        # across ranks, telemetry; with scope micro_batch the weights are chosen in _stare_batch_weights
        step = stare_step(self.stare_controller, cfg, logp, adv, mask, EntropyStats(ent, -logp, phi),
                          memory=StepMemory(**self.stare_prev), group=self._stare_group(),
                          generator=self._stare_generator())
        self.stare_state = step.state
        self.stare_prev = step.memory.as_dict()
        weights = step.weights

        keep_phi = cfg.scope == "micro_batch"
        for uid, item in enumerate(items):
            n = item.action_mask.shape[0]
            self._stare_rows[uid] = (weights[uid, :n] if weights is not None else None,
                                     phi[uid, :n] if keep_phi and phi is not None else None)
            if step.penalty is not None:
                self._stare_penalty_rows[uid] = step.penalty[uid, :n]
        return step.metrics

    def _stare_batch_weights(self, experience, uids) -> torch.Tensor | None:
        """This micro-batch's weights [B, A] (None: every weight is 1)."""
        state = self.stare_state
        rule = self.stare_cfg.token_rule != "none"  # a baseline's 0/1 mask, chosen over the whole step
        if uids is None or not rule and (self.stare_controller is None or state is None or not state.gate_on):
            return None
        width = experience.action_mask.shape[1]
        device = experience.action_mask.device
        uids = [int(u) for u in uids.tolist()]
        if rule or self.stare_cfg.scope == "global":
            rows = [self._stare_rows[u][0] for u in uids]
            if any(r is None for r in rows):
                return None
            return _pad_rows([r.to(device) for r in rows], width, 1.0)
        # the reference's rule: select inside this micro-batch only
        phi_rows = [self._stare_rows[u][1] for u in uids]  # None: Phi was not needed (telemetry, selection)
        phi = None if any(r is None for r in phi_rows) else _pad_rows([r.to(device) for r in phi_rows], width, 0.0)
        weights = stare_token_weights(experience.action_log_probs.detach().float(),
                                      experience.advantages.float(), experience.action_mask, phi=phi,
                                      **self.stare_cfg.selection_kwargs(), **state.weight_kwargs())
        experience.info["stare/micro_batch_mean_weight"] = reweight_stats(
            weights, experience.advantages, experience.action_mask)["mean_weight"]
        return weights

    def _stare_batch_penalty(self, experience, uids) -> torch.Tensor | None:
        """This micro-batch's KL-Cov coefficients [B, A] (None: no penalty), 0 on padding."""
        if uids is None or not self._stare_penalty_rows:
            return None
        rows = [self._stare_penalty_rows[int(u)].to(experience.action_mask.device) for u in uids.tolist()]
        return _pad_rows(rows, experience.action_mask.shape[1], 0.0)

    # ---- OpenRLHF's entry points ----------------------------------------------------------------
    def ppo_train(self, kl_ctl: float):
        try:
            metrics = self.stare_prepare_step()
            status = super().ppo_train(kl_ctl)
        finally:
            self._stare_rows = {}
            self._stare_penalty_rows = {}
            self._stare_stash_clear()  # the weights change now: no stashed row may outlive this step
            self.stare_steps += 1
        status.update(metrics)
        if metrics and self._stare_needs()[0]:
            report = self.stare_stash_report
            status["stare/stash_recomputed"] = float(report["recomputed"])
            status["stare/stash_exchanged"] = float(report["exchanged"])
        return status

    def training_step(self, experience, kl_ctl, step, loss_batch_info=None):
        uids = experience.info.pop(UID_KEY, None)
        self.actor_loss_fn.token_weights = self._stare_batch_weights(experience, uids)
        self.actor_loss_fn.token_penalty = self._stare_batch_penalty(experience, uids)
        try:
            return super().training_step(experience, kl_ctl, step, loss_batch_info)
        finally:
            self.actor_loss_fn.token_weights = None
            self.actor_loss_fn.token_penalty = None

    # ---- controller state next to OpenRLHF's checkpoints -------------------------------------------
    def stare_state_dict(self) -> dict:
        return {"controller": None if self.stare_controller is None else self.stare_controller.state_dict(),
                "prev": self.stare_prev, "algo": self.stare_cfg.name, "steps": self.stare_steps}

    def stare_load_state_dict(self, state: dict) -> None:
        if state.get("algo") != self.stare_cfg.name:
            raise ValueError(f"the checkpoint's STARE state is for {state.get('algo')!r}, this run is "
                             f"{self.stare_cfg.name!r}")
        if self.stare_controller is not None and state.get("controller") is not None:
            self.stare_controller.load_state_dict(state["controller"])
        self.stare_prev = dict(state.get("prev") or {"entropy": None, "forecast": None})
        self.stare_steps = int(state.get("steps", 0))  # absent in states written before it


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
    trainer.actor_loss_fn = StarePolicyLoss.from_parsed(trainer.actor_loss_fn, unclipped=cfg.unclipped)
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

    def forward(self, sequences, action_mask=None, attention_mask=None, packed_seq_lens=None,
                mm_train_inputs_list=None):
        """OpenRLHF's old-log-prob forward (same inputs, same output), which also stashes each sample's
        entropy and Phi for this step's ``ppo_train`` (``StareActorTrainer.stare_old_log_probs``)."""
        trainer = getattr(self, "trainer", None)
        if not isinstance(trainer, StareActorTrainer):
            return super().forward(sequences, action_mask, attention_mask, packed_seq_lens, mm_train_inputs_list)
        device = torch.cuda.current_device()
        mm_inputs = {}
        if mm_train_inputs_list and getattr(self.actor, "is_vlm", False):
            mm_inputs = _ppo_actor.merge_mm_train_inputs(mm_train_inputs_list, device)
        self.actor.eval()
        with torch.no_grad():
            action_log_probs = trainer.stare_old_log_probs(sequences.to(device), action_mask.to(device),
                                                           attention_mask.to(device), **mm_inputs)
        self.actor.train()  # reset model state, as OpenRLHF does
        return action_log_probs.to("cpu")

    def save_checkpoint(self, tag, client_states=None, metric_value=None, metric_key=None):
        super().save_checkpoint(tag, client_states, metric_value, metric_key)
        if not dist.is_initialized() or dist.get_rank() == 0:
            args = self.strategy.args
            save_stare_state(self.trainer, args.ckpt.path, tag, args.ckpt.max_num)


def register() -> None:
    """Make OpenRLHF's driver create ``StarePolicyModelActor`` wherever it creates ``PolicyModelActor``."""
    import ray

    _ppo_actor.PolicyModelActor = ray.remote(num_gpus=1)(StarePolicyModelActor)
