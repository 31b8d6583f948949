"""``entropy_sensitivity(..., kernel="compiled")``: the per-row statistics as one ``torch.compile``d function.

The Triton kernel's sums (see ``_entropy_triton``), written as tensor operations and left to TorchInductor to
fuse: on CPU it generates one C++ loop nest per row block (a pass for the row maximum, a second that takes the
exponential and the four sums together), vectorised and without any [rows, V] temporary; on CUDA it generates a
Triton kernel. With ``u_j = z_j - max z`` and ``e_j = e^{u_j}``:

    S0 = sum e_j    S1 = sum u_j e_j    S2 = sum e_j^2    S3 = sum u_j e_j^2

    H = log S0 - S1 / S0,    s_a = log S0 - u_a,    Phi = p_a (s_a - H) - (S2 S1 / S0 - S3) / S0^2

Every term of S1 and S3 has the same sign (u_j <= 0), so nothing cancels inside the sums; H is the sum of two
non-negative numbers. Compared with the eager torch path (a softmax and about eight more passes, each writing or
reading a [rows, V] float32 chunk), this reads each logit twice and writes nothing per logit, so it is faster on
CPU (figures: docs/benchmarks.md). The price is the compilation, once per process and input kind (dtype, layout),
much shorter when Inductor's on-disk cache is warm. It needs what ``torch.compile`` needs on the device (a C++
compiler on CPU). Imported lazily; ``stare.algorithms`` itself never compiles anything.

-inf logits (a masked vocabulary) count as p = 0, and an action whose logit is -inf gets s_a = inf and Phi its
p_a -> 0 limit, an action id outside [0, V) NaN, a row with no finite logit NaN: the Triton kernel's behaviour.
"""
from __future__ import annotations

import functools

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

# Logits below LOW (-inf) are raised to it: far below any real logit, so e^(u) is exactly 0, yet finite, so u e^u
# is 0 and not -inf * 0 = NaN. A row maximum still below FLOOR had no finite logit at all.
LOW = -2e30
FLOOR = -1e30


def _row_stats(x: torch.Tensor, actions: torch.Tensor, inv_temperature: torch.Tensor):
    """(H, s_a, Phi) float32 [rows] for logits ``x`` [rows, V] (any float dtype and strides), ``actions`` [rows]."""
    vocab = x.shape[-1]
    z = torch.clamp_min(x.to(torch.float32) * inv_temperature, LOW)  # NaN stays NaN
    m = z.amax(dim=-1, keepdim=True)
    u = z - m
    e = torch.exp(u)
    ue = u * e
    s0 = e.sum(dim=-1)
    s1 = ue.sum(dim=-1)
    s2 = (e * e).sum(dim=-1)
    s3 = (ue * e).sum(dim=-1)
    log_s0 = torch.log(s0)
    mean_u = s1 / s0  # sum_j p_j u_j
    h = log_s0 - mean_u
    valid = (actions >= 0) & (actions < vocab)
    index = actions.clamp(0, vocab - 1).unsqueeze(-1)
    z_a = x.gather(-1, index).squeeze(-1).to(torch.float32) * inv_temperature  # the raw logit: -inf stays -inf
    s_a = torch.where(valid, log_s0 - (z_a - m.squeeze(-1)), float("nan"))
    p_a = torch.exp(-s_a)
    second = (s2 * mean_u - s3) / (s0 * s0)  # sum_j p_j^2 (s_j - H)
    phi = torch.where(p_a == 0.0, 0.0, p_a * (s_a - h)) - second  # p_a (s_a - H) -> 0 as p_a -> 0
    nothing = m.squeeze(-1) < FLOOR  # no finite logit: no distribution
    nan = torch.full_like(h, float("nan"))
    return torch.where(nothing, nan, h), torch.where(nothing, nan, s_a), torch.where(nothing, nan, phi)


# Graphs per process: one per input kind (dtype; one row or many; the strides of the tensor the rows are a view
# of). A training run meets one or two kinds; the tests meet a dozen. Past the limit a call raises (fullgraph).
RECOMPILE_LIMIT = 32


@functools.lru_cache(maxsize=None)
def _compiled():
    # dynamic: the row count (and the vocabulary) change from call to call; one graph serves them all
    return torch.compile(_row_stats, dynamic=True, fullgraph=True)


def entropy_stats_rows(
    rows: torch.Tensor, actions: torch.Tensor, entropy: torch.Tensor, surprisal: torch.Tensor, phi: torch.Tensor,
    *, temperature: float,
) -> None:
    """Fill ``entropy``, ``surprisal``, ``phi`` (float32 ``[r]``) for logits ``rows`` ``[r, V]`` and ``actions`` ``[r]``."""
    if rows.shape[0] == 0:
        return
    inv_t = torch.full((), 1.0 / temperature, dtype=torch.float32, device=rows.device)
    if _get_current_dispatch_mode() is not None:
        # under a TorchDispatchMode (a profiler counting ops, fake tensors) torch.compile does not trace: the same
        # function runs eagerly, op by op (the same numbers to rounding, with [rows, V] temporaries)
        h, s_a, ph = _row_stats(rows, actions, inv_t)
    else:
        rows = rows.detach()
        if rows.stride(-1) != 1:  # a vocabulary with a stride (rare): these rows copied, one kind fewer to compile
            rows = rows.contiguous()
        try:
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                h, s_a, ph = _compiled()(rows, actions, inv_t)
        except Exception as exc:  # torch.compile reports a missing compiler and the like only at the first call
            raise RuntimeError(
                f"kernel='compiled' could not compile the statistics on {rows.device.type} ({type(exc).__name__}: "
                f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}); torch.compile needs a working "
                "C++ compiler on CPU and Triton on CUDA. Use kernel='torch' (or 'auto')") from exc
    entropy.copy_(h)
    surprisal.copy_(s_a)
    phi.copy_(ph)
