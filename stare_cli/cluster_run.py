"""``stare run`` on a GPU preset: every arm x seed trained by ``stare train`` (OpenRLHF's ``train_ppo_ray``), each
final model evaluated by ``stare eval`` on every benchmark, then the comparison, in one folder.

Each step is the CLI a user would type, run as a child process of this one with the same environment: a training is
``stare train --preset P --algo A --out OUT/<arm>/seed<S> --set seed=<seed + S> [--set ...] [--resume]
[--ray-address ...]``, so its OpenRLHF command is exactly the one ``stare train --dry-run`` prints; an evaluation is
``stare eval --bench B --out OUT/<arm>/seed<S> ...``, which evaluates that run's ``final/`` into
``OUT/<arm>/seed<S>/eval-<B>/``. Each step's output goes to ``OUT/logs/<arm>-seed<S>-<train|eval-B>.log``.
Nothing here schedules GPUs: every training is an OpenRLHF job on the Ray cluster (``--ray-address``) or on a Ray
head its ``stare train`` starts on this node, and ``--parallel N`` only starts N arms' steps at once, after checking
that the cluster has the GPUs for them (``ray.cluster_resources()``).

1. ``plan_cluster_run``: every check ``stare train --dry-run`` and ``stare eval`` make, for every arm, before
   anything is written (``CliError``, one line); the steps with what each finds: ``kept`` (a finished training or
   evaluation, never rewritten), ``resume`` (an interrupted one: ``stare train --resume`` continues from its last
   OpenRLHF checkpoint with the controller state, ``stare eval --resume`` from its samples) or ``new``.
   ``--dry-run`` prints ``ClusterPlan.to_json``.
2. ``run_cluster``: the steps, a line as each starts and ends (with its time); a training or evaluation that fails
   is recorded (its error line and log) and the other arms go on; the comparison of every arm that trained
   (``stare.cli.report.compare``: tables, seed intervals and tests, curves from the runs' TensorBoard logs), the failures
   in its notes. ``--resume`` retries the failed steps.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from .errors import CliError
from .run_set import KEPT, NEW, RESUME, plan_json
from .rundir import FINAL, eval_dir

LOGS = "logs"
TRAIN, EVAL = "train", "eval"


@dataclass
class EvalOptions:
    """What every evaluation of the run is asked for (``stare eval``'s flags); None: the protocol's (k, max tokens),
    the layout ``eval_layout`` picks (engines, tp), ``stare eval``'s own (backend, batching)."""
    benches: list[str]
    protocol: str
    k: int | None = None
    max_tokens: int | None = None
    limit: int | None = None
    backend: str | None = None
    engines: int | None = None
    tp: int | None = None
    seed: int = 0  # the sampling seed: the same for every arm, so the arms are compared on the same draws
    batching: str | None = None

    def flags(self, ray_address: str | None) -> list[str]:
        out = ["--protocol", self.protocol, "--seed", str(self.seed), "--engines", str(self.engines),
               "--tp", str(self.tp)]
        for flag, value in (("--k", self.k), ("--max-tokens", self.max_tokens), ("--limit", self.limit),
                            ("--backend", self.backend), ("--batching", self.batching),
                            ("--ray-address", ray_address)):
            if value is not None:
                out += [flag, str(value)]
        return out


@dataclass
class Step:
    kind: str  # train | eval
    arm: str
    index: int  # the seed's index: folder seed<index>
    seed: int  # the training seed
    run_dir: Path
    command: list[str]  # the stare command (after the interpreter)
    state: str  # kept | resume | new
    log: Path
    bench: str | None = None
    openrlhf_argv: list[str] | None = None
    memory: dict | None = None  # a training's memory plan (stare train --dry-run's "memory")

    @property
    def name(self) -> str:
        return f"{self.kind} {self.arm} seed{self.index}" + (f" {self.bench}" if self.bench else "")

    def to_json(self) -> dict:
        d = {"step": self.kind, "arm": self.arm, "seed": self.seed, "out": str(self.run_dir), "state": self.state,
             "command": ["stare", *self.command], "log": str(self.log)}
        if self.memory is not None:
            d["memory"] = self.memory
        if self.bench:
            d["bench"], d["out"] = self.bench, str(eval_dir(self.run_dir, self.bench))
        if self.openrlhf_argv is not None:
            d["openrlhf_argv"] = self.openrlhf_argv
        return d


@dataclass
class ClusterPlan:
    preset: str
    out: Path
    arms: list[str]
    seeds: int
    evals: EvalOptions
    steps: list[Step]
    parallel: int
    ray_address: str | None
    gpus_per_arm: int
    failures: list[str] = field(default_factory=list)
    memory: dict = field(default_factory=dict)  # the evaluation's memory plan (gpu_memory.eval_phase), when known
    refusal: str | None = None  # the first training or evaluation the memory plan says cannot fit (memory_check)

    def pipelines(self) -> list[list[Step]]:
        """The steps by arm and seed, in order: a training, then its evaluations."""
        by_run: dict[Path, list[Step]] = {}
        for s in self.steps:
            by_run.setdefault(s.run_dir, []).append(s)
        return list(by_run.values())

    def to_json(self) -> dict:
        """``run_set.plan_json``'s shape, with this engine's own keys."""
        return plan_json(self.preset, self.out, self.arms, self.seeds, [s.to_json() for s in self.steps],
                         benches=self.evals.benches, parallel=self.parallel, ray_address=self.ray_address,
                         eval_layout={"engines": self.evals.engines, "tp": self.evals.tp,
                                      "gpus": self.evals.engines * (1 if self.evals.backend == "hf" else self.evals.tp),
                                      "batching": self.evals.batching or "all (or an interrupted evaluation's own)",
                                      **({"memory": self.memory} if self.memory else {})},
                         gpus_per_arm=self.gpus_per_arm)


# ---- 1. the plan ----------------------------------------------------------------------------------------------

def gpus_per_arm(settings: dict, evals: EvalOptions) -> int:
    """The GPUs one arm holds at a time: its training's (the actor ranks; the vLLM engines' beside them unless
    colocated; a reference model's beside them when kl_coef > 0 and not colocated), or its evaluation's (engines x
    tp, for vLLM), whichever is more."""
    ranks = settings["gpus_per_node"] * settings["nodes"]
    train = ranks
    if not settings["colocate"]:
        train += settings["vllm_engines"] * settings["vllm_tensor_parallel"]
        if settings["kl_coef"] > 0:
            train += ranks
    return max(train, evals.engines * evals.tp)


def eval_layout(settings: dict, evals: EvalOptions, ray_address: str | None) -> EvalOptions:
    """``evals`` with its engines and tensor parallelism filled in where not given: tp the smallest at which the
    memory plan fits the model and its context on a card (``_fitting_tp``), engines as many as the GPUs hold
    at that tp: the preset's node (``gpus_per_node``), or every node (``x nodes``) on the ``--ray-address`` cluster,
    where one ``stare eval`` spreads its engines over the nodes. The HF backend takes one GPU per engine."""
    from dataclasses import replace

    gpus = settings["gpus_per_node"] * (settings["nodes"] if ray_address else 1)
    tp = evals.tp or (1 if evals.backend == "hf" else _fitting_tp(settings))
    per_engine = 1 if evals.backend == "hf" else tp
    return replace(evals, tp=tp, engines=evals.engines or max(1, gpus // per_engine))


def _fitting_tp(settings: dict) -> int:
    """The evaluation's tensor parallelism on vLLM: the smallest power of two within a node at which the memory
    plan says the model and one sequence of its context fit a card (``gpu_memory.eval_tp``); the preset's
    ``vllm_tensor_parallel`` (what its rollouts held the model at) where the model's shapes are not known."""
    from .gpu_memory import GIB, eval_tp, load_shapes

    shapes = load_shapes(settings.get("cold_start_checkpoint") or settings["model"])
    if shapes is None:
        return settings["vllm_tensor_parallel"]
    return eval_tp(shapes, int(settings["gpu_memory_gib"] * GIB), 1, settings["gpus_per_node"])


def eval_memory(settings: dict, evals: EvalOptions) -> tuple[dict, str | None]:
    """The evaluation's memory plan per GPU (vLLM only; {} where the model's shapes are not known) and its refusal
    line when it cannot fit and ``memory_check`` is refuse."""
    from . import gpu_memory as gm
    from stare.eval.protocols import resolve_protocol

    shapes = gm.load_shapes(settings.get("cold_start_checkpoint") or settings["model"])
    if shapes is None or evals.backend == "hf":
        return {}, None
    proto = resolve_protocol(evals.protocol, k=evals.k, temperature=None, top_p=None, max_tokens=evals.max_tokens)
    phase = gm.eval_phase(shapes, evals.tp, int(settings["gpu_memory_gib"] * gm.GIB), proto.max_tokens,
                          settings["max_prompt_len"])
    plan = gm.MemoryPlan(phase.gpu, shapes, settings["model"], [phase])
    why = gm.refusal({"problems": plan.problems()}, settings["memory_check"])
    return phase.to_json(), why and f"{why.rstrip(')')}; stare run picks the smallest that fits when --tp is not given)"


def check_eval_length(settings: dict, evals: EvalOptions) -> None:
    """The evaluation lets a response run as long as the training did: a protocol (or ``--max-tokens``) that stops
    responses before ``max_response_len`` would cut the long answers the models learnt to give and score them wrong
    (``CliError`` naming both numbers and the ways out)."""
    from stare.eval.protocols import resolve_protocol

    proto = resolve_protocol(evals.protocol, k=evals.k, temperature=None, top_p=None, max_tokens=evals.max_tokens)
    if proto.max_tokens < settings["max_response_len"]:
        source = "--max-tokens" if evals.max_tokens is not None else f"protocol {proto.name!r} (eval_protocol)"
        raise CliError(f"the evaluation stops responses at {proto.max_tokens} tokens ({source}), and the arms train "
                       f"with responses of up to {settings['max_response_len']} (max_response_len): longer answers "
                       "would be cut off and scored wrong; use --set eval_protocol=dapo (20480) or r1 (32768), or "
                       f"--max-tokens {settings['max_response_len']} or more")


def check_eval_options(evals: EvalOptions, ray_address: str | None) -> None:
    """What ``stare eval`` would refuse for these options on any model (``CliError``): each benchmark and its
    problems, the backend, the engines, the protocol with its overrides."""
    from stare.eval import BENCHES, load_bench
    from stare.eval.data import local_data_file
    from stare.eval.backends import check_backend
    from stare.eval.protocols import resolve_protocol

    from stare.eval.batching import check_batching

    from .eval_plan import check_engines, check_harness

    try:
        if evals.backend is not None:
            check_backend(evals.backend)
        if evals.batching is not None:
            check_batching(evals.batching, evals.backend)
        # Ray itself is checked when the run starts (every training needs it), not by the plan: --dry-run needs none
        check_engines(evals.engines, ray_address, "stare", require_ray=False)
        resolve_protocol(evals.protocol, k=evals.k, temperature=None, top_p=None, max_tokens=evals.max_tokens)
        for bench in evals.benches:
            if bench not in BENCHES:
                raise ValueError(f"--bench {bench!r}: unknown benchmark; valid benchmarks: {', '.join(BENCHES)}")
            check_harness("stare", bench, resume=True, tools=None)
            load_bench(bench, data_file=local_data_file(bench, None) or "hub", limit=evals.limit)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def _eval_state(run_dir: Path, bench: str, evals: EvalOptions, seed: int) -> str:
    """kept (summary.json there), resume (samples, no summary) or new; ``CliError`` when the folder's samples were
    drawn with other settings than these (what ``stare eval --resume`` would refuse)."""
    from stare.eval.record import EvalRefused, check_resume, eval_record, holds_samples, recorded_batching

    folder = eval_dir(run_dir, bench)
    has_summary = (folder / "summary.json").is_file()
    if not holds_samples(folder):  # nothing there, or what a failed start left (a record, no sample)
        return NEW
    from stare.eval.batching import DEFAULT_BATCHING
    from stare.eval.data import local_data_file
    from stare.eval.protocols import resolve_protocol

    proto = resolve_protocol(evals.protocol, k=evals.k, temperature=None, top_p=None, max_tokens=evals.max_tokens)
    local = local_data_file(bench, None)
    data = str(Path(local).resolve()) if local is not None else "hub"
    batching = evals.batching or recorded_batching(folder) or DEFAULT_BATCHING  # as stare eval --resume decides
    try:
        check_resume(folder, eval_record(proto, seed=evals.seed, model=str(run_dir / FINAL), bench=bench,
                                         data=data, tools=None, batching=batching))
    except EvalRefused as exc:
        raise CliError(str(exc)) from None
    return KEPT if has_summary else RESUME


def trained(run_dir: Path) -> bool:
    """The training in ``run_dir`` finished: its final model is there, whole (every weight file as long as its
    header says)."""
    from .rundir import final_model, safetensors_problem

    final = final_model(run_dir)
    if final is None:
        return False
    weights = sorted(final.glob("*.safetensors"))
    return bool(weights) and all(safetensors_problem(w) is None for w in weights)


def plan_cluster_run(arm_set, out: Path, *, preset_arg: str, sets: list[str], evals: EvalOptions,
                     ray_address: str | None, resume: bool, parallel: int) -> ClusterPlan:
    """Every step of the run with its state, after every check (``CliError``, one line, nothing written)."""
    from .openrlhf_backend import train as openrlhf_train
    from .openrlhf_backend import launch as orl
    from .rundir import RunDirError, check_run_dir, check_run_set_dir

    out = Path(out).absolute()  # the children run with this folder, wherever their working directory
    try:
        check_run_set_dir(out, arm_set.preset)
        if ray_address:
            orl.check_address_syntax(ray_address)
    except (RunDirError, orl.LaunchError) as exc:
        raise CliError(str(exc)) from None
    if parallel > 1 and not ray_address:
        raise CliError(f"--parallel {parallel}: arms run at once only on a Ray cluster with the GPUs for them; give "
                       "--ray-address (without it each arm's stare train starts a Ray head of its own on this node)")
    evals = eval_layout(arm_set.settings, evals, ray_address)
    check_eval_options(evals, ray_address)
    check_eval_length(arm_set.settings, evals)
    eval_mem, refusal = eval_memory(arm_set.settings, evals)
    preset = str(Path(preset_arg).absolute()) if Path(preset_arg).is_file() else preset_arg
    base_seed = arm_set.settings["seed"]
    steps: list[Step] = []
    for arm in arm_set.arms:
        for i in range(arm_set.seeds):
            run_dir = out / arm / f"seed{i}"
            resolved = json.loads(json.dumps(arm_set.resolved[arm]))
            resolved["settings"]["seed"] = seed = base_seed + i
            launch_plan = openrlhf_train.plan(resolved, run_dir, ray_address)  # what stare train --dry-run checks
            existing = (run_dir / "config.yaml").exists()
            try:
                check_run_dir(run_dir, resolved, resume and existing)
            except RunDirError as exc:
                raise CliError(str(exc)) from None
            state = KEPT if trained(run_dir) else RESUME if existing else NEW
            command = ["train", "--preset", preset, "--algo", arm_set.algo(arm), "--out", str(run_dir)]
            for s in [*sets, *arm_set.swept(arm), f"seed={seed}"]:
                command += ["--set", s]
            command += (["--resume"] if state == RESUME else []) + (["--ray-address", ray_address] if ray_address
                                                                    else [])
            logs = out / LOGS
            steps.append(Step(TRAIN, arm, i, seed, run_dir, command, state, logs / f"{arm}-seed{i}-train.log",
                              openrlhf_argv=launch_plan["openrlhf_argv"], memory=launch_plan["memory"]))
            refusal = refusal or (state != KEPT and openrlhf_train.memory_refusal(launch_plan, resolved["settings"]))
            for bench in evals.benches:
                e_state = _eval_state(run_dir, bench, evals, seed) if state == KEPT else NEW
                e_cmd = ["eval", "--bench", bench, "--out", str(run_dir), *evals.flags(ray_address)]
                e_cmd += ["--resume"] if e_state == RESUME else []
                steps.append(Step(EVAL, arm, i, seed, run_dir, e_cmd, e_state, logs / f"{arm}-seed{i}-eval-{bench}.log",
                                  bench=bench))
    return ClusterPlan(arm_set.preset, out, list(arm_set.arms), arm_set.seeds, evals, steps, parallel, ray_address,
                       gpus_per_arm(arm_set.settings, evals), memory=eval_mem, refusal=refusal or None)


def check_cluster(plan: ClusterPlan, resources=None) -> None:
    """``--parallel N`` on the cluster: it has the GPUs for N arms at once (``resources``: ``ray.cluster_resources``
    of the cluster at ``plan.ray_address``, asked here when not given). ``CliError`` otherwise."""
    if plan.parallel <= 1:
        return
    if resources is None:
        import ray

        from .stopping import reclaim

        ray.init(address=plan.ray_address, logging_level="ERROR", log_to_driver=False)
        reclaim()  # ray.init's SIGTERM handler would exit 15 without a word
        try:
            resources = ray.cluster_resources()
        finally:
            ray.shutdown()
    have, need = int(resources.get("GPU", 0)), plan.parallel * plan.gpus_per_arm
    if have < need:
        raise CliError(f"--parallel {plan.parallel}: {plan.parallel} arms of {plan.preset} at once need {need} GPUs "
                       f"({plan.gpus_per_arm} each), and the Ray cluster at {plan.ray_address} has {have}; use "
                       f"--parallel {max(1, have // plan.gpus_per_arm)} or a larger cluster (nothing was started)")


# ---- 2. the run -------------------------------------------------------------------------------------------------

def _minutes(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return (f"{h}h{rest // 60:02d}m" if h else f"{rest // 60}m{rest % 60:02d}s")


def error_line(log: Path) -> str:
    """The line of a failed step's log that says why: the last ``error:`` line, else the last exception line, else
    the last line."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    for pick in (lambda ln: ln.startswith("error:"), lambda ln: "Error" in ln.split(":")[0]):
        found = [ln for ln in lines if pick(ln)]
        if found:
            return found[-1]
    return lines[-1] if lines else "(empty log)"


def run_step(step: Step, log_line, running: dict | None = None) -> bool | None:
    """One step as a child process (this interpreter's ``stare``), its output appended to its log; True when it
    exited 0, None when a stop ended it. The child leads its own process group, so a terminal's Ctrl-C reaches only
    this process, which stops the children itself (``run_cluster``); it dies with this process
    (``stopping.child_env``) and is given this process's folder locks (``folder_lock.child_env``). ``running``:
    where the child is registered while it runs."""
    from . import folder_lock, stopping

    step.log.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    log_line(f"{step.name}: started ({'resumed' if step.state == RESUME else 'new'}; log {step.log})")
    running = {} if running is None else running
    with open(step.log, "a") as log:
        log.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} stare {' '.join(step.command)}\n")
        log.flush()
        with _starting:  # no child starts once a stop began
            if stopping.requested() is not None:
                return None
            proc = subprocess.Popen([sys.executable, "-m", "stare.cli.main", *step.command], stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    env=folder_lock.child_env(stopping.child_env()))
            running[proc.pid] = proc
            stopping.track(proc, group=True)
        try:
            rc = proc.wait()
        finally:
            running.pop(proc.pid, None)
            stopping.untrack(proc)
    took = _minutes(time.monotonic() - start)
    if stopping.requested() is not None and rc != 0:
        log_line(f"{step.name}: stopped after {took}")
        return None
    if rc == 0:
        log_line(f"{step.name}: finished in {took}")
        return True
    log_line(f"{step.name}: FAILED after {took} (exit {rc}): {error_line(step.log)}")
    return False


_starting = threading.Lock()
STOP_GRACE_S = 60.0  # a stopped training's stare train ends Ray and its engines before it exits


def run_cluster(plan: ClusterPlan, log_line) -> list[str]:
    """Every step not kept, ``plan.parallel`` arm-seeds at a time (a training, then its evaluations); returns the
    failures, one line each (the step, its error line, its log). On SIGINT or SIGTERM (``stopping``) no step
    starts, the running ones get SIGTERM (each ``stare train`` or ``stare eval`` stops as it does alone, leaving its
    last checkpoint or sample), SIGKILL after ``STOP_GRACE_S``, and the stop goes on up."""
    from . import stopping
    from .rundir import mark_run_set

    mark_run_set(plan.out, plan.preset, plan.arms, plan.seeds)
    failures: list[str] = []
    lock = threading.Lock()
    running: dict = {}

    def say(text: str) -> None:
        with lock:
            log_line(f"[{time.strftime('%H:%M:%S')}] {text}")

    def pipeline(steps: list[Step]) -> None:
        for step in steps:
            if step.state == KEPT:
                continue
            ok = run_step(step, say, running)
            if ok is None:  # stopped
                return
            if not ok:
                with lock:
                    failures.append(f"{step.name} failed: {error_line(step.log)} (log: {step.log})")
                if step.kind == TRAIN:  # nothing to evaluate
                    return

    kept = sum(s.state == KEPT for s in plan.steps)
    if kept:
        say(f"{kept} finished step(s) kept: " + ", ".join(s.name for s in plan.steps if s.state == KEPT))
    pool = ThreadPoolExecutor(max_workers=plan.parallel)
    try:
        list(pool.map(pipeline, plan.pipelines()))
    except KeyboardInterrupt:  # stopping.Stopped, or a KeyboardInterrupt of a wait it cut
        with _starting:
            children = list(running.values())
        stopped = stopping.stop_processes(children, group=True, grace=STOP_GRACE_S)
        stopping.report(f"{stopped} running step(s) stopped (each resumes from its last checkpoint or sample), "
                        f"the others not started")
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    plan.failures = failures
    return failures


def write_report(plan: ClusterPlan) -> list[Path]:
    """The comparison of every arm-seed that trained (``stare.cli.report.compare``), the failures in its notes; returns
    the run folders compared (none: nothing written)."""
    from .report.compare import compare

    dirs = [s.run_dir for s in plan.steps if s.kind == TRAIN and trained(s.run_dir)]
    if dirs:
        compare(dirs, plan.out, notes=plan.failures)
    return dirs
