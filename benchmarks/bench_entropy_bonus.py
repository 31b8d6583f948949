"""Memory and time of the entropy bonus's entropy, forward + backward: OpenRLHF's compute_entropy vs chunked_entropy.

When ``--actor.entropy_coef`` is set, OpenRLHF 0.11.2's ``Actor.forward`` computes each micro-batch's entropy with
``compute_entropy`` (``openrlhf/models/utils.py``, under ``torch.compile``) on the whole ``[tokens, V]`` float32
logits, inside the autograd graph; the STARE plugin swaps in ``stare.algorithms.entropy_bonus.chunked_entropy``
(same value and gradient, ``--chunk-rows`` rows at a time). Variants, each on the same ``N x V`` float32 logits with
the same incoming gradient:

- ``openrlhf``: OpenRLHF's ``compute_entropy`` as it runs in training: compiled, first on toy inputs of two shapes
  (a static graph, then the dynamic one later micro-batches get) before the measured inputs exist;
- ``openrlhf-eager``: its undecorated function (``__wrapped__``), what runs where ``torch.compile`` is off
  (``TORCHDYNAMO_DISABLE=1``);
- ``chunked``: ``chunked_entropy(logits, chunk_rows)``.

Memory: each variant runs once per FRESH subprocess (``--mem-repeats`` processes each, worst kept), forward then
backward, and reports the extra bytes over the inputs at three points: the forward's peak, what the forward leaves
allocated (its output and what it saved for backward), and the peak of forward + backward (the returned gradient,
``N x V`` float32, included). Two measures: torch's allocator (the profiler's memory events: every byte torch
allocates, what a GPU memory plan counts) and, on CPU, peak RSS (``ru_maxrss``) minus the RSS once the inputs exist.
On CUDA: ``max_memory_allocated``. Each is also printed in units of one ``N x V`` float32 tensor (``TV``).

Time: forward + backward of each variant, ``--repeats`` interleaved samples in this process after a warm-up;
medians. Agreement: the max abs difference of the entropy and of the gradient between ``chunked`` and ``openrlhf``.

``--actor`` adds the same measurement one level up: OpenRLHF's real ``Actor.forward(..., return_entropy=True)`` on
a tiny random Llama (hidden 64, one layer, vocabulary ``--vocab``, one sequence of ``--actor-tokens`` tokens, the
second half the response) with the loss ``-mean(log p) - 0.01 mean(entropy)`` and its backward, allocator peak,
for ``none`` (no entropy), ``openrlhf``, ``openrlhf-eager`` and ``chunked``: what the entropy bonus adds to the
peak of a training micro-batch, with the log-probs' own memory (here OpenRLHF's CPU path) beside it.

No target: it reports. Uses the test suite's flash-attn / vLLM stand-ins to import OpenRLHF on a CPU machine.

    python benchmarks/bench_entropy_bonus.py [--n 8192] [--vocab 32768] [--chunk-rows 1024] [--repeats 3]
                                             [--mem-repeats 3] [--device cpu|cuda] [--actor] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
from pathlib import Path

import torch

from _timing import BackgroundLoad, interleaved_times, median, print_result, synchronize

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--n", type=int, default=8192, help="rows (tokens) of logits (default 8192)")
parser.add_argument("--vocab", type=int, default=32768, help="vocabulary size (default 32768)")
parser.add_argument("--chunk-rows", type=int, default=None, help="chunked_entropy's rows per chunk (default: its own)")
parser.add_argument("--repeats", type=int, default=3, help="timed samples per variant (default 3)")
parser.add_argument("--mem-repeats", type=int, default=3, help="fresh processes per variant for memory (default 3)")
parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
parser.add_argument("--actor", action="store_true", help="also measure OpenRLHF's Actor.forward + backward")
parser.add_argument("--actor-tokens", type=int, default=4096, help="tokens of the --actor sequence (default 4096)")
parser.add_argument("--quick", action="store_true", help="a smoke run: 512 x 4096 logits, 1 repeat, 1 process each")
parser.add_argument("--worker", help=argparse.SUPPRESS)
args = parser.parse_args()
if args.quick:
    args.n, args.vocab, args.repeats, args.mem_repeats, args.actor_tokens = 512, 4096, 1, 1, 512

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import openrlhf_standins  # noqa: E402

openrlhf_standins.install()
from openrlhf.models.utils import compute_entropy  # noqa: E402

from stare.algorithms.entropy_bonus import DEFAULT_CHUNK_ROWS, chunked_entropy  # noqa: E402

device = torch.device(args.device)
chunk_rows = args.chunk_rows or DEFAULT_CHUNK_ROWS
ENTROPY = {
    "openrlhf": compute_entropy,
    "openrlhf-eager": compute_entropy.__wrapped__,
    "chunked": lambda z: chunked_entropy(z, chunk_rows),
}
VARIANTS = list(ENTROPY)
ACTOR_VARIANTS = ["none", *VARIANTS]
MIB = 2 ** 20


def make_inputs(n: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [1, n, vocab] (OpenRLHF's packed layout) at a logit scale of 3 and an incoming gradient, seeded; built
    without a temporary of their size, so the process's high-water mark is the inputs themselves."""
    gen = torch.Generator(device=device).manual_seed(0)
    z = torch.randn(1, n, vocab, generator=gen, device=device).mul_(3.0).requires_grad_(True)
    return z, torch.randn(1, n, generator=gen, device=device)


def forward_backward(variant: str, z: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = ENTROPY[variant](z)
    (grad,) = torch.autograd.grad(h, z, g)
    return h, grad


def compile_first(variant: str, vocab: int) -> None:
    """Compile OpenRLHF's function (a static graph, then the dynamic one) on toy inputs, before the measured ones."""
    if variant == "openrlhf":
        for rows in (8, 9):
            z = torch.randn(1, rows, vocab, device=device, requires_grad=True)
            forward_backward(variant, z, torch.ones(1, rows, device=device))


# ---- worker: one variant, once, in a fresh process; prints its extra memory as JSON ----------------------------
def allocated(fn) -> tuple[int, int]:
    """(peak, net) bytes that torch's allocator hands out while ``fn()`` runs: on CPU from the profiler's memory
    events, on CUDA from the allocator's counters."""
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before, torch.cuda.memory_allocated(device) - before
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    now = peak = 0
    for _, nbytes in events:
        now += nbytes
        peak = max(peak, now)
    return peak, now


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def worker(variant: str) -> dict:
    if args.worker.startswith("actor:"):
        return actor_worker(variant)
    compile_first(variant, args.vocab)
    z, g = make_inputs(args.n, args.vocab)
    box = {}
    base = rss()
    fwd_peak, fwd_kept = allocated(lambda: box.setdefault("h", ENTROPY[variant](z)))
    rss_fwd_peak, rss_fwd_kept = peak_rss() - base, rss() - base
    bwd_peak, _ = allocated(lambda: box.setdefault("grad", torch.autograd.grad(box["h"], z, g)[0]))
    rss_both = peak_rss() - base
    assert torch.isfinite(box["h"]).all() and torch.isfinite(box["grad"]).all()
    out = {"variant": variant, "fwd_peak": fwd_peak, "fwd_kept": fwd_kept, "peak": max(fwd_peak, fwd_kept + bwd_peak)}
    if device.type == "cpu":
        out.update(rss_fwd_peak=rss_fwd_peak, rss_fwd_kept=rss_fwd_kept, rss_peak=rss_both)
    return out


def actor_worker(variant: str) -> dict:
    """One micro-batch of OpenRLHF's Actor.forward (+ the entropy when asked) and the loss's backward."""
    from openrlhf.models import Actor
    from openrlhf.models import actor as models_actor
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tokens = args.actor_tokens
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=tokens + 16)
    actor = Actor(LlamaForCausalLM(cfg).float().to(device))
    actor.packing_samples = False
    if variant != "none":
        models_actor.compute_entropy = ENTROPY[variant]

    def step(n_tokens: int) -> None:
        seq = torch.randint(0, args.vocab, (1, n_tokens), device=device)
        attn = torch.ones(1, n_tokens, dtype=torch.long, device=device)
        action_mask = torch.ones(1, n_tokens // 2, dtype=torch.bool, device=device)
        log_probs, out = actor(seq, action_mask, attn, return_output=True, return_entropy=variant != "none")
        loss = -log_probs.mean()
        if variant != "none":
            loss = loss - 0.01 * out.entropy[:, -action_mask.shape[1]:].mean()
        del out
        loss.backward()
        actor.zero_grad(set_to_none=True)

    step(16)  # warm-up, and OpenRLHF's compilation: a static graph, then the dynamic one
    step(17)
    peak, _ = allocated(lambda: step(tokens))
    return {"variant": variant, "peak": peak}


if args.worker:
    print("WORKER " + json.dumps(worker(args.worker.split(":")[-1])))
    sys.exit(0)


# ---- parent: memory via fresh workers, then agreement and interleaved timing here ------------------------------
def measure(variant: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", variant, "--device", args.device, "--n",
           str(args.n), "--vocab", str(args.vocab), "--chunk-rows", str(chunk_rows), "--actor-tokens",
           str(args.actor_tokens)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"memory worker {variant!r} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("WORKER "))
    return json.loads(line[len("WORKER "):])


def worst(runs: list[dict]) -> dict:
    return {k: (max(r[k] for r in runs) if k != "variant" else runs[0][k]) for k in runs[0]}


load = BackgroundLoad()
tv = args.n * args.vocab * 4  # one [N, V] float32 tensor
memory = {v: worst([measure(v) for _ in range(args.mem_repeats)]) for v in VARIANTS}
actor_memory = {}
if args.actor:
    actor_memory = {v: worst([measure(f"actor:{v}") for _ in range(args.mem_repeats)]) for v in ACTOR_VARIANTS}

for v in VARIANTS:
    compile_first(v, args.vocab)
z, g = make_inputs(args.n, args.vocab)
h_c, grad_c = forward_backward("chunked", z, g)
h_o, grad_o = forward_backward("openrlhf", z, g)
diff = {"entropy": float((h_c - h_o).detach().abs().max()), "grad": float((grad_c - grad_o).abs().max())}
del h_c, grad_c, h_o, grad_o
times = interleaved_times({v: (lambda v=v: forward_backward(v, z, g)) for v in VARIANTS}, repeats=args.repeats,
                          warmup=1, device=device)
med = {v: median(ts) for v, ts in times.items()}

chunk = min(chunk_rows, args.n) * args.vocab * 4  # the buffers hold at most N rows
print(f"entropy bonus's entropy, forward + backward: N={args.n} x V={args.vocab} float32 (one [N, V] float32 tensor "
      f"= TV = {tv / MIB:.0f} MiB), chunk {chunk_rows} rows ({chunk / MIB:.0f} MiB a buffer), device={device}, "
      f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}"
      + (f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""))
print(f"  agreement chunked vs openrlhf: entropy {diff['entropy']:.3g}, gradient {diff['grad']:.3g} (max abs)")
print(f"  extra memory over the inputs, worst of {args.mem_repeats} fresh processes each (MiB, and in TV):")
how = "allocator" if device.type == "cuda" else "allocator (profiler events) | peak RSS"
print(f"  {'variant':16s} {'forward peak':>22s} {'kept for backward':>22s} {'forward+backward peak':>24s}   [{how}]")


def cell(nbytes: int) -> str:
    return f"{nbytes / MIB:9.1f} ({nbytes / tv:5.3f})"


for v in VARIANTS:
    m = memory[v]
    print(f"  {v:16s} {cell(m['fwd_peak']):>22s} {cell(m['fwd_kept']):>22s} {cell(m['peak']):>24s}")
    if "rss_peak" in m:
        print(f"  {'  peak RSS':16s} {cell(m['rss_fwd_peak']):>22s} {cell(m['rss_fwd_kept']):>22s} "
              f"{cell(m['rss_peak']):>24s}")
print(f"  chunked, predicted: forward 2 chunks = {2 * chunk / MIB:.1f} MiB; forward+backward the gradient + 1 chunk = "
      f"{(tv + chunk) / MIB:.1f} MiB")
ratio = memory["chunked"]["fwd_peak"] / memory["openrlhf"]["fwd_peak"]
ratio_peak = memory["chunked"]["peak"] / memory["openrlhf"]["peak"]
print(f"  chunked / openrlhf (allocator): forward peak {ratio:.3f}, forward+backward peak {ratio_peak:.3f}; "
      f"chunked / openrlhf-eager forward+backward peak "
      f"{memory['chunked']['peak'] / memory['openrlhf-eager']['peak']:.3f}")
print(f"  {args.repeats} interleaved samples of forward + backward; medians:")
for v in VARIANTS:
    print(f"  {v + ':':16s} {med[v] * 1e3:9.1f} ms   ({med[v] / med['openrlhf']:.2f} x openrlhf)")
if actor_memory:
    print(f"  OpenRLHF's Actor.forward + backward, {args.actor_tokens} tokens, V={args.vocab} (TV here "
          f"{args.actor_tokens * args.vocab * 4 / MIB:.0f} MiB), allocator peak, worst of {args.mem_repeats}:")
    actor_tv = args.actor_tokens * args.vocab * 4
    for v in ACTOR_VARIANTS:
        p = actor_memory[v]["peak"]
        print(f"  {v:16s} {p / MIB:9.1f} MiB ({p / actor_tv:5.3f} TV; "
              f"{(p - actor_memory['none']['peak']) / actor_tv:+.3f} TV over none)")
print(load.line())
result = {
    "bench": "entropy_bonus", "device": str(device), "n": args.n, "vocab": args.vocab, "chunk_rows": chunk_rows,
    "repeats": args.repeats, "background_load_cores": load.cores(), "max_abs_diff": diff,
    "memory_mib": {v: {k: x / MIB for k, x in m.items() if k != "variant"} for v, m in memory.items()},
    "memory_tv": {v: {k: x / tv for k, x in m.items() if k != "variant"} for v, m in memory.items()},
    "ms": {v: med[v] * 1e3 for v in VARIANTS}, "forward_peak_ratio": ratio, "peak_ratio": ratio_peak,
}
if actor_memory:
    result["actor_peak_tv"] = {v: m["peak"] / (args.actor_tokens * args.vocab * 4) for v, m in actor_memory.items()}
print_result(result)
