"""``stare run`` and ``stare train`` after their flags are parsed: one entry each for both engines.

``run_arm_set`` takes the resolved arms (``stare.cli.run_set.RunSet``) and either prints the plan (``--dry-run``: every
step and whether it is kept, resumed or new, as the run itself decides it) or runs it, then prints the comparison and
ends the same way on both engines: a failed arm is recorded with its error line, the others go on, the table's notes
name it, and the command exits 1 with the ``--resume`` command that retries it (``fail_with``).

The engine decides only how a step executes: a local preset's arms train in worker processes here
(``stare.cli.local.runner``), a GPU preset's steps are ``stare train`` / ``stare eval`` child processes
(``stare.cli.cluster_run``). Both write the comparison with ``stare.cli.report.compare``.

``train_one`` is ``stare train``: one arm, here (local presets) or through OpenRLHF (``stare.cli.openrlhf_backend``).
"""
from __future__ import annotations

import json
import shlex
import sys
from dataclasses import astuple, dataclass, fields
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.markup import escape

from . import errors
from .errors import fail
from .run_set import plan_json


@dataclass
class EvalFlags:
    """``stare run``'s evaluation flags: GPU presets only (a local preset evaluates on its own held-out problems)."""
    bench: Optional[str] = None
    ray_address: Optional[str] = None
    backend: Optional[str] = None
    k: Optional[int] = None
    max_tokens: Optional[int] = None
    limit: Optional[int] = None
    engines: Optional[int] = None
    tp: Optional[int] = None
    batching: Optional[str] = None

    def given(self) -> list[str]:
        """The flags given, as ``--name``."""
        return [f"--{f.name.replace('_', '-')}" for f, v in zip(fields(self), astuple(self)) if v is not None]


def dump(data: dict) -> None:
    """A plan on stdout as one JSON object."""
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


def train_one(resolved: dict, out: Optional[Path], *, algo: str, preset: str, resume: bool, dry_run: bool,
              ray_address: Optional[str], console: Console) -> None:
    """``stare train``: the plan (``--dry-run``) or the training of one arm in ``out`` (default runs/PRESET-ALGO)."""
    run_dir = out or Path("runs") / f"{resolved['preset']}-{algo}"
    errors.check_out_dir(run_dir)
    if resolved["backend"] == "openrlhf":
        from .openrlhf_backend import train as openrlhf_train

        launch_plan = openrlhf_train.plan(resolved, run_dir, ray_address)
        if dry_run:
            dump(launch_plan)  # the plan, a layout that does not fit included, then its refusal
        openrlhf_train.check_memory(launch_plan, resolved["settings"])
        if dry_run:
            return
        openrlhf_train.train(resolved, launch_plan, run_dir, resume=resume, ray_address=ray_address, console=console)
        return
    if ray_address is not None:
        fail(f"--ray-address {ray_address}: the flag is for GPU presets; {preset!r} is a local preset that trains on "
             "this machine")
    if dry_run:
        dump({**resolved, "out": str(out)} if out is not None else resolved)
        return
    from .local.runner import held_out_line, train_arm

    result = train_arm(resolved, run_dir, resume=resume, console=console)
    console.print(held_out_line(result))
    console.print(f"run directory: {escape(str(run_dir))}")


def run_arm_set(arm_set, out: Path, *, preset: str, sets: list[str], parallel: Optional[int], resume: bool,
                dry_run: bool, flags: EvalFlags, console: Console) -> None:
    """``stare run``: the plan or the run of ``arm_set`` in ``out``, on the engine its preset names."""
    errors.check_out_dir(out)
    if arm_set.backend == "openrlhf":
        _run_cluster(arm_set, out, preset=preset, sets=sets, parallel=parallel or 1, resume=resume, dry_run=dry_run,
                     flags=flags, console=console)
        return
    given = flags.given()
    if given:
        fail(f"{given[0]} is for GPU presets; {arm_set.preset!r} is a local preset, evaluated on its own held-out "
             "problems (its eval_* settings)")
    from .local.runner import plan_run_set, run_set

    parallel = parallel or 2  # arms at a time, on one CPU thread each
    if dry_run:  # the run's own decision for every arm (kept, resume, new), or its refusal
        steps = [a.to_json() for a in plan_run_set(arm_set, out, resume=resume)]
        # "runs": the same steps under the key of the first local plans (before the shape was shared), for scripts
        # that read it; deprecated
        dump(plan_json(arm_set.preset, out, arm_set.arms, arm_set.seeds, steps, parallel=parallel,
                       runs=[{k: v for k, v in s.items() if k != "step"} for s in steps]))
        return
    from .report.compare import compare

    failures = run_set(arm_set, out, resume=resume, parallel=parallel, console=console,
                       report=lambda finished, failed: compare(finished, out, notes=failed))
    if (out / "comparison.md").is_file():
        print_comparison(out, console)
        plots = sorted(p.name for p in out.glob("*.png"))
        console.print(f"wrote {out}/comparison.md, comparison.csv" + "".join(f", {p}" for p in plots),
                      markup=False, highlight=False)
    fail_with(failures)


def print_comparison(out: Path, console: Console) -> None:
    """The comparison table of ``out`` (``comparison.md``) on stdout, as written."""
    console.print((out / "comparison.md").read_text(), markup=False, highlight=False, soft_wrap=True)


def compare_dirs(dirs: list[Path], out: Path, *, baseline: Optional[str], console: Console) -> None:
    """``stare compare``: the comparison of ``dirs`` written in ``out`` (``report.compare``) and printed; its
    warnings (runs that differ in more than algorithm and seed) on stderr."""
    from .report.compare import compare

    errors.check_out_dir(out)
    try:
        rows = compare(list(dirs), out, baseline=baseline, warn=errors.warning)
    except ValueError as exc:
        fail(str(exc))
    print_comparison(out, console)
    console.print(f"{len(rows)} row(s) -> {out}/comparison.md, comparison.csv" +
                  (", plots" if (out / "entropy.png").exists() else ""), markup=False, highlight=False)


def fail_with(failures: list[str]) -> None:
    """The end of a ``stare run`` with failed steps (either engine): each on a ``failed:`` line, then one error line
    with the command that continues (exit 1); nothing when there are none."""
    if not failures:
        return
    for line in failures:
        errors.err_console.print(f"failed: {line}", markup=False, highlight=False, soft_wrap=True)
    again = sys.argv[1:] + ([] if "--resume" in sys.argv else ["--resume"])
    fail(f"{len(failures)} step(s) failed (above, and in the table's notes); fix and continue with: stare "
         f"{shlex.join(again)}", code=1)


def _run_cluster(arm_set, out: Path, *, preset: str, sets: list[str], parallel: int, resume: bool, dry_run: bool,
                 flags: EvalFlags, console: Console) -> None:
    """``stare run`` on a GPU preset (``stare.cli.cluster_run``): plan, then train, evaluate and compare."""
    from . import cluster_run as cr
    from .folder_lock import check_free, hold
    from .openrlhf_backend.train import check_training_stack

    ray_address = flags.ray_address
    if ray_address is not None and not ray_address.strip():
        fail("--ray-address '': expected HOST:PORT, ray://HOST:PORT or auto (leave the flag out to start a Ray head "
             "per training here)")
    settings = arm_set.settings
    benches_text = flags.bench if flags.bench is not None else settings["benches"]
    benches = [b.strip() for b in benches_text.split(",") if b.strip()]
    if not benches or len(set(benches)) != len(benches):
        fail(f"--bench {benches_text!r}: expected distinct comma-separated benchmarks, e.g. aime24,aime25")
    evals = cr.EvalOptions(benches, settings["eval_protocol"], k=flags.k, max_tokens=flags.max_tokens,
                           limit=flags.limit, backend=flags.backend, engines=flags.engines, tp=flags.tp,
                           batching=flags.batching)
    if not dry_run:
        check_free(out)  # another process writing there: refused before its folders are read
    plan = cr.plan_cluster_run(arm_set, out, preset_arg=preset, sets=sets, evals=evals, ray_address=ray_address,
                               resume=resume, parallel=parallel)
    if dry_run:
        dump(plan.to_json())  # the plan, a layout that does not fit included, then its refusal
    if plan.refusal:
        fail(plan.refusal)
    if dry_run:
        return
    check_training_stack()
    if ray_address:
        from .openrlhf_backend import launch as orl

        try:
            orl.check_ray_address(ray_address)
        except orl.LaunchError as exc:
            fail(str(exc))
    cr.check_cluster(plan)
    say = errors.plain(console)
    counts = plan.to_json()
    say(f"stare run {arm_set.preset}: {', '.join(arm_set.arms)} x {arm_set.seeds} seed(s), evaluated on "
        f"{', '.join(benches)} -> {plan.out} ({counts['to_run']} step(s) to run, {counts['kept']} kept)")
    with hold(plan.out):  # the whole folder; its stare train and stare eval children are given the lock
        failures = cr.run_cluster(plan, say)
        compared = cr.write_report(plan)
    if compared:
        print_comparison(plan.out, console)
        say(f"wrote {plan.out}/comparison.md, comparison.csv, comparison.json and the plots ({len(compared)} run(s))")
    fail_with(failures)
