"""``stare eval --out RUN --checkpoints all|every:N``: accuracy over training, one evaluation per kept policy.

Each policy a run kept (``stare.cli.rundir.saved_checkpoints``: a local run's ``checkpoints/step-<S>/``, an OpenRLHF
run's ``ckpt/global_step<S>_hf/``) is evaluated as ``stare eval --model`` would, into ``RUN/eval-<bench>/step-<S>/``:
a normal eval folder (samples.jsonl, summary.json, eval_settings.json), which ``stare compare`` reads as a curve.
When RUN is a ``stare run`` folder (its ``run.yaml``), each arm's run folder is swept the same way.

Every step's evaluation is planned (``eval_plan.plan_eval``: the protocol, the data, the model folder, the output
folder, ``--resume``) before the first model loads, so a bad value stops the sweep before anything is written.
A sweep that stopped (killed, or run with ``every:N`` first) continues with ``--resume``: steps with a
summary.json are kept (after the same settings check as any ``--resume``), a step cut mid-way continues from
its samples, the others start.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .errors import CliError
from .rundir import RUN_SET_MARKER, eval_dir, saved_checkpoints

SPEC_FORMS = "all, or every:N with N a positive integer (every:50: the steps that are multiples of 50)"


def parse_checkpoints(spec: str) -> int:
    """``all`` -> 1, ``every:N`` -> N (the step multiple kept); ``CliError`` naming the value otherwise."""
    text = spec.strip()
    if text == "all":
        return 1
    m = re.fullmatch(r"every:(\d+)", text)
    if m and int(m.group(1)) >= 1:
        return int(m.group(1))
    raise CliError(f"--checkpoints {spec!r}: expected {SPEC_FORMS}")


def _is_run(folder: Path) -> bool:
    return (folder / "config.yaml").is_file()


def swept_runs(out: Path) -> list[Path]:
    """The training run folders ``--out`` names: the folder itself, or each arm of a ``stare run`` folder."""
    out = Path(out)
    if _is_run(out):
        return [out]
    if (out / RUN_SET_MARKER).is_file():
        arms = sorted({p.parent for p in out.rglob("config.yaml") if p.parent != out
                       and "warmstart" not in p.relative_to(out).parts})
        if arms:
            return arms
    raise CliError(f"--out {out}: --checkpoints needs a training run folder (with config.yaml) or a stare run "
                   "folder (with run.yaml and its arms)")


@dataclass
class StepPlan:
    run: Path
    step: int
    plan: object  # eval_plan.EvalPlan
    done: bool  # summary.json there: kept


def plan_sweep(*, out: Path, spec: str, bench: str, model: str | None, harness: str, resume: bool,
               **eval_args) -> list[StepPlan]:
    """Every step's ``EvalPlan``, checked before anything loads or is written; ``CliError`` (one line) for a bad
    ``--checkpoints``, ``--model`` given too, ``--harness lm-eval``, a run with no kept policy (or none at the
    asked steps), or anything ``plan_eval`` refuses for one of the steps."""
    from .eval_plan import plan_eval

    every = parse_checkpoints(spec)
    if model is not None:
        raise CliError(f"--model {model}: --checkpoints evaluates the policies the run in --out kept; leave --model "
                       "out")
    if harness != "stare":
        raise CliError(f"--harness {harness}: --checkpoints works with --harness stare only (it resumes per step)")
    if out is None:
        raise CliError("--checkpoints needs --out: the training run (or stare run folder) whose checkpoints to "
                       "evaluate")
    plans = []
    for run in swept_runs(out):
        kept = saved_checkpoints(run)
        if not kept:
            raise CliError(f"{run} has no saved checkpoints (checkpoints/step-<S>/ of a local run trained with --set "
                           "keep_checkpoint_every=N, or ckpt/global_step<S>_hf/ of an OpenRLHF run trained with --set "
                           "save_hf_checkpoints=true)")
        chosen = [(s, folder) for s, folder in kept if s % every == 0]
        if not chosen:
            raise CliError(f"--checkpoints {spec}: {run} kept no checkpoint at a multiple of {every} (its steps: "
                           f"{', '.join(str(s) for s, _ in kept)})")
        for step, folder in chosen:
            step_out = eval_dir(run, bench) / f"step-{step}"
            done = (step_out / "summary.json").is_file()
            if done and not resume:
                raise CliError(f"{step_out} already holds a finished evaluation; pass --resume to continue the sweep "
                               "(finished steps are kept) or evaluate another run (nothing was changed)")
            plan = plan_eval(bench=bench, model=str(folder), out=step_out, harness=harness, resume=resume,
                             **eval_args)
            plans.append(StepPlan(run, step, plan, done))
    return plans


def run_sweep(plans: list[StepPlan], console) -> list[tuple[StepPlan, dict]]:
    """Evaluate the steps not yet done, in order (one progress bar per step, as ``stare eval``); returns each
    step's summary (a kept step's from its summary.json)."""
    from stare.eval.summary import read_summary, scores_line

    from .eval_plan import run_eval_plan

    out = []
    todo = sum(not p.done for p in plans)
    n = 0
    for p in plans:
        if p.done:
            summary = read_summary(p.plan.out)
            console.print(f"step {p.step} of {p.run}: kept ({scores_line(summary)})", markup=False, highlight=False)
        else:
            n += 1
            console.print(f"step {p.step} of {p.run} ({n}/{todo} to evaluate): {p.plan.model}", markup=False,
                          highlight=False)
            summary = run_eval_plan(p.plan, console)  # with --resume, a step cut mid-way continues from its samples
        out.append((p, summary))
    return out
