"""Tiny shared helpers for the benchmarks: interleaved median timing and the summary printout.

Not a framework: each benchmark script reads top to bottom and calls these functions.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import os
import random
import resource
import statistics
import time

import torch


def synchronize(device: torch.device | str) -> None:
    """Wait for queued kernels on an accelerator; no-op on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def keep_freed_memory() -> str:
    """Ask glibc to keep freed memory in the process instead of handing it back to the operating system.

    By default glibc serves blocks above a dynamic threshold (128 KB to 32 MB) with fresh ``mmap`` calls and
    returns them on ``free``, and trims the heap's free top; a training step that allocates and frees
    multi-MB activations then page-faults all of them in again on every step, which makes a tiny model's step
    slower and identical steps noisy (figures: docs/benchmarks.md). Blocks up to 32 MB (glibc's ceiling) stay in
    the heap.
    Call it first, before the big allocations. Returns a line for the printout (what was done, or why not).
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return "allocator: left as it is (no glibc mallopt here)"
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    done = (mallopt(m_mmap_threshold, 32 << 20) == 1 and mallopt(m_trim_threshold, (1 << 31) - 1) == 1
            and mallopt(m_top_pad, 256 << 20) == 1)
    if not done:
        return "allocator: glibc refused the settings; freed memory may page-fault back in every step"
    return "allocator: freed blocks up to 32 MB stay in the process (glibc mallopt), so steps do not page-fault"


def interleaved_times(fns: dict, *, repeats: int, warmup: int = 2, device="cpu") -> dict[str, list[float]]:
    """Time each callable ``repeats`` times, interleaved, after ``warmup`` untimed rounds; seconds per call.

    Interleaving (A B, then B A, then A B, ...) exposes both variants to the same machine state (clock
    boost, other load, allocator caches), so their ratio is fair even when absolute times drift.
    """
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    synchronize(device)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(repeats):
        order = names if i % 2 == 0 else names[::-1]
        for name in order:
            gc.collect()
            synchronize(device)
            t0 = time.perf_counter()
            fns[name]()
            synchronize(device)
            times[name].append(time.perf_counter() - t0)
    return times


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def ratio_interval(variant_times, base_times, *, resamples=2000, level=0.90, seed=0):
    """(low, high): the ``level`` interval of median(variant) / median(base) by a paired bootstrap over the repeats.

    Repeat i of every variant ran in the same round of the interleaving, so a round is resampled whole: what
    moved every variant's step in that round (another process, the clock) moves both medians together.
    """
    n = len(base_times)
    if n == 0 or len(variant_times) != n:
        raise ValueError(f"ratio_interval needs one time per repeat for both, got {len(variant_times)} and {n}")
    rng = random.Random(seed)
    draws = []
    for _ in range(resamples):
        pick = [rng.randrange(n) for _ in range(n)]
        draws.append(median([variant_times[i] for i in pick]) / median([base_times[i] for i in pick]))
    draws.sort()
    tail = (1.0 - level) / 2
    return draws[int(tail * (resamples - 1))], draws[int((1.0 - tail) * (resamples - 1))]


def verdict(ratio: float, target: float) -> str:
    return "PASS" if ratio <= target else "FAIL"


class BackgroundLoad:
    """How many CPU cores OTHER processes kept busy between construction and the first ``cores()`` (Linux).

    Machine-wide busy time from /proc/stat minus this process's (and its finished children's) CPU time.
    A benchmark prints it so that a reader can tell a slow run from a contended one; None off Linux.
    """

    def __init__(self):
        self.start = self._snapshot()

    @staticmethod
    def _snapshot():
        try:
            with open("/proc/stat") as f:
                ticks = [int(v) for v in f.readline().split()[1:9]]
        except OSError:
            return None
        busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
        own = sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                    resource.getrusage(resource.RUSAGE_CHILDREN)))
        return busy, own, time.monotonic()

    def cores(self) -> float | None:
        """Measured at the first call (which ends the window); later calls return the same value."""
        if not hasattr(self, "_cores"):
            end = self._snapshot()
            if self.start is None or end is None or end[2] <= self.start[2]:
                self._cores = None
            else:
                other = (end[0] - self.start[0]) - (end[1] - self.start[1])
                self._cores = max(0.0, other / (end[2] - self.start[2]))
        return self._cores

    def line(self) -> str:
        cores = self.cores()
        if cores is None:
            return "  background load: unknown"
        text = f"  background load from other processes: {cores:.2f} of {os.cpu_count()} cores"
        if cores > 0.25:
            text += "  WARNING: the machine was busy, timings (and possibly ratios) are unreliable"
        return text


def print_result(payload: dict) -> None:
    """The last line of every benchmark: ``RESULT {json}`` for scripts to parse."""
    print("RESULT " + json.dumps(payload, sort_keys=True))
