"""Fused Triton kernel for ``entropy_sensitivity``: entropy H, the action's surprisal s_a and Phi per row.

Imported lazily (only when ``kernel="triton"`` is chosen), so ``stare.algorithms`` needs no Triton. One program
per logits row reads the row once, in ``BLOCK_V`` columns at a time, accumulates in float32 whatever the
logits' dtype, and writes three float32 numbers: no [rows, V] temporary exists anywhere.

The streaming form (``z`` = logits / temperature of one row, ``m`` = the running maximum of the columns read
so far, ``u_j = z_j - m``):

    S0 = sum_j e^{u_j}          S1 = sum_j u_j e^{u_j}
    S2 = sum_j e^{2 u_j}        S3 = sum_j u_j e^{2 u_j}

When a new block raises the maximum from ``m`` to ``m'`` (``d = m - m' <= 0``, ``alpha = e^d``), every ``u_j``
of the columns already summed becomes ``u_j + d`` and every ``e^{u_j}`` becomes ``alpha e^{u_j}``, so

    S0 <- alpha S0                  S1 <- alpha (S1 + d S0)
    S2 <- alpha^2 S2                S3 <- alpha^2 (S3 + d S2)

and then the new block's terms are added. At the end, with ``log p_j = u_j - log S0`` and ``p_j = e^{u_j} / S0``:

    H            = -sum_j p_j log p_j         = log S0 - S1 / S0
    s_a          = -log p_a                   = log S0 - u_a
    sum_j p_j^2 (s_j - H)                     = (S2 S1 / S0 - S3) / S0^2
                   (because s_j - H = S1 / S0 - u_j)
    Phi          = p_a (s_a - H) - sum_j p_j^2 (s_j - H),   p_a = e^{-s_a}

S0 and S2 are at least 1 (the maximum's own term is e^0), so nothing divides by a small number. The four sums
are kept per lane (``BLOCK_V`` float32 accumulators sharing one scalar running maximum) and reduced across
lanes once at the end; the rescale runs only for blocks that raise the maximum (a branch uniform over the
program), which after the first few blocks of a row is rare.

In the kernel the same sums are taken in base 2: ``w = z log2(e)`` (one multiply by ``scale = log2(e) / T``),
``e^{u_j} = 2^{w_j - m2}``, so each exponential is a single ex2 instruction; the sums of ``(w_j - m2) 2^{...}``
are ``S1 / ln 2`` and ``S3 / ln 2`` and the rescale has the same form with ``alpha = 2^{d2}`` (the loop's
instruction count on sm_90: docs/benchmarks.md).

-inf logits (a masked vocabulary) and the masked tail of the last block are raised to a finite LOW below the
initial maximum FLOOR: their ``2^{w - m2}`` is exactly 0 and their ``(w - m2) 2^{w - m2}`` is 0, not
-inf * 0. An action whose logit is -inf gets s_a = inf and Phi = -sum_j p_j^2 (s_j - H) (the p_a -> 0 limit).
A row with no finite logit, or an action id outside [0, V), gives NaN (ids are not checked on the host: no
synchronisation; the NaN is visible downstream). NaN logits give NaN.
"""
from __future__ import annotations

import contextlib
import math

import torch
import triton
import triton.language as tl
from triton import knobs

# The running maximum (base-2 units) starts at FLOOR; logits below LOW (-inf, masked vocabulary entries, and the
# masked tail of the last block) are raised to LOW. Both are far below any real logit, so 2^(w - m) underflows
# to exactly 0, yet finite, so (w - m) 2^(w - m) is 0 and not -inf * 0 = NaN, and the rescale terms d * S stay
# finite. (A global read inside @triton.jit must be a constexpr.)
FLOOR = tl.constexpr(-1e30)
LOW = tl.constexpr(-2e30)
LN2 = tl.constexpr(0.6931471805599453)
LOG2_E = 1.0 / math.log(2.0)


# Reductions through tl.reduce with combine functions defined here, tl.full for zeros: tl.max, tl.sum, tl.zeros are
# @triton.jit functions of triton.language, made compiled or interpreted once, when triton is first imported,
# so under TRITON_INTERPRET=1 set after that import (a test process) they could not be called. These two are
# made whenever this module is (re)imported, and compile to the same reductions on a GPU.
@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _exp2(x, FAST: tl.constexpr):
    """2^x: on a GPU one MUFU.EX2 with subnormal results flushed to 0 (tl.exp2 adds a range check and two
    multiplies around it to keep them); in the interpreter, which runs no PTX, tl.exp2."""
    if FAST:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return tl.exp2(x)


@triton.jit
def _entropy_stats_kernel(
    x_ptr, act_ptr, h_ptr, s_ptr, phi_ptr,
    inner, stride_outer, stride_inner, stride_v, V, scale,
    BLOCK_V: tl.constexpr, FAST_EXP: tl.constexpr,
):
    # Base 2 inside the loop: w = z log2(e) (scale = log2(e) / temperature), e^(z - m) = 2^(w - m2), so the
    # exponential is one ex2 with no extra multiply; S1 and S3 are summed in base-2 units and times ln 2 at the end.
    r = tl.program_id(0)
    i = r // inner
    j = r - i * inner
    row = x_ptr + i.to(tl.int64) * stride_outer + j.to(tl.int64) * stride_inner
    offs = tl.arange(0, BLOCK_V)
    m = tl.reduce(tl.full([BLOCK_V], FLOOR, tl.float32), 0, _max)
    s0 = tl.full([BLOCK_V], 0.0, tl.float32)
    s1 = tl.full([BLOCK_V], 0.0, tl.float32)
    s2 = tl.full([BLOCK_V], 0.0, tl.float32)
    s3 = tl.full([BLOCK_V], 0.0, tl.float32)
    # software prefetch: the next block's load is issued before this block's reduction and arithmetic
    nxt = tl.load(row + offs.to(tl.int64) * stride_v, mask=offs < V, other=float("-inf"))
    for start in range(0, V, BLOCK_V):
        # -inf (and the masked tail) become LOW < FLOOR <= m: 2^(w - m) = 0 and (w - m) 2^(w - m) = 0 exactly;
        # NaN stays NaN (max.NaN)
        w = tl.maximum(nxt.to(tl.float32) * scale, LOW, propagate_nan=tl.PropagateNan.ALL)
        cols = start + BLOCK_V + offs
        nxt = tl.load(row + cols.to(tl.int64) * stride_v, mask=cols < V, other=float("-inf"))
        m_new = tl.maximum(m, tl.reduce(w, 0, _max))
        if m_new > m:  # the same for the whole program; after the first blocks the maximum rarely moves
            d = m - m_new  # finite, and about -1e30 (alpha = 0) while m is still FLOOR
            alpha = _exp2(d, FAST_EXP)
            s1 = alpha * (s1 + d * s0)
            s0 = alpha * s0
            alpha2 = alpha * alpha
            s3 = alpha2 * (s3 + d * s2)
            s2 = alpha2 * s2
            m = m_new
        u = w - m
        e = _exp2(u, FAST_EXP)
        ue = u * e
        s0 += e
        s1 += ue
        s2 += e * e
        s3 += ue * e
    S0 = tl.reduce(s0, 0, _add)
    S1 = tl.reduce(s1, 0, _add) * LN2  # natural units from here on
    S2 = tl.reduce(s2, 0, _add)
    S3 = tl.reduce(s3, 0, _add) * LN2
    log_s0 = tl.log(S0)
    mean_u = S1 / S0  # sum_j p_j u_j
    h = log_s0 - mean_u
    a = tl.load(act_ptr + r).to(tl.int64)
    valid = (a >= 0) & (a < V)
    w_a = tl.load(row + a * stride_v, mask=valid, other=float("nan")).to(tl.float32) * scale
    s_a = log_s0 - (w_a - m) * LN2  # +inf for an action whose logit is -inf
    p_a = tl.exp(-s_a)
    inv_s0 = 1.0 / S0
    second = (S2 * mean_u - S3) * inv_s0 * inv_s0
    phi = tl.where(p_a == 0.0, 0.0, p_a * (s_a - h)) - second  # p_a (s_a - H) -> 0 as p_a -> 0 (not 0 * inf)
    nothing = m == FLOOR  # no logit above LOW (all -inf): no distribution, NaN like the torch path's
    tl.store(h_ptr + r, tl.where(nothing, float("nan"), h))
    tl.store(s_ptr + r, tl.where(nothing, float("nan"), s_a))
    tl.store(phi_ptr + r, tl.where(nothing, float("nan"), phi))


# (BLOCK_V, num_warps): 8 or 16 columns per thread, which compile for sm_90 without register spills; 32 per thread
# reaches the per-thread register limit (register counts: docs/benchmarks.md).
_CONFIGS = [
    triton.Config({"BLOCK_V": block}, num_warps=warps, num_stages=1)
    for block, warps in ((1024, 4), (2048, 8), (4096, 16), (8192, 32), (2048, 4), (4096, 8), (8192, 16))
]
_tuned_kernel = triton.autotune(configs=_CONFIGS, key=["V"])(_entropy_stats_kernel)

# Under TRITON_INTERPRET=1 (CPU tests) one fixed, small block: the interpreter runs each program in Python.
INTERPRET_BLOCK_V = 256


def interpreting() -> bool:
    return bool(knobs.runtime.interpret)


def entropy_stats_block(
    block: torch.Tensor, actions: torch.Tensor, entropy: torch.Tensor, surprisal: torch.Tensor, phi: torch.Tensor,
    *, temperature: float, block_v: int | None = None,
) -> None:
    """Fill ``entropy``, ``surprisal``, ``phi`` (float32, contiguous, ``[k * m]``) for logits ``block`` ``[k, m, V]``.

    ``block`` may have any strides (the last one need not be 1); ``actions`` is ``[k * m]`` int64, contiguous,
    in the same row order (row ``r`` is ``block[r // m, r % m]``). ``block_v`` forces the column block (a power
    of two); by default the autotuned one on a GPU, ``INTERPRET_BLOCK_V`` under the interpreter.
    """
    k, m, vocab = block.shape
    rows = k * m
    if rows == 0:
        return
    args = (block, actions, entropy, surprisal, phi, m, block.stride(0), block.stride(1), block.stride(2), vocab,
            LOG2_E / temperature)
    fast = not interpreting()
    with torch.cuda.device(block.device) if block.device.type == "cuda" else contextlib.nullcontext():
        if block_v is None and fast:
            _tuned_kernel[(rows,)](*args, FAST_EXP=True, enable_fp_fusion=True)
        else:
            bv = block_v or min(INTERPRET_BLOCK_V, triton.next_power_of_2(vocab))
            _entropy_stats_kernel[(rows,)](*args, BLOCK_V=bv, FAST_EXP=fast, num_warps=4, enable_fp_fusion=True)
