"""The GPU check's CPU side: its dry run, and the device switch that runs the algorithm tests on a GPU.

No GPU here: the switch is exercised with torch's ``meta`` device, which needs none; the real run is
``bash scripts/gpu-check.sh`` on a GPU machine.
"""
import json
import os
import shutil
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest

import torch

from conftest import ALGORITHM_TESTS, TestCodeOnDevice

REPO = Path(__file__).resolve().parents[1]


def test_factories_called_from_test_code_go_to_the_device_and_library_calls_do_not():
    lib = {}
    exec(compile("import torch\ndef make():\n    return torch.zeros(2), torch.Generator()\n",
                 "/not/the/tests/lib.py", "exec"), lib)
    real_generator = torch.Generator
    with TestCodeOnDevice("meta"):
        a, b = torch.zeros(3), torch.tensor([1.0, 2.0])
        c = torch.ones(2, device="cpu")  # an explicit device is kept
        inner, gen = lib["make"]()
        assert isinstance(real_generator(), torch.Generator)  # the stand-in is a class: instances still match
        assert typing.get_args(torch.Generator | None) == (torch.Generator, type(None))  # and annotations work
    assert a.device.type == "meta" and b.device.type == "meta" and c.device.type == "cpu"
    assert inner.device.type == "cpu" and gen.device.type == "cpu"  # the code under test keeps torch's default
    assert torch.Generator is real_generator and torch.zeros(1).device.type == "cpu"  # all undone on exit


def test_the_cuda_marker_selects_exactly_the_algorithm_tests():
    res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "cuda", "-p",
                          "no:cacheprovider", "tests/test_loss.py", "tests/test_scoring.py", "tests/test_entropy.py"],
                         cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    files = {line.split("::")[0] for line in res.stdout.splitlines() if "::" in line}
    assert files == {"tests/test_loss.py", "tests/test_entropy.py"}
    assert {"test_loss.py", "test_entropy.py"} <= set(ALGORITHM_TESTS)


def test_a_cuda_run_without_a_gpu_is_refused_in_one_line():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "--device", "cuda", "-p", "no:cacheprovider",
                          "tests/test_loss.py"], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 4 and "--device cuda: torch sees no CUDA device" in res.stderr


def gpu_check(*args):
    return subprocess.run(["bash", str(REPO / "scripts" / "gpu-check.sh"), *args], cwd=REPO, capture_output=True,
                          text=True)


def test_dry_run_prints_the_plan_in_order_checks_imports_and_writes_nothing(tmp_path):
    out = tmp_path / "check"
    res = gpu_check("--dry-run", "--out", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    text = res.stdout
    steps = [line.split(" ")[1] for line in text.splitlines() if line.startswith("- ")]
    # the three figures that matter first, then the other benchmarks
    assert steps == ["bench-entropy-triton", "algorithm-tests-cuda", "gpu-memory-plan", "stare-run-tiny-cpu",
                     "bench-entropy", "bench-weighted-loss", "bench-selection", "bench-eval-hf"]
    commands = [line.strip() for line in text.splitlines() if line.startswith("    ") and "python" in line]
    triton, tests_line, memory_line, run_line, entropy = commands[:5]
    for flag in ("--device cuda", "--n 8192", "--vocab 151936", "--dtype bf16", "--kernel both"):
        assert flag in triton, flag
    for flag in ("--device cuda", "--n 32768", "--vocab 151936", "--dtype bf16"):
        assert flag in entropy, flag
    assert "benchmarks/bench_weighted_loss.py --device cuda" in text
    assert "benchmarks/bench_selection.py --device cuda" in text
    assert "benchmarks/bench_eval.py --device cuda --backend hf" in text
    # the algorithm tests on CUDA, every one of them, and the local engine end to end
    assert "-m cuda --device cuda" in tests_line
    assert all(f"tests/{name}" in tests_line for name in ALGORITHM_TESTS)
    assert "stare.cli.main run --preset tiny-cpu" in run_line and "--set device=cuda" in run_line
    assert memory_line.endswith("scripts/gpu_check.py --item gpu-memory-plan")  # this script's own item
    assert text.count("    runnable") == 8 and "8 of 8 steps runnable" in text  # their imports were tried here
    assert str(out / "gpu-check.json") in text
    assert not out.exists()  # nothing ran, nothing was written


def load_gpu_check():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    return gpu_check


def test_the_dry_run_names_a_step_whose_modules_do_not_import(tmp_path, monkeypatch, capsys):
    gc = load_gpu_check()
    monkeypatch.setattr(gc, "STEPS", {**gc.STEPS, "bench-selection": gc.STEPS["bench-selection"]._replace(
        imports=("torch", "stare_no_such_module"))})
    assert gc.main(["--dry-run", "--only", "bench-selection,bench-weighted-loss", "--out", str(tmp_path)]) == 1
    text = capsys.readouterr().out
    assert ("NOT runnable here: import stare_no_such_module: ModuleNotFoundError: No module named "
            "'stare_no_such_module'") in text
    assert "1 of 2 steps runnable" in text
    assert text.index("bench-weighted-loss") < text.index("bench-selection")  # --only keeps the check's order


def test_the_lists_agree_with_conftest_and_pyproject():
    tomllib = pytest.importorskip("tomllib")
    gc = load_gpu_check()
    assert gc.ALGORITHM_TESTS == ALGORITHM_TESTS
    assert {"test_step.py", "test_baselines.py", "test_entropy_kernels.py"} <= set(ALGORITHM_TESTS)
    assert all((REPO / "tests" / name).is_file() for name in ALGORITHM_TESTS)
    package_dir = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert {f"stare.{part}": folder for part, folder in gc.PACKAGE_DIRS.items()} == package_dir


def write_wheel(folder: Path, module: str, body: str) -> Path:
    """A minimal pure-Python wheel, made here (no network, no build backend)."""
    import base64
    import hashlib
    import zipfile

    dist = f"{module}-0.1.dist-info"
    files = {f"{module}/__init__.py": body,
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = [f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
              f"{len(text.encode())}" for name, text in files.items()] + [f"{dist}/RECORD,,"]
    files[f"{dist}/RECORD"] = "\n".join(record) + "\n"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{module}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


def test_the_steps_import_stare_from_the_tree_and_the_carried_wheels(tmp_path):
    gc = load_gpu_check()
    write_wheel(tmp_path / "wheels", "stare_carried_probe", "VALUE = 42\n")
    env, notes = gc.step_env(tmp_path / "scratch", tmp_path / "wheels")
    assert notes == [f"installed 1 carried wheels from {tmp_path / 'wheels'}"]
    assert env["PIP_NO_INDEX"] == "1"
    code = ("import stare.algorithms, stare.cli, stare_carried_probe; from pathlib import Path; "
            "print(Path(stare.algorithms.__file__).resolve().parent, stare_carried_probe.VALUE)")
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [str(REPO / "algorithms"), "42"]  # this tree's code, not an installed copy
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "broken-0.1-py3-none-any.whl").write_text("not a zip")
    _, notes = gc.step_env(tmp_path / "scratch2", bad)
    assert len(notes) == 1 and notes[0].startswith(f"pip install --no-index from {bad} failed")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.mark.parametrize("how", ["timeout", "exits"])
def test_a_step_ends_with_everything_it_started(tmp_path, how):
    """A step's time-out ends its process group (the benchmark workers, the arms), not only its own process; a step
    that exits leaves nothing behind either."""
    gc = load_gpu_check()
    pidfile = tmp_path / "pid"
    tail = "wait" if how == "timeout" else "exit 0"
    script = f"sleep 300 & echo $! > {pidfile}; echo started; {tail}"
    t0 = time.monotonic()
    rc, output, seconds = gc.run_step(["bash", "-c", script], 2 if how == "timeout" else 60, os.environ.copy())
    grandchild = int(pidfile.read_text())
    assert (rc is None) == (how == "timeout") and "started" in output
    assert time.monotonic() - t0 < 30
    for _ in range(50):
        if not alive(grandchild):
            break
        time.sleep(0.1)
    assert not alive(grandchild), "the step's child outlived it"


def test_bad_flags_fail_in_one_line(tmp_path):
    res = gpu_check("--only", "bench-nope", "--dry-run")
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "--only" in res.stderr
    assert "bench-entropy" in res.stderr  # the valid choices are named
    if not torch.cuda.is_available():
        res = gpu_check("--out", str(tmp_path / "x"))
        assert res.returncode == 2 and res.stderr.count("\n") == 1 and "no CUDA device" in res.stderr
        assert res.stdout == "" and not (tmp_path / "x").exists()


def test_result_parsing_reads_the_benchmarks_last_line_and_junit(tmp_path):
    gpu_check = load_gpu_check()
    assert gpu_check.parse_result('x\nRESULT {"a": 1}\nRESULT {"b": 2}\ntrailing\n') == {"b": 2}
    assert gpu_check.parse_result("no result") is None
    xml = tmp_path / "r.xml"
    xml.write_text('<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
                   '<testcase classname="tests.test_loss" name="test_a"><failure/></testcase>'
                   '<testcase classname="tests.test_loss" name="test_b"/></testsuite></testsuites>')
    assert gpu_check.parse_junit(xml) == {"tests": 3, "failures": 1, "errors": 0, "skipped": 1,
                                          "failed": ["tests.test_loss::test_a"]}


# ---- the item gpu-memory-plan: its parts that need no GPU ---------------------------------------------------------
def test_the_memory_item_compares_the_presets_plan_written_out_by_hand():
    """The item measures the qwen-1.5b-1gpu preset's model at its packing budget, and the numbers it compares
    against are the plan's own for one rank at ZeRO-0, equal to the arithmetic from the model's card: P 1.54B,
    T 16,384, V 151,936, L 28, h 1536, q 1536, kv 256, I 8960."""
    from stare.cli.presets import resolve

    gc = load_gpu_check()
    settings = resolve("qwen-1.5b-1gpu", "grpo")["settings"]
    assert (gc.MEMORY_MODEL, gc.MEMORY_TOKENS) == (settings["model"], settings["max_tokens_per_gpu"])
    cfg = gc.memory_config()
    P, T, V, L, h, q, kv, I = 1_543_714_304, 16384, 151936, 28, 1536, 1536, 256, 8960  # noqa: E741
    hand = {"weights (bf16)": 2 * P, "gradients (bf16)": 2 * P, "optimizer (fp32 weights, Adam m and v)": 12 * P,
            "activation checkpoints": T * L * h * 2,
            "one layer's activations with gradients": T * (4 * h + 2 * q + 2 * kv + 4 * I) * 2 * 2,
            "logits (fp32, with gradients)": T * V * (4 + 4 + 2), "CUDA context": 2 ** 30}
    assert gc.planned_terms(cfg, T, bonus=False) == hand
    bonus = gc.planned_terms(cfg, T, bonus=True)
    assert bonus == {**hand, "entropy bonus": T * V * 6 + 2 * 1024 * V * 4}
    compared = sum(v for k, v in bonus.items() if k in gc.COMPARED)
    assert compared == sum(bonus.values()) - 12 * P - 2 ** 30  # all but the optimizer and the context
    assert round(compared / 2 ** 30, 2) == 48.1 and gc.MEMORY_BOUNDS == (0.6, 1.0)


def test_the_memory_item_skips_without_cuda_in_one_line(monkeypatch, capsys):
    gc = load_gpu_check()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    t0 = time.monotonic()
    assert gc.main(["--item", "gpu-memory-plan"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"gpu-memory-plan: skipped: no CUDA (torch {torch.__version__} sees no CUDA device)"
    assert gc.parse_result(out) == {"status": "skipped", "reason": f"no CUDA (torch {torch.__version__} sees no "
                                                                   "CUDA device)"}
    assert time.monotonic() - t0 < 5
    assert gc.main(["--item", "gpu-memory-plan", "--tokens", "1"]) == 2


def test_a_skipped_item_and_an_items_summary_reach_the_report(tmp_path, monkeypatch, capsys):
    gc = load_gpu_check()
    say = 'print("RESULT " + __import__("json").dumps({})); raise SystemExit({})'
    steps = {"a": gc.Step([sys.executable, "-c", say.format({"status": "skipped", "reason": "no CUDA"}, 0)], 30, (),
                          "a"),
             "b": gc.Step([sys.executable, "-c", say.format({"summary": "peak 1 GiB, planned 2 GiB"}, 1)], 30, (),
                          "b")}
    args = gc.argparse.Namespace(budget=60)
    assert gc.run(steps, ["a", "b"], args, tmp_path / "out", os.environ.copy(), [], tmp_path, {}) == 1
    report = json.loads((tmp_path / "out" / "gpu-check.json").read_text())["steps"]
    assert (report["a"]["status"], report["a"]["reason"]) == ("skipped", "no CUDA")
    assert (report["b"]["status"], report["b"]["summary"]) == ("failed", "peak 1 GiB, planned 2 GiB")
    assert "gpu-check: b: peak 1 GiB, planned 2 GiB" in capsys.readouterr().out


TINY_QWEN2 = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 300, "tie_word_embeddings": True,
              "max_position_embeddings": 64}


def test_the_memory_items_micro_batch_has_the_gradients_of_openrlhfs_loss_on_cpu():
    """The micro-batch the item measures, on a tiny Qwen2 on CPU: the fused log-prob (flash-attn's memory contract)
    and the chunked entropy bonus give the gradients of -mean log_softmax(next token) - 0.01 mean entropy."""
    gc = load_gpu_check()
    torch.manual_seed(0)
    model = gc.build_model(TINY_QWEN2, "cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and model.is_gradient_checkpointing
    assert model.training and model.config._attn_implementation == "sdpa"
    # compared in float32: in bfloat16 the bonus's share of the gradient (0.3-0.8% of its norm) is about one rounding,
    # so the two paths' roundings (which differ with the CPU's kernels: AVX2 against AVX-512) would hide it
    model.float()
    ids = torch.randint(0, 300, (1, 40))
    for bonus in (False, True):
        model.zero_grad(set_to_none=True)
        loss, output = gc.micro_batch(model, ids, bonus)
        assert output["logits"].dtype == torch.float32
        got = [p.grad.float().clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        logp = torch.log_softmax(model(ids).logits.float(), -1)
        want = -logp.gather(-1, torch.roll(ids, -1, 1)[..., None]).mean()
        if bonus:
            want = want - 0.01 * -(logp.exp() * logp).sum(-1).mean()
        want.backward()
        assert float(loss) == pytest.approx(want.item(), rel=1e-5)
        for g, p in zip(got, model.parameters()):
            torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-5 * float(p.grad.abs().max()))


def test_the_memory_item_walks_through_on_cpu_with_stubbed_counters(monkeypatch):
    """The whole item on a tiny Qwen2 on CPU, torch.cuda's memory counters stubbed: its results name every term and
    its ratio is the peak over the plan's compared terms."""
    gc = load_gpu_check()
    peaks = []
    for name, value in (("is_available", True), ("get_device_name", "stub"), ("synchronize", None),
                        ("reset_peak_memory_stats", None), ("memory_allocated", 0), ("max_memory_reserved", 0),
                        ("memory_reserved", 0), ("mem_get_info", (0, 2 ** 30))):
        monkeypatch.setattr(torch.cuda, name, lambda *a, v=value: v)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: peaks.pop(0))
    tokens = 32
    plain, bonus = (sum(v for k, v in gc.planned_terms(TINY_QWEN2, tokens, b).items() if k in gc.COMPARED)
                    for b in (False, True))
    peaks += [int(0.9 * plain), int(0.5 * bonus)]
    result, rc = gc.memory_item(tokens, None, cfg=TINY_QWEN2, device="cpu")
    assert [r["ratio"] for r in result["runs"].values()] == [0.9, 0.5] and result["parameters"] > 0
    assert not result["passed"] and rc == 1 and result["summary"].endswith("(bounds 0.6-1.0: OUTSIDE)")
    assert [t["term"] for t in result["terms"]] == [
        "weights (bf16)", "gradients (bf16)", "micro-batch (log-probs): peak less weights and gradients",
        "after the forward: checkpoints + float32 logits",
        "micro-batch (log-probs + entropy bonus): peak less weights and gradients", "entropy bonus", "CUDA context"]
    assert json.loads(json.dumps(result)) == result  # what the RESULT line carries


# ---- the lent machine, simulated ---------------------------------------------------------------------------------
# What the machine holds, as last read (Python 3.12, torch 2.11.0 with CUDA 13.0 there), as close as CPU wheels
# allow here: Python 3.11 (this machine's), the local CPU torch 2.13.0 (torch 2.11's CPU build is not reachable
# here), and the rest at the machine's versions; no math-verify, datasets, vLLM, Ray, DeepSpeed, OpenRLHF, and
# not this package. Cached in build/gpu-sim-env (gitignored) under a stamp of this list; a first build takes
# about a minute.
SIM_PACKAGES = ("torch==2.13.0", "triton==3.6.0", "transformers==5.17.0", "typer", "rich", "pyyaml", "matplotlib",
                "numpy", "pytest", "setuptools")
SIM_ENV = Path(os.environ.get("STARE_GPU_SIM_ENV", REPO / "build" / "gpu-sim-env"))
SIM_CHECK = """import importlib.util, torch, triton, transformers
assert torch.version.cuda is None, "a CUDA torch was installed; the CPU wheel is wanted"
assert triton.__version__ == "3.6.0" and transformers.__version__ == "5.17.0", (triton.__version__,
                                                                                transformers.__version__)
absent = ["math_verify", "datasets", "vllm", "ray", "deepspeed", "openrlhf", "stare"]
assert not [m for m in absent if importlib.util.find_spec(m)], [m for m in absent if importlib.util.find_spec(m)]
"""


def sim_python() -> Path:
    py, stamp = SIM_ENV / "bin" / "python", SIM_ENV / ".stare-stamp"
    text = f"python{sys.version_info[0]}.{sys.version_info[1]} " + " ".join(SIM_PACKAGES)
    if stamp.is_file() and stamp.read_text() == text and py.exists():
        return py
    if SIM_ENV.exists() and not (SIM_ENV / "pyvenv.cfg").exists():
        pytest.fail(f"{SIM_ENV} exists and is not a virtual environment; not replacing it (set STARE_GPU_SIM_ENV)")
    shutil.rmtree(SIM_ENV, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(SIM_ENV)], check=True, timeout=300)
    pip = [str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    for packages in (SIM_PACKAGES[:1], SIM_PACKAGES[1:]):  # torch first: the pinned CPU wheel, never a CUDA build
        res = subprocess.run(pip + list(packages), capture_output=True, text=True, timeout=1800)
        assert res.returncode == 0, res.stderr[-3000:]
    res = subprocess.run([str(py), "-c", SIM_CHECK], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    stamp.write_text(text)
    return py


def tracked_tree(dest: Path) -> int:
    """The tracked files as the working tree holds them (what the device tool sends: in CI's clean clone the same
    as ``git archive HEAD``; here it also carries uncommitted edits), copied to ``dest``; returns their bytes."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    total = 0
    for name in filter(None, names.decode().split("\0")):
        src = REPO / name
        if src.is_file() and not src.is_symlink():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
            total += src.stat().st_size
    return total


def test_on_a_simulated_lent_machine_every_step_is_runnable_and_a_run_stops_in_one_line(tmp_path):
    """The machine lent for the GPU check, without its GPU: a fresh venv holding only what it holds, the tracked
    files alone, the network unusable (pip has no index, every proxy is a dead port). ``--dry-run`` (which does the
    check's whole set-up and imports every step's modules) shows all eight steps runnable; a real run stops at once
    in one line, writing nothing; and the Triton kernel compiles for sm_80 and sm_90 with the machine's Triton,
    3.6.0."""
    py = sim_python()
    tree = tmp_path / "tree"
    size = tracked_tree(tree)
    assert size < 48 * 2**20, f"the tracked files take {size / 2**20:.1f} MiB; the device tool sends at most 64 MiB"
    dead = "http://127.0.0.1:9"
    env = {"PATH": f"{py.parent}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}", "HOME": str(tmp_path),
           "PYTHON": str(py), "PIP_NO_INDEX": "1", "HF_HUB_OFFLINE": "1", "LANG": "C.UTF-8",
           **{k: dead for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY")}}
    bare = subprocess.run([str(py), "-c", "import stare.algorithms"], cwd=tree, env=env, capture_output=True, text=True)
    assert bare.returncode != 0 and "No module named 'stare'" in bare.stderr  # nothing installed: the check's doing

    out = tmp_path / "OUT" / "gpu-check"
    dry = subprocess.run(["bash", "scripts/gpu-check.sh", "--dry-run", "--out", str(out), "--budget", "500"],
                         cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "8 of 8 steps runnable" in dry.stdout and "NOT runnable" not in dry.stdout, dry.stdout
    assert dry.stdout.count("    runnable") == 8 and f"{py} benchmarks/bench_entropy.py" in dry.stdout

    t0 = time.monotonic()
    real = subprocess.run(["bash", "scripts/gpu-check.sh", "--out", str(out), "--budget", "500"], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=300)
    assert real.returncode == 2 and real.stdout == "", real.stdout + real.stderr
    assert real.stderr.count("\n") == 1 and real.stderr.startswith("error: no CUDA device"), real.stderr
    assert time.monotonic() - t0 < 60 and not (tmp_path / "OUT").exists()  # at once, and nothing written

    mapping = tmp_path / "mapping"  # stare -> the copied tree, as the check maps it
    (mapping / "stare").mkdir(parents=True)
    for part, folder in load_gpu_check().PACKAGE_DIRS.items():
        (mapping / "stare" / part).symlink_to(tree / folder, target_is_directory=True)
    from test_entropy_kernels import COMPILE_FOR_AMPERE_AND_HOPPER

    compiled = subprocess.run([str(py), "-c", COMPILE_FOR_AMPERE_AND_HOPPER], cwd=tree, capture_output=True, text=True,
                              env={**env, "PYTHONPATH": str(mapping), "TRITON_DEFAULT_FP_FUSION": "1"}, timeout=600)
    assert compiled.returncode == 0 and "compiled" in compiled.stdout, compiled.stderr[-3000:]
