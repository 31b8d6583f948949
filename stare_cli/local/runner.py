"""``stare run`` and ``stare train`` for local presets: arms in worker processes, progress bars, the report.

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
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from . import progress as bars
from .device import engine_device
from ..rundir import check_resumable
from .trainer import LocalTrainer, check_run_dir, prepare_run_dir, warmstart_name


def quiet() -> None:
    """Silence library chatter (tokenizers, hub progress bars, warnings, transformers' logging) in this process."""
    import os
    import warnings

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except Exception:  # pragma: no cover - logging tweaks are best effort
        pass


_quiet = quiet  # the older private name


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


def _count_lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def arm_dirs(out: Path, algos: list[str], seeds: int) -> dict[tuple[str, int], Path]:
    """Arm directories: DIR/<algo> with one seed, DIR/<algo>/seed<S> with several."""
    return {(a, s): (out / a if seeds == 1 else out / a / f"seed{s}") for a in algos for s in range(seeds)}


def run_arms(resolved_by_algo: dict[str, dict], out: Path, *, seeds: int, resume: bool, parallel: int = 2,
             console: Console | None = None) -> list[Path]:
    """Train and evaluate every arm; returns their run directories (in algorithm, seed order)."""
    console = console or Console()
    base_seed = next(iter(resolved_by_algo.values()))["settings"]["seed"]
    plan = []  # (algo, seed, resolved, run_dir, done)
    for (algo, s), run_dir in arm_dirs(out, list(resolved_by_algo), seeds).items():
        resolved = json.loads(json.dumps(resolved_by_algo[algo]))
        resolved["settings"]["seed"] = base_seed + s
        # with --resume, arms not started yet are simply started
        check_run_dir(run_dir, resolved, resume and (run_dir / "config.yaml").exists())
        if resume and not (run_dir / "eval.json").exists():
            check_resumable(run_dir)  # a corrupt metrics line or checkpoint: one line, before anything is written
        plan.append((algo, base_seed + s, resolved, run_dir, (run_dir / "eval.json").exists()))
    for _, _, resolved, run_dir, _ in plan:  # every arm checked before anything is written
        prepare_run_dir(run_dir, resolved, resume=(run_dir / "config.yaml").exists())

    ctx = mp.get_context("spawn")
    columns = bars.columns()  # steps, live reward and entropy, clock, ETA
    with ProcessPoolExecutor(max_workers=parallel, mp_context=ctx) as pool, \
            Progress(*columns, console=console, transient=False) as progress:
        ws_needed = {}
        for algo, seed, resolved, run_dir, done in plan:
            if not done and resolved["settings"].get("model", "tiny") == "tiny":
                ws_needed.setdefault(seed, resolved)
        device = engine_device(plan[0][2]["settings"])
        ws_dirs = {seed: out / "warmstart" / warmstart_name(device, f"seed{seed}") for seed in {p[1] for p in plan}}
        if ws_needed:
            t = progress.add_task("warm starts", total=len(ws_needed), status="supervised warm start")
            futures = [pool.submit(_warmstart_job, r, str(ws_dirs[seed])) for seed, r in ws_needed.items()]
            for f in futures:
                f.result()
                progress.advance(t)
        tasks, futures = {}, {}
        for algo, seed, resolved, run_dir, done in plan:
            name = algo if seeds == 1 else f"{algo} seed{seed}"
            steps = resolved["settings"]["steps"]
            tasks[run_dir] = progress.add_task(name, total=steps, completed=steps if done else 0,
                                               status="done (kept)" if done else "queued")
            if not done:
                futures[run_dir] = pool.submit(_arm_job, resolved, str(run_dir), str(ws_dirs[seed]),
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
    return [p[3] for p in plan]
