"""Cost of STARE's per-token weights in the policy loss.

Times ``stare.algorithms.policy_loss`` forward + backward with ``weights=`` a per-token weight tensor against
the very same call with ``weights=None``, on an 8 x 4096 micro-batch with DAPO settings (token-mean,
clip 0.2 / 0.28, dual clip 10). One call is small, so each timed sample is a loop of ``--calls`` calls; the
two variants' samples are interleaved and the medians compared.

Target: weighted / plain <= 1.10.

    python benchmarks/bench_weighted_loss.py [--repeats 30] [--calls 50] [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import platform

import torch

from _timing import BackgroundLoad, interleaved_times, median, print_result, verdict

TARGET = 1.10

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--repeats", type=int, default=30, help="timed samples per variant (default 30)")
parser.add_argument("--calls", type=int, default=50, help="forward+backward calls per timed sample (default 50)")
parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--seq-len", type=int, default=4096)
args = parser.parse_args()

from stare.algorithms import policy_loss  # noqa: E402  (after argparse so --help is instant)

device = torch.device(args.device)
gen = torch.Generator().manual_seed(0)
B, T = args.batch, args.seq_len

# Inputs that look like one micro-batch of a step: sampled-token log-probs (-Exponential), the new policy a
# little off the old one, per-sequence advantages of both signs (and a zero), the tail of most rows padded.
old_logprobs = -torch.empty(B, T).exponential_(1.0, generator=gen)
logprobs = old_logprobs + 0.05 * torch.randn(B, T, generator=gen)
advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0, 2.0, -2.0, 0.7]).repeat((B + 7) // 8)[:B]
advantages = advantages[:, None].expand(B, T).contiguous()
lengths = torch.randint(T // 4, T + 1, (B,), generator=gen)
lengths[0] = T
mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float32)
# STARE-like weights: 1.0 on most tokens, 1.1 on a random 10%.
weights = torch.where(torch.rand(B, T, generator=gen) < 0.1, 1.1, 1.0).to(torch.float32)

old_logprobs, advantages, mask, weights = (t.to(device) for t in (old_logprobs, advantages, mask, weights))
logprobs = logprobs.to(device).requires_grad_(True)

DAPO = dict(agg="token-mean", clip_low=0.2, clip_high=0.28, dual_clip=10.0)


def run(w):
    def loop():
        for _ in range(args.calls):
            loss, _metrics = policy_loss(logprobs, old_logprobs, advantages, mask, weights=w, **DAPO)
            loss.backward()
            logprobs.grad = None
    return loop


# Same loss where all weights are 1 (sanity: the weighted path is the plain path times the weights).
with torch.no_grad():
    plain_loss, _ = policy_loss(logprobs, old_logprobs, advantages, mask, **DAPO)
    ones_loss, _ = policy_loss(logprobs, old_logprobs, advantages, mask, weights=torch.ones_like(weights), **DAPO)
assert torch.allclose(plain_loss, ones_loss), (plain_loss, ones_loss)

load = BackgroundLoad()
times = interleaved_times({"weighted": run(weights), "plain": run(None)}, repeats=args.repeats, warmup=3, device=device)
per_call = {name: median(ts) / args.calls for name, ts in times.items()}
ratio = per_call["weighted"] / per_call["plain"]

print(f"policy_loss fwd+bwd, [{B}, {T}] float32, DAPO settings, device={device}, torch {torch.__version__}, "
      f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
print(f"  {args.repeats} interleaved samples x {args.calls} calls each; medians per call:")
print(f"  weighted (10% at 1.1): {per_call['weighted'] * 1e6:9.1f} us")
print(f"  plain (weights=None):  {per_call['plain'] * 1e6:9.1f} us")
print(f"  ratio weighted/plain = {ratio:.3f}   target <= {TARGET:.2f}   {verdict(ratio, TARGET)}")
print(load.line())
print_result({
    "background_load_cores": load.cores(),
    "bench": "weighted_loss", "device": str(device), "shape": [B, T], "repeats": args.repeats, "calls": args.calls,
    "weighted_us": per_call["weighted"] * 1e6, "plain_us": per_call["plain"] * 1e6,
    "ratio": ratio, "target": TARGET, "pass": ratio <= TARGET,
})
