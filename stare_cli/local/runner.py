"""``stare run`` and ``stare train`` for local presets: arms in worker processes, progress bars, the report.

``train_arm`` is ``stare train`` on a local preset (one arm, in this process); ``run_set`` is ``stare run`` (every
arm of a ``stare.cli.run_set.RunSet`` through ``run_arms``, then the comparison and the plots). Both check this
machine first (``check_device``, ``check_model``) and raise ``stare.cli.errors.CliError`` (one line) for what the
user fixes, before anything is written. What ``stare run`` does with each arm's folder (kept, resume, new, or the
refusal) is decided once, by ``plan_run_set``, for the run and for ``stare run --dry-run`` alike.

Each arm (algorithm x seed) is one process with one torch thread; ``parallel`` arms run at a time (two on
two cores). With ``device: cuda`` the arms' processes share the one GPU, each with its own CUDA context (the tiny
models need little memory beyond it). The parent process only watches each arm's ``metrics.jsonl`` to draw
progress bars, so a worker never has to talk back. Warm starts are trained first, once per seed, into
``DIR/warmstart/seed<S>`` (``seed<S>-cuda`` for a GPU run: see ``trainer.warmstart_name``) and shared by every arm
of that seed.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import Progress

from . import progress as bars
from .device import DeviceError, engine_device
from .. import stopping
from ..errors import CliError
from ..folder_lock import check_free, hold
from ..quiet import quiet
from ..rundir import (RunDirError, check_resumable, check_run_dir, check_run_set_dir, mark_run_set, prepare_run_dir,
                      remove_unstarted_run)
from .trainer import LocalTrainer, warmstart_name


def check_device(resolved: dict) -> None:
    """The ``device`` setting names a device this machine has (``cuda`` needs a visible GPU)."""
    try:
        engine_device(resolved["settings"])
    except DeviceError as exc:
        raise CliError(str(exc)) from None


def check_model(resolved: dict, *, prepare: bool = False) -> None:
    """A preset on a packaged model fails (exit code 1) before any folder is made when the package is missing.
    ``prepare``: convert the model once here rather than in every worker."""
    if resolved["settings"].get("model") != "smollm2-135m":
        return
    from .smollm import MissingModelError, ensure_available, smollm_checkpoint

    try:
        ensure_available()
        if prepare:
            smollm_checkpoint()
    except MissingModelError as exc:
        raise CliError(str(exc), code=1) from None


def train_arm(resolved: dict, out: Path, *, resume: bool, console: Console) -> dict:
    """``stare train`` on a local preset: the run folder (checked, then made or resumed), training with a progress
    bar, the held-out evaluation (returned, as in eval.json). The folder is locked while this writes it
    (``folder_lock``). A new run that fails before its first checkpoint leaves nothing behind, so a corrected retry
    is not refused; one stopped by a signal keeps its folder, for ``--resume``."""
    check_device(resolved)
    check_model(resolved)
    existed = out.exists()
    check_free(out)  # another process writing there: refused before anything of it is read
    with hold(out):
        try:
            if resume:
                check_resumable(out)  # a cut metrics line, a checkpoint that does not load: one line, before any write
            started = prepare_run_dir(out, resolved, resume)
        except RunDirError as exc:
            raise CliError(str(exc)) from None
        try:
            return _train(resolved, out, resume, console)
        except KeyboardInterrupt:  # stopping.Stopped (or torch's KeyboardInterrupt of a wait it cut)
            stopping.report(f"the training in {out} (its last checkpoint is kept)")
            raise
        except BaseException:
            if not started:
                remove_unstarted_run(out, existed)
            raise


def _train(resolved: dict, out: Path, resume: bool, console: Console) -> dict:
    quiet()
    trainer = LocalTrainer(resolved, out)
    settings = resolved["settings"]
    if settings.get("model", "tiny") == "tiny" and not (trainer.warmstart_dir / "warmstart.json").exists():
        console.print(f"warm start: {settings['warmstart_steps']} supervised steps on noisy demonstrations "
                      f"(cached in {escape(str(trainer.warmstart_dir))})")
    with Progress(*bars.columns(), console=console) as progress:  # steps, live reward and entropy, ETA
        task = progress.add_task(f"{resolved['algo']['name']} on {resolved['preset']}", total=settings["steps"],
                                 status="starting")

        def on_step(step, steps, rec):
            progress.update(task, completed=step, status=bars.live_status(rec))

        return trainer.run(resume=resume, on_step=on_step)


KEPT, RESUME, NEW = "kept", "resume", "new"


@dataclass
class ArmPlan:
    """One arm x seed of a local ``stare run``: its settings (the seed set), its folder and what the run does there:
    ``kept`` (finished: its eval.json is there), ``resume`` (its folder holds this run, interrupted) or ``new``."""
    arm: str
    seed: int
    resolved: dict
    run_dir: Path
    state: str

    def to_json(self) -> dict:
        return {"arm": self.arm, "seed": self.seed, "out": str(self.run_dir), "state": self.state}


def plan_arms(resolved_by_arm: dict[str, dict], out: Path, *, seeds: int, resume: bool) -> list[ArmPlan]:
    """Every arm x seed's state (``ArmPlan``), reading only. ``RunDirError`` (one line) for what the run refuses: a
    folder that holds a run without ``resume``, a run of another preset, algorithm or settings, a non-empty folder
    that holds none, a run to resume whose metrics or checkpoint are corrupt."""
    base_seed = next(iter(resolved_by_arm.values()))["settings"]["seed"]
    plan = []
    for (arm, s), run_dir in arm_dirs(out, list(resolved_by_arm), seeds).items():
        resolved = json.loads(json.dumps(resolved_by_arm[arm]))
        resolved["settings"]["seed"] = base_seed + s
        # with --resume, arms not started yet are simply started
        existing = check_run_dir(run_dir, resolved, resume and (run_dir / "config.yaml").exists())
        state = KEPT if existing and (run_dir / "eval.json").exists() else RESUME if existing else NEW
        if state == RESUME:
            check_resumable(run_dir)  # a corrupt metrics line or checkpoint: one line, before anything is written
        plan.append(ArmPlan(arm, base_seed + s, resolved, run_dir, state))
    return plan


def plan_run_set(arm_set, out: Path, *, resume: bool) -> list[ArmPlan]:
    """The one decision of a local ``stare run`` for every arm x seed (``plan_arms``, after ``check_run_set_dir``),
    shared by the run (``run_set``) and ``stare run --dry-run``; ``CliError`` (one line) for a refusal. Reads only."""
    try:
        check_run_set_dir(out, arm_set.preset)
        return plan_arms(arm_set.resolved, out, seeds=arm_set.seeds, resume=resume)
    except RunDirError as exc:
        raise CliError(str(exc)) from None


def run_set(arm_set, out: Path, *, resume: bool, parallel: int, console: Console) -> list[Path]:
    """``stare run``: every arm and seed of ``arm_set`` (a ``stare.cli.run_set.RunSet``) trained and evaluated in
    ``out`` (``run_arms``), then ``comparison.md``/``.csv``/``.json`` and the plots; returns the plot files."""
    from ..errors import check_out_dir
    from ..report.dose_response import plot as plot_dose_response
    from ..report.plots import plot_accuracy, plot_curves
    from ..report.runs import load_run
    from ..report.tables import write_comparison

    first = next(iter(arm_set.resolved.values()))  # the arms share the preset's settings
    check_device(first)
    check_out_dir(out)
    check_free(out)  # another process writing there (or in a folder above): refused before anything is read
    plan = plan_run_set(arm_set, out, resume=resume)  # what --dry-run prints
    check_model(first, prepare=True)
    with hold(out):  # the arms' folders are inside: one lock for all
        mark_run_set(out, arm_set.preset, arm_set.arms, arm_set.seeds)
        arms = escape(", ".join(arm_set.arms))  # a swept arm's name, stare[w=2], is not rich markup
        console.print(f"[bold]stare run[/] {escape(arm_set.preset)}: {arms} x {arm_set.seeds} seed(s) -> "
                      f"{escape(str(out))}")
        try:
            dirs = run_arms(plan, out, seeds=arm_set.seeds, parallel=parallel, console=console)
        except RunDirError as exc:
            raise CliError(str(exc)) from None
        runs = [load_run(d) for d in dirs]
        summary = write_comparison(out, runs)
        accuracy = plot_accuracy(out, runs)  # only with eval_every (or checkpoint sweeps) on
        dose = plot_dose_response(out, summary["dose_response"], summary["arms"])  # only with --sweep
        return plot_curves(out, runs) + [p for p in (accuracy, dose) if p]


def _warmstart_job(resolved: dict, folder: str) -> str:
    quiet()
    import torch

    from .models import initial_policy
    from .tasks import get_task

    torch.set_num_threads(resolved["settings"].get("threads", 1))
    settings = resolved["settings"]
    return str(initial_policy(settings, get_task(settings["task"]), Path(folder), device=engine_device(settings)))


def _arm_job(resolved: dict, run_dir: str, warmstart_dir: str | None, resume: bool) -> dict:
    quiet()
    trainer = LocalTrainer(resolved, Path(run_dir), warmstart_dir=Path(warmstart_dir) if warmstart_dir else None)
    return trainer.run(resume=resume)


def _train_arms(plan: list, pool: ProcessPoolExecutor, futures: dict, progress: Progress, *, out: Path,
                seeds: int) -> None:
    """The warm starts (once per seed), then every arm not done, ``pool``'s workers at a time, drawn as progress
    bars; ``futures`` holds the arms submitted and not finished (what a stop interrupts)."""
    ws_needed = {}
    for algo, seed, resolved, run_dir, done in plan:
        if not done and resolved["settings"].get("model", "tiny") == "tiny":
            ws_needed.setdefault(seed, resolved)
    device = engine_device(plan[0][2]["settings"])
    ws_dirs = {seed: out / "warmstart" / warmstart_name(device, f"seed{seed}") for seed in {p[1] for p in plan}}
    if ws_needed:
        t = progress.add_task("warm starts", total=len(ws_needed), status="supervised warm start")
        for seed, r in ws_needed.items():
            futures[f"warm start seed{seed}"] = stopping.submit(pool, _warmstart_job, r, str(ws_dirs[seed]))
        for name in list(futures):
            futures[name].result()
            del futures[name]
            progress.advance(t)
    tasks = {}
    for algo, seed, resolved, run_dir, done in plan:
        name = algo if seeds == 1 else f"{algo} seed{seed}"
        steps = resolved["settings"]["steps"]
        tasks[run_dir] = progress.add_task(escape(name), total=steps, completed=steps if done else 0,
                                           status="done (kept)" if done else "queued")
        if not done:
            futures[run_dir] = stopping.submit(pool, _arm_job, resolved, str(run_dir), str(ws_dirs[seed]),
                                               (run_dir / "checkpoint").exists())
    while futures:
        for run_dir, fut in list(futures.items()):
            lines, rec = bars.last_record(run_dir / "metrics.jsonl")
            if fut.done():
                result = fut.result()  # re-raises a worker's error
                k = result["k"]
                progress.update(tasks[run_dir], completed=lines,
                                status=f"avg@{k} {result[f'avg_at_{k}']:.3f} pass@{k} {result[f'pass_at_{k}']:.3f}")
                del futures[run_dir]
            elif lines:
                progress.update(tasks[run_dir], completed=lines, status=bars.live_status(rec))
        time.sleep(0.3)


def _stop_pool(pool: ProcessPoolExecutor, futures: dict) -> None:
    """A stop: no queued arm starts, the running ones get SIGTERM (each exits after the checkpoint it may be
    writing), then SIGKILL after ``stopping.GRACE_S``; says how many of each."""
    queued = sum(f.cancel() for f in futures.values())  # not handed to a worker yet
    procs = list((getattr(pool, "_processes", None) or {}).values())  # the executor's worker processes
    for p in procs:
        stopping.track(p)  # a second signal kills them at once
    stopped = stopping.stop_processes(procs)
    stopping.report(f"{stopped} worker(s) stopped, {queued} queued job(s) not started (each arm resumes from its "
                    "last checkpoint)")


def arm_dirs(out: Path, algos: list[str], seeds: int) -> dict[tuple[str, int], Path]:
    """Arm directories: DIR/<algo> with one seed, DIR/<algo>/seed<S> with several."""
    return {(a, s): (out / a if seeds == 1 else out / a / f"seed{s}") for a in algos for s in range(seeds)}


def run_arms(arm_plans: list[ArmPlan], out: Path, *, seeds: int, parallel: int = 2,
             console: Console | None = None) -> list[Path]:
    """Train and evaluate every arm of ``arm_plans`` (``plan_arms``: the kept ones are not touched); returns their
    run directories (in algorithm, seed order)."""
    console = console or Console()
    for a in arm_plans:  # the new arms' folders and config.yaml, every arm checked before (plan_arms)
        prepare_run_dir(a.run_dir, a.resolved, resume=a.state != NEW)
    plan = [(a.arm, a.seed, a.resolved, a.run_dir, a.state == KEPT) for a in arm_plans]  # (algo, seed, ..., done)

    ctx = mp.get_context("spawn")
    columns = bars.columns()  # steps, live reward and entropy, clock, ETA
    # the workers ignore Ctrl-C and die with this process (stopping.worker_setup); a signal here stops them
    pool = ProcessPoolExecutor(max_workers=parallel, mp_context=ctx, initializer=stopping.worker_setup,
                               initargs=(os.getpid(),))
    futures: dict = {}
    try:
        with Progress(*columns, console=console, transient=False) as progress:
            _train_arms(plan, pool, futures, progress, out=out, seeds=seeds)
    except KeyboardInterrupt:  # stopping.Stopped
        _stop_pool(pool, futures)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return [p[3] for p in plan]
