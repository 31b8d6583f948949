"""The GPU check behind ``scripts/gpu-check.sh``: the fused Triton kernel at 8,192 x 151,936 bf16, the algorithm
tests on CUDA, the memory plan against one training micro-batch (``--item gpu-memory-plan``), ``stare run --preset
tiny-cpu --set device=cuda``, then the other benchmarks at real size, each as a subprocess (its own process group)
with a time limit, into one JSON file of figures and one combined log.

Written for the machine it runs on when a GPU is lent: a stock CUDA PyTorch image (its own torch, triton,
transformers; no vLLM, DeepSpeed, OpenRLHF, math-verify or datasets), no network, the working tree copied in, and
only ``--out`` coming back (at most 8 files). Nothing is installed into that Python: ``stare`` is made importable
from the working tree by a path mapping (a temporary folder holding ``stare/{cli,algorithms,eval,configs}`` as links
to the tree's folders, put first on ``PYTHONPATH``), and the wheels in ``gpu-wheels/`` (``scripts/gpu-wheels.sh``),
if any, go into a temporary ``--target`` folder with ``pip --no-index``. ``--dry-run`` does the same set-up, then
imports each step's modules in a subprocess with the steps' environment (and collects the tests), so it says
exactly which steps would run there; it writes nothing under ``--out``.

Standard library only (torch is imported for the device check, and torch and transformers by ``--item``), so
``--dry-run`` works anywhere.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
WHEELS = REPO / "gpu-wheels"  # scripts/gpu-wheels.sh fills it; travels only when the device tool's carry names it
# the import package stare's parts -> the working tree's folders (pyproject's [tool.setuptools.package-dir]; a
# test compares them)
PACKAGE_DIRS = {"cli": "stare_cli", "algorithms": "algorithms", "eval": "eval", "configs": "configs"}
# The algorithm tests (conftest's ALGORITHM_TESTS; a test compares them): run with -m cuda --device cuda.
ALGORITHM_TESTS = ("test_advantages.py", "test_baselines.py", "test_controllers.py", "test_entropy.py",
                   "test_entropy_kernels.py", "test_loss.py", "test_selection.py", "test_step.py")
VOCAB = 151_936
DEFAULT_BUDGET = 500  # s: the documented command's; the device tool allows 600 s a command
MIN_STEP_S = 20  # a step is not started with less than this left


class Step(NamedTuple):
    cmd: list[str]  # "{out}" -> the run's scratch folder (not --out: only figures go there)
    limit: int  # s
    imports: tuple[str, ...]  # modules the step needs, imported by the dry run's probe
    what: str


def bench(script: str, *args: str) -> list[str]:
    return [PY, f"benchmarks/{script}", "--device", "cuda", *args]


BENCH_IMPORTS = ("torch", "_timing", "stare.algorithms")  # _timing: benchmarks/_timing.py (the probe adds the folder)
TEST_CMD = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda"]

# In the order they run: what matters most first, so a slow start or a slow step costs the least important figures.
STEPS: dict[str, Step] = {
    # the fused kernel's target is stated at 8,192 rows x 151,936 bf16 (<= 1.0 ms on one H200): torch and Triton
    # side by side
    "bench-entropy-triton": Step(
        bench("bench_entropy.py", "--n", "8192", "--vocab", str(VOCAB), "--dtype", "bf16", "--repeats", "5",
              "--mem-repeats", "1", "--kernel", "both"), 150,
        BENCH_IMPORTS + ("triton", "stare.algorithms._entropy_triton"),
        "entropy/Phi, torch vs the fused Triton kernel, 8,192 x 151,936 bf16 (target <= 1.0 ms)"),
    "algorithm-tests-cuda": Step(
        TEST_CMD + ["--device", "cuda", "--junitxml", "{out}/algorithm-tests.xml"]
        + [f"tests/{name}" for name in ALGORITHM_TESTS], 200,
        ("pytest", "torch", "stare.algorithms"), "the algorithm tests (marker cuda) with their tensors on the GPU"),
    # the memory plan (stare_cli/gpu_memory.py) against one real training micro-batch: this script's own item
    "gpu-memory-plan": Step(
        [PY, "scripts/gpu_check.py", "--item", "gpu-memory-plan"], 150,
        ("torch", "transformers", "stare.cli.gpu_memory", "stare.algorithms.entropy_bonus"),
        "the memory plan's training terms against torch's peak over one micro-batch of the qwen-1.5b-1gpu preset "
        "(Qwen2.5-Math-1.5B shapes, random bf16 weights, 16,384 tokens), with and without the entropy bonus"),
    "stare-run-tiny-cpu": Step(
        [PY, "-m", "stare.cli.main", "run", "--preset", "tiny-cpu", "--out", "{out}/tiny-cpu", "--parallel", "4",
         "--set", "device=cuda"], 240,
        ("stare.cli.main", "stare.cli.local.runner", "stare.cli.local.trainer", "stare.cli.report.tables",
         "stare.cli.report.plots", "transformers", "tokenizers", "typer", "rich", "yaml", "numpy", "matplotlib.pyplot"),
        "the local engine end to end on the GPU (device=cuda: warm starts, training, evaluation; 4 arms share it)"),
    "bench-entropy": Step(
        bench("bench_entropy.py", "--n", str(8 * 4096), "--vocab", str(VOCAB), "--dtype", "bf16", "--repeats", "5",
              "--mem-repeats", "2"), 150, BENCH_IMPORTS,
        "entropy/surprisal/Phi, chunked vs naive vs full-grad, 8 x 4096 tokens, V 151,936, bf16"),
    "bench-weighted-loss": Step(bench("bench_weighted_loss.py"), 60, BENCH_IMPORTS,
                                "policy_loss fwd+bwd with STARE weights vs without, 8 x 4096"),
    "bench-selection": Step(bench("bench_selection.py"), 60, BENCH_IMPORTS,
                            "stare_token_weights over 512 x 4096 vs one kthvalue"),
    # no vLLM and no math-verify there: the HF backend, scoring off (its --score auto)
    "bench-eval-hf": Step(
        bench("bench_eval.py", "--backend", "hf", "--limit", "10", "--k", "8", "--max-tokens", "128", "--repeats",
              "2", "--layers", "8", "--hidden", "1024"), 150,
        ("torch", "_timing", "transformers", "tokenizers", "stare.eval.harness"),
        "stare eval's HF backend, problems batched vs one at a time, 10 AIME 2025 problems x k 8 x 128 tokens"),
}


def plan() -> dict[str, Step]:
    return dict(STEPS)


# ---- set-up: stare from the working tree, the carried wheels ------------------------------------------------------
def path_mapping(root: Path) -> Path:
    """``root/stare/<part>`` -> the working tree's folders: ``stare`` importable with nothing installed."""
    pkg = root / "stare"
    pkg.mkdir(parents=True, exist_ok=True)
    for part, folder in PACKAGE_DIRS.items():
        link = pkg / part
        if not link.exists():
            link.symlink_to(REPO / folder, target_is_directory=True)
    return root


def install_carried(wheels: Path, target: Path) -> str | None:
    """``pip install --no-index --no-deps --target`` of every wheel in ``wheels``; None when done (or none), else
    the one-line reason."""
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not found:
        return None
    res = subprocess.run([PY, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                          "--disable-pip-version-check", "--target", str(target), *map(str, found)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or ["pip failed"])[-1]
        return f"pip install --no-index from {wheels} failed: {last}"
    return None


def step_env(scratch: Path, wheels: Path) -> tuple[dict, list[str]]:
    """The environment every step (and the dry run's probes) runs in, and notes on how it was made."""
    notes = []
    mapping = path_mapping(scratch / "path")
    paths = [str(mapping)]
    carried = scratch / "carried"
    problem = install_carried(wheels, carried)
    if problem:
        notes.append(problem)
    elif carried.is_dir():
        paths.insert(0, str(carried))
        notes.append(f"installed {len(list(wheels.glob('*.whl')))} carried wheels from {wheels}")
    old = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(paths + ([old] if old else [])),
           "PIP_NO_INDEX": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return env, notes


PROBE = """import importlib, sys
sys.path.insert(0, "benchmarks")
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except BaseException as e:
        print(f"import {name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        sys.exit(1)
"""


def probe(name: str, step: Step, env: dict, scratch: Path) -> str | None:
    """None when the step's modules import in ``env`` (and, for the tests, pytest collects them); else why not."""
    try:
        res = subprocess.run([PY, "-c", PROBE, *step.imports], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=120)
    except subprocess.TimeoutExpired:
        return "importing its modules took over 120 s"
    if res.returncode != 0:
        return (res.stdout.strip() or res.stderr.strip() or f"exit {res.returncode}").splitlines()[-1]
    if name == "algorithm-tests-cuda":  # the test files import (collection does not need the GPU)
        files = [c for c in step.cmd if c.startswith("tests/")]
        res = subprocess.run(TEST_CMD + ["--collect-only", *files], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=180)
        if res.returncode != 0:
            lines = [ln for ln in (res.stdout + res.stderr).splitlines() if "Error" in ln] or ["collection failed"]
            return f"pytest --collect-only: {lines[0].strip()}"
    return None


# ---- running a step -------------------------------------------------------------------------------------------------
def kill_group(pgid: int, grace: float = 3.0) -> None:
    """SIGTERM to the whole process group (the step and whatever it started), SIGKILL after ``grace`` s."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_step(cmd: list[str], limit: float, env: dict) -> tuple[int | None, str, float]:
    """Run ``cmd`` in a session of its own for at most ``limit`` s; whatever it started is ended with it.
    Returns (exit code, None on time-out; its output; seconds)."""
    t0 = time.monotonic()
    with tempfile.TemporaryFile("w+", errors="replace") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            rc = None
        kill_group(proc.pid)  # on a time-out the step; in any case what it left behind (workers, arms)
        proc.wait()
        log.seek(0)
        output = log.read()
    return rc, output, time.monotonic() - t0


def parse_result(output: str) -> dict | None:
    """The benchmarks' last ``RESULT {json}`` line."""
    for line in reversed(output.splitlines()):
        if line.startswith("RESULT "):
            try:
                return json.loads(line[len("RESULT "):])
            except json.JSONDecodeError:
                return None
    return None


def parse_junit(path: Path) -> dict | None:
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    return {**counts, "failed": failed}


def environment() -> dict:
    env = {"python": platform.python_version(), "machine": platform.machine()}
    try:
        import torch

        env["torch"] = torch.__version__
        env["cuda_available"] = torch.cuda.is_available()
        env["torch_cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            env["gpu"] = p.name
            env["gpu_memory_gib"] = round(p.total_memory / 2**30, 1)
            env["gpu_count"] = torch.cuda.device_count()
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        env["torch_error"] = f"{type(e).__name__}: {e}"
    from importlib.metadata import version

    for mod in ("triton", "transformers", "vllm", "deepspeed", "openrlhf", "math-verify"):
        try:
            env[mod] = version(mod)
        except Exception:  # noqa: BLE001 - not installed
            env[mod] = None
    return env


# ---- the item gpu-memory-plan: the memory plan's training terms against one micro-batch on the GPU ----------------
# The qwen-1.5b-1gpu preset's model and packing budget (a test compares them with the preset). The plan counts the
# micro-batch's terms for one actor rank without ZeRO sharding (N = 1, stage 0) and gradient checkpointing on.
MEMORY_ITEM = "gpu-memory-plan"
MEMORY_MODEL = "Qwen/Qwen2.5-Math-1.5B"
MEMORY_TOKENS = 16_384
MEMORY_BOUNDS = (0.6, 1.0)  # measured peak / planned terms: within the plan, and not wildly below it
BONUS_COEF = 0.01  # the entropy bonus's coefficient in the second run (its value does not change the memory)
LOGPROB_CHUNK_ROWS = 256
# the plan's terms a micro-batch without an optimizer holds (allocated through torch's allocator)
COMPARED = ("weights (bf16)", "gradients (bf16)", "activation checkpoints", "one layer's activations with gradients",
            "logits (fp32, with gradients)", "entropy bonus")
NOT_MEASURED = {"optimizer (fp32 weights, Adam m and v)": "no optimizer step is taken (no DeepSpeed there)",
                "CUDA context": "outside torch's allocator: measured apart (the device's used memory less what torch "
                                "reserved), not in the ratio"}
GIB_ = 2 ** 30


def ensure_stare() -> None:
    """``stare`` importable: the step's PYTHONPATH maps it already; run by hand, map this tree for this process."""
    try:
        import stare.cli  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(path_mapping(Path(tempfile.mkdtemp(prefix="stare-gpu-check-path-")))))


def memory_settings(tokens: int) -> dict:
    """The settings the plan reads for the measured micro-batch: one rank, ZeRO-0, packing at ``tokens``."""
    return {"gpus_per_node": 1, "nodes": 1, "zero_stage": 0, "packing": True, "max_tokens_per_gpu": tokens,
            "gradient_checkpointing": True, "kl_coef": 0.0, "colocate": False}


def memory_config(layers: int | None = None) -> dict:
    """The model's config.json as shipped (configs/model_shapes.json), ``layers`` decoder layers if given."""
    ensure_stare()
    from stare.cli import gpu_memory as gm

    cfg = dict(gm.shipped_shapes()[MEMORY_MODEL])
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    return cfg


def planned_terms(cfg: dict, tokens: int, bonus: bool) -> dict[str, int]:
    """The plan's training terms in bytes, computed by stare_cli/gpu_memory.py itself for these shapes and tokens."""
    ensure_stare()
    from stare.cli import gpu_memory as gm

    shapes = gm.Shapes.from_config(cfg, source=MEMORY_MODEL)
    return dict(gm.train_phase(shapes, memory_settings(tokens), 80 * gm.GIB, bonus).terms)


def fused_log_prob():
    """``apply(logits [T, V] float32, labels [T]) -> log-probs [T]`` with the memory contract of flash-attn's
    cross_entropy_loss, which OpenRLHF's log_probs_from_logits calls on a GPU (no flash-attn on the lent machine):
    the forward keeps the float32 logits and one logsumexp per row, the backward writes one float32 gradient, both
    ``LOGPROB_CHUNK_ROWS`` rows at a time (tests/test_gpu_memory.py's PEAK measures the same on CPU)."""
    import torch

    class FusedLogProb(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logits, labels):
            lse = torch.cat([torch.logsumexp(c, -1) for c in logits.split(LOGPROB_CHUNK_ROWS)])
            ctx.save_for_backward(logits, lse, labels)
            return logits.gather(-1, labels[:, None])[:, 0] - lse

        @staticmethod
        def backward(ctx, g):
            logits, lse, labels = ctx.saved_tensors
            grad = torch.empty_like(logits)
            for rows in range(0, len(logits), LOGPROB_CHUNK_ROWS):
                sl = slice(rows, rows + LOGPROB_CHUNK_ROWS)
                torch.exp(logits[sl] - lse[sl, None], out=grad[sl])
            grad.mul_(-g[:, None])
            grad.scatter_add_(-1, labels[:, None], g[:, None])
            return grad, None

    return FusedLogProb.apply


def build_model(cfg: dict, device):
    """A randomly initialised Qwen2ForCausalLM of ``cfg``'s shapes on ``device`` in bf16, sdpa attention, gradient
    checkpointing on (non-reentrant, OpenRLHF 0.11.2's default), in training mode."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    kw = {k: v for k, v in cfg.items() if k != "model_type"}
    config = Qwen2Config(**kw, use_cache=False, attn_implementation="sdpa")
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # made in bf16 (no float32 copy first); rotary's inv_freq stays float32
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def micro_batch(model, ids, bonus: bool, after_forward=None):
    """One training micro-batch as OpenRLHF 0.11.2's Actor.forward and its loss: the logits cast to float32 (kept
    in ``output`` until after the backward, as the trainer keeps it), the log-probs of the next tokens (rolled ids),
    loss = -mean log-prob (minus ``BONUS_COEF`` x the chunked entropy's mean with the bonus), backward. Returns
    (loss, output): the caller drops the output."""
    import torch

    ensure_stare()
    from stare.algorithms.entropy_bonus import chunked_entropy

    rolled = torch.roll(ids, shifts=-1, dims=1)
    output = model(ids)
    output["logits"] = output["logits"].to(torch.float32)
    if after_forward is not None:
        after_forward()
    log_probs = fused_log_prob()(output["logits"].reshape(-1, output["logits"].shape[-1]), rolled.reshape(-1))
    loss = -log_probs.mean()
    if bonus:
        loss = loss - BONUS_COEF * chunked_entropy(output["logits"]).mean()
    loss.backward()
    return loss.detach(), output


def _gib(n: float) -> float:
    return round(n / GIB_, 3)


def _term(name: str, measured: float, planned: float, what: str) -> dict:
    return {"term": name, "measured_gib": _gib(measured), "planned_gib": _gib(planned),
            "ratio": round(measured / planned, 3) if planned else None, "what": what}


def attention_kernels():
    """sdpa in flash-attn's memory class, never its math kernel (a T x T matrix per head): flash or memory-efficient
    attention, or an error saying neither applies (an older torch without ``sdpa_kernel``: sdpa chooses)."""
    import contextlib

    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])


def memory_item(tokens: int, layers: int | None, *, cfg: dict | None = None, device: str = "cuda") -> tuple[dict, int]:
    """The item on CUDA: (its result, its exit code: 0 within ``MEMORY_BOUNDS``, 1 outside, out of memory or an
    error); without CUDA a skip with its reason. ``cfg`` and ``device`` are for the test that walks it on CPU with
    torch.cuda's memory counters stubbed: the shipped model's shapes and CUDA otherwise."""
    import gc

    import torch

    if not torch.cuda.is_available():
        return {"status": "skipped", "reason": f"no CUDA (torch {torch.__version__} sees no CUDA device)"}, 0
    cfg = cfg or memory_config(layers)
    cuda = torch.device(device)
    lo, hi = MEMORY_BOUNDS
    runs, terms = {}, []  # filled as measured: an out-of-memory keeps what came before it
    result = {"model": f"{MEMORY_MODEL}'s shapes, {cfg['num_hidden_layers']} layers, random weights",
              "how": "Qwen2ForCausalLM (transformers), bf16, sdpa (flash or memory-efficient kernels only), gradient "
                     "checkpointing (non-reentrant); one row of the tokens; float32 logits; log-probs by a fused "
                     "function with flash-attn's memory contract; no optimizer; one rank, ZeRO stage 0",
              "tokens": tokens, "gpu": torch.cuda.get_device_name(0), "bounds": list(MEMORY_BOUNDS),
              "ratio_is": "torch.cuda.max_memory_allocated() over the micro-batch / the plan's terms it holds "
                          "(weights, gradients, checkpoints, one layer's activations, logits, entropy bonus)",
              "not_compared": NOT_MEASURED, "runs": runs, "terms": terms}

    def settle() -> int:
        gc.collect()
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    try:
        with attention_kernels():
            torch.manual_seed(0)
            start = settle()
            model = build_model(cfg, cuda)
            weights = settle() - start
            result["parameters"] = sum(p.numel() for p in model.parameters())
            ids = torch.randint(0, cfg["vocab_size"], (1, tokens), device=cuda)
            # a first micro-batch: its gradients then exist, as from a step's second micro-batch on (the plan counts
            # them whole), and cuBLAS and the kernels are warm
            loss, output = micro_batch(model, ids, bonus=False)
            del output, loss
            grads = settle() - start - weights - ids.nbytes
            plain = planned_terms(cfg, tokens, bonus=False)
            terms += [_term("weights (bf16)", weights, plain["weights (bf16)"], "memory_allocated after building"),
                      _term("gradients (bf16)", grads, plain["gradients (bf16)"],
                            "memory_allocated after the first backward, less the weights")]
            peaks = {}
            for bonus in (False, True):
                planned = planned_terms(cfg, tokens, bonus)
                compared = {k: v for k, v in planned.items() if k in COMPARED}
                before = settle()
                torch.cuda.reset_peak_memory_stats()
                snap = {}
                t0 = time.perf_counter()
                loss, output = micro_batch(model, ids, bonus, after_forward=lambda: snap.setdefault(
                    "forward", torch.cuda.memory_allocated()))
                torch.cuda.synchronize()
                seconds = time.perf_counter() - t0
                peaks[bonus] = peak = torch.cuda.max_memory_allocated()
                reserved = torch.cuda.max_memory_reserved()
                del output
                name = "log-probs + entropy bonus" if bonus else "log-probs"
                total = sum(compared.values())
                per_token = total - compared["weights (bf16)"] - compared["gradients (bf16)"]
                runs[name] = {"peak_allocated_gib": _gib(peak), "planned_gib": _gib(total),
                              "ratio": round(peak / total, 3), "peak_reserved_gib": _gib(reserved),
                              "allocated_before_gib": _gib(before), "seconds": round(seconds, 3),
                              "loss": round(float(loss), 4),
                              "planned_terms_gib": {k: _gib(v) for k, v in planned.items()}}
                terms.append(_term(f"micro-batch ({name}): peak less weights and gradients", peak - before, per_token,
                                   "max_memory_allocated less memory_allocated before; planned: checkpoints, one "
                                   "layer's activations, logits" + (", entropy bonus" if bonus else "")))
                if not bonus:
                    terms.append(_term("after the forward: checkpoints + float32 logits", snap["forward"] - before,
                                       planned["activation checkpoints"] + tokens * cfg["vocab_size"] * 4,
                                       "memory_allocated after the cast less before; planned: the checkpoints and "
                                       "the logits term's float32 copy (4 of its 10 B per entry)"))
                else:
                    terms.append(_term("entropy bonus", peaks[True] - peaks[False], planned["entropy bonus"],
                                       "the peak with the bonus less the peak without"))
            free, card = torch.cuda.mem_get_info()
            terms.append(_term("CUDA context", card - free - torch.cuda.memory_reserved(), plain["CUDA context"],
                               "the device's used memory less torch's reserved memory, after the runs"))
    except RuntimeError as e:  # out of memory (a subclass), or no attention kernel: what came before is kept
        kind = "out of memory" if isinstance(e, torch.cuda.OutOfMemoryError) else "error"
        result.update(status=kind, error=f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}")
        return result, 1
    result["passed"] = all(lo <= r["ratio"] <= hi for r in runs.values())
    result["summary"] = "; ".join(f"{name}: peak {r['peak_allocated_gib']:.2f} GiB, planned {r['planned_gib']:.2f} "
                                  f"GiB, ratio {r['ratio']:.3f}" for name, r in runs.items()) + \
        f" (bounds {lo}-{hi}: {'within' if result['passed'] else 'OUTSIDE'})"
    return result, 0 if result["passed"] else 1


def run_item(name: str, tokens: int, layers: int | None) -> int:
    """One of this script's own items in this process (what its step's subprocess runs): its ``RESULT`` line last."""
    result, rc = memory_item(tokens, layers)
    if result.get("status") == "skipped":
        print(f"{name}: skipped: {result['reason']}")
    elif "summary" in result:
        print(f"{name}: {result['summary']}")
    else:
        print(f"{name}: {result.get('status')}: {result.get('error')}")
    print("RESULT " + json.dumps(result), flush=True)
    return rc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/gpu-check.sh", description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="set up as a run would, check that every step's modules import, run no step, write nothing")
    ap.add_argument("--out", default="runs/gpu-check",
                    help="folder for gpu-check.json, gpu-check.log and the tiny run's table and plot (on the lent "
                         "machine: \"$OUT/gpu-check\", the only folder that comes back)")
    ap.add_argument("--only", default="", help="comma-separated step names (default: all, in order)")
    ap.add_argument("--budget", type=int, default=DEFAULT_BUDGET,
                    help=f"seconds for the whole check (default {DEFAULT_BUDGET})")
    ap.add_argument("--wheels", default=str(WHEELS), help="folder of wheels to install with --no-index (default "
                                                          "gpu-wheels/, made by scripts/gpu-wheels.sh)")
    ap.add_argument("--item", choices=[MEMORY_ITEM],
                    help="run one of this script's own items here and now (what its step runs), printing its RESULT")
    ap.add_argument("--tokens", type=int, default=MEMORY_TOKENS,
                    help=f"--item {MEMORY_ITEM}: tokens of the micro-batch (default {MEMORY_TOKENS})")
    ap.add_argument("--layers", type=int, default=None,
                    help=f"--item {MEMORY_ITEM}: decoder layers (default: the model's own)")
    args = ap.parse_args(argv)
    if args.item:
        if args.tokens < 2 or (args.layers is not None and args.layers < 1):
            print("error: --tokens must be >= 2 and --layers >= 1", file=sys.stderr)
            return 2
        return run_item(args.item, args.tokens, args.layers)

    steps = plan()
    names = [s for s in args.only.split(",") if s] or list(steps)
    unknown = [s for s in names if s not in steps]
    if unknown:
        print(f"error: --only: unknown step {unknown[0]!r}; steps: {', '.join(steps)}", file=sys.stderr)
        return 2
    names = [s for s in steps if s in names]  # always in the check's order
    if args.budget < 1:
        print(f"error: --budget must be >= 1 second, got {args.budget}", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    wheels = Path(args.wheels).resolve()

    if not args.dry_run:
        env0 = environment()
        if not env0.get("cuda_available"):
            why = env0.get("torch_error") or f"torch {env0.get('torch')} sees none"
            print(f"error: no CUDA device ({why}); the GPU check needs one and ran nothing (--dry-run shows the plan)",
                  file=sys.stderr)
            return 2

    with tempfile.TemporaryDirectory(prefix="stare-gpu-check-") as tmp:
        scratch = Path(tmp)
        env, notes = step_env(scratch, wheels)
        if args.dry_run:
            return dry_run(steps, names, args, out, env, notes, scratch)
        return run(steps, names, args, out, env, notes, scratch, env0)


def dry_run(steps, names, args, out, env, notes, scratch) -> int:
    print(f"gpu-check (dry run): {len(names)} steps, budget {args.budget} s, figures -> {out / 'gpu-check.json'}")
    for note in notes:
        print(f"  set-up: {note}")
    blocked = 0
    for name in names:
        step = steps[name]
        cmd = [c.replace("{out}", "<scratch>") for c in step.cmd]  # a temporary folder; only figures go to --out
        why = probe(name, step, env, scratch)
        blocked += why is not None
        state = "runnable" if why is None else f"NOT runnable here: {why}"
        print(f"- {name} (limit {step.limit} s): {step.what}\n    {shlex.join(cmd)}\n    {state}")
    print(f"gpu-check (dry run): {len(names) - blocked} of {len(names)} steps runnable in this environment")
    return 0 if blocked == 0 else 1


def run(steps, names, args, out, env, notes, scratch, env0) -> int:
    work = scratch / "run"
    work.mkdir()
    out.mkdir(parents=True, exist_ok=True)
    report = {"started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "budget_s": args.budget,
              "environment": env0, "setup": notes, "steps": {}}
    path, log_path = out / "gpu-check.json", out / "gpu-check.log"
    log_path.write_text("")
    t_start = time.monotonic()
    for name in names:
        step = steps[name]
        cmd = [c.replace("{out}", str(work)) for c in step.cmd]
        row = {"what": step.what, "command": shlex.join(cmd)}
        left = args.budget - (time.monotonic() - t_start)
        if left < MIN_STEP_S:  # (no import probe here: a step that cannot import fails in seconds, and says why)
            row.update(status="skipped", reason=f"budget spent ({args.budget} s)")
        else:
            limit = int(min(step.limit, left))
            print(f"== {name} (limit {limit} s): {shlex.join(cmd)}", flush=True)
            rc, output, seconds = run_step(cmd, limit, env)
            row["status"] = "timeout" if rc is None else ("ok" if rc == 0 else "failed")
            if rc is not None:
                row["exit_code"] = rc
            row["seconds"] = round(seconds, 1)
            with log_path.open("a") as log:
                log.write(f"===== {name} ({row['status']}, {row['seconds']} s): {row['command']}\n{output}\n")
            result = parse_result(output)
            if result is not None:
                row["result"] = result
                if rc == 0 and result.get("status") == "skipped":  # an item that cannot run here says why
                    row.update(status="skipped", reason=result.get("reason", ""))
                if result.get("summary"):  # an item's one line: printed now and in the closing summary
                    row["summary"] = result["summary"]
            if name == "algorithm-tests-cuda":
                row["tests"] = parse_junit(work / "algorithm-tests.xml")
            if name == "stare-run-tiny-cpu":
                tiny = work / "tiny-cpu"
                for fname in ("comparison.md", "comparison.csv"):
                    if (tiny / fname).exists():
                        row[fname.replace(".", "_")] = (tiny / fname).read_text()
                if (tiny / "entropy.png").exists():
                    shutil.copy(tiny / "entropy.png", out / "tiny-cpu-entropy.png")
                    row["entropy_png"] = "tiny-cpu-entropy.png"
            if row["status"] != "ok":
                row["output_tail"] = output[-3000:]
            print(f"   {row['status']} in {row['seconds']} s", flush=True)
            if row.get("summary"):
                print(f"   {row['summary']}", flush=True)
        report["steps"][name] = row
        report["elapsed_s"] = round(time.monotonic() - t_start, 1)
        path.write_text(json.dumps(report, indent=2) + "\n")  # after every step: a killed check keeps its figures
    statuses = {n: r["status"] for n, r in report["steps"].items()}
    for name, row in report["steps"].items():
        if row.get("summary"):
            print(f"gpu-check: {name}: {row['summary']}")
    print(f"gpu-check: {json.dumps(statuses)}; figures in {path}, output in {log_path}")
    return 0 if all(s == "ok" for s in statuses.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
