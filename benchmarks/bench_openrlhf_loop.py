"""The plugin's cost inside OpenRLHF's real ``train_ppo_ray`` loop on CPU: ``stare`` and ``stare-phi`` against ``grpo``.

``bench_plugin_step.py`` times the actor's step outside the loop. Here each arm is one real ``stare train`` on the GPU
preset, run through the loop as tests/test_openrlhf_e2e.py runs it (Ray, vLLM's CPU engine, DeepSpeed ZeRO-3 over
gloo, the weight sync; the test suite's CPU patches, tests/openrlhf_cpu/), on the e2e test's one-layer model and
sizing (3 prompts x 8 samples a step, 16 new tokens), telemetry off, ``--steps`` steps (one episode each). What a
step costs is read from OpenRLHF's own per-step timings in the run's TensorBoard log:

- ``timing/ppo_train``: the actor's update (the plugin's once-per-step block, its loss, the exchange between ranks);
- ``timing/make_experience``: the old-log-prob and reward passes (where the plugin stashes its per-token
  statistics).

The first ``--warmup`` steps of every run are dropped (DeepSpeed's and vLLM's first calls); the script prints
each arm's median per step, the ratio to grpo's with a 90% interval (a bootstrap over the steps of each run,
unpaired: the arms run one after the other, so slow drifts of the machine are not shared), and
``RESULT {json}``. ``--rounds 2`` runs every arm twice, in turn (grpo, stare, stare-phi, grpo, ...), and pools
the steps. Target: stare's ppo_train <= 1.05 x grpo's. A benchmark, not a test: it never fails on a ratio.

Needs the vLLM CPU environment of the end-to-end tests (``bash scripts/vllm-cpu-env.sh``; ``STARE_VLLM_CPU_ENV``
names another). About 1.5 min per arm and round on an idle 2-core machine, most of it start-up.

    python benchmarks/bench_openrlhf_loop.py [--steps 12] [--warmup 2] [--rounds 1] [--algos grpo,stare,stare-phi]
        [--keep DIR]
"""
from __future__ import annotations

import argparse
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests" / "openrlhf_cpu"), str(REPO / "tests"), str(Path(__file__).resolve().parent)]

from _timing import BackgroundLoad, median, print_result, verdict  # noqa: E402
from loop_env import PRESET, SIZING, loop_env, scalars  # noqa: E402
from tiny_models import build_tiny_model, write_problems  # noqa: E402
from vllm_cpu_env import ENV_DIR, ENV_STARE, absent_reason  # noqa: E402

PHASES = ("timing/ppo_train", "timing/make_experience")
TARGETS = {"stare": 1.05}  # ppo_train, against grpo
BASE = "grpo"


def train(algo: str, steps: int, work: Path, out: Path) -> float:
    """One ``stare train`` through the loop; returns its wall seconds. Exits the script if the run fails."""
    ray_tmp = tempfile.mkdtemp(prefix="ray-bench-", dir="/tmp")  # short: Ray's socket paths must fit AF_UNIX
    sets = [f"model={work / 'model'}", f"data={work / 'problems.jsonl'}", *SIZING, f"episodes={steps}",
            f"save_steps={steps + 1}", "telemetry=off"]  # no checkpoint inside the run: its saves are not timed anyway
    cmd = [str(ENV_STARE), "train", "--preset", PRESET, "--algo", algo, "--out", str(out)]
    for s in sets:
        cmd += ["--set", s]
    env = loop_env(ENV_DIR, gpus=2, ray_tmpdir=ray_tmp, patch_log=work / "patches.log")
    t0 = time.monotonic()
    with open(out.parent / f"{out.name}.log", "w") as log:
        rc = subprocess.run(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            timeout=1800).returncode
    shutil.rmtree(ray_tmp, ignore_errors=True)
    if rc != 0:
        sys.exit(f"{algo}: stare train exited {rc}; its output: {out.parent / f'{out.name}.log'}")
    return time.monotonic() - t0


def step_times(out: Path) -> dict[str, dict[int, float]]:
    """OpenRLHF's per-step timings from the run's TensorBoard log: phase -> {step: seconds}."""
    times: dict[str, dict[int, float]] = {p: {} for p in PHASES}
    for tag, values in scalars(out).items():
        phase = next((p for p in PHASES if tag.endswith(p)), None)
        if phase:
            times[phase].update(values)
    return times


def ratio_interval_unpaired(variant: list[float], base: list[float], *, resamples=2000, level=0.90, seed=0):
    """The ``level`` interval of median(variant) / median(base), each resampled on its own (the runs are not
    paired step by step)."""
    rng = random.Random(seed)
    draws = sorted(median(rng.choices(variant, k=len(variant))) / median(rng.choices(base, k=len(base)))
                   for _ in range(resamples))
    tail = (1.0 - level) / 2
    return draws[int(tail * (resamples - 1))], draws[int((1.0 - tail) * (resamples - 1))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12, help="steps per run (default 12)")
    ap.add_argument("--warmup", type=int, default=2, help="first steps of each run not counted (default 2)")
    ap.add_argument("--rounds", type=int, default=1, help="runs per arm, in turn (default 1)")
    ap.add_argument("--algos", default="grpo,stare,stare-phi", help="arms; the first is the base of the ratios")
    ap.add_argument("--keep", type=Path, help="keep the runs in this folder (default: a temporary one, removed)")
    args = ap.parse_args()
    algos = [a.strip() for a in args.algos.split(",") if a.strip()]
    if args.steps - args.warmup < 1:
        sys.exit(f"--steps {args.steps} leaves no step after --warmup {args.warmup}")
    reason = absent_reason(openrlhf=True)
    if reason:
        sys.exit(reason)
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench-loop-"))
    work.mkdir(parents=True, exist_ok=True)
    build_tiny_model(work / "model", train=True, hidden_size=128, steps=200)
    write_problems(work / "problems.jsonl")
    # the runs' own processes (Ray, vLLM) are not this process's children, so the load is taken before they start
    load = BackgroundLoad()
    time.sleep(5)
    load_line = load.line().replace("background load", "background load (5 s before the runs)")
    samples = {a: {p: [] for p in PHASES} for a in algos}
    walls = {a: [] for a in algos}
    for r in range(args.rounds):
        for algo in algos:
            out = work / f"{algo}-r{r}"
            print(f"round {r + 1}/{args.rounds}: {algo} ({args.steps} steps) ...", flush=True)
            walls[algo].append(train(algo, args.steps, work, out))
            times = step_times(out)
            for p in PHASES:
                kept = [v for s, v in sorted(times[p].items()) if s > args.warmup]
                if len(kept) < args.steps - args.warmup:
                    sys.exit(f"{algo}: {p} logged for steps {sorted(times[p])}, expected 1..{args.steps}")
                samples[algo][p] += kept
    base = algos[0]
    print(f"\nOpenRLHF's real loop on CPU, {args.steps} steps a run ({args.warmup} dropped), {args.rounds} round(s); "
          f"seconds per step, medians")
    print(f"{'arm':<12}" + "".join(f"{p.split('/')[1]:>18}{'x ' + base:>10}{'90% interval':>18}" for p in PHASES)
          + f"{'run wall s':>12}")
    result = {}
    for algo in algos:
        row = f"{algo:<12}"
        for p in PHASES:
            m = median(samples[algo][p])
            ratio = m / median(samples[base][p])
            lo, hi = ratio_interval_unpaired(samples[algo][p], samples[base][p])
            row += f"{m:>18.3f}{ratio:>10.3f}{f'[{lo:.3f}, {hi:.3f}]':>18}"
            result.setdefault(algo, {})[p.split("/")[1]] = {"median_s": round(m, 4), "ratio": round(ratio, 4),
                                                            "interval": [round(lo, 4), round(hi, 4)]}
        row += f"{median(walls[algo]):>12.0f}"
        print(row)
    for algo, target in TARGETS.items():
        if algo in result and algo != base:
            r = result[algo]["ppo_train"]["ratio"]
            print(f"  {algo} ppo_train / {base}: {r:.3f} (target <= {target}): {verdict(r, target)}")
    print(load_line)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    print_result({"base": base, "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "arms": result})


if __name__ == "__main__":
    main()
