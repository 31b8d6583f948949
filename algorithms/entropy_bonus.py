"""Per-token entropy with its gradient in bounded memory, for the entropy bonus (``--actor.entropy_coef``).

``chunked_entropy(logits)`` returns, for logits ``z`` of shape ``[..., V]``, each row's entropy

    H = logsumexp(z) - sum_i softmax(z)_i z_i

with autograd, the same function as OpenRLHF's ``compute_entropy`` (``openrlhf/models/utils.py``), which the
OpenRLHF plugin swaps in for it (``stare.cli.openrlhf_backend.actor``). It walks the rows ``chunk_rows`` at a
time and never builds a ``[rows, V]`` tensor beyond one chunk:

- forward: per chunk, ``d = z - max`` and ``e = exp(d)`` into two ``[chunk_rows, V]`` buffers, ``s = sum e``,
  ``w = sum e d``; then ``H = log s - w / s`` (no cancellation: both terms are >= 0). Saved for backward: the
  input itself (a reference, no copy) and three ``[rows]`` vectors, ``max``, ``log s`` and ``w / s``.
- backward: ``dH/dz_i = -p_i (z_i - mu)`` with ``mu = sum_j p_j z_j``, recomputed per chunk from ``d = z - max``
  (written straight into the gradient's rows): ``p = exp(d - log s)`` into the buffer, times the incoming gradient,
  times ``mu - z = w / s - d``. Every difference is taken relative to the row's max, so a row's accuracy does not
  depend on its offset (logits near 1e4 keep float32's accuracy near 1, unlike ``logsumexp(z) - sum p z``).

Memory, for ``N`` rows of ``V`` logits computed in float32 (4 bytes; float64 inputs compute in float64, 8):

- forward: two ``chunk_rows x V`` buffers, plus ``[N]`` vectors (the output and the three saved ones);
- between forward and backward: the saved ``3 N`` floats (the input is the caller's);
- backward: the gradient itself (``N x V`` in the input's dtype, which any implementation returns) plus one
  ``chunk_rows x V`` buffer (two for float16/bfloat16 inputs, whose chunks are converted to float32 first).

OpenRLHF's eager formula keeps the ``N x V`` softmax for backward and builds several more ``N x V`` tensors; its
``torch.compile``d form recomputes the softmax in backward too, with the temporaries its compiler chooses
(figures in docs/benchmarks.md). The logits must be finite (a model's are): an entry of -inf gives NaN, as in
OpenRLHF's function.
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ._checks import check_range
from .entropy import _rows

# Rows per chunk (a parameter of chunked_entropy). With Qwen's 152,064-word vocabulary one float32 chunk buffer is
# 1024 x 152,064 x 4 B = 594 MiB; on the CPU the chunk size barely changes the time (docs/benchmarks.md).
DEFAULT_CHUNK_ROWS = 1024


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other float dtype is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class ChunkedEntropy(torch.autograd.Function):
    """Row entropy of ``[..., V]`` logits, forward and backward ``chunk_rows`` rows at a time (see the module)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, chunk_rows: int) -> torch.Tensor:
        vocab = logits.shape[-1]
        n = logits.numel() // vocab if vocab else 0
        cdt = _compute_dtype(logits.dtype)
        kw = {"dtype": cdt, "device": logits.device}
        row_max, log_s, w_over_s = (torch.empty(n, **kw) for _ in range(3))
        rows = min(chunk_rows, n)
        diff_buf, exp_buf = torch.empty(rows, vocab, **kw), torch.empty(rows, vocab, **kw)
        for lo in range(0, n, chunk_rows):
            hi = min(lo + chunk_rows, n)
            x, d, e = _rows(logits, lo, hi), diff_buf[:hi - lo], exp_buf[:hi - lo]
            m = x.amax(dim=-1, keepdim=True).to(cdt)
            if x.dtype == cdt:
                torch.sub(x, m, out=d)
            else:  # convert first, so the difference is taken in float32
                d.copy_(x)
                d.sub_(m)
            torch.exp(d, out=e)
            s = e.sum(dim=-1)
            e.mul_(d)  # e (z - max)
            torch.div(e.sum(dim=-1), s, out=w_over_s[lo:hi])  # sum p (z - max), <= 0
            torch.log(s, out=log_s[lo:hi])
            row_max[lo:hi] = m.squeeze(-1)
        ctx.chunk_rows = chunk_rows
        ctx.save_for_backward(logits, row_max, log_s, w_over_s)
        return (log_s - w_over_s).view(logits.shape[:-1]).to(logits.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        logits, row_max, log_s, w_over_s = ctx.saved_tensors
        vocab = logits.shape[-1]
        n, rows = row_max.shape[0], ctx.chunk_rows
        cdt = row_max.dtype
        g = grad.reshape(n).to(cdt)
        out = torch.empty(n, vocab, dtype=logits.dtype, device=logits.device)
        buf = torch.empty(min(rows, n), vocab, dtype=cdt, device=logits.device)
        low_precision = logits.dtype != cdt
        work = torch.empty_like(buf) if low_precision else None
        for lo in range(0, n, rows):
            hi = min(lo + rows, n)
            x, p, gc = _rows(logits, lo, hi), buf[:hi - lo], out[lo:hi]
            d = work[:hi - lo] if low_precision else gc  # float32 rows, copied to the gradient's dtype at the end
            if low_precision:
                d.copy_(x)
                d.sub_(row_max[lo:hi, None])
            else:
                torch.sub(x, row_max[lo:hi, None], out=d)  # z - max
            torch.sub(d, log_s[lo:hi, None], out=p)
            p.exp_()  # p = exp(z - max - log s)
            p.mul_(g[lo:hi, None])
            torch.sub(w_over_s[lo:hi, None], d, out=d)  # mu - z = (mu - max) - (z - max)
            d.mul_(p)  # g p (mu - z) = -g p (z - mu)
            if low_precision:
                gc.copy_(d)
        return out.view(logits.shape), None


def chunked_entropy(logits: torch.Tensor, chunk_rows: int = DEFAULT_CHUNK_ROWS) -> torch.Tensor:
    """Each row's entropy ``[...]`` of ``logits`` ``[..., V]``, with its gradient, ``chunk_rows`` rows at a time.

    The value and gradient of ``logsumexp(z) - sum softmax(z) z`` (OpenRLHF's ``compute_entropy``), in the logits'
    dtype (computed in float32, or float64 for float64 logits). Extra memory: two ``chunk_rows x V`` buffers in
    forward, three ``[rows]`` vectors kept for backward, and in backward one buffer beside the gradient (module
    docstring). Any strided view of the logits is read in place (a chunk is copied only where its rows are not
    evenly spaced in memory). Differentiable once (no double backward).
    """
    if logits.dim() < 1 or not logits.is_floating_point():
        raise ValueError(f"logits must be a float tensor [..., V], got {logits.dtype} of shape {tuple(logits.shape)}")
    if not isinstance(chunk_rows, int) or isinstance(chunk_rows, bool):
        raise ValueError(f"chunk_rows must be a positive int, got {chunk_rows!r}")
    check_range("chunk_rows", chunk_rows, low=1)
    return ChunkedEntropy.apply(logits, chunk_rows)
