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
from concurrent.futures.process import BrokenProcessPool
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
from ..run_set import KEPT, NEW, RESUME
from ..rundir import (CHECKPOINT, RunDirError, check_resumable, check_run_dir, check_run_set_dir, mark_run_set,
                      prepare_run_dir, remove_unstarted_run)
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


def held_out_line(result: dict) -> str:
    """A local run's eval.json on one line: held-out avg@k, pass@k, greedy accuracy (and the hard cases')."""
    k = result["k"]
    line = (f"held-out avg@{k} {result['avg_at_k']:.3f}  pass@{k} {result['pass_at_k']:.3f}  "
            f"greedy {result['greedy_accuracy']:.3f}")
    if result.get("hard"):
        h = result["hard"]
        line += f"  |  hard cases: avg@{k} {h['avg_at_k']:.3f} pass@{k} {h['pass_at_k']:.3f}"
    return line


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
        """One step of ``run_set.plan_json``: the arm's training, its held-out evaluation at the end."""
        return {"step": "train", "arm": self.arm, "seed": self.seed, "out": str(self.run_dir), "state": self.state}


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


def run_set(arm_set, out: Path, *, resume: bool, parallel: int, console: Console, report) -> list[str]:
    """``stare run``: every arm and seed of ``arm_set`` (a ``stare.cli.run_set.RunSet``) trained and evaluated in
    ``out`` (``run_arms``), then ``report(finished, failures)`` with the folders of those that finished, while ``out``
    is still locked (``stare.cli.run_command`` passes the comparison, ``report.compare``: this engine never imports
    the report). An arm that fails does not stop the others (the policy of a GPU preset's ``stare run``): returns the
    failures, one line each, which are also the table's notes; ``--resume`` retries them."""
    from ..errors import check_out_dir

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
        failures: list[str] = []
        try:
            dirs = run_arms(plan, out, seeds=arm_set.seeds, parallel=parallel, console=console, failures=failures)
        except RunDirError as exc:
            raise CliError(str(exc)) from None
        finished = [d for d in dirs if (d / "eval.json").is_file()]
        if finished:
            report(finished, failures)
        return failures


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


class Jobs:
    """The worker jobs of a ``stare run``: warm starts, then arms. They wait here, in order, and at most ``parallel``
    at a time are handed to the pool, so a job handed over has a worker of its own and a job not handed over was never
    started. A stop then counts exactly (``queued``) and never cancels a pool future: cancelling one the pool had not
    yet picked up made its broken-pool handling raise ``InvalidStateError`` in a thread of its own when the workers
    were stopped. An arm is handed over only once no warm start is waiting or running (it reads the warm start)."""

    def __init__(self, pool: ProcessPoolExecutor, parallel: int, failures: list[str] | None = None):
        self.pool, self.parallel = pool, parallel
        self.queued: list[tuple[object, bool, object, tuple]] = []  # (key, is a warm start, fn, args)
        self.running: dict = {}  # key -> Future
        self.warm_running: set = set()
        self.failures = failures  # a list: an arm's error is recorded there and the others go on; None: raised

    def add(self, key, fn, *args, warm: bool = False) -> None:
        self.queued.append((key, warm, fn, args))

    def fill(self) -> None:
        while self.queued and len(self.running) < self.parallel:
            key, warm, fn, args = self.queued[0]
            if not warm and self.warm_running:
                return
            self.queued.pop(0)
            self.running[key] = stopping.submit(self.pool, fn, *args)
            if warm:
                self.warm_running.add(key)

    def finished(self, key) -> None:
        del self.running[key]
        self.warm_running.discard(key)


def _train_arms(plan: list, jobs: Jobs, progress: Progress, *, out: Path, seeds: int) -> None:
    """The warm starts (once per seed), then every arm not done, ``jobs.parallel`` workers at a time, drawn as progress
    bars; ``jobs`` holds what waits and what runs (what a stop interrupts)."""
    ws_needed = {}
    for algo, seed, resolved, run_dir, done in plan:
        if not done and resolved["settings"].get("model", "tiny") == "tiny":
            ws_needed.setdefault(seed, resolved)
    device = engine_device(plan[0][2]["settings"])
    ws_dirs = {seed: out / "warmstart" / warmstart_name(device, f"seed{seed}") for seed in {p[1] for p in plan}}
    ws_task = progress.add_task("warm starts", total=len(ws_needed), status="supervised warm start") \
        if ws_needed else None
    for seed, r in ws_needed.items():
        jobs.add(f"warm start seed{seed}", _warmstart_job, r, str(ws_dirs[seed]), warm=True)
    tasks, names = {}, {}
    for algo, seed, resolved, run_dir, done in plan:
        name = algo if seeds == 1 else f"{algo} seed{seed}"
        names[run_dir] = name
        steps = resolved["settings"]["steps"]
        tasks[run_dir] = progress.add_task(escape(name), total=steps, completed=steps if done else 0,
                                           status="done (kept)" if done else "queued")
        if not done:
            jobs.add(run_dir, _arm_job, resolved, str(run_dir), str(ws_dirs[seed]), (run_dir / CHECKPOINT).exists())
    while jobs.queued or jobs.running:
        jobs.fill()
        for key, fut in list(jobs.running.items()):
            if key in jobs.warm_running:
                if fut.done():
                    fut.result()  # re-raises a worker's error
                    jobs.finished(key)
                    progress.advance(ws_task)
                continue
            lines, rec = bars.last_record(key / "metrics.jsonl")
            if fut.done():
                try:
                    result = fut.result()
                except BrokenProcessPool:  # a worker died (killed, out of memory): the pool is gone for all
                    raise
                except Exception as exc:  # noqa: BLE001 - the arm's own error: recorded, the others go on
                    if jobs.failures is None:
                        raise
                    jobs.failures.append(f"train {names[key]} failed: {error_line(exc)} (in {key})")
                    progress.update(tasks[key], completed=lines, status="FAILED")
                    jobs.finished(key)
                    continue
                k = result["k"]
                progress.update(tasks[key], completed=lines,
                                status=f"avg@{k} {result[f'avg_at_{k}']:.3f} pass@{k} {result[f'pass_at_{k}']:.3f}")
                jobs.finished(key)
            elif lines:
                progress.update(tasks[key], completed=lines, status=bars.live_status(rec))
        time.sleep(0.3)


def error_line(exc: BaseException) -> str:
    """An arm's error in one line: its message's first line, or its type where it has none."""
    text = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _stop_pool(pool: ProcessPoolExecutor, jobs: Jobs) -> None:
    """A stop: no waiting job starts, the running ones get SIGTERM (each exits after the checkpoint it may be
    writing), then SIGKILL after ``stopping.GRACE_S``; says how many of each."""
    queued = len(jobs.queued)
    jobs.queued.clear()
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
             console: Console | None = None, failures: list[str] | None = None) -> list[Path]:
    """Train and evaluate every arm of ``arm_plans`` (``plan_arms``: the kept ones are not touched); returns their
    run directories (in algorithm, seed order). ``failures``: a list that gets one line per arm whose training
    raised, while the others go on (without it, the first such error is raised); a warm start's error, or a worker
    that died, stops them all."""
    console = console or Console()
    for a in arm_plans:  # the new arms' folders and config.yaml, every arm checked before (plan_arms)
        prepare_run_dir(a.run_dir, a.resolved, resume=a.state != NEW)
    plan = [(a.arm, a.seed, a.resolved, a.run_dir, a.state == KEPT) for a in arm_plans]  # (algo, seed, ..., done)

    ctx = mp.get_context("spawn")
    columns = bars.columns()  # steps, live reward and entropy, clock, ETA
    # the workers ignore Ctrl-C and die with this process (stopping.worker_setup); a signal here stops them
    pool = ProcessPoolExecutor(max_workers=parallel, mp_context=ctx, initializer=stopping.worker_setup,
                               initargs=(os.getpid(),))
    jobs = Jobs(pool, parallel, failures)
    try:
        with Progress(*columns, console=console, transient=False) as progress:
            _train_arms(plan, jobs, progress, out=out, seeds=seeds)
    except KeyboardInterrupt:  # stopping.Stopped
        _stop_pool(pool, jobs)
        raise
    finally:
        pool.shutdown(wait=True)  # nothing waits in the pool (Jobs): nothing to cancel
    return [p[3] for p in plan]
