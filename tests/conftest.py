"""The algorithm tests on another device: ``pytest -m cuda --device cuda`` (or ``STARE_TEST_DEVICE=cuda``).

Every test in ``ALGORITHM_TESTS`` carries the ``cuda`` marker. With ``--device cuda`` each such test runs with the
tensors that *test code* builds without a device (``torch.randn``, ``torch.tensor``, ``torch.Generator()``, ...)
put on that device; tensors that ``stare.algorithms`` builds itself keep torch's own default (CPU), so an
algorithm that forgets ``device=`` fails on a GPU run instead of being moved there silently (which
``torch.set_default_device`` would do). The default, ``--device cpu``, changes nothing: CI runs the same tests on
CPU.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

TESTS_DIR = str(Path(__file__).resolve().parent) + os.sep
ALGORITHM_TESTS = ("test_advantages.py", "test_baselines.py", "test_controllers.py", "test_entropy.py",
                   "test_entropy_kernels.py", "test_loss.py", "test_selection.py", "test_step.py")
DEVICES = ("cpu", "cuda")


def pytest_addoption(parser):
    parser.addoption("--device", default=None, choices=DEVICES,
                     help="device for the algorithm tests (marker `cuda`); default cpu, or $STARE_TEST_DEVICE")


def test_device(config) -> str:
    dev = config.getoption("--device") or os.environ.get("STARE_TEST_DEVICE") or "cpu"
    if dev not in DEVICES:
        raise pytest.UsageError(f"STARE_TEST_DEVICE must be one of {', '.join(DEVICES)}, got {dev!r}")
    return dev


test_device.__test__ = False  # a helper, not a test


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: an algorithm test that also runs on a GPU (pytest -m cuda --device cuda)")
    config.addinivalue_line("markers", "xdist_group(name): tests run on one pytest-xdist worker (set per module "
                                       "in conftest.py)")
    config.addinivalue_line("markers", "cpu_only: a test in an algorithm test file that checks CPU-only code or "
                                       "compares with CPU worker processes; not marked cuda")
    dev = test_device(config)
    if dev == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise pytest.UsageError("--device cuda: torch sees no CUDA device")


# Modules that start real engines (OpenRLHF's training loop, the vLLM CPU engine) and pace their own processes two
# at a time: under pytest-xdist (scripts/test.sh: -n 2 --dist loadgroup) they share one worker while the other runs
# the rest of the suite. Measured on a 2-core machine: 21 min 24 s of tests this way (xdist deals the groups with
# the most tests first, so this group starts after a few quick modules); dealing it first
# (--no-loadscope-reorder) was slower (43% of the tests done after 20 min), and giving each module its own worker ran four engine processes at once
# and 11 tests, the vLLM module's count, errored at its start (cause not pinned down).
REAL_ENGINE_TESTS = ("test_openrlhf_e2e.py", "test_vllm_cpu.py")


@pytest.hookimpl(tryfirst=True)  # before xdist's loadgroup reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in ALGORITHM_TESTS and item.get_closest_marker("cpu_only") is None:
            item.add_marker(pytest.mark.cuda)
        group = "real-engines" if item.path.name in REAL_ENGINE_TESTS else item.path.stem
        item.add_marker(pytest.mark.xdist_group(group))  # a module's fixtures are built once


def pytest_report_header(config):
    return f"stare test device (marker cuda): {test_device(config)}"


class TestCodeOnDevice:
    """A torch function mode: factory calls made from a file under tests/ without a ``device`` get ``device``;
    calls from anywhere else (the code under test) are left alone. ``torch.Generator()`` is covered while the mode
    is entered (see ``patched_generator``)."""

    __test__ = False

    def __init__(self, device: str):
        import torch
        from torch.overrides import TorchFunctionMode
        from torch.utils._device import _device_constructors

        constructors = _device_constructors()
        target = torch.device(device)

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func in constructors and kwargs.get("device") is None:
                    # frame 1: the Python code that called the (C) factory function
                    if sys._getframe(1).f_code.co_filename.startswith(TESTS_DIR):
                        kwargs["device"] = target
                return func(*args, **kwargs)

        self.mode, self.device = Mode(), target

    def __enter__(self):
        import torch

        self._generator = real = torch.Generator
        target = self.device

        class Meta(type(real)):
            def __instancecheck__(cls, obj):
                return isinstance(obj, real)

            def __subclasscheck__(cls, sub):
                return issubclass(sub, real)

        class Generator(real, metaclass=Meta):
            """``torch.Generator`` as test code sees it: no device means ``device``. Still a type (annotations such
            as ``torch.Generator | None`` in modules imported meanwhile work) and real generators are instances."""

            def __new__(cls, device=None):
                if device is None and sys._getframe(1).f_code.co_filename.startswith(TESTS_DIR):
                    device = target
                return real(device) if device is not None else real()

        torch.Generator = Generator
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        import torch

        self.mode.__exit__(*exc)
        torch.Generator = self._generator
        return False


@pytest.fixture(autouse=True)
def _algorithm_test_device(request):
    dev = test_device(request.config)
    if dev == "cpu" or request.node.get_closest_marker("cuda") is None:
        yield
        return
    with TestCodeOnDevice(dev):
        yield
