"""Cost of STARE's once-per-step token selection, in units of one order statistic.

Times ``stare.algorithms.stare_token_weights`` (quantile selection, variant C2, gate on, top 10%) over a
whole 2M-token step (512 sequences x 4096 tokens) against ONE ``torch.kthvalue`` of a tensor of the same
2M elements: the floor for any exact top-share rule. The selection needs two thresholds (A > 0 and A < 0
tokens) plus masking, so a small multiple of that floor is expected. Samples are interleaved; medians.

Target: selection / kthvalue <= 3.

    python benchmarks/bench_selection.py [--repeats 50] [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import platform

import torch

from _timing import BackgroundLoad, interleaved_times, median, print_result, verdict

TARGET = 3.0

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--repeats", type=int, default=50, help="timed samples per variant (default 50)")
parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
parser.add_argument("--batch", type=int, default=512)
parser.add_argument("--seq-len", type=int, default=4096)
args = parser.parse_args()

from stare.algorithms import reweight_stats, stare_token_weights, top_count  # noqa: E402

device = torch.device(args.device)
gen = torch.Generator().manual_seed(0)
B, T = args.batch, args.seq_len
TOP_RATIO = 0.1

# One step's batch: sampled-token log-probs -Exponential (mean surprisal 0.5 nats, long tail), per-sequence
# advantages of both signs with a share of zeros (groups where every answer scored the same), and padding:
# response lengths uniform in [T/4, T] (about 62% of the slots are response tokens).
logprobs = -torch.empty(B, T).exponential_(2.0, generator=gen)
advantages = torch.randn(B, generator=gen)
advantages[torch.rand(B, generator=gen) < 0.25] = 0.0
lengths = torch.randint(T // 4, T + 1, (B,), generator=gen)
mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float32)
logprobs, advantages, mask = logprobs.to(device), advantages.to(device), mask.to(device)

# The baseline: one k-th value of a 2M-element tensor, at the same order statistic (top 10%).
flat = (-logprobs).reshape(-1).contiguous()
n = flat.numel()
k_small = n - top_count(TOP_RATIO, n) + 1


def selection():
    stare_token_weights(logprobs, advantages, mask, selection="quantile", variant="C2", gate_on=True,
                        top_ratio=TOP_RATIO)


def one_kthvalue():
    torch.kthvalue(flat, k_small)


# Sanity: about 10% of the A > 0 and of the A < 0 response tokens get a weight other than 1.
stats = reweight_stats(stare_token_weights(logprobs, advantages, mask, selection="quantile", variant="C2",
                                           gate_on=True, top_ratio=TOP_RATIO), advantages, mask)
pos_share, neg_share = float(stats["positive_reweight_ratio"]), float(stats["negative_reweight_ratio"])

load = BackgroundLoad()
times = interleaved_times({"selection": selection, "kthvalue": one_kthvalue}, repeats=args.repeats, warmup=3,
                          device=device)
med = {name: median(ts) for name, ts in times.items()}
ratio = med["selection"] / med["kthvalue"]

print(f"stare_token_weights(quantile, C2, top {TOP_RATIO:.0%}) over [{B}, {T}] = {n / 1e6:.2f}M tokens "
      f"({int(mask.sum()) / 1e6:.2f}M response), device={device}, torch {torch.__version__}, "
      f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
print(f"  reweighted share: A>0 {pos_share:.4f}, A<0 {neg_share:.4f}")
print(f"  {args.repeats} interleaved samples; medians:")
print(f"  selection:        {med['selection'] * 1e3:9.2f} ms")
print(f"  one kthvalue(2M): {med['kthvalue'] * 1e3:9.2f} ms")
print(f"  ratio selection/kthvalue = {ratio:.3f}   target <= {TARGET:.2f}   {verdict(ratio, TARGET)}")
print(load.line())
print_result({
    "background_load_cores": load.cores(),
    "bench": "selection", "device": str(device), "shape": [B, T], "repeats": args.repeats,
    "selection_ms": med["selection"] * 1e3, "kthvalue_ms": med["kthvalue"] * 1e3,
    "positive_reweight_ratio": pos_share, "negative_reweight_ratio": neg_share,
    "ratio": ratio, "target": TARGET, "pass": ratio <= TARGET,
})
