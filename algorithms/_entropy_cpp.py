"""``entropy_sensitivity(..., kernel="cpp")``: the per-row statistics as a C++ loop, built at first use, for the CPU.

``_entropy_cpp.cc`` (beside this file) holds the loop: per row a pass for the maximum, then one that takes the
exponential and the four sums S0..S3 of the Triton kernel together, in 16 float lanes with a polynomial exponential,
writing nothing per logit; every 1,024 logits the float lanes hand their sums to double ones. On one core it is
faster than both the torch path and the compiled kernel, and the most accurate of the three against float64
(figures: docs/benchmarks.md). It is built with the machine's C++ compiler (``$CXX``, else ``c++``, ``g++`` or
``clang++``; ``-O3 -march=native``) into a cache folder (``$STARE_KERNEL_CACHE``, else
``~/.cache/stare/kernels``), under a name that hashes the source, the compiler, its flags and the CPU, so a shared
home folder never hands one machine another's build. It runs on one thread (the torch path uses torch's threads).
``auto`` never picks it: the default CPU numbers stay the torch path's, bit for bit.

float32 rows with a contiguous vocabulary are read in place, however far apart the rows are; other dtypes and
layouts are converted a few rows at a time (about 1M logits). -inf logits, bad actions, rows without a finite
logit and NaN logits behave as in the compiled and Triton kernels.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("_entropy_cpp.cc")
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC")
NATIVE = "-march=native"  # the machine's own vector width; dropped if the compiler refuses it
CONVERT_ELEMENTS = 1 << 20  # logits converted to float32 per call when the input is not float32 rows


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise RuntimeError("kernel='cpp' needs a C++ compiler (set CXX, or install g++ or clang++); "
                       "use kernel='torch' (or 'auto')")


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and feature flags (Linux), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def cache_dir() -> Path:
    return Path(os.environ.get("STARE_KERNEL_CACHE") or Path.home() / ".cache" / "stare" / "kernels")


def _build(compiler: str, flags: tuple[str, ...], target: Path) -> str | None:
    """Compile into ``target`` (atomically: a temporary file renamed); None on success, else the compiler's error."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *flags, str(SOURCE), "-o", tmp], capture_output=True, text=True)
        if proc.returncode != 0:
            return (proc.stderr.strip() or proc.stdout.strip() or f"exit status {proc.returncode}").splitlines()[0]
        os.replace(tmp, target)
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL:
    """The built kernel, loaded (built first when this machine has no build of this source yet)."""
    compiler = _compiler()
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    except OSError:
        version = ""
    built_by = [SOURCE.read_text(), compiler, version, _cpu_signature()]  # what a build depends on, besides flags
    error = None
    for flags in (FLAGS + (NATIVE,), FLAGS):
        key = hashlib.sha256("\0".join(built_by + [" ".join(flags)]).encode()).hexdigest()[:20]
        target = cache_dir() / f"entropy_{key}.so"
        if not target.exists():
            try:
                error = _build(compiler, flags, target)
            except OSError as exc:  # an unwritable cache folder, a compiler that cannot start
                error = f"{type(exc).__name__}: {exc}"
            if error is not None:
                continue
        lib = ctypes.CDLL(str(target))
        fn = lib.stare_entropy_rows
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_float,
                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        fn.restype = None
        return lib
    raise RuntimeError(f"kernel='cpp' could not build {SOURCE.name} with {compiler} into {cache_dir()} ({error}); "
                       "set CXX or STARE_KERNEL_CACHE, or use kernel='torch' (or 'auto')")


def entropy_stats_rows(
    rows: torch.Tensor, actions: torch.Tensor, entropy: torch.Tensor, surprisal: torch.Tensor, phi: torch.Tensor,
    *, temperature: float,
) -> None:
    """Fill ``entropy``, ``surprisal``, ``phi`` (float32 ``[r]``, contiguous) for logits ``rows`` ``[r, V]`` (CPU)
    and ``actions`` ``[r]``."""
    n, vocab = rows.shape
    if n == 0:
        return
    fn = library().stare_entropy_rows
    actions = actions.to(torch.int64).contiguous()
    inv_t = 1.0 / temperature
    if rows.dtype == torch.float32 and rows.stride(-1) == 1 and (n == 1 or rows.stride(0) >= vocab):
        fn(rows.data_ptr(), n, vocab, rows.stride(0), inv_t, actions.data_ptr(), entropy.data_ptr(),
           surprisal.data_ptr(), phi.data_ptr())
        return
    step = max(1, CONVERT_ELEMENTS // max(vocab, 1))
    for lo in range(0, n, step):  # converted (or made contiguous) a few rows at a time, never all of them at once
        block = rows[lo:lo + step].to(torch.float32).contiguous()
        fn(block.data_ptr(), block.shape[0], vocab, vocab, inv_t, actions[lo:].data_ptr(), entropy[lo:].data_ptr(),
           surprisal[lo:].data_ptr(), phi[lo:].data_ptr())
