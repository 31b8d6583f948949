"""The local RL engine: one arm (one algorithm, one seed) trained in one process, on CPU or one GPU.

Each step, in order (the same ``stare.algorithms`` calls the OpenRLHF plugin makes):

1. sample G responses for each of the step's prompts and score them; with DAPO dynamic sampling, groups whose
   rewards are all equal are dropped and more prompts sampled, up to ``max_gen_rounds`` rounds;
2. ``group_advantages`` (plus DAPO's overlong penalty where the algorithm asks for it);
3. one no-grad pass of the old policy: log-probs and ``entropy_sensitivity`` (entropy, surprisal, Phi);
4. the shuffled split into ``mini_batches`` mini-batches of micro-batches (``micro_batch_size`` sequences);
5. ``stare_step`` (the block the OpenRLHF plugin runs too): the controller's update, once, from the batch's mean
   token entropy; the weights, once over the whole step's batch (``scope: global``) or inside each of the
   micro-batches of 4. (``scope: micro_batch``); an entropy baseline's token rule instead (clip-cov and 80-20: a 0/1
   mask as the weights; kl-cov: per-token penalty coefficients, with the unclipped surrogate; Clip-Cov draws from
   its own generator, seeded from the seed and kept in checkpoints, so no other algorithm's streams move); the
   ``stare/*`` telemetry;
6. ``mini_batches`` optimizer steps of ``policy_loss`` (plus ``entropy_bonus_loss`` on the current policy's entropy
   when the algorithm has an entropy bonus, with the coefficient ``stare_step`` gave), each accumulated over
   micro-batches with the mini-batch's global token and sequence counts;
7. one more no-grad pass over the same batch for ``stare/entropy_change_same_batch`` (setting
   ``same_batch_entropy``; off, the metric is absent); every ``eval_every`` steps (0: never) the held-out avg@k,
   pass@k and greedy accuracy with a 95% bootstrap interval (``heldout/*``, the same evaluation as eval.json's, on
   its own generator); one JSON line in ``metrics.jsonl``, a checkpoint every ``save_every`` steps, and the policy
   alone in ``checkpoints/step-<S>/`` every ``keep_checkpoint_every`` steps and at the last (0: never; what
   ``stare eval --checkpoints`` evaluates). Neither draws from the training's random streams, so turning them on
   changes no training number.

A checkpoint holds the model, optimizer, controller and every RNG state, so a killed run resumed with
``--resume`` ends with the same metrics as an uninterrupted one (CPU arithmetic is deterministic).

Everything runs on one device, ``self.device`` (the ``device`` setting, ``local/device.py``): the model, the
sampling generator, the rollouts, rewards, advantages, the loss and the evaluation. Checkpoints load on any
device; the sampling generator's state is kept only when the device type is the same (a CPU and a CUDA generator
have different states), and is otherwise seeded again from the seed and the step.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

import torch
import yaml

from stare.algorithms import (
    AlgoConfig,
    StepMemory,
    batch_mean,
    clip_cov_seed,
    entropy_bonus_loss,
    entropy_bonus_metrics,
    entropy_sensitivity,
    group_advantages,
    informative_groups,
    overlong_penalty,
    policy_loss,
    stare_step,
    token_entropy,
)

from .device import engine_device
from .evaluate import evaluate_policy
from .policy import Rollout, concat_rollouts, encode_prompts, load_policy, response_logits, sample, token_logprobs
from .tasks import get_task

from .. import stopping
from ..rundir import CHECKPOINT, FINAL, KEPT, atomic_write, read_jsonl  # KEPT: checkpoints/step-<S>/


def warmstart_name(device: torch.device, base: str = "warmstart") -> str:
    """The warm start cache folder's name: a GPU warm start is not bit-identical with the CPU one, so it gets its
    own folder (``warmstart-cuda``) and never replaces or stands in for a CPU one (CPU keeps the plain name, as in
    folders written before the device setting)."""
    return base if device.type == "cpu" else f"{base}-{device.type}"


class LocalTrainer:
    def __init__(self, resolved: dict, run_dir: Path, *, warmstart_dir: Path | None = None):
        self.resolved = resolved
        self.run_dir = Path(run_dir)
        self.s = dict(resolved["settings"])
        self.algo = AlgoConfig(**resolved["algo"])
        self.task = get_task(self.s["task"])
        self.chat = self.s.get("model", "tiny") != "tiny"
        self.device = engine_device(self.s)
        self.warmstart_dir = Path(warmstart_dir) if warmstart_dir else self.run_dir / warmstart_name(self.device)

    # ---- set-up ---------------------------------------------------------------------------------------------
    def _initial_policy_dir(self) -> Path:
        from .models import initial_policy

        return initial_policy(self.s, self.task, self.warmstart_dir, device=self.device)

    def _build(self, start_dir: Path) -> None:
        self.model, self.tokenizer = load_policy(start_dir, self.device)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=self.s["lr"], weight_decay=0.0,
                                     betas=(0.9, 0.99))
        self.controller = self.algo.make_controller()
        self.entropy_coef = self.algo.make_entropy_coef()  # the entropy bonus's coefficient (None: no bonus)
        self.memory = StepMemory()  # the previous step's batch entropy and forecast
        self.gen = torch.Generator(self.device).manual_seed(self.s["seed"])
        # Clip-Cov's random choice among its candidates: its own generator, so no other algorithm's streams move
        self.clip_gen = torch.Generator(self.device).manual_seed(clip_cov_seed(self.s["seed"]))
        self.py_rng = random.Random(f"rl:{self.s['seed']}")
        self.pool = self.task.problems(self.s["train_problems"], seed=self.s["seed"], split="train")
        self.step = 0

    def _save(self) -> None:
        with stopping.critical():  # a stop waits for the checkpoint (its two renames above all)
            self._write_checkpoint()

    def _write_checkpoint(self) -> None:
        tmp = self.run_dir / (CHECKPOINT + ".tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        self.model.save_pretrained(tmp)
        self.tokenizer.save_pretrained(tmp)
        torch.save({
            "step": self.step,
            "optimizer": self.opt.state_dict(),
            "controller": None if self.controller is None else self.controller.state_dict(),
            "entropy_coef": None if self.entropy_coef is None else self.entropy_coef.state_dict(),
            "memory": self.memory.as_dict(),
            "generator": self.gen.get_state(),
            "clip_generator": self.clip_gen.get_state(),
            "device": self.device.type,
            "torch_rng": torch.get_rng_state(),
            "py_rng": self.py_rng.getstate(),
        }, tmp / "trainer_state.pt")
        final = self.run_dir / CHECKPOINT
        old = self.run_dir / (CHECKPOINT + ".old")
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        if old.exists():
            shutil.rmtree(old)

    def _keep(self) -> None:
        """The policy of this step in ``checkpoints/step-<S>/`` (model and tokenizer, loadable with
        ``from_pretrained``), written through a temporary folder; a step redone after a resume replaces it."""
        folder = self.run_dir / KEPT / f"step-{self.step}"
        tmp = folder.with_name(folder.name + ".tmp")
        with stopping.critical():
            if tmp.exists():
                shutil.rmtree(tmp)
            self.model.save_pretrained(tmp)
            self.tokenizer.save_pretrained(tmp)
            if folder.exists():
                shutil.rmtree(folder)
            tmp.rename(folder)

    def _heldout(self) -> dict:
        """The held-out evaluation of ``finish`` (same problems, k and seed) at this step, as ``heldout/*`` metrics
        with the 95% bootstrap interval of avg@k over problems (``stare.eval.metrics.bootstrap_ci``). It samples
        from its own generator and leaves the model in training mode, so no training number moves."""
        from stare.eval.metrics import bootstrap_ci

        self.model.eval()
        result = evaluate_policy(self.model, self.tokenizer, self.task, n_problems=self.s["eval_problems"],
                                 k=self.s["eval_k"], seed=self.s["seed"], max_new_tokens=self.s["max_new_tokens"],
                                 temperature=self.s["temperature"], chat=self.chat, per_problem=True)
        self.model.train()
        low, high = bootstrap_ci(result["per_problem"])
        return {"heldout/avg_at_k": result["avg_at_k"], "heldout/pass_at_k": result["pass_at_k"],
                "heldout/greedy_accuracy": result["greedy_accuracy"], "heldout/ci_low": low, "heldout/ci_high": high,
                "heldout/k": result["k"]}

    def _restore(self) -> None:
        ckpt = self.run_dir / CHECKPOINT
        self._build(ckpt)
        # to CPU whatever device saved it: RNG states must be CPU tensors, and the optimizer moves its state to
        # the parameters' device itself
        state = torch.load(ckpt / "trainer_state.pt", weights_only=False, map_location="cpu")
        self.opt.load_state_dict(state["optimizer"])
        if self.controller is not None:
            self.controller.load_state_dict(state["controller"])
        if self.entropy_coef is not None:
            self.entropy_coef.load_state_dict(state["entropy_coef"])
        self.memory = StepMemory(**(state.get("memory") or {}))  # absent in checkpoints written before it
        if state.get("device", "cpu") == self.device.type:
            self.gen.set_state(state["generator"])
            if "clip_generator" in state:  # absent in checkpoints written before Clip-Cov
                self.clip_gen.set_state(state["clip_generator"])
        else:  # saved on another kind of device: its generator state does not fit this one
            self.gen.manual_seed(self.s["seed"] * 1_000_003 + state["step"])
            self.clip_gen.manual_seed(clip_cov_seed(self.s["seed"] * 1_000_003 + state["step"]))
        torch.set_rng_state(state["torch_rng"])
        self.py_rng.setstate(state["py_rng"])
        self.step = state["step"]
        # drop metrics written after the checkpoint: those steps run again
        metrics = self.run_dir / "metrics.jsonl"
        if metrics.exists():
            records, cut = read_jsonl(metrics, what="step")  # a corrupt line before the last: RunDirError
            if cut:
                print(f"warning: {metrics}: the last line was cut (a kill during its write); dropped, its step "
                      "runs again", file=sys.stderr, flush=True)
            keep = [rec for rec in records if rec["step"] <= self.step]
            atomic_write(metrics, "".join(json.dumps(rec) + "\n" for rec in keep))

    # ---- one step -------------------------------------------------------------------------------------------
    def _rollout(self) -> tuple[Rollout, torch.Tensor, float, int]:
        P, G = self.s["prompts_per_step"], self.s["samples_per_prompt"]
        kept, kept_rewards, all_rewards = [], [], []
        rounds = self.algo.max_gen_rounds if self.algo.dynamic_sampling else 1
        for _ in range(rounds):
            problems = self.py_rng.sample(self.pool, P)
            ids, attn = encode_prompts(self.tokenizer, [p.prompt for p in problems], chat=self.chat,
                                       device=self.device)
            self.model.eval()
            r = sample(self.model, self.tokenizer, ids, attn, repeats=G,  # row i * G + j: prompt i's sample j
                       max_new_tokens=self.s["max_new_tokens"], temperature=self.s["temperature"],
                       generator=self.gen)
            self.model.train()
            rewards = torch.tensor([self.task.reward(problems[i // G], t) for i, t in enumerate(r.texts)],
                                   device=self.device).view(P, G)
            all_rewards.append(rewards)
            if self.algo.dynamic_sampling:
                keep = informative_groups(rewards).nonzero().squeeze(-1).tolist()
            else:
                keep = list(range(P))
            for i in keep:
                kept.append(r.select(list(range(i * G, (i + 1) * G))))
                kept_rewards.append(rewards[i])
            if len(kept) >= P:
                break
        mean_reward = float(torch.cat(all_rewards).mean())
        if not kept:  # every group uninformative in every round: measure the last round, learn nothing
            return r, None, mean_reward, len(all_rewards)
        kept, kept_rewards = kept[:P], kept_rewards[:P]
        batch = concat_rollouts(kept, self.tokenizer.pad_token_id)
        return batch, torch.stack(kept_rewards), mean_reward, len(all_rewards)

    def train_step(self) -> dict:
        t0 = time.perf_counter()
        G = self.s["samples_per_prompt"]
        batch, rewards, reward_mean, rounds = self._rollout()
        rec = {"step": self.step + 1, "reward_mean": reward_mean, "gen_rounds": rounds}
        mask = batch.action_mask.float()
        if rewards is None:  # no informative group: log the old policy's entropy, no update
            with torch.no_grad():
                h = entropy_sensitivity(response_logits(self.model, batch, self.s["temperature"]), batch.responses,
                                        kernel=self.algo.stats_kernel)
            entropy = batch_mean(h.entropy, mask)
            rec.update({"skipped": True, "stare/entropy": entropy, **self.memory.change_metrics(entropy),
                        "stare/entropy_change_same_batch": 0.0,
                        "response_length": float(batch.action_mask.sum(-1).float().mean()), "batch_prompts": 0,
                        "time_s": time.perf_counter() - t0})
            self.memory = StepMemory(entropy, 0.0)  # no update: the policy did not move
            return rec
        lengths = batch.action_mask.sum(-1).float()
        shaped = rewards.float()
        if self.algo.overlong_shaping:
            shaped = shaped + overlong_penalty(lengths, max_len=self.s["max_new_tokens"],
                                               buffer_len=self.algo.overlong_buffer_len,  # <= the limit (resolve)
                                               factor=self.algo.overlong_penalty).view_as(shaped)
        adv = group_advantages(shaped, std_norm=self.algo.std_norm).reshape(-1)  # per sequence
        actions = batch.responses
        temp = self.s["temperature"]
        with torch.no_grad():
            logits = response_logits(self.model, batch, temp)
            old_logprobs = token_logprobs(logits, actions)
            stats = entropy_sensitivity(logits, actions, kernel=self.algo.stats_kernel)
        del logits

        # the split: mini-batches (one optimizer step each) of micro-batches (accumulated with global counts)
        n = actions.shape[0]
        order = torch.randperm(n, generator=self.gen, device=self.device)
        mb_count = self.s["mini_batches"]
        plan = [list(mb.split(self.s["micro_batch_size"])) for mb in order.chunk(mb_count)]
        step = stare_step(self.controller, self.algo, old_logprobs, adv, mask, stats, memory=self.memory,
                          micro_batches=[micro for micros in plan for micro in micros],
                          generator=self.clip_gen if self.algo.rule.random else None,
                          entropy_coef=self.entropy_coef)
        weights, penalty, entropy = step.weights, step.penalty, step.metrics["stare/entropy"]
        coef = step.entropy_coef  # the entropy bonus's coefficient this step (None: no bonus)
        self.memory = step.memory
        rec.update(step.metrics)

        sums: dict[str, float] = {}
        # the LM head on the response positions only in the training pass too (absent in old configs: off)
        response_only = self.s.get("logits_to_keep", False)
        for micros in plan:
            mb_mask = mask[torch.cat(micros)]
            n_tok, n_seq = mb_mask.sum(), mb_mask.shape[0]
            self.opt.zero_grad(set_to_none=True)
            for micro in micros:
                sub = batch.select(micro)
                logits = response_logits(self.model, sub, temp, response_only=response_only)
                lp = token_logprobs(logits, sub.responses)
                loss, m = policy_loss(lp, old_logprobs[micro], adv[micro], mask[micro],
                                      clip_low=self.algo.clip_low, clip_high=self.algo.clip_high,
                                      dual_clip=self.algo.dual_clip, agg=self.algo.agg,
                                      weights=None if weights is None else weights[micro],
                                      penalty=None if penalty is None else penalty[micro],
                                      clip=not self.algo.unclipped,
                                      num_tokens=n_tok, num_seqs=n_seq, norm_len=self.s["max_new_tokens"])
                total = loss
                if coef:  # the entropy bonus: the current policy's entropy, with its gradient
                    bonus, term = entropy_bonus_loss(token_entropy(logits), mask[micro], coef, agg=self.algo.agg,
                                                     num_tokens=n_tok, num_seqs=n_seq,
                                                     norm_len=self.s["max_new_tokens"])
                    total = loss + bonus
                    m = {**m, "stare/entropy_bonus": coef * term.detach()}
                del logits
                total.backward()
                for k, v in {"loss": loss.detach(), **m}.items():
                    sums[k] = sums.get(k, 0.0) + float(v) / mb_count
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.s["grad_clip"])
            self.opt.step()
        if coef is not None:  # the bonus's size beside the policy loss's
            sums.update(entropy_bonus_metrics(sums.get("loss", 0.0), sums.get("stare/entropy_bonus", 0.0)))
        if self.s.get("same_batch_entropy", True):  # one more no-grad forward (absent in old configs: on)
            with torch.no_grad():
                new_entropy = entropy_sensitivity(response_logits(self.model, batch, temp), actions,
                                                  kernel=self.algo.stats_kernel).entropy
            rec["stare/entropy_change_same_batch"] = batch_mean(new_entropy, mask) - entropy
        rec.update({
            "response_length": float(lengths.mean()),
            "batch_prompts": n // G,
            **sums,
            "time_s": time.perf_counter() - t0,
        })
        return rec

    # ---- the whole run --------------------------------------------------------------------------------------
    def run(self, *, resume: bool = False, on_step=None) -> dict:
        torch.set_num_threads(self.s.get("threads", 1))
        if resume and (self.run_dir / CHECKPOINT / "trainer_state.pt").exists():
            self._restore()
        else:
            self._build(self._initial_policy_dir())
            (self.run_dir / "metrics.jsonl").write_text("")
        steps = self.s["steps"]
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            while self.step < steps:
                rec = self.train_step()
                self.step += 1
                every = self.s.get("eval_every", 0)  # absent in configs from before the setting: off
                if every and (self.step % every == 0 or self.step == steps):
                    rec.update(self._heldout())
                f.write(json.dumps(rec) + "\n")
                f.flush()
                keep = self.s.get("keep_checkpoint_every", 0)
                if keep and (self.step % keep == 0 or self.step == steps):
                    self._keep()
                if self.step % self.s["save_every"] == 0 or self.step == steps:
                    self._save()
                if on_step is not None:
                    on_step(self.step, steps, rec)
        return self.finish()

    def finish(self) -> dict:
        final = self.run_dir / FINAL
        if final.exists():
            shutil.rmtree(final)
        shutil.copytree(self.run_dir / CHECKPOINT, final, ignore=shutil.ignore_patterns("trainer_state.pt"))
        self.model.eval()
        result = evaluate_policy(self.model, self.tokenizer, self.task, n_problems=self.s["eval_problems"],
                                 k=self.s["eval_k"], seed=self.s["seed"], max_new_tokens=self.s["max_new_tokens"],
                                 temperature=self.s["temperature"], chat=self.chat)  # on the model's device
        ws = self.warmstart_dir / "warmstart.json"
        if ws.exists():
            result["warmstart"] = json.loads(ws.read_text()).get("eval")
        result["algo"] = self.algo.name
        result["steps"] = self.step
        atomic_write(self.run_dir / "eval.json", json.dumps(result, indent=2))
        return result
