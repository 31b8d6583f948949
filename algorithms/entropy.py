"""Entropy, surprisal and the first-order entropy sensitivity Phi, plus the statistics built on them.

For one position with next-token distribution p, surprisal s_j = -log p_j and entropy H = sum_j p_j s_j, a
policy-gradient step of size eta on the sampled token a with advantage A moves the logits by
eta A (e_a - p) and, to first order, the entropy by eta A Phi with

    Phi(p, a) = p_a (s_a - H) - sum_j p_j^2 (s_j - H)

(section 1 of docs/algorithm.md). ``entropy_sensitivity`` computes H, s_a and Phi in one pass over
the logits, in float32, without gradient, with one of four kernels:

- ``torch``: ``chunk_size`` rows at a time; the extra memory is two chunk x V float32 buffers for the whole
  call, never N x V.
- ``triton`` (``_entropy_triton``, CUDA, or the CPU interpreter under ``TRITON_INTERPRET=1``): one fused pass
  per row with a streaming (online max) softmax; the only extra memory is the three [N] outputs.
- ``compiled`` (``_entropy_compiled``, any device ``torch.compile`` supports): the same sums written as tensor
  operations and fused by TorchInductor (on CPU a vectorised C++ loop that reads each row twice and writes no
  [rows, V] temporary); ``auto`` never picks it, since it costs a compilation per process.
- ``cpp`` (``_entropy_cpp``, CPU): the same sums as a C++ loop in 16 float lanes with a polynomial exponential,
  built once per machine with its C++ compiler (then cached), the fastest on a CPU core (docs/benchmarks.md).
  ``auto`` never picks it either, so the default CPU numbers stay the torch path's.

All four read the logits through any strided view (``logits[:, :-1][:, -width:]`` as it comes): the leading
dimensions are merged where that is a view and walked in row blocks otherwise, so the logits are never copied
whole.
"""
from __future__ import annotations

import functools
import importlib
import math
from typing import Iterator, NamedTuple

import torch

from ._checks import broadcast_advantages, check_choice, check_range, check_same_shape

# Default chunk, whatever the vocabulary size: about 1M logits (4 MB per float32 buffer) on CPU, where a chunk that
# stays in cache is faster (docs/benchmarks.md); about 4M (16 MB) on other devices, where fewer, larger launches
# count more.
DEFAULT_CHUNK_ELEMENTS = 1 << 22
DEFAULT_CHUNK_ELEMENTS_CPU = 1 << 20
from ._plain import KERNELS  # noqa: E402 - ("auto", "torch", "triton", "compiled", "cpp"), torch-free for the registry


class EntropyStats(NamedTuple):
    entropy: torch.Tensor  # H per position, float32
    surprisal: torch.Tensor  # s_a = -log p_a of the given action, float32
    phi: torch.Tensor | None  # first-order entropy sensitivity, float32 (None: with_phi=False)


def _merge_leading(x: torch.Tensor) -> torch.Tensor:
    """The same elements of ``x`` [..., V] as a view with as few leading dimensions as the strides allow (>= 1).

    Size-1 dimensions are dropped and neighbours (a, b) merged when stride_a == size_b * stride_b, so a
    contiguous tensor becomes [N, V] and ``full[:, :-1][:, -w:]`` of a contiguous [B, T, V] stays [B, w, V].
    """
    sizes, strides = [], []
    for size, stride in zip(x.shape[:-1], x.stride()[:-1]):
        if size == 1:
            continue
        if sizes and strides[-1] == size * stride:
            sizes[-1] *= size
            strides[-1] = stride
        else:
            sizes.append(size)
            strides.append(stride)
    if not sizes:
        sizes, strides = [1], [0]
    if math.prod(sizes) == 0:
        sizes, strides = [0], [0]
    return x.as_strided(sizes + [x.shape[-1]], strides + [x.stride(-1)], x.storage_offset())


def _row_blocks(x: torch.Tensor, max_rows: int, start: int = 0) -> Iterator[tuple[int, torch.Tensor]]:
    """Views ``[k, m, V]`` of ``x`` [..., V] covering its rows in order, each at most ``max_rows`` rows.

    Yields ``(first_row, block)``: the block's rows (in ``reshape(-1)`` order) are rows
    ``first_row .. first_row + k m - 1`` of ``x.reshape(-1, V)``. No data is copied.
    """
    x = _merge_leading(x)
    lead = x.shape[:-1]
    if len(lead) == 1:
        for s in range(0, lead[0], max_rows):
            yield start + s, x[s:s + max_rows].unsqueeze(0)
    elif len(lead) == 2:
        n_outer, n_inner = lead
        if n_inner <= max_rows:  # whole inner runs, several at a time
            step = max_rows // n_inner
            for i in range(0, n_outer, step):
                yield start + i * n_inner, x[i:i + step]
        else:
            for i in range(n_outer):
                for s in range(0, n_inner, max_rows):
                    yield start + i * n_inner + s, x[i, s:s + max_rows].unsqueeze(0)
    else:
        inner = math.prod(lead[1:])
        for i in range(lead[0]):
            yield from _row_blocks(x[i], max_rows, start + i * inner)


def _copy_rows(x: torch.Tensor, lo: int, hi: int, out: torch.Tensor) -> None:
    """Copy rows ``lo .. hi - 1`` of ``x.reshape(-1, V)`` into ``out`` [hi - lo, V], straight from ``x``'s views."""
    x = _merge_leading(x)
    if x.dim() == 2:
        out.copy_(x[lo:hi])
        return
    inner = math.prod(x.shape[1:-1])
    i0, i1 = lo // inner, (hi - 1) // inner
    if i0 == i1:
        _copy_rows(x[i0], lo - i0 * inner, hi - i0 * inner, out)
        return
    head = inner - (lo - i0 * inner)
    _copy_rows(x[i0], lo - i0 * inner, inner, out[:head])
    middle = (i1 - i0 - 1) * inner
    if middle:
        out[head:head + middle].view(x[i0 + 1:i1].shape).copy_(x[i0 + 1:i1])
    _copy_rows(x[i1], 0, hi - i1 * inner, out[head + middle:])


def _rows(x: torch.Tensor, lo: int, hi: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``lo .. hi - 1`` of ``x.reshape(-1, V)`` as a [hi - lo, V] tensor without copying the rest of ``x``.

    A view when those rows lie evenly spaced in memory (always for a contiguous ``x``; within one sequence
    of ``full[:, :-1][:, -w:]``); otherwise a copy of these rows only, into ``out`` when given (converted to its
    dtype; returned).
    """
    x = _merge_leading(x)
    while x.dim() > 2:
        inner = math.prod(x.shape[1:-1])
        i0 = lo // inner
        if (hi - 1) // inner != i0:
            if out is None:
                out = torch.empty(hi - lo, x.shape[-1], dtype=x.dtype, device=x.device)
            _copy_rows(x, lo, hi, out)
            return out
        x, lo, hi = _merge_leading(x[i0]), lo - i0 * inner, hi - i0 * inner
    return x[lo:hi]


@functools.lru_cache(maxsize=None)
def _triton_problem() -> str | None:
    """Why the Triton kernel cannot be used here, or None. Importing ``_entropy_triton`` checks what it needs
    (``triton.language`` and ``triton.knobs``, Triton 3.4 or later), not only that some ``triton`` imports."""
    try:
        importlib.import_module(f"{__package__}._entropy_triton")
    except (ImportError, AttributeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _triton_available() -> bool:
    return _triton_problem() is None


def _resolve_kernel(kernel: str, device: torch.device) -> str:
    check_choice("kernel", kernel, KERNELS)
    if kernel == "auto":
        return "triton" if device.type == "cuda" and _triton_available() else "torch"
    if kernel == "triton":
        if not _triton_available():
            raise ValueError(f"kernel='triton' needs the triton package, 3.4 or later (pip install triton): "
                             f"{_triton_problem()}; use kernel='torch' or 'auto'")
        from . import _entropy_triton
        if device.type != "cuda" and not _entropy_triton.interpreting():
            raise ValueError(f"kernel='triton' needs CUDA tensors (got {device.type}), or TRITON_INTERPRET=1 in the "
                             "environment from the start to run Triton's CPU interpreter; use kernel='torch' or 'auto'")
    if kernel == "cpp" and device.type != "cpu":
        raise ValueError(f"kernel='cpp' runs on CPU tensors (got {device.type}); use kernel='auto' (triton on CUDA) "
                         "or 'torch'")
    return kernel


@torch.no_grad()
def entropy_sensitivity(
    logits: torch.Tensor,
    actions: torch.Tensor,
    *,
    chunk_size: int | None = None,
    temperature: float = 1.0,
    kernel: str = "auto",
    with_phi: bool = True,
) -> EntropyStats:
    """Per-position entropy, the action's surprisal and Phi for logits ``[..., V]`` and actions ``[...]``.

    ``logits`` may be any strided view (it is never copied whole) in any float dtype; the outputs are float32
    ``[...]``. ``temperature`` divides the logits first (the gate wants the entropy at the sampling
    temperature). ``kernel``: ``"torch"`` (chunked, ``chunk_size`` rows at a time, default about 1M logits per
    chunk on CPU, 4M elsewhere), ``"triton"`` (fused single pass, CUDA; ``chunk_size`` is ignored),
    ``"compiled"`` (the same sums fused by ``torch.compile``, any device: faster than the torch path on CPU,
    after a compilation per process and input kind; ``chunk_size`` is ignored), ``"cpp"`` (CPU tensors: the same
    sums as a C++ loop built once per machine with its compiler, faster still on one core; ``chunk_size`` is
    ignored) or ``"auto"`` (triton on CUDA when the kernel module imports, else
    torch). No host synchronisation on any path. ``with_phi=False`` returns ``phi=None`` and, on the torch path, skips Phi's two
    reductions over the vocabulary (entropy and surprisal are the same numbers either way); for callers that need
    only the gate's entropy.
    """
    if logits.dim() < 1 or tuple(actions.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"actions must have the logits' shape without the vocabulary dimension: logits {tuple(logits.shape)}, "
            f"actions {tuple(actions.shape)}"
        )
    if actions.is_floating_point():
        raise ValueError(f"actions must be integer token ids, got dtype {actions.dtype}")
    if actions.device != logits.device:
        raise ValueError(f"actions must be on the logits' device: logits {logits.device}, actions {actions.device}")
    check_range("temperature", temperature, 0, None, low_open=True)
    kernel = _resolve_kernel(kernel, logits.device)
    vocab = logits.shape[-1]
    flat_actions = actions.reshape(-1).to(torch.long)  # [N] ints: small, a copy is fine
    n = flat_actions.shape[0]
    if chunk_size is None:
        per_chunk = DEFAULT_CHUNK_ELEMENTS_CPU if logits.device.type == "cpu" else DEFAULT_CHUNK_ELEMENTS
        chunk_size = max(1, per_chunk // max(vocab, 1))
    check_range("chunk_size", chunk_size, 1, None)

    entropy = torch.empty(n, dtype=torch.float32, device=logits.device)
    surprisal = torch.empty_like(entropy)
    phi = torch.empty_like(entropy) if with_phi or kernel in ("triton", "compiled", "cpp") else None
    if kernel in ("compiled", "cpp"):
        if kernel == "cpp":
            from ._entropy_cpp import entropy_stats_rows
        else:
            from ._entropy_compiled import entropy_stats_rows

        for start, block in _row_blocks(logits, max(n, 1)):
            m = block.shape[1]
            for i in range(block.shape[0]):  # one call per evenly spaced run of rows (a view, never a copy)
                lo, hi = start + i * m, start + (i + 1) * m
                entropy_stats_rows(block[i], flat_actions[lo:hi], entropy[lo:hi], surprisal[lo:hi], phi[lo:hi],
                                   temperature=temperature)
    elif kernel == "triton":
        from ._entropy_triton import entropy_stats_block

        flat_actions = flat_actions.contiguous()
        for start, block in _row_blocks(logits, max(n, 1)):
            end = start + block.shape[0] * block.shape[1]
            entropy_stats_block(block, flat_actions[start:end], entropy[start:end], surprisal[start:end],
                                phi[start:end], temperature=temperature)
    elif n:
        # Two [chunk, V] float32 buffers for the whole call, p and log p, reused by every chunk: a fresh pair per
        # chunk page-faults its memory in again whenever the allocator has handed it back to the OS (the cost:
        # docs/benchmarks.md)
        p_buf = torch.empty(min(chunk_size, n), vocab, dtype=torch.float32, device=logits.device)
        l_buf = torch.empty_like(p_buf)
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            p, logp = p_buf[:end - start], l_buf[:end - start]
            # the same [rows, V] float32 chunks as from a contiguous copy of the logits, without that copy: a view
            # of the logits when they are float32 rows, else converted into the log p buffer
            z = _rows(logits, start, end, out=logp)
            if z is not logp and (z.dtype != torch.float32 or not z.is_contiguous()):
                z = logp.copy_(z)
            if temperature != 1.0:
                z = z.div_(temperature) if z is logp else torch.div(z, temperature, out=logp)
            # one exponential per logit (softmax): the log-normaliser comes from p's largest entry, which is
            # exp(z_max - lse) >= 1 / V, so its log is accurate; log p = z - lse then costs a subtraction, not a
            # second pass of exp (log_softmax followed by exp would compute the exponentials twice)
            torch.softmax(z, dim=-1, out=p)
            lse = z.amax(dim=-1) - p.amax(dim=-1).log()
            logp = torch.sub(z, lse[:, None], out=logp)  # in place when z is already in that buffer
            del z
            logp_a = logp.gather(-1, flat_actions[start:end, None]).squeeze(-1)
            if phi is not None:
                sum_p2 = torch.linalg.vector_norm(p, dim=-1).square()  # a reduction, no [rows, V] product
            p_logp = logp.mul_(p)  # log p is not needed past the gather: p log p takes its place
            h = -p_logp.sum(dim=-1)
            if phi is not None:
                sum_p2_logp = p_logp.mul_(p).sum(dim=-1)  # and p^2 log p takes p log p's
            del p_logp, logp, p
            s_a = -logp_a
            entropy[start:end] = h
            surprisal[start:end] = s_a
            if phi is not None:
                # sum_j p_j^2 (s_j - H) = -sum_j p_j^2 log p_j - H sum_j p_j^2
                second = -sum_p2_logp - h * sum_p2
                phi[start:end] = logp_a.exp() * (s_a - h) - second
    shape = actions.shape
    return EntropyStats(entropy.view(shape), surprisal.view(shape),
                        phi.view(shape) if with_phi else None)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Each position's entropy ``[..., ]`` from ``logits`` ``[..., V]``, with its gradient (the entropy bonus's
    input; ``entropy_sensitivity`` is the no-grad statistics pass): ``logsumexp(z) - sum softmax(z) z``, in the
    logits' dtype (float32 here and in OpenRLHF, whose ``compute_entropy`` is the same formula)."""
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over ``mask`` (0-dim tensor; 0 when the mask is empty)."""
    m = mask.to(torch.float32)
    return (values.to(torch.float32) * m).sum() / m.sum().clamp(min=1.0)


def entropy_forecast_sums(
    phi: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *, weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of w A Phi over the response tokens, number of response tokens)``, 0-dim float32 tensors.

    ``predicted_entropy_change`` is their quotient; summing both over data-parallel ranks before dividing gives
    the exact forecast over all ranks' tokens. ``phi`` and ``mask``: ``[B, T]``; ``advantages``: ``[B, T]`` or
    per-sequence ``[B]``; ``weights``: ``[B, T]`` or None (all 1).
    """
    advantages = broadcast_advantages(advantages, phi)
    check_same_shape("phi", phi, mask=mask, weights=weights)
    contrib = advantages.to(torch.float32) * phi.to(torch.float32)
    if weights is not None:
        contrib = contrib * weights.to(torch.float32)
    m = mask.to(torch.float32)
    return (contrib * m).sum(), m.sum()


def predicted_entropy_change(
    phi: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """First-order forecast of the change of the batch's mean token entropy, per unit step size.

    The token-mean of ``w A Phi`` over response tokens: each token's own logits move along its advantage
    (scaled by its STARE weight when given). It ignores clipping and the coupling between positions through
    shared parameters, so it forecasts direction and relative size, not the exact change.
    """
    total, n_tokens = entropy_forecast_sums(phi, advantages, mask, weights=weights)
    return total / n_tokens.clamp(min=1.0)


QUADRANTS = ("pos_low", "pos_high", "neg_low", "neg_high")


def quadrant_sums(
    surprisal: torch.Tensor,
    entropy: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    phi: torch.Tensor | None = None,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``quadrant_stats`` as (numerator, denominator) pairs of 0-dim float32 tensors, before the division.

    Summing numerators and denominators over data-parallel ranks before dividing gives the exact shares over all
    ranks' tokens (the denominators: tokens with A != 0 for the shares, response tokens for the contributions).
    """
    advantages = broadcast_advantages(advantages, surprisal)
    check_same_shape("surprisal", surprisal, entropy=entropy, mask=mask, phi=phi)
    m = mask.bool()
    high = surprisal > entropy
    cells = {
        "pos_low": m & (advantages > 0) & ~high,
        "pos_high": m & (advantages > 0) & high,
        "neg_low": m & (advantages < 0) & ~high,
        "neg_high": m & (advantages < 0) & high,
    }
    counts = {k: c.to(torch.float32).sum() for k, c in cells.items()}
    active = sum(counts.values())
    out = {f"{k}_share": (counts[k], active) for k in cells}
    if phi is not None:
        contrib = advantages.to(torch.float32) * phi.to(torch.float32)
        n_tokens = m.to(torch.float32).sum()
        for k, c in cells.items():
            out[f"{k}_contrib"] = ((contrib * c).sum(), n_tokens)
    return out


def quadrant_stats(
    surprisal: torch.Tensor,
    entropy: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    phi: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """How the step's tokens fall into the four advantage-sign x surprisal-vs-entropy quadrants.

    Quadrants: ``pos_low`` (A > 0, s <= H: lowers entropy, the usual majority), ``pos_high`` (A > 0, s > H:
    raises it), ``neg_low`` (A < 0, s <= H: raises it), ``neg_high`` (A < 0, s > H: lowers it). Returns
    ``{quadrant}_share`` (share of the response tokens with A != 0) and, with ``phi``, ``{quadrant}_contrib``:
    the quadrant's part of ``predicted_entropy_change`` (they add up to it). All values are 0-dim tensors.
    Shapes: ``surprisal``, ``entropy``, ``mask``, ``phi`` ``[B, T]``; ``advantages`` ``[B, T]`` or ``[B]``.
    """
    return {k: num / den.clamp(min=1.0)
            for k, (num, den) in quadrant_sums(surprisal, entropy, advantages, mask, phi=phi).items()}
