"""The entropy bonus's chunked entropy (``stare.algorithms.entropy_bonus``) and its swap into OpenRLHF's actor.

References, each computed independently of the code under test: OpenRLHF 0.11.2's own ``compute_entropy`` (the
``torch.compile``d function its ``Actor.forward`` calls) with its autograd gradient; the same formula written out
in float64 with torch's autograd; central finite differences in float64; and the allocator's own byte counts (the
profiler's memory events) for the memory bound. The OpenRLHF parts run with the suite's flash-attn / vLLM
stand-ins, on a tiny random Llama.
"""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("openrlhf")
pytest.importorskip("deepspeed")
import openrlhf_standins  # noqa: E402

openrlhf_standins.install()
from openrlhf.models import Actor  # noqa: E402
from openrlhf.models import actor as openrlhf_actor_module  # noqa: E402
from openrlhf.models.utils import compute_entropy as openrlhf_compute_entropy  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from stare.algorithms.entropy_bonus import DEFAULT_CHUNK_ROWS, chunked_entropy  # noqa: E402
from stare.cli.openrlhf_backend import actor as stare_actor  # noqa: E402


def _entropy64(z: torch.Tensor) -> torch.Tensor:
    """The definition, differentiable by torch's autograd: logsumexp(z) - sum softmax(z) z (callers pass float64)."""
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)


def _value_and_grad(fn, z: torch.Tensor, g: torch.Tensor):
    """``fn(z)`` and the gradient of ``(fn(z) * g).sum()`` with respect to ``z``, on a fresh leaf copy of ``z``."""
    z = z.detach().clone().requires_grad_(True)
    h = fn(z)
    (grad,) = torch.autograd.grad(h, z, g.to(h.dtype))
    return h.detach(), grad


def _logits(shape, scale, seed):
    """Random logits of ``shape`` at ``scale``, with extreme rows in the first sequence: a near one-hot row (one logit
    60 above the rest), a uniform row (all 7: entropy log V) and a row of ``scale``-spread logits offset by 1e4."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(shape, generator=g) * scale
    z[0, 0] = 0.0
    z[0, 0, 5] = 60.0
    z[0, 1] = 7.0
    z[0, 2] += 1e4
    return z, torch.randn(shape[:-1], generator=g)


@pytest.mark.parametrize("shape", [(3, 17, 257), (1, 50, 1000)], ids=["B,T,V", "1,T,V"])
@pytest.mark.parametrize("scale", [1.0, 8.0, 40.0])
def test_value_and_gradient_match_openrlhfs_compute_entropy_and_float64(shape, scale):
    """On [B, T, V] and packed [1, T, V] float32 logits, chunks of 7 rows: the entropy and its gradient (under a
    random incoming gradient) equal OpenRLHF's compute_entropy's to within its own float32 rounding on every row
    without a large offset, and equal the float64 definition on every row. On the row offset by 1e4 OpenRLHF's own
    formula loses digits (logsumexp(z) - sum p z cancels near 1e4); there ours is within 1e-5 of float64 and never
    farther from it than OpenRLHF's."""
    z, g = _logits(shape, scale, seed=int(scale) + shape[0])
    h, grad = _value_and_grad(lambda t: chunked_entropy(t, 7), z, g)
    h_o, grad_o = _value_and_grad(openrlhf_compute_entropy, z, g)
    h_64, grad_64 = _value_and_grad(_entropy64, z.double(), g)
    assert h.dtype == grad.dtype == torch.float32 and h.shape == shape[:-1] and grad.shape == shape
    # OpenRLHF's float32 formula is exact to a few ulps of the row's logits and of its logsumexp (cancellation, and
    # sums over V): measured 15 ulps of (max|z| + log V) at most on these rows (the uniform one), 2.3 of max|z| |g|
    # for the gradient; the bounds allow twice that
    eps, zmax = torch.finfo(torch.float32).eps, z.abs().amax(dim=-1)
    plain = torch.ones(shape[:-1], dtype=torch.bool)
    plain[0, 2] = False  # the offset row
    value_tol = 1e-6 + 32 * eps * (zmax + math.log(shape[-1]))
    grad_tol = 1e-7 + 8 * eps * zmax * g.abs()
    assert ((h - h_o).abs() <= value_tol)[plain].all()
    assert ((grad - grad_o).abs().amax(dim=-1) <= grad_tol)[plain].all()
    assert torch.allclose(h.double(), h_64, rtol=1e-6, atol=1e-5)
    assert torch.allclose(grad.double(), grad_64, rtol=1e-5, atol=1e-6)
    assert abs(h[0, 1].item() - math.log(shape[-1])) < 1e-5  # the uniform row
    assert h[0, 0].item() < 1e-20 and h[0, 0].item() >= 0  # the near one-hot row: 0 to float32's precision
    err, err_o = (h[0, 2].double() - h_64[0, 2]).abs(), (h_o[0, 2].double() - h_64[0, 2]).abs()
    assert err <= max(err_o, 1e-6)


def test_gradient_matches_central_finite_differences_in_float64():
    """Every partial derivative of sum_rows g_r H_r (float64, chunks of 4 rows over 6) against a central difference
    with step 1e-6: the analytic backward, not only its agreement with another implementation."""
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(2, 3, 9, dtype=torch.float64, generator=gen) * 3
    g = torch.randn(2, 3, dtype=torch.float64, generator=gen)
    _, grad = _value_and_grad(lambda t: chunked_entropy(t, 4), z, g)
    assert grad.dtype == torch.float64
    step = 1e-6
    numeric = torch.empty_like(z)
    flat, out = z.reshape(-1), numeric.reshape(-1)
    for i in range(flat.numel()):
        up, down = flat.clone(), flat.clone()
        up[i] += step
        down[i] -= step
        f = lambda x: float((_entropy64(x.view_as(z)) * g).sum())  # noqa: E731
        out[i] = (f(up) - f(down)) / (2 * step)
    assert torch.allclose(grad, numeric, rtol=1e-6, atol=1e-8), (grad - numeric).abs().max()


@pytest.mark.parametrize("chunk_rows", [1, 3, 4, 5, 7, 11, 12, 13, DEFAULT_CHUNK_ROWS])
def test_every_chunk_size_gives_the_same_numbers(chunk_rows):
    """12 rows ([3, 4, 33]) in chunks that divide them (1, 3, 4, 12) and that do not (5, 7, 11, 13, the default):
    value and gradient equal the float64 definition on every row."""
    gen = torch.Generator().manual_seed(4)
    z = torch.randn(3, 4, 33, generator=gen) * 5
    g = torch.randn(3, 4, generator=gen)
    h, grad = _value_and_grad(lambda t: chunked_entropy(t, chunk_rows), z, g)
    h_64, grad_64 = _value_and_grad(_entropy64, z.double(), g)
    assert torch.allclose(h.double(), h_64, rtol=1e-6, atol=1e-6)
    assert torch.allclose(grad.double(), grad_64, rtol=1e-5, atol=1e-7)


def test_strided_views_and_bfloat16_logits():
    """A non-contiguous view (``full[:, :-1][:, -w:]``, rows not evenly spaced) and bfloat16 logits (chunks computed
    in float32, value and gradient returned in bfloat16): the float64 definition on the same numbers, and the
    gradient lands in the viewed positions of the full tensor only."""
    gen = torch.Generator().manual_seed(5)
    full = torch.randn(3, 10, 40, generator=gen) * 4
    g = torch.randn(3, 4, generator=gen)
    _, grad = _value_and_grad(lambda t: chunked_entropy(t[:, :-1][:, -4:], 5), full, g)
    _, grad_64 = _value_and_grad(lambda t: _entropy64(t[:, :-1][:, -4:]), full.double(), g)
    assert torch.allclose(grad.double(), grad_64, rtol=1e-5, atol=1e-7)
    assert grad[:, :5].abs().max() == 0 and grad[:, -1].abs().max() == 0
    zb = (torch.randn(2, 9, 64, generator=gen) * 3).bfloat16()
    gb = torch.randn(2, 9, generator=gen)
    h, grad_b = _value_and_grad(lambda t: chunked_entropy(t, 4), zb, gb)
    h_64, grad_64 = _value_and_grad(_entropy64, zb.double(), gb)  # the definition on the same bfloat16 numbers
    assert h.dtype == grad_b.dtype == torch.bfloat16
    assert torch.allclose(h.double(), h_64, rtol=1e-2, atol=1e-2)  # bfloat16's 8 bits of mantissa
    assert torch.allclose(grad_b.double(), grad_64, rtol=1e-2, atol=1e-3)


def _allocator_peak(fn) -> tuple[int, int]:
    """(peak, net) bytes allocated by torch's CPU allocator while ``fn()`` runs, from the profiler's memory events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    now = peak = 0
    for _, nbytes in events:
        now += nbytes
        peak = max(peak, now)
    return peak, now


def test_memory_is_two_chunks_in_forward_and_the_gradient_plus_one_chunk_in_backward():
    """Measured by the allocator, 256 rows of V = 4096 in chunks of 32 (one chunk 512 KiB, the logits 4 MiB): the
    forward's peak is two chunk buffers plus a few bytes per row, and it keeps only 3 floats per row for backward
    (plus the [rows] output); the backward's peak is the [rows, V] gradient plus one chunk buffer. The input is saved
    as it is (the same storage, no copy)."""
    n, vocab, rows = 256, 4096, 32
    z = torch.randn(n, vocab, requires_grad=True)
    g = torch.randn(n)
    chunk_bytes, per_row = rows * vocab * 4, 64 * n
    box = {}
    peak, kept = _allocator_peak(lambda: box.setdefault("h", chunked_entropy(z, rows)))
    assert 2 * chunk_bytes <= peak <= 2 * chunk_bytes + per_row, peak / chunk_bytes
    assert kept <= 4 * 4 * n + 1024, kept  # lse-like vectors and the output: no [rows, V] tensor survives
    saved = box["h"].grad_fn.saved_tensors
    assert saved[0].data_ptr() == z.data_ptr() and saved[0].shape == z.shape
    assert all(t.numel() == n for t in saved[1:])
    peak, kept = _allocator_peak(lambda: box.setdefault("grad", torch.autograd.grad(box["h"], z, g)))
    assert n * vocab * 4 + chunk_bytes <= peak <= n * vocab * 4 + chunk_bytes + per_row, peak / chunk_bytes
    assert kept >= n * vocab * 4  # the gradient, returned


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="chunk_rows"):
        chunked_entropy(torch.zeros(2, 3), 0)
    with pytest.raises(ValueError, match="chunk_rows"):
        chunked_entropy(torch.zeros(2, 3), 2.0)
    with pytest.raises(ValueError, match="float tensor"):
        chunked_entropy(torch.zeros(2, 3, dtype=torch.long))


# ---- the swap through the plugin's seam ------------------------------------------------------------------------

V, T, B = 96, 12, 3


def _actor(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    actor = Actor(LlamaForCausalLM(cfg).float())
    actor.packing_samples = False
    return actor


def _entropy_through_actor_forward():
    """OpenRLHF's real ``Actor.forward(..., return_entropy=True)`` on a tiny Llama (right-padded batch, temperature
    1.5 as OpenRLHF applies it in place): the entropy it returns, and the parameters' gradient of a random weighting of
    it."""
    actor = _actor()
    actor.temperature = 1.5
    gen = torch.Generator().manual_seed(7)
    seq = torch.randint(1, V, (B, T), generator=gen)
    attn = torch.ones(B, T, dtype=torch.long)
    attn[1, 9:] = 0
    attn[2, 6:] = 0
    action_mask = attn[:, 1:][:, -5:].bool()
    _, out = actor(seq, action_mask, attn, return_output=True, return_entropy=True)
    w = torch.randn(out.entropy.shape, generator=gen)
    (out.entropy * w).sum().backward()
    grads = torch.cat([p.grad.reshape(-1) for p in actor.parameters()])
    return out.entropy.detach(), grads


def test_the_plugin_points_openrlhfs_actor_at_the_chunked_entropy(monkeypatch):
    """Before the plugin installs, OpenRLHF's actor module uses its own compute_entropy; ``install`` (what every
    policy worker runs after building the model) rebinds that name to ``chunked_entropy`` and leaves
    ``openrlhf.models.utils.compute_entropy`` as it was."""
    from test_openrlhf_plugin import _args, _install, _model, _settings_env, _trainer

    monkeypatch.setattr(openrlhf_actor_module, "compute_entropy", openrlhf_compute_entropy)
    _settings_env(monkeypatch, "entropy-adaptive")
    _install(_trainer(monkeypatch, _model(), _args()))
    assert openrlhf_actor_module.compute_entropy is chunked_entropy
    import openrlhf.models.utils as openrlhf_utils
    assert openrlhf_utils.compute_entropy is openrlhf_compute_entropy


def test_openrlhfs_actor_forward_gives_the_same_entropy_and_gradient_after_the_swap(monkeypatch):
    """OpenRLHF's real ``Actor.forward(return_entropy=True)``, once with its own compute_entropy and once after
    ``use_chunked_entropy``: the same entropy at every position and the same parameter gradient, to float32
    tolerance (and the swap is in effect: the entropy function called is ours)."""
    monkeypatch.setattr(openrlhf_actor_module, "compute_entropy", openrlhf_compute_entropy)
    h_o, grads_o = _entropy_through_actor_forward()
    stare_actor.use_chunked_entropy()
    calls = []
    original = openrlhf_actor_module.compute_entropy
    assert original is chunked_entropy
    monkeypatch.setattr(openrlhf_actor_module, "compute_entropy", lambda z: calls.append(z.shape) or original(z))
    h, grads = _entropy_through_actor_forward()
    assert calls == [(B, T, V)]
    assert h.shape == (B, T - 1)
    assert torch.allclose(h, h_o, rtol=1e-5, atol=1e-6)
    assert torch.allclose(grads, grads_o, rtol=1e-4, atol=1e-7)
    assert grads.abs().max() > 0
