"""The actor's side of one RL step in the pinned OpenRLHF, with OpenRLHF's own loss vs the STARE plugin, on CPU.

One step = the old-log-prob forward over the step's rollouts (what OpenRLHF's ``PolicyModelActor.forward``
runs, one call per rollout micro-batch; the plugin's actor computes the entropy and Phi there and stashes
them) + filling the replay buffer + ``ActorPPOTrainer.ppo_train`` (micro-batches, forward + backward,
optimizer step). OpenRLHF's real ``Actor`` and trainer run on a tiny random Llama; DeepSpeed is replaced by a
small strategy object (backward, an SGD step), the same for every variant. Variants:

- ``openrlhf``: OpenRLHF's own trainer and loss (no plugin);
- ``grpo``: the plugin with a baseline (telemetry only; ``--telemetry``, default ``full``);
- ``stare``: the plugin, O1, gate forced on (target entropy 100);
- ``stare-phi``: the plugin, Phi-sign selection, band gate forced on;
- ``openrlhf again``: OpenRLHF's own step once more, timed like the others: the run's noise floor.

All variants share one model and optimizer (the same weights at the same addresses; with a model each, memory
layout alone moves identical steps apart) and the learning rate is 0, so every repeat trains on the same
weights and the gate stays on. The n-th step of every variant draws the same shuffle of the replay buffer (hence
the same micro-batches and padding). Repeats are interleaved; medians. glibc is told to keep freed memory in the
process (``_timing.keep_freed_memory``): otherwise each step page-faults its multi-MB buffers back in, which
slows the step and adds most of its noise. Targets (idle 2-core machine): grpo <= 1.03, stare <= 1.05,
stare-phi <= 1.10 times OpenRLHF's own step.

The plugin's per-token statistics run in the fused C++ kernel by default (``--kernel cpp``, built at first use;
``auto`` where it cannot be built): on GPUs the plugin reads each logits row once in the fused Triton kernel that
``auto`` picks there, and this is its CPU counterpart. ``--kernel auto`` measures the eager torch path that the
engines take on CPU by default (a softmax and about eight more passes per chunk), which costs more of this toy
step, whose hidden size of 128 makes it almost all vocabulary work (results: docs/benchmarks.md).

    python benchmarks/bench_plugin_step.py [--repeats 7] [--vocab 16384] [--threads 1]
        [--clock wall|cpu|thread] [--telemetry full|entropy|off] [--kernel auto|torch|compiled|cpp] [--profile] [--quick]

``--clock thread`` times the benchmark thread's own CPU (with one torch thread every op runs on it), which
other processes disturb least. ``--profile`` adds a table per variant and phase of counts that do not depend on
the machine's load (aten ops, bytes written, matmul FLOPs, host reads, Python calls) beside each phase's CPU
time.

The last line is one JSON object ``{"grpo": r, "stare": r, "stare-phi": r}`` of the ratios to OpenRLHF's own.
"""
from __future__ import annotations

import argparse
import copy
import gc
import time
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from _timing import BackgroundLoad, keep_freed_memory, median, ratio_interval, verdict

ALLOCATOR = keep_freed_memory()

TARGETS = {"grpo": 1.03, "stare": 1.05, "stare-phi": 1.10}
VARIANTS = ("openrlhf", "grpo", "stare", "stare-phi")
AGAIN = "openrlhf again"  # OpenRLHF's own step timed a second time: the run's own noise floor (ideal ratio 1)
OWN = ("openrlhf", AGAIN)  # the variants that run OpenRLHF's own trainer, without the plugin

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--repeats", type=int, default=7, help="timed steps per variant (default 7)")
parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first (default 2)")
parser.add_argument("--vocab", type=int, default=16384, help="vocabulary size (default 16384)")
parser.add_argument("--hidden", type=int, default=128, help="hidden size of the tiny Llama (default 128)")
parser.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
parser.add_argument("--samples", type=int, default=16, help="samples per step (default 16)")
parser.add_argument("--prompt-len", type=int, default=16, help="prompt tokens (default 16)")
parser.add_argument("--response-len", type=int, default=48, help="longest response (default 48)")
parser.add_argument("--micro-batch", type=int, default=4, help="train and rollout micro-batch (default 4)")
parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
parser.add_argument("--clock", choices=["wall", "cpu", "thread"], default="wall",
                    help="wall (default), this process's CPU time, or the benchmark thread's own CPU time "
                         "(time.thread_time: with --threads 1 every op runs on it; least disturbed by other load)")
parser.add_argument("--telemetry", choices=["full", "entropy", "off"], default="full",
                    help="the plugin variants' telemetry setting (default full: entropy, Phi, shares)")
parser.add_argument("--kernel", choices=["auto", "torch", "compiled", "cpp"], default=None,
                    help="the plugin's stats_kernel. Default cpp, the fused C++ loop (built at first use; auto if "
                         "this machine cannot build it): on GPUs the plugin reads the logits once in the fused Triton "
                         "kernel, and this is its CPU counterpart. auto: the eager torch kernel on CPU (the engines' "
                         "CPU default; about 2.5 points of the toy step more); compiled: the torch.compile'd kernel, "
                         "compiled in the warm-up steps")
parser.add_argument("--quick", action="store_true", help="a seconds-long smoke run at toy sizes")
parser.add_argument("--profile", action="store_true",
                    help="also count, per variant and phase (old-log-prob forward, the plugin's statistics in it, "
                         "its once-per-step block, the rest of ppo_train), what does not depend on machine load: aten "
                         "ops, bytes the non-view ops write, matmul FLOPs, host reads (item/nonzero), Python calls; "
                         "and the thread's CPU seconds per phase (medians over the repeats)")
args = parser.parse_args()
KERNEL_NOTE = None
if args.kernel is None:
    from stare.algorithms import _entropy_cpp

    try:
        _entropy_cpp.library()
        args.kernel = "cpp"
    except RuntimeError as exc:
        args.kernel = "auto"
        KERNEL_NOTE = f"  stats kernel: auto, since the default cpp could not be built here ({exc})"
if args.quick:
    args.repeats, args.warmup, args.vocab, args.hidden = 2, 1, 1024, 32
    args.samples, args.prompt_len, args.response_len, args.micro_batch = 8, 4, 8, 4
for name in ("repeats", "vocab", "hidden", "layers", "samples", "prompt_len", "response_len", "micro_batch",
             "threads"):
    if getattr(args, name) < 1:
        parser.exit(2, f"bench_plugin_step.py: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}\n")
if args.samples % 4:
    parser.exit(2, f"bench_plugin_step.py: --samples must be a multiple of 4 (groups of 4), got {args.samples}\n")
torch.set_num_threads(args.threads)

# OpenRLHF imports flash-attn and vLLM at module level; on a CPU machine those are absent. The test suite's
# stand-ins (which raise if ever called) let its trainer modules import; the paths timed here never call them.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import openrlhf_standins  # noqa: E402

openrlhf_standins.install()
from openrlhf.models import Actor  # noqa: E402
from openrlhf.trainer.ppo_utils.experience import Experience  # noqa: E402
from openrlhf.trainer.ray import ppo_actor  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from stare.algorithms import get_algorithm  # noqa: E402
from stare.cli.openrlhf_backend import plugin, stats  # noqa: E402
from stare.cli.openrlhf_backend.argv import SETTINGS_ENV  # noqa: E402

ppo_actor.torch_dist_barrier_and_cuda_sync = lambda: None
_DEVICE = [0]  # the trainer's constructor formats "cuda:{n}" (never used on this path); ppo_train moves to it
torch.cuda.current_device = lambda: _DEVICE[0]


class Strategy:
    """What ActorPPOTrainer needs of DeepSpeedStrategy: backward (divided by the accumulation steps) and an
    optimizer step (plain SGD, lr 0: the weights stay the same from repeat to repeat)."""

    ring_attn_group = None

    def __init__(self, cfg, gas):
        self.args, self.accumulated_gradient = cfg, gas
        self._micro = 0

    def backward(self, loss, model, optimizer):
        (loss / self.accumulated_gradient).backward()

    def optimizer_step(self, optimizer, model, scheduler, name="model"):
        self._micro += 1
        if self._micro % self.accumulated_gradient == 0:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    def get_grad_norm(self, model):
        return 0.0

    def all_reduce(self, data, op="mean"):
        return data

    def is_rank_0(self):
        return False  # no progress bars

    def print(self, *a):
        pass


class Sched:
    def step(self):
        pass

    def get_last_lr(self):
        return [0.0]


def make_model():
    torch.manual_seed(0)
    heads = max(1, args.hidden // 32)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=heads,
                      max_position_embeddings=args.prompt_len + args.response_len + 8)
    return LlamaForCausalLM(cfg).float()


def make_rollouts():
    """The step's rollout micro-batches: prompts, right-padded responses, group-normalised advantages."""
    g = torch.Generator().manual_seed(1)
    n, p, r = args.samples, args.prompt_len, args.response_len
    lengths = torch.randint(max(1, r // 3), r + 1, (n,), generator=g)
    seq = torch.randint(1, args.vocab, (n, p + r), generator=g)
    attn = torch.ones(n, p + r, dtype=torch.long)
    for i, k in enumerate(lengths.tolist()):
        attn[i, p + k:] = 0
        seq[i, p + k:] = 0
    action_mask = attn[:, 1:][:, -r:].bool()
    rewards = (torch.rand(n, generator=g) > 0.5).float()
    grp = rewards.view(-1, 4)
    adv = ((grp - grp.mean(1, keepdim=True)) / (grp.std(1, keepdim=True) + 1e-6)).view(-1)
    out = []
    for s in range(0, n, args.micro_batch):
        e = slice(s, s + args.micro_batch)
        out.append(Experience(sequences=seq[e], attention_mask=attn[e], action_mask=action_mask[e],
                              advantages=(adv[e, None].expand(-1, r) * action_mask[e]).float().contiguous(),
                              response_length=lengths[e].float(), total_length=(lengths[e] + p).float(),
                              info={"reward": rewards[e].clone()}))
    return out


def make_actor():
    """The one actor and optimizer every variant trains (the same weights at the same addresses)."""
    actor = Actor(make_model())
    actor.packing_samples = False
    return actor, torch.optim.SGD(actor.parameters(), lr=0.0)


def make_trainer(variant, actor, optim):
    cfg = openrlhf_standins.openrlhf_args()
    gas = max(1, args.samples // args.micro_batch)  # one optimizer step per RL step
    _DEVICE[0] = 0
    trainer = ppo_actor.ActorPPOTrainer(Strategy(cfg, gas), actor, None, optim, Sched(),
                                        micro_train_batch_size=args.micro_batch, buffer_cpu_offload=False,
                                        dataloader_pin_memory=False)
    _DEVICE[0] = "cpu"
    if variant not in OWN:
        over = {"stare": {"target_entropy": 100.0}, "stare-phi": {"band_low": 99.0, "band_high": 100.0}}
        algo = get_algorithm(variant, telemetry=args.telemetry, stats_kernel=args.kernel, **over.get(variant, {}))
        trainer = plugin.install(SimpleNamespace(trainer=trainer),
                                 {SETTINGS_ENV: json.dumps({"algo": algo.to_dict(), "run": "bench"})})
    return trainer


# old-log-prob forward (without the statistics), the plugin's per-token statistics inside it (its
# entropy_sensitivity calls), the plugin's once-per-step block, the rest of ppo_train
PHASES = ("forward", "stats", "prepare", "train")
RUNNING = [None]  # the Phases of the step being run: the statistics' wrapper below times into it
_entropy_sensitivity = stats.entropy_sensitivity


def timed_entropy_sensitivity(*a, **kw):
    if RUNNING[0] is None:
        return _entropy_sensitivity(*a, **kw)
    with RUNNING[0]("stats"):
        return _entropy_sensitivity(*a, **kw)


stats.entropy_sensitivity = timed_entropy_sensitivity  # what the plugin's forward hook calls, timed in place


class Phases:
    """Which phase of a step is running (nested: ``prepare`` runs inside ``train``), the benchmark thread's CPU
    seconds per phase, and a counter hook for the profile passes (``count(phase)`` is called by them)."""

    def __init__(self):
        self.stack, self.seconds, self.t0 = [], {}, 0.0

    def __call__(self, name):
        phases = self

        class _Ctx:
            def __enter__(self):
                now = time.thread_time()
                if phases.stack:
                    top = phases.stack[-1]
                    phases.seconds[top] = phases.seconds.get(top, 0.0) + now - phases.t0
                phases.stack.append(name)
                phases.t0 = now

            def __exit__(self, *exc):
                now = time.thread_time()
                top = phases.stack.pop()
                phases.seconds[top] = phases.seconds.get(top, 0.0) + now - phases.t0
                phases.t0 = now

        return _Ctx()

    @property
    def current(self):
        return self.stack[-1] if self.stack else None


def make_step(variant, rollouts, actor, optim):
    trainer = make_trainer(variant, actor, optim)
    status = {}
    phases = Phases()
    if variant not in OWN:
        prepare = trainer.stare.prepare_step

        def timed_prepare():
            with phases("prepare"):
                return prepare()

        trainer.stare.prepare_step = timed_prepare

    def step():
        phases.seconds = {}
        RUNNING[0] = phases
        trainer.replay_buffer.items.clear()
        with phases("forward"):
            for batch in rollouts:
                exp = copy.copy(batch)
                exp.info = dict(batch.info)
                # the driver's old-log-prob forward, one call per rollout micro-batch (PolicyModelActor.forward)
                trainer.actor.eval()
                with torch.no_grad():
                    if variant in OWN:
                        lp = trainer.actor(exp.sequences, exp.action_mask, exp.attention_mask)
                    else:
                        lp = trainer.stare.stash.old_log_probs(exp.sequences, exp.action_mask, exp.attention_mask)
                trainer.actor.train()
                exp.action_log_probs = lp * exp.action_mask
                trainer.replay_buffer.append(exp)
        status.clear()
        # ppo_train shuffles the buffer (global RNG) and pads each micro-batch to its longest sample: the same
        # seed for every variant's n-th step gives them the same micro-batches, so the ratio compares like with like
        torch.manual_seed(1000 + step.calls)
        step.calls += 1
        with phases("train"):
            status.update(trainer.ppo_train(0.0))

    step.phases, step.calls = phases, 0
    return step, status


rollouts = make_rollouts()
actor, optim = make_actor()
TIMED = VARIANTS + (AGAIN,)
steps, statuses = {}, {}
for v in TIMED:
    steps[v], statuses[v] = make_step(v, rollouts, actor, optim)
load = BackgroundLoad()
# the same interleaving as _timing.interleaved_times (A B .. then .. B A), on the chosen clock; each timed call
# also leaves its phases' thread CPU seconds
clock = {"wall": time.perf_counter, "cpu": time.process_time, "thread": time.thread_time}[args.clock]
for _ in range(args.warmup):
    for v in TIMED:
        steps[v]()
times = {v: [] for v in TIMED}
phase_times = {v: {p: [] for p in PHASES} for v in TIMED}
for i in range(args.repeats):
    for v in (TIMED if i % 2 == 0 else TIMED[::-1]):
        gc.collect()
        t0 = clock()
        steps[v]()
        times[v].append(clock() - t0)
        for p in PHASES:
            phase_times[v][p].append(steps[v].phases.seconds.get(p, 0.0))

size = (f"{args.samples} samples x {args.prompt_len}+{args.response_len} tokens, V {args.vocab}, hidden {args.hidden}, "
        f"{args.layers} layers, micro-batch {args.micro_batch}, {args.threads} thread(s), {args.clock} clock, "
        f"telemetry {args.telemetry}, stats kernel {args.kernel}")
print(f"one RL step on the actor (old-log-prob forward + ppo_train), OpenRLHF {plugin.OPENRLHF_VERSION} on CPU: {size}")
print(f"{'variant':<14} {'median s':>9} {'ratio':>7} {'target':>7}  verdict  gate  recomputed  90% interval")
base = median(times["openrlhf"])
ratios = {}
for v in TIMED:
    m = median(times[v])
    st = statuses[v]
    lo, hi = ratio_interval(times[v], times["openrlhf"])
    interval = f"{lo:.3f}-{hi:.3f}"
    if v in OWN:
        print(f"{v:<14} {m:9.4f} {m / base:7.3f}" + (f"{'':37}{interval}" if v != "openrlhf" else ""))
        continue
    ratios[v] = m / base
    gate = {1.0: "on", 0.0: "off"}.get(st.get("stare/gate_on"), "-")
    print(f"{v:<14} {m:9.4f} {ratios[v]:7.3f} {TARGETS[v]:7.2f}  {verdict(ratios[v], TARGETS[v]):<7}  {gate:<4}  "
          f"{int(st.get('stare/stash_recomputed', 0)):>10}  {interval}")
print(f"  noise floor: '{AGAIN}' is OpenRLHF's own step timed a second time in the same interleaving; its distance "
      "from 1 is how far this run's ratios can move by chance")
print("  90% interval: of the ratio, resampling the repeats (the rounds of the interleaving, every variant's step of a "
      "round kept together); a verdict is firm only where its interval lies on one side of the target")
# the plugin's own extra work, timed where it runs (the thread's CPU, medians): not a difference of two noisy step
# times, so steadier than the ratio; it leaves out what the extra work costs the rest of the step (caches)
in_place = {v: (1e3 * median(phase_times[v]["stats"]), 1e3 * median(phase_times[v]["prepare"])) for v in ratios}
print("  in place: the plugin's per-token statistics + its once-per-step block, in ms of the thread's CPU per step "
      "(medians), and their sum as a share of OpenRLHF's own step: "
      + "; ".join(f"{v} {a:.1f} + {b:.1f} = +{(a + b) / (1e3 * base):.1%}" for v, (a, b) in in_place.items()))
print(f"  {ALLOCATOR}")
if KERNEL_NOTE:
    print(KERNEL_NOTE)
print(load.line())
if args.profile:
    from torch.utils._pytree import tree_leaves
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry

    FIELDS = ("ops", "bytes", "new", "flops", "reads", "calls")
    # ops that read a value back to the host (on an accelerator: a synchronisation)
    READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
             torch.ops.aten.masked_select.default, torch.ops.aten.equal.default, torch.ops.aten.is_nonzero.default}

    class OpCounter(TorchDispatchMode):
        """Per phase: aten ops, bytes the non-view ones write (all, and into fresh tensors), matmul FLOPs, host
        reads."""

        def __init__(self, phases, counts):
            super().__init__()
            self.phases, self.counts = phases, counts

        def __torch_dispatch__(self, func, types, a=(), kw=None):
            kw = kw or {}
            out = func(*a, **kw)
            c = self.counts.setdefault(self.phases.current, dict.fromkeys(FIELDS, 0))
            c["ops"] += 1
            if not func.is_view:
                inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((a, kw)) if isinstance(t, torch.Tensor)}
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        c["bytes"] += t.numel() * t.element_size()
                        if t.untyped_storage().data_ptr() not in inputs:
                            c["new"] += t.numel() * t.element_size()
            if func.overloadpacket in flop_registry:
                c["flops"] += flop_registry[func.overloadpacket](*a, **kw, out_val=out)
            c["reads"] += func in READS
            return out

    def count_step(step) -> dict:
        """One step under the op counter, then one under a Python-call counter (not both at once: the counter's
        own calls would be counted)."""
        counts, phases = {}, step.phases
        with OpCounter(phases, counts):
            step()

        def tracer(frame, event, arg):
            if event == "call" and phases.current is not None:
                counts.setdefault(phases.current, dict.fromkeys(FIELDS, 0))["calls"] += 1

        sys.setprofile(tracer)
        try:
            step()
        finally:
            sys.setprofile(None)
        return counts

    print("per phase (forward: the old-log-prob forward without stats; stats: the plugin's per-token statistics in it; "
          "prepare: the plugin's once-per-step block; train: the rest of ppo_train): the thread's CPU ms (median over "
          "the repeats), and counted over one step: aten ops, MB written by non-view ops (all; into fresh tensors), "
          "matmul GFLOP, host reads (item, nonzero, ...), Python calls")
    print(f"{'variant':<10} {'phase':<8} {'cpu ms':>8} {'ops':>7} {'MB':>8} {'MB new':>8} {'GFLOP':>8} {'reads':>6} "
          f"{'py calls':>9}")
    for v in VARIANTS:
        counts = count_step(steps[v])
        total = dict.fromkeys(("ms",) + FIELDS, 0)
        for p in PHASES:
            if p not in counts:
                continue
            c = {"ms": 1e3 * median(phase_times[v][p]), **counts[p]}
            for k in total:
                total[k] += c[k]
            for name, c in ((p, c),) + ((("step", total),) if p == "train" else ()):
                print(f"{v:<10} {name:<8} {c['ms']:8.2f} {c['ops']:7d} {c['bytes'] / 1e6:8.2f} {c['new'] / 1e6:8.2f} "
                      f"{c['flops'] / 1e9:8.3f} {c['reads']:6d} {c['calls']:9d}")
if args.quick:
    print("  --quick: toy sizes, a smoke test; the ratios mean nothing")
print(json.dumps({v: round(r, 4) for v, r in ratios.items()}, sort_keys=True))
