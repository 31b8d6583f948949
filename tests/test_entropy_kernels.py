"""entropy_sensitivity's three kernels against an independent float64 full-softmax computation.

The torch path runs as is; the fused Triton kernel runs on CPU through Triton's interpreter (TRITON_INTERPRET=1,
set by the ``triton_kernel`` fixture before the kernel module is (re)imported), which executes every program in
Python: the Triton cases are kept to a few hundred rows. The compiled kernel is really compiled (TorchInductor's
C++ code for the CPU), once per input kind, which takes seconds. Also: strided views are read without a full copy
(allocation sizes recorded with a TorchDispatchMode), and the kernel choice.
"""
import importlib
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from conftest import test_device
from stare.algorithms import entropy_sensitivity
from stare.algorithms.entropy import KERNELS, _resolve_kernel


def reference(logits: torch.Tensor, actions: torch.Tensor, temperature: float = 1.0):
    """float64 on the full [..., V] softmax, from the definitions; -inf logits have p = 0 and add nothing."""
    logp = torch.log_softmax(logits.detach().double() / temperature, dim=-1)
    p = logp.exp()
    s = -logp
    h = torch.where(p > 0, p * s, 0.0).sum(-1)
    s_a = s.gather(-1, actions[..., None]).squeeze(-1)
    p_a = p.gather(-1, actions[..., None]).squeeze(-1)
    phi = torch.where(p_a > 0, p_a * (s_a - h), 0.0) - torch.where(p > 0, p * p * (s - h[..., None]), 0.0).sum(-1)
    return h, s_a, phi


def assert_matches(stats, logits, actions, temperature=1.0, tol=1e-5):
    """Within ``tol`` plus what rounding the scaled logits z / T to float32 alone can cause (a few ulps of |z|)."""
    finite = logits.detach()[torch.isfinite(logits.detach())].abs()
    atol = tol + 4 * torch.finfo(torch.float32).eps * (float(finite.max()) / temperature if finite.numel() else 0.0)
    for name, got, want in zip(("entropy", "surprisal", "phi"), stats, reference(logits, actions, temperature)):
        assert got.dtype == torch.float32 and got.shape == actions.shape, name
        torch.testing.assert_close(got.double(), want, atol=atol, rtol=tol, msg=lambda m: f"{name}: {m}")


ON_CPU_ONLY = {"cpp": "kernel='cpp' runs on CPU tensors",
               "compiled": "kernel='compiled' is measured on CPU (on CUDA a TorchInductor build per input kind would "
                           "take the GPU check's time; auto never picks it)"}


def skip_off_cpu(kernel_name: str, config) -> None:
    """Under ``--device cuda`` (the GPU check) the kernels that only the CPU runs are skipped."""
    if kernel_name in ON_CPU_ONLY and test_device(config) != "cpu":
        pytest.skip(ON_CPU_ONLY[kernel_name])


@pytest.fixture(scope="module")
def interpreter(request):
    """The Triton kernel module compiled for the CPU interpreter; restored afterwards. Under ``--device cuda`` the
    real kernel module instead, compiled for the GPU."""
    pytest.importorskip("triton")
    if test_device(request.config) == "cuda":
        from stare.algorithms import _entropy_triton
        yield _entropy_triton
        return
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # read when @triton.jit runs, i.e. when the module is (re)imported
    from stare.algorithms import _entropy_triton
    module = importlib.reload(_entropy_triton)
    assert module.interpreting()
    yield module
    if before is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = before
    importlib.reload(module)


@pytest.fixture(params=["torch", "triton", "compiled", "cpp"])
def kernel(request):
    skip_off_cpu(request.param, request.config)
    if request.param == "triton":
        request.getfixturevalue("interpreter")
    return request.param


def random_case(g: torch.Generator, i: int):
    """Vocabulary sizes around the interpreter's 256-column block, sharp to flat rows, big offsets."""
    vocab = [1, 2, 3, 17, 255, 256, 257, 300, 513, 64][i % 10]
    scale = [0.01, 1.0, 4.0, 30.0, 300.0][i % 5]
    offset = [0.0, 1e3, -1e3][i % 3]
    rows = torch.randn(2, 2, vocab, generator=g, dtype=torch.float64) * scale + offset
    dtype = torch.bfloat16 if i % 2 else torch.float32
    logits = rows.to(dtype)
    temperature = [1.0, 0.6, 1.7][(i // 2) % 3]
    probs = torch.softmax(logits.double() / temperature, -1)
    sampled = torch.multinomial(probs.reshape(-1, vocab), 1, generator=g).view(2, 2)
    uniform = torch.randint(0, vocab, (2, 2), generator=g)  # often very unlikely tokens at high scale
    actions = torch.where(torch.rand(2, 2, generator=g) < 0.5, sampled, uniform)
    return logits, actions, temperature


def test_kernels_match_float64_on_random_cases(kernel):
    g = torch.Generator().manual_seed(11)
    for i in range(30):
        logits, actions, temperature = random_case(g, i)
        if i % 3 == 1:  # a strided view, as the plugin passes it
            padded = torch.cat([logits, logits[:, :1]], dim=1)
            logits = padded[:, :-1]
            assert not logits.is_contiguous()
        stats = entropy_sensitivity(logits, actions, temperature=temperature, kernel=kernel)
        assert_matches(stats, logits, actions, temperature)


def test_phi_matches_finite_differences(kernel):
    """Phi is dH along e_a - p, independently of any closed form: central differences of the exact entropy."""
    g = torch.Generator().manual_seed(12)
    for trial in range(25):
        V = int(torch.randint(2, 60, (1,), generator=g))
        z = torch.randn(V, generator=g, dtype=torch.float64) * float(torch.rand(1, generator=g) * 6)
        a = int(torch.randint(0, V, (1,), generator=g))
        direction = -torch.softmax(z, -1)
        direction[a] += 1.0

        def exact_entropy(x):
            logp = torch.log_softmax(x, -1)
            return -(logp.exp() * logp).sum()

        eps = 1e-5
        fd = (exact_entropy(z + eps * direction) - exact_entropy(z - eps * direction)) / (2 * eps)
        phi = entropy_sensitivity(z.float(), torch.tensor(a), kernel=kernel).phi
        assert phi.shape == () and phi.item() == pytest.approx(fd.item(), abs=2e-6, rel=2e-4), (trial, V)


def test_chunk_and_block_boundaries(kernel, request):
    """The running maximum first, last and in the middle of the row; rows and columns that do not divide evenly."""
    V = 37
    ramp = torch.linspace(-6.0, 6.0, V)
    logits = torch.stack([ramp, ramp.flip(0), torch.sin(torch.arange(V) * 1.3) * 8, torch.zeros(V),
                          torch.randn(V, generator=torch.Generator().manual_seed(13)) * 3,
                          torch.full((V,), 5.0).index_fill(0, torch.tensor([18]), 40.0), ramp * 0.01])
    actions = torch.tensor([36, 36, 5, 0, 17, 18, 3])
    if kernel == "torch":
        for chunk in (1, 2, 3, 7, 100):
            assert_matches(entropy_sensitivity(logits, actions, chunk_size=chunk, kernel="torch"), logits, actions)
        return
    if kernel in ("compiled", "cpp"):  # no blocks: each row in one vectorised loop, with a tail when V % width != 0
        for v in (37, 15, 16, 17, 31, 32, 33, 64, 100):  # cpp: 16 lanes, its maximum in two sets of 16
            z = torch.cat([logits] * 3, dim=-1)[:, :v]
            assert_matches(entropy_sensitivity(z, actions % v, kernel=kernel), z, actions % v)
        return
    module = request.getfixturevalue("interpreter")
    for block_v in (8, 16, 32, 64):  # 37 = 4 x 8 + 5 = 2 x 16 + 5 = 32 + 5 = one partial block of 64
        out = [torch.empty(7) for _ in range(3)]
        module.entropy_stats_block(logits[None], actions, *out, temperature=1.0, block_v=block_v)
        assert_matches(tuple(out), logits, actions)


def test_strided_views_and_shapes(kernel):
    g = torch.Generator().manual_seed(14)
    V = 70
    full = torch.randn(2, 7, V, generator=g) * 3
    views = {
        "plugin slice": full[:, :-1][:, -4:],
        "transposed": full.transpose(0, 1),
        "every other row": full[:, ::2],
        "vocab stride 2": full[..., ::2],
        "4-d permuted": full[:, :6].reshape(2, 2, 3, V).permute(1, 2, 0, 3),
        "bf16 slice": full.to(torch.bfloat16)[:, 1:-2],
        "one row": full[1, 4],
        "requires grad": full.clone().requires_grad_()[:, 2:4],
        "empty": full[:, :0],
    }
    for name, logits in views.items():
        actions = torch.randint(0, logits.shape[-1], logits.shape[:-1], generator=g)
        stats = entropy_sensitivity(logits, actions, kernel=kernel)
        assert_matches(stats, logits, actions)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, on the deliberate inf and NaN rows
@pytest.mark.parametrize("fused", ["triton", "compiled", "cpp"])
def test_fused_kernels_neg_inf_logits_and_bad_actions(fused, request):
    """-inf entries (a masked vocabulary) count as p = 0 (an action on one has s_a = inf and Phi its p_a -> 0 limit);
    an action id outside [0, V) gives NaN, not a wild read; an all -inf row gives NaN."""
    skip_off_cpu(fused, request.config)
    if fused == "triton":
        request.getfixturevalue("interpreter")
    g = torch.Generator().manual_seed(15)
    logits = torch.randn(4, 300, generator=g) * 2
    logits[0, :260] = float("-inf")  # whole first block masked: the running max starts at -inf
    logits[1, 100:] = float("-inf")
    logits[2, ::3] = float("-inf")
    actions = torch.tensor([280, 7, 1, 299])
    for dtype in (torch.float32, torch.bfloat16):
        z = logits.to(dtype)
        assert_matches(entropy_sensitivity(z, actions, kernel=fused), z, actions)
    on_masked = torch.tensor([3, 200, 0, 5])  # actions whose logit is -inf (not row 3): s_a = inf, Phi = -sum p^2 (s - H)
    stats = entropy_sensitivity(logits, on_masked, kernel=fused)
    assert torch.isinf(stats.surprisal[:3]).all()
    assert_matches(stats, logits, on_masked)
    bad = entropy_sensitivity(logits[3:], torch.tensor([300]), kernel=fused)
    assert torch.isnan(bad.surprisal).all() and torch.isnan(bad.phi).all()
    assert bad.entropy.item() == pytest.approx(reference(logits[3:], torch.tensor([0]))[0].item(), abs=1e-5)
    nothing = entropy_sensitivity(torch.full((1, 300), float("-inf")), torch.tensor([1]), kernel=fused)
    assert all(torch.isnan(t).all() for t in nothing)  # no distribution at all, as on the torch path
    with_nan = logits[3:].clone()
    with_nan[0, 123] = float("nan")
    assert all(torch.isnan(t).all() for t in entropy_sensitivity(with_nan, torch.tensor([1]), kernel=fused))


def test_compiled_kernel_under_a_dispatch_mode_runs_the_same_function_eagerly():
    """A profiler's TorchDispatchMode (bench_plugin_step --profile) stops torch.compile from tracing: the kernel then
    runs its function op by op, and the op counter sees its [rows, V] work; same numbers to rounding."""
    g = torch.Generator().manual_seed(18)
    logits = torch.randn(5, 300, generator=g) * 3
    actions = torch.randint(0, 300, (5,), generator=g)
    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Ops():
        stats = entropy_sensitivity(logits, actions, kernel="compiled")
    assert "exp" in seen and "amax" in seen
    assert_matches(stats, logits, actions)


def test_strided_logits_are_never_copied_whole():
    """The plugin's ``logits[:, :-1][:, -w:]`` is not contiguous: no tensor bigger than one chunk may be created.

    Every aten op's fresh outputs (storage not shared with an input) are recorded; the largest must be one
    float32 chunk, while the old ``reshape(-1, V)`` copied all [B, A, V] first.
    """

    class FreshAllocations(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sizes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                    self.sizes.append(t.untyped_storage().nbytes())
            return out

    g = torch.Generator().manual_seed(16)
    B, T, A, V, chunk = 3, 41, 25, 500, 4
    for dtype in (torch.float32, torch.bfloat16):
        full = (torch.randn(B, T, V, generator=g) * 3).to(dtype)
        logits = full[:, :-1][:, -A:]
        assert not logits.is_contiguous()
        actions = torch.randint(0, V, (B, A), generator=g)
        with FreshAllocations() as rec:
            stats = entropy_sensitivity(logits, actions, chunk_size=chunk, kernel="torch")
        assert_matches(stats, logits, actions)
        one_chunk = chunk * V * 4  # [chunk, V] float32
        assert max(rec.sizes) == one_chunk, (dtype, max(rec.sizes), one_chunk)
        assert B * A * V * logits.element_size() > 4 * one_chunk


def test_torch_path_numbers_do_not_depend_on_the_layout():
    """A strided view gives bit-for-bit what its contiguous copy gives (the old code copied, then chunked)."""
    g = torch.Generator().manual_seed(17)
    full = torch.randn(3, 20, 3001, generator=g) * 3
    four_d = full[:, :18].reshape(3, 3, 6, 3001).permute(2, 0, 1, 3)[1:]  # chunks cross two leading dims
    for logits in (full[:, :-1][:, -12:], full.transpose(0, 1), full[:, ::3], four_d):
        actions = torch.randint(0, 3001, logits.shape[:-1], generator=g)
        for kw in ({}, {"chunk_size": 7}, {"chunk_size": 11}, {"temperature": 0.7}):
            got = entropy_sensitivity(logits, actions, kernel="torch", **kw)
            want = entropy_sensitivity(logits.contiguous(), actions, kernel="torch", **kw)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), kw


@pytest.mark.cpu_only  # CPU tensors by design (errors name the device cpu; no CUDA kernel is expected)
def test_kernel_choice(monkeypatch):
    logits = torch.randn(3, 10)
    actions = torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"unknown kernel 'cuda'; valid choices: auto, torch, triton, compiled, cpp"):
        entropy_sensitivity(logits, actions, kernel="cuda")
    with pytest.raises(ValueError, match=r"actions must be on the logits' device: logits cpu, actions meta"):
        entropy_sensitivity(logits, actions.to("meta"))  # a kernel would read a pointer of the wrong device
    assert KERNELS == ("auto", "torch", "triton", "compiled", "cpp")
    with pytest.raises(ValueError, match=r"kernel='cpp' runs on CPU tensors \(got meta\)"):
        _resolve_kernel("cpp", torch.device("meta"))
    assert _resolve_kernel("auto", torch.device("cpu")) == "torch"
    auto = entropy_sensitivity(logits, actions)
    assert all(torch.equal(a, b) for a, b in zip(auto, entropy_sensitivity(logits, actions, kernel="torch")))
    try:
        import triton  # noqa: F401
    except ImportError:
        assert _resolve_kernel("auto", torch.device("cuda")) == "torch"
        with pytest.raises(ValueError, match="needs the triton package"):
            entropy_sensitivity(logits, actions, kernel="triton")
        return
    assert _resolve_kernel("auto", torch.device("cuda")) == "triton"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="kernel='triton' needs CUDA tensors"):
        entropy_sensitivity(logits, actions, kernel="triton")


def test_triton_is_pinned_in_the_test_extra():
    """CI installs the test extra: the interpreter tests above must not be skipped there for want of triton."""
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11 (CI's)

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert any(req.replace(" ", "").startswith("triton==") for req in project["optional-dependencies"]["test"])


COMPILE_FOR_AMPERE_AND_HOPPER = r"""
import time
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from stare.algorithms._entropy_triton import _CONFIGS, _entropy_stats_kernel

aligned = {(i,): [["tt.divisibility", 16]] for i in (0, 2, 3, 4, 6, 7, 9)}  # what the launcher sees at real sizes
start = time.perf_counter()
for arch in (80, 90):
    for dtype in ("bf16", "fp32"):
        signature = {"x_ptr": "*" + dtype, "act_ptr": "*i64", "h_ptr": "*fp32", "s_ptr": "*fp32", "phi_ptr": "*fp32",
                     "inner": "i32", "stride_outer": "i64", "stride_inner": "i32", "stride_v": "constexpr",
                     "V": "i32", "scale": "fp32", "BLOCK_V": "constexpr", "FAST_EXP": "constexpr"}
        for config in _CONFIGS:
            src = ASTSource(fn=_entropy_stats_kernel, signature=signature,
                            constexprs={"BLOCK_V": config.kwargs["BLOCK_V"], "stride_v": 1, "FAST_EXP": True},
                            attrs=aligned)
            compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                      options={"num_warps": config.num_warps, "num_stages": config.num_stages,
                                               "enable_fp_fusion": True})
            where = f"sm_{arch} {dtype} {config}"
            ptx = compiled.asm["ptx"]
            assert f".target sm_{arch}" in ptx and compiled.asm["cubin"], where  # assembled by ptxas for that arch
            assert "ld.global.v4.b32" in ptx, f"{where}: row loads are not vectorised"
            per_thread = config.kwargs["BLOCK_V"] // (32 * config.num_warps)
            assert ptx.count("ex2.approx.ftz.f32") == per_thread + 1, f"{where}: not one exp2 per logit (+ rescale)"
print(f"compiled with triton {triton.__version__} in {time.perf_counter() - start:.1f} s")
"""


def test_triton_kernel_compiles_for_ampere_and_hopper():
    """The interpreter accepts code the real compiler rejects (it ran a non-constexpr global fine): compile the
    kernel, every autotune config, for bf16 and float32 logits, to PTX and a cubin for sm_80 (A100) and sm_90
    (H100, H200) with Triton's own compiler and bundled ptxas, so the inline ex2.approx.ftz that the interpreter
    cannot run is assembled for both; no GPU needed. One exp2 per logit and 16-byte loads, as the bandwidth target
    needs. With the test extra's triton, the one the Docker image gets (the next test): 28 compiles, about 16 s on
    this 2-core machine with Triton 3.7.1."""
    pytest.importorskip("triton")
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", COMPILE_FOR_AMPERE_AND_HOPPER], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]


def test_the_installed_triton_is_the_one_the_image_gets(request):
    """The compile above proves something about the GPU image only with the image's Triton: the test extra pins
    the triton torch 2.13.0 pins (test_packaging checks the Dockerfile installs the same), and that must be the one
    installed here. Under ``--device cuda`` the lent machine's own Triton is what it is, and this is skipped."""
    triton = pytest.importorskip("triton")
    if test_device(request.config) != "cpu":
        pytest.skip("the GPU check runs the machine's own Triton")
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11 (CI's)
    test_extra = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["test"]
    pinned = next(r.split(";")[0].split("==")[1].strip() for r in test_extra
                  if r.replace(" ", "").startswith("triton=="))
    assert triton.__version__ == pinned, (f"triton {triton.__version__} is installed, the test extra pins {pinned}: "
                                          "pip install -e '.[test]'")


@pytest.mark.cpu_only  # kernel='cpp' runs on CPU tensors
def test_cpp_kernel_at_a_real_vocabulary():
    """Qwen's 151,936 logits per row: each of the 16 float lanes sums 64 terms at a time before handing them to a
    double lane (about 150 hand-overs per row); within the matrix's tolerance of the float64 computation (sharp and
    flat rows, likely and unlikely actions)."""
    g = torch.Generator().manual_seed(19)
    V = 151936
    logits = torch.randn(6, V, generator=g) * torch.tensor([0.5, 2.0, 4.0, 8.0, 1.0, 3.0])[:, None]
    logits[4, 7] += 30.0  # one token takes almost all the mass
    actions = torch.tensor([3, 10, logits[2].argmax(), 5, 7, logits[5].argmin()])
    assert_matches(entropy_sensitivity(logits, actions, kernel="cpp"), logits, actions)


@pytest.mark.cpu_only  # kernel='cpp' runs on CPU tensors
def test_cpp_kernel_is_built_once_per_machine_into_its_cache(tmp_path):
    """Built at first use into $STARE_KERNEL_CACHE, loaded from there by the next process (not rebuilt); a compiler
    that fails, or a cache that cannot be written, gives a RuntimeError that names the ways out."""
    import subprocess
    import sys

    code = ("import torch; from stare.algorithms import entropy_sensitivity as e; "
            "print(float(e(torch.zeros(1, 4), torch.zeros(1, dtype=torch.long), kernel='cpp').entropy[0]))")
    env = {**os.environ, "STARE_KERNEL_CACHE": str(tmp_path / "k")}
    env.pop("CXX", None)
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    assert float(first.stdout) == pytest.approx(1.3862944, abs=1e-6)  # log 4: four equal logits
    built = list((tmp_path / "k").glob("entropy_*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    again = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and float(again.stdout) == pytest.approx(1.3862944, abs=1e-6)
    assert list((tmp_path / "k").glob("entropy_*.so")) == built and built[0].stat().st_mtime_ns == stamp
    broken = {**env, "CXX": "false", "STARE_KERNEL_CACHE": str(tmp_path / "other")}
    failed = subprocess.run([sys.executable, "-c", code], env=broken, capture_output=True, text=True, timeout=300)
    assert failed.returncode != 0
    assert "kernel='cpp' could not build _entropy_cpp.cc" in failed.stderr and "use kernel='torch'" in failed.stderr
    blocked = tmp_path / "a file, not a folder"
    blocked.write_text("")
    unwritable = {**env, "STARE_KERNEL_CACHE": str(blocked)}
    failed = subprocess.run([sys.executable, "-c", code], env=unwritable, capture_output=True, text=True, timeout=300)
    assert failed.returncode != 0 and "kernel='cpp' could not build" in failed.stderr, failed.stderr[-2000:]
    assert "STARE_KERNEL_CACHE" in failed.stderr


def test_an_old_triton_without_knobs_means_the_torch_path(monkeypatch):
    """_entropy_triton needs ``from triton import knobs`` (Triton >= 3.4): with an older Triton, whose ``import
    triton`` works, auto must keep CUDA on the torch path (not pick a kernel that cannot import) and
    kernel='triton' must say why."""
    import sys
    import types

    from stare.algorithms import entropy as entropy_module

    for name in [m for m in sys.modules if m == "triton" or m.startswith("triton.")]:
        monkeypatch.delitem(sys.modules, name)  # the real Triton's modules, put back afterwards
    old = types.ModuleType("triton")  # an old Triton: triton and triton.language import, triton.knobs does not
    old.__version__ = "3.2.0"
    monkeypatch.setitem(sys.modules, "triton", old)
    monkeypatch.setitem(sys.modules, "triton.language", types.ModuleType("triton.language"))
    monkeypatch.delitem(sys.modules, "stare.algorithms._entropy_triton", raising=False)
    entropy_module._triton_problem.cache_clear()
    try:
        assert _resolve_kernel("auto", torch.device("cuda")) == "torch"
        with pytest.raises(ValueError, match=r"needs the triton package, 3.4 or later .*knobs"):
            _resolve_kernel("triton", torch.device("cuda"))
    finally:
        entropy_module._triton_problem.cache_clear()  # the real Triton again for the tests after this one
