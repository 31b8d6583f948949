"""The old policy's per-token statistics (entropy, Phi) for one RL step, stashed per sample.

OpenRLHF computes the old log-probs in its policy actor's forward, once per rollout micro-batch, before the step's
``ppo_train``. ``Stash.old_log_probs`` is that forward: from the same logits (read by a one-shot forward hook on the
model, in the model's dtype, before OpenRLHF's float32 copy) it also computes each response token's entropy (and Phi
when needed) on the action rows only (``stare.algorithms.entropy_sensitivity``; never OpenRLHF's full-vocabulary
entropy) and keeps them per sample, keyed by a hash of the sample's unpadded token ids and mask.

``Stash.step_stats`` then finds every replay-buffer item's rows: in this rank's stash, else in another data-parallel
rank's (dynamic batching re-deals samples), else by an extra no-grad forward, run in lockstep by every rank (ZeRO-3
gathers parameters inside forwards). A row is used only in the step it was computed in: ``clear`` after each update.
"""
from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from stare.algorithms import AlgoConfig, entropy_sensitivity

from . import OPENRLHF_VERSION
from .compat import (
    gather_and_pad_tensor,
    get_tensor_in_current_ring_attn_rank,
    make_experience_batch,
    unpad_and_slice_tensor,
)


def needed_stats(cfg: AlgoConfig) -> tuple[bool, bool]:
    """(entropy, phi): which per-token statistics a run needs from the old policy."""
    need_phi = cfg.needs_phi or cfg.telemetry == "full"
    return cfg.needs_entropy or need_phi, need_phi


# ---- sample keys: what the replay buffer keeps of a sample, hashed ---------------------------------------------


def sample_key(sequence: torch.Tensor, attention: torch.Tensor) -> tuple[bytes, int]:
    """(key, right padding) of one sample [T]: a hash of its token ids and attention mask without the right
    padding, which is what OpenRLHF's ``remove_padding_in_sequences`` leaves in the replay buffer (the same
    count: the position of the last attended token from the end)."""
    right_pad = int(attention.flip(0).argmax()) if attention.numel() else 0
    n = attention.shape[0] - right_pad
    return _key_digest(sequence[:n].to(torch.int64).numpy(), attention[:n].to(torch.int64).numpy()), right_pad


def sample_keys(sequences: torch.Tensor, attention: torch.Tensor) -> list[tuple[bytes, int]]:
    """``sample_key`` of every row of a batch [B, T] (CPU tensors): one reduction and one conversion for the
    whole batch, then a hash per row."""
    if sequences.shape[1] == 0:
        return [sample_key(sequences[b], attention[b]) for b in range(sequences.shape[0])]
    right_pads = attention.flip(1).argmax(1).tolist()  # per row, as in sample_key (first maximum)
    seq_np = sequences.to(torch.int64).numpy()
    attn_np = attention.to(torch.int64).numpy()
    out = []
    for b, right_pad in enumerate(right_pads):
        n = attention.shape[1] - right_pad
        out.append((_key_digest(seq_np[b, :n], attn_np[b, :n]), right_pad))
    return out


def _key_digest(token_ids, attention) -> bytes:
    """The stash key of one sample: a hash of its unpadded token ids and attention mask (int64 numpy arrays)."""
    h = hashlib.blake2b(digest_size=20)
    h.update(token_ids.tobytes())
    h.update(attention.tobytes())
    return h.digest()


# ---- the data-parallel group --------------------------------------------------------------------------------------


def dp_group(strategy):
    """The data-parallel process group of OpenRLHF's DeepSpeed strategy (None: not distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    mesh = getattr(strategy, "ds_device_mesh", None)
    return mesh["dp"].get_group() if mesh is not None else dist.group.WORLD


def all_reduce_max(t: torch.Tensor, group) -> torch.Tensor:
    """``t`` replaced in place by its maximum over ``group``; unchanged when not distributed."""
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


def model_device(actor) -> torch.device:
    return next(actor.model.parameters()).device


# ---- the stash ----------------------------------------------------------------------------------------------------


class Stash:
    """Per-sample entropy and Phi rows of the current policy version, and how one step finds them."""

    def __init__(self, trainer, cfg: AlgoConfig):
        self.trainer, self.cfg = trainer, cfg
        # sample key -> (version, entropy row, phi row or None), filled by OpenRLHF's old-log-prob forward
        # (``old_log_probs``); only rows of the current version (no update since) are ever used
        self.rows: dict[bytes, tuple[int, torch.Tensor, torch.Tensor | None]] = {}
        self.version = 0  # bumped by ``clear`` after every ppo_train (the weights change there)
        self.report = {"stashed": 0, "exchanged": 0, "recomputed": 0}

    # ---- the statistics from OpenRLHF's own old-log-prob forward ------------------------------------------------
    @torch.no_grad()
    def forward_stats(self, sequences, action_mask, attention_mask, need_phi=None, **mm_inputs):
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
        actor = self.trainer.actor
        if need_phi is None:
            need_phi = needed_stats(self.cfg)[1]
        ring = self.trainer.strategy.ring_attn_group
        batch, seqlen = sequences.shape
        width = action_mask.shape[1]
        # which logits row predicts an action token: row t predicts token t + 1 (Actor.forward's roll)
        grid = torch.zeros(batch, seqlen, dtype=torch.long, device=sequences.device)
        grid[:, seqlen - 1 - width: seqlen - 1] = action_mask.long()
        if actor.packing_samples:
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
        temperature = float(actor.temperature)  # what Actor.forward divides the logits by
        kernel = self.cfg.stats_kernel
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

        handle = actor.model.register_forward_hook(take_stats)
        try:
            log_probs = actor(sequences, action_mask, attention_mask, ring_attn_group=ring, **mm_inputs)
        finally:
            handle.remove()
        if "stats" not in taken:
            raise RuntimeError(f"STARE: OpenRLHF's Actor.forward did not call its model (OpenRLHF {OPENRLHF_VERSION} "
                               "does); the entropy statistics could not be taken")
        out = []
        for t in taken.pop("stats"):
            if t is not None:
                if actor.packing_samples:
                    t = gather_and_pad_tensor(t.view(1, -1), ring, pad_len, indices, batch, seqlen)
                t = t.view(batch, seqlen)[:, :-1][:, -width:]
            out.append(t)
        return log_probs, out[0], out[1]

    @torch.no_grad()
    def old_log_probs(self, sequences, action_mask, attention_mask, **mm_inputs) -> torch.Tensor:
        """What OpenRLHF's ``PolicyModelActor.forward`` returns (the old log-probs, on the device), with each
        sample's entropy (and Phi) stashed for this step's ``ppo_train``, keyed by the sample's token ids and
        mask without right padding (what the replay buffer keeps)."""
        need_ent, need_phi = needed_stats(self.cfg)
        if not need_ent:
            return self.trainer.actor(sequences, action_mask, attention_mask,
                                      ring_attn_group=self.trainer.strategy.ring_attn_group, **mm_inputs)
        log_probs, ent, phi = self.forward_stats(sequences, action_mask, attention_mask, need_phi, **mm_inputs)
        width = action_mask.shape[1]
        for b, (key, right_pad) in enumerate(sample_keys(sequences.cpu(), attention_mask.cpu())):
            n = max(0, width - right_pad)
            # views into this call's [B, T] statistics (small, float32), not copies
            self.rows[key] = (self.version, ent[b, :n], None if phi is None else phi[b, :n])
        return log_probs

    # ---- once per step: every buffer item's rows -------------------------------------------------------------------
    def step_stats(self, items) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(entropy, phi) per buffer item: from the stash, else from the other data-parallel ranks' stashes
        (dynamic batching re-deals samples), else from the extra pass (in lockstep over the ranks)."""
        device = model_device(self.trainer.actor)
        need_phi = needed_stats(self.cfg)[1]
        out: list = [None] * len(items)
        keys = []
        for i, item in enumerate(items):
            key, _ = sample_key(item.sequences.cpu(), item.attention_mask.cpu())
            keys.append(key)
            hit = self.rows.get(key)
            if hit is not None and hit[0] == self.version and (hit[2] is not None or not need_phi):
                out[i] = self._fit(hit[1], hit[2], item, device)
        report = {"stashed": len(self.rows), "exchanged": 0, "recomputed": 0}
        missing = [i for i, r in enumerate(out) if r is None]
        # one small all-reduce decides, on every rank alike, whether any rank misses a sample
        group = dp_group(self.trainer.strategy)
        any_missing = all_reduce_max(torch.tensor([len(missing)], device=device), group)
        if int(any_missing.item()) > 0:
            if group is not None and dist.get_world_size(group) > 1:
                got = self._exchange([keys[i] for i in missing], group, need_phi)
                for i in missing:
                    if keys[i] in got:
                        ent, phi = got[keys[i]]
                        out[i] = self._fit(ent, phi, items[i], device)
                        report["exchanged"] += 1
                missing = [i for i in missing if out[i] is None]
            # the extra pass for what is still missing; every rank joins (it all-reduces its pass count)
            spare = items[0] if items else None
            recomputed = self.recompute([items[i] for i in missing], spare=spare)
            for i, r in zip(missing, recomputed):
                out[i] = r
            report["recomputed"] = len(missing)
        self.report = report
        return out

    def _exchange(self, wanted_keys, group, need_phi):
        """Rows other ranks stashed for the keys this rank misses (two all-gathers of small objects)."""
        world = dist.get_world_size(group)
        wanted = [None] * world
        dist.all_gather_object(wanted, wanted_keys, group=group)
        offer = {}
        for keys in wanted:
            for key in keys or ():
                hit = self.rows.get(key)
                if key not in offer and hit is not None and hit[0] == self.version \
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
    def _fit(ent, phi, item, device):
        n = item.action_mask.shape[0]
        if ent.shape[0] != n:
            raise RuntimeError(f"STARE: a stashed row has {ent.shape[0]} action positions, the buffer's sample {n}")
        return ent.to(device), None if phi is None else phi.to(device)

    @torch.no_grad()
    def recompute(self, items, spare=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(entropy, phi) per buffer item over its action positions, from the current (= old) policy, on the
        training device: the extra pass, for the items OpenRLHF's old-log-prob forward did not stash.

        Every rank runs the same number of forwards (ZeRO-3 gathers parameters inside them); a rank with
        nothing to compute while others do runs padding passes on ``spare`` (any of its buffer items)."""
        trainer = self.trainer
        groups: list[list[int]] = []
        if trainer.args.train.dynamic_batch_enable:
            # Token-budget groups, by length so padding stays small; each group's padded B x T_max is held to
            # half the budget, so its logits (padded when not packing) stay within what OpenRLHF's own forward
            # holds at the full budget.
            budget = max(1, int(trainer.args.train.max_tokens_per_gpu) // 2)
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
            size = max(1, int(trainer.micro_train_batch_size))
            groups = [list(range(i, min(i + size, len(items)))) for i in range(0, len(items), size)]
        device = model_device(trainer.actor)
        # ZeRO-3 gathers parameters inside forward: every rank must run the same number of forwards.
        n_passes = int(all_reduce_max(torch.tensor([len(groups)], device=device), dp_group(trainer.strategy)).item())
        out: list = [None] * len(items)
        was_training = trainer.actor.training
        trainer.actor.eval()
        try:
            for p in range(n_passes):
                if groups:
                    idx = groups[min(p, len(groups) - 1)]  # past the end: repeat the last one, for lockstep
                    batch = [items[i] for i in idx]
                elif spare is not None:  # nothing to recompute here, but other ranks do: keep lockstep
                    idx, batch = [], [spare]
                else:  # an empty buffer on this rank (OpenRLHF's own step would not run either)
                    break
                exp = make_experience_batch(batch, trainer.args.ds.packing_samples)
                exp.to_device(device)
                _, ent, phi = self.forward_stats(exp.sequences, exp.action_mask, exp.attention_mask)
                if p >= len(groups):
                    continue  # a padding pass for collective lockstep
                for row, i in enumerate(idx):
                    n = items[i].action_mask.shape[0]
                    out[i] = (ent[row, :n], None if phi is None else phi[row, :n])
        finally:
            trainer.actor.train(was_training)
        return out

    def clear(self) -> None:
        """After the update: no row computed before it may ever be used."""
        self.rows = {}
        self.version += 1
