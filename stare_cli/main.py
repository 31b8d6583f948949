"""The ``stare`` command line. Thin: each command parses and validates its flags, calls the module that does the
work and prints the result.

- ``train``: ``stare.cli.local.runner.train_arm`` (local presets) or ``stare.cli.openrlhf_backend.train`` (GPU presets);
- ``run``: ``stare.cli.run_set`` (the arms and seeds) and ``stare.cli.local.runner.run_set``;
- ``eval``: ``stare.cli.eval_plan`` (every check, then the harness);
- ``compare``: ``stare.cli.report.compare``.

Errors the user can fix (an unknown preset, algorithm or setting, a bad value) print one line naming the
bad value and the valid choices, and exit with code 2, without a traceback: ``errors.fail`` here, and
``errors.CliError`` raised by those modules (printed by ``errors.StareGroup``).
"""
from __future__ import annotations

import functools
import json
import re
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import List, Optional

import typer
import typer.core
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from stare.algorithms import ALGORITHMS
from stare.eval.data import BENCHES

from . import errors
from .errors import fail  # one line, escaped: rich would eat [...] in user values and hints
from .presets import (DEFAULT_PRESET, PresetError, load_preset, preset_names, resolve, shipped_preset_text,
                      shipped_presets_dir)

app = typer.Typer(
    name="stare",
    cls=errors.StareGroup,  # one-line usage errors; on/off flags shown without a type
    help=(
        "RL post-training with STARE, GRPO and DAPO, and AIME avg@k evaluation.\n\n"
        "Start with `stare presets` (what can run) and `stare algos` (what each --algo means)."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()


def _stoppable(command):
    """A long command that SIGINT (Ctrl-C) and SIGTERM stop cleanly: ``stare.cli.stopping``."""
    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        from . import stopping

        say = lambda line: errors.err_console.print(line, markup=False, highlight=False, soft_wrap=True)  # noqa: E731
        with stopping.stop_on_signals(say):
            return command(*args, **kwargs)
    return wrapper


def _version() -> str:
    try:
        return version("stare")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "unknown"


def _version_callback(value: bool) -> None:
    if value:
        console.print(f"stare {_version()}")
        raise typer.Exit()


@app.callback()
def _root(
    show_version: bool = typer.Option(
        False, "--version", callback=_version_callback, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    pass


@app.command()
def presets(
    show: Optional[str] = typer.Option(None, "--show", metavar="NAME",
                                       help="Print a shipped preset's YAML (a starting point for one's own)."),
) -> None:
    """List the presets shipped in configs/, with their backend and a one-line description.

    --preset also takes a path to a YAML file of one's own, checked like a shipped preset: a copy
    (stare presets --show qwen-7b-short-cot > my.yaml) or a file that starts from a shipped preset
    (base: qwen-7b-short-cot) and overrides its settings.
    """
    if show is not None:
        try:
            sys.stdout.write(shipped_preset_text(show))
        except PresetError as exc:
            fail(str(exc))
        return
    table = Table(title="stare presets", show_lines=False)
    table.add_column("preset", style="bold cyan")
    table.add_column("backend")
    table.add_column("description")
    for name in preset_names():
        try:
            p = load_preset(name)
        except PresetError as exc:
            table.add_row(name, "?", f"[red]invalid: {escape(str(exc))}[/]")
            continue
        table.add_row(p.name, p.backend, escape(p.description))
    console.print(table)
    errors.plain(console)(f"shipped presets: {shipped_presets_dir()}; --preset also takes a path to a preset YAML "
                          "file (stare presets --show NAME prints one to start from)")


@app.command()
def algos(
    settings: bool = typer.Option(False, "--settings", help="Also list every setting --set can override, with its defaults and meaning."),
) -> None:
    """List the algorithms --algo accepts and what each one means."""
    table = Table(title="stare algorithms")
    table.add_column("algo", style="bold cyan")
    table.add_column("description")
    for cfg in ALGORITHMS.values():
        table.add_row(cfg.name, escape(cfg.description))
    console.print(table)
    if settings:
        from .settings_doc import print_settings

        print_settings(console)  # every --set key: algorithm and run settings, defaults, meaning


def _resolve_or_fail(preset: str, algo: str, sets: list[str]) -> dict:
    try:
        return resolve(preset, algo, sets)
    except PresetError as exc:
        fail(str(exc))


def _warning(line: str) -> None:
    """One ``warning:`` line on stderr (plain text, never markup)."""
    errors.err_console.print(f"warning: {line}", markup=False, highlight=False, soft_wrap=True)


def _warn_inert(sets: list[str], resolved: dict[str, dict]) -> None:
    """One ``warning:`` line per ``--set`` that no arm reads (``run_set.inert_sets``)."""
    from .run_set import inert_sets

    for line in inert_sets(sets, resolved):
        _warning(line)


def _dump(data: dict) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


@app.command()
@_stoppable
def train(
    preset: str = typer.Option(..., "--preset", "-p", help="Preset name (see `stare presets`) or path to a preset YAML file."),
    algo: str = typer.Option("stare", "--algo", "-a", help="Algorithm (see `stare algos`)."),
    set_: Optional[List[str]] = typer.Option(
        None, "--set", help="Override a preset or algorithm setting, e.g. --set w=1.5 --set steps=50. Repeatable."
    ),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Run directory (default: runs/PRESET-ALGO)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --out from its last checkpoint."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print what would run as one JSON object and exit "
                                 "(GPU presets: openrlhf_argv, command, stare, ray)."),
    ray_address: Optional[str] = typer.Option(
        None, "--ray-address", help="GPU presets: submit to this Ray cluster (HOST:PORT, ray://HOST:PORT or auto). "
                                    "Default: start a Ray head on this node."),
) -> None:
    """Train one arm: a preset (model, data, engine) with one algorithm.

    Local presets (tiny-cpu, ...) train here on the CPU (on the GPU with --set device=cuda), then evaluate: the run
    directory gets config.yaml, metrics.jsonl (one line per step), checkpoint/, final/ and eval.json; a killed
    run continues with --resume.

    GPU presets (qwen-7b-short-cot, ...) run the pinned OpenRLHF's Ray PPO trainer with STARE plugged into its
    policy actor: checkpoints in OUT/ckpt (resumed automatically with --resume), the final model in
    OUT/final, TensorBoard logs in OUT/tensorboard (keys train/stare/*). Check the exact OpenRLHF command
    first with --dry-run.

    Ctrl-C or SIGTERM stops the training (and Ray, with its engines) after the checkpoint being written, exit 130 /
    143, with the --resume command; OUT is locked while this writes it.
    """
    resolved = _resolve_or_fail(preset, algo, set_ or [])
    _warn_inert(set_ or [], {algo: resolved})
    if ray_address is not None and not ray_address.strip():  # given empty: not "start a head here"
        fail("--ray-address '': expected HOST:PORT, ray://HOST:PORT or auto (leave the flag out to start a Ray head "
             "here)")
    run_dir = out or Path("runs") / f"{resolved['preset']}-{algo}"
    errors.check_out_dir(run_dir)
    if resolved["backend"] == "openrlhf":
        from .openrlhf_backend import train as openrlhf_train

        launch_plan = openrlhf_train.plan(resolved, run_dir, ray_address)
        if dry_run:
            _dump(launch_plan)  # the plan, a layout that does not fit included, then its refusal
        openrlhf_train.check_memory(launch_plan, resolved["settings"])
        if dry_run:
            return
        openrlhf_train.train(resolved, launch_plan, run_dir, resume=resume, ray_address=ray_address, console=console)
        return
    if ray_address is not None:
        fail(f"--ray-address {ray_address}: the flag is for GPU presets; {preset!r} is a local preset that trains on "
             "this machine")
    if dry_run:
        _dump({**resolved, "out": str(out)} if out is not None else resolved)
        return
    from .local.runner import train_arm

    result = train_arm(resolved, run_dir, resume=resume, console=console)
    console.print(_held_out_line(result))
    console.print(f"run directory: {escape(str(run_dir))}")


def _held_out_line(result: dict) -> str:
    """A local run's eval.json on one line: held-out avg@k, pass@k, greedy accuracy (and the hard cases')."""
    k = result["k"]
    line = (f"held-out avg@{k} {result['avg_at_k']:.3f}  pass@{k} {result['pass_at_k']:.3f}  "
            f"greedy {result['greedy_accuracy']:.3f}")
    if result.get("hard"):
        h = result["hard"]
        line += f"  |  hard cases: avg@{k} {h['avg_at_k']:.3f} pass@{k} {h['pass_at_k']:.3f}"
    return line


@app.command()
@_stoppable
def run(
    preset: str = typer.Option(DEFAULT_PRESET, "--preset", "-p", help="A preset (see `stare presets`) or path to a "
                                                                  "preset YAML file: local or GPU."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Output folder (default: runs/PRESET)."),
    algos: Optional[str] = typer.Option(None, "--algos", help="Comma-separated arms (default: the preset's list)."),
    seeds: Optional[int] = typer.Option(None, "--seeds", min=1, help="Seeds per arm (default: the preset's)."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a setting for every arm. Repeatable."),
    sweep: Optional[List[str]] = typer.Option(
        None, "--sweep", metavar="KEY=V1,V2,...", help="Train every arm once per value of a setting, as arm "
        "<algo>[KEY=V] in DIR/<algo>[KEY=V]/ (e.g. --sweep w=1.1,2,4); several --sweep give every combination. "
        "The comparison adds a dose-response table (per value: mean and 95% interval over seeds; a Spearman trend "
        "test over seeds x values) and dose_response.png."),
    parallel: Optional[int] = typer.Option(
        None, "--parallel", min=1, help="Arms at a time. Local presets: worker processes, one CPU thread each "
        "(default 2). GPU presets: arms' OpenRLHF jobs at once on the --ray-address cluster, checked against its "
        "GPUs before anything starts (default 1)."),
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted run: finished trainings and "
                                "evaluations are kept, interrupted ones continue, failed ones are retried."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan as one JSON object (every step, its "
                                 "command and whether it is kept, resumed or new, as the run decides it; what the "
                                 "run refuses, refused with its line) and exit; nothing is written; needs no Ray."),
    bench: Optional[str] = typer.Option(None, "--bench", "-b", help="GPU presets: comma-separated benchmarks each "
                                        "final model is evaluated on (default: the preset's benches setting)."),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="GPU presets: run every training and "
                                              "evaluation on this Ray cluster (HOST:PORT, ray://HOST:PORT or auto). "
                                              "Default: each starts a Ray head on this node."),
    engines: Optional[int] = typer.Option(None, "--engines", min=1, help="GPU presets, evaluation: engines per stare "
                                          "eval (default: as many as the GPUs hold at --tp: the preset's node, or "
                                          "all its nodes with --ray-address)."),
    tp: Optional[int] = typer.Option(None, "--tp", min=1, help="GPU presets, evaluation: tensor parallel size per "
                                     "engine (default: the smallest at which the memory plan fits the model and one sequence of its "
                                     "context on a card; the dry run shows it)."),
    batching: Optional[str] = typer.Option(None, "--batching", help="GPU presets, evaluation: stare eval's --batching "
                                           "(all, invariant, problem; default all, or an interrupted evaluation's "
                                           "own)."),
    backend: Optional[str] = typer.Option(None, "--backend", help="GPU presets, evaluation: vllm or hf (default: "
                                          "stare eval's)."),
    k: Optional[int] = typer.Option(None, "--k", min=1, help="GPU presets, evaluation: samples per problem "
                                    "(default: the protocol's, setting eval_protocol)."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", min=1, help="GPU presets, evaluation: response "
                                             "limit (default: the protocol's)."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="GPU presets, evaluation: only the first N "
                                        "problems of each benchmark."),
) -> None:
    """Train every arm (GRPO, DAPO, STARE, ...) x seed, evaluate them, compare, plot: the whole comparison.

    Local presets train here: DIR/<arm>/ per arm (DIR/<arm>/seed<S>/ with several seeds). GPU presets run one
    `stare train` (OpenRLHF) per arm and seed into DIR/<arm>/seed<S>/, then `stare eval` of each final model on
    every benchmark into DIR/<arm>/seed<S>/eval-<bench>/ (logs in DIR/logs/); a failed step is reported and the
    others go on. Both write DIR/comparison.md, .csv, .json and the plots. --resume continues either.

    Ctrl-C or SIGTERM stops every worker within seconds (exit 130 / 143) and prints the --resume command; DIR is
    locked while this writes it (a second writer is refused).
    """
    from .run_set import check_flags_against_sets, resolve_run_set

    try:
        check_flags_against_sets(set_ or [], {"--algos": algos, "--seeds": seeds, "--bench": bench})
        arm_set = resolve_run_set(preset, set_ or [], algos=algos, seeds=seeds, sweeps=sweep)
    except PresetError as exc:
        fail(str(exc))
    _warn_inert(set_ or [], arm_set.resolved)
    out = out or Path("runs") / arm_set.preset
    errors.check_out_dir(out)
    if arm_set.backend == "openrlhf":
        _run_cluster(arm_set, out, preset=preset, sets=set_ or [], parallel=parallel or 1, resume=resume,
                     dry_run=dry_run, bench=bench, ray_address=ray_address, engines=engines, tp=tp, backend=backend,
                     k=k, max_tokens=max_tokens, limit=limit, batching=batching)
        return
    given = [flag for flag, value in (("--bench", bench), ("--ray-address", ray_address), ("--backend", backend),
                                      ("--k", k), ("--max-tokens", max_tokens), ("--limit", limit),
                                      ("--engines", engines), ("--tp", tp), ("--batching", batching))
             if value is not None]
    if given:
        fail(f"{given[0]} is for GPU presets; {arm_set.preset!r} is a local preset, evaluated on its own held-out "
             "problems (its eval_* settings)")
    if dry_run:  # the run's own decision for every arm (kept, resume, new), or its refusal
        from .local.runner import plan_run_set

        _dump({"preset": arm_set.preset, "out": str(out), "arms": arm_set.arms, "seeds": arm_set.seeds,
               "runs": [a.to_json() for a in plan_run_set(arm_set, out, resume=resume)]})
        return
    from .local.runner import run_set

    failures = run_set(arm_set, out, resume=resume, parallel=parallel or 2, console=console)
    if (out / "comparison.md").is_file():
        console.print((out / "comparison.md").read_text(), markup=False, highlight=False, soft_wrap=True)
        plots = sorted(p.name for p in out.glob("*.png"))
        console.print(f"wrote {out}/comparison.md, comparison.csv" + "".join(f", {p}" for p in plots),
                      markup=False, highlight=False)
    _fail_with(failures)


def _fail_with(failures: list[str]) -> None:
    """The end of a ``stare run`` with failed steps (either engine): each on a ``failed:`` line, then one error line
    with the command that continues (exit 1); nothing when there are none."""
    if not failures:
        return
    import shlex

    for line in failures:
        errors.err_console.print(f"failed: {line}", markup=False, highlight=False, soft_wrap=True)
    again = sys.argv[1:] + ([] if "--resume" in sys.argv else ["--resume"])
    fail(f"{len(failures)} step(s) failed (above, and in the table's notes); fix and continue with: stare "
         f"{shlex.join(again)}", code=1)


def _run_cluster(arm_set, out: Path, *, preset: str, sets: list[str], parallel: int, resume: bool, dry_run: bool,
                 bench: Optional[str], ray_address: Optional[str], engines: Optional[int], tp: Optional[int],
                 backend: Optional[str], k: Optional[int], max_tokens: Optional[int], limit: Optional[int],
                 batching: Optional[str]) -> None:
    """``stare run`` on a GPU preset (``stare.cli.cluster_run``): plan, then train, evaluate and compare."""
    from . import cluster_run as cr
    from .folder_lock import check_free, hold
    from .openrlhf_backend.train import check_training_stack

    if ray_address is not None and not ray_address.strip():
        fail("--ray-address '': expected HOST:PORT, ray://HOST:PORT or auto (leave the flag out to start a Ray head "
             "per training here)")
    settings = arm_set.settings
    benches_text = bench if bench is not None else settings["benches"]
    benches = [b.strip() for b in benches_text.split(",") if b.strip()]
    if not benches or len(set(benches)) != len(benches):
        fail(f"--bench {benches_text!r}: expected distinct comma-separated benchmarks, e.g. aime24,aime25")
    evals = cr.EvalOptions(benches, settings["eval_protocol"], k=k, max_tokens=max_tokens, limit=limit,
                           backend=backend, engines=engines, tp=tp, batching=batching)
    if not dry_run:
        check_free(out)  # another process writing there: refused before its folders are read
    plan = cr.plan_cluster_run(arm_set, out, preset_arg=preset, sets=sets, evals=evals, ray_address=ray_address,
                               resume=resume, parallel=parallel)
    if dry_run:
        _dump(plan.to_json())  # the plan, a layout that does not fit included, then its refusal
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
        console.print((plan.out / "comparison.md").read_text(), markup=False, highlight=False, soft_wrap=True)
        say(f"wrote {plan.out}/comparison.md, comparison.csv, comparison.json and the plots ({len(compared)} run(s))")
    _fail_with(failures)


@app.command("eval")
@_stoppable
def eval_(
    bench: str = typer.Option(..., "--bench", "-b", help="Benchmark: aime24, aime25, amc23, math500."),
    model: Optional[str] = typer.Option(None, "--model", "-m",
                                        help="Model folder or hub id (default: the final checkpoint of the "
                                             "training run in --out)."),
    k: Optional[int] = typer.Option(None, "--k", min=1, help="Samples per problem (default: the protocol's)."),
    protocol: str = typer.Option("stare", "--protocol", help="stare (k 32, T 1.0, top_p 0.7), dapo, r1 (T 0.6, "
                                                            "top_p 0.95)."),
    temperature: Optional[float] = typer.Option(None, "--temperature", help="Overrides the protocol; in [0, 2]. 0 "
                                                                           "is greedy: one sample, so --k 1."),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="Overrides the protocol."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", min=1, help="Overrides the protocol."),
    backend: Optional[str] = typer.Option(None, "--backend", help="vllm or hf (default: vllm when importable "
                                                                  "with a GPU, else hf)."),
    harness: str = typer.Option("stare", "--harness", help="stare (this project's harness) or lm-eval (the "
                                                           "shipped lm-eval tasks, aime24 and aime25)."),
    tp: int = typer.Option(1, "--tp", min=1, help="Tensor parallel size (vllm): GPUs per engine."),
    engines: str = typer.Option("1", "--engines", help="Engines drawing problems at once, each a Ray actor on --tp "
                                                       "GPUs (8 GPUs: --engines 8 --tp 1 or --engines 4 --tp 2), or "
                                                       "auto: as many as this machine's GPUs (or the --ray-address "
                                                       "cluster's) hold at --tp or the tp the model's weights need. "
                                                       "Every sample keeps its seed for any count (see --batching); "
                                                       "1 runs here without Ray."),
    batching: Optional[str] = typer.Option(None, "--batching", help="How problems reach the engine, and what that "
                                                                     "promises "
                                                         "across --resume and --engines. all: every remaining "
                                                         "problem in flight at once, each written as it completes "
                                                         "(the engine's speed; bit-exact only where the engine's "
                                                         "arithmetic ignores the batch, e.g. vLLM on CPU, not on "
                                                         "GPUs). invariant: all with vLLM's batch-invariant kernels "
                                                         "(CUDA GPUs): bit-exact, slower. problem: one problem at a "
                                                         "time per engine: bit-exact on any device, slowest. Default: "
                                                         "all, or with --resume the folder's (eval_settings.json), "
                                                         "which --resume refuses to change."),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="Run the engines on this Ray cluster "
                                                                          "(HOST:PORT, ray://HOST:PORT or auto). "
                                                                          "Default: a local Ray when --engines > 1."),
    data_file: Optional[Path] = typer.Option(None, "--data-file", help="Local JSONL, JSON or parquet with problem "
                                                                      "and answer fields, or 'hub' for the Hugging "
                                                                      "Face hub (default: $STARE_DATA_DIR, else the "
                                                                      "copy shipped with stare, one for each "
                                                                      f"benchmark: {', '.join(BENCHES)})."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Only the first N problems."),
    seed: int = typer.Option(0, "--seed", help="Sampling seed (sample j of problem i: (seed mod 2**31) * 2**32 + "
                                               "i * k + j)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Output folder (default: evals/BENCH)."),
    resume: bool = typer.Option(False, "--resume", help="Skip samples already in OUT/samples.jsonl."),
    tools: Optional[str] = typer.Option(None, "--tools", help="python: multi-turn tool use, code blocks run in a "
                                                              "sandbox (settings: STARE_TOOL_* variables; isolation "
                                                              "STARE_SANDBOX_ISOLATION, namespaces by default)."),
    checkpoints: Optional[str] = typer.Option(None, "--checkpoints", help="all or every:N: evaluate each policy the "
                                              "training run in --out kept (each arm's, for a stare run folder) into "
                                              "OUT/eval-BENCH/step-S/, for accuracy-over-training curves in stare "
                                              "compare; --resume continues a stopped sweep, keeping finished steps."),
) -> None:
    """Evaluate a model on a math benchmark: avg@k, pass@k, maj@k with 95% bootstrap intervals.

    Writes samples.jsonl (one line per sample, as each problem completes), summary.json and summary.md.
    --harness lm-eval runs the shipped lm-eval tasks instead (no --resume) and writes the same summary fields.
    --checkpoints all (or every:50) evaluates the policies a run kept along the way (local: --set
    keep_checkpoint_every=N; OpenRLHF: --set save_hf_checkpoints=true), one folder per step.
    Ctrl-C or SIGTERM stops it with every finished problem kept (exit 130 / 143; then --resume); the output folder
    is locked while this writes it.
    """
    from stare.eval.summary import scores_line

    from .eval_plan import plan_eval, run_eval_plan

    if checkpoints is not None:
        from .eval_sweep import plan_sweep, run_sweep

        plans = plan_sweep(out=out, spec=checkpoints, bench=bench, model=model, harness=harness, resume=resume,
                           protocol=protocol, k=k, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                           backend=backend, tp=tp, data_file=data_file, limit=limit, seed=seed, tools=tools,
                           engines=engines, ray_address=ray_address, batching=batching)
        for p, summary in run_sweep(plans, console):
            console.print(f"{bench} step {p.step}: {scores_line(summary)}  -> {escape(str(p.plan.out))}/summary.md")
        return

    plan = plan_eval(bench=bench, model=model, out=out, protocol=protocol, k=k, temperature=temperature, top_p=top_p,
                     max_tokens=max_tokens, backend=backend, harness=harness, tp=tp, data_file=data_file, limit=limit,
                     seed=seed, resume=resume, tools=tools, engines=engines, ray_address=ray_address,
                     batching=batching)
    summary = run_eval_plan(plan, console)
    console.print(f"{bench} ({summary['n_problems']} problems, {plan.how}): {scores_line(summary)}  -> "
                  f"{escape(str(plan.out))}/summary.md")


class _PlainUsage(typer.core.TyperCommand):
    """A usage line that names a required argument as ``DIR...`` (the newer typer writes ``{DIR}...``, which reads as
    a template left unfilled)."""

    def collect_usage_pieces(self, ctx) -> list[str]:
        return [re.sub(r"^\{([^{}]*)\}", r"\1", piece) for piece in super().collect_usage_pieces(ctx)]


@app.command(cls=_PlainUsage)
def compare(
    dirs: List[Path] = typer.Argument(..., metavar="DIR", help="Training runs, eval outputs, or folders holding "
                                      "runs."),
    out: Path = typer.Option(Path("comparison"), "--out", "-o", help="Where the tables and plots go."),
    baseline: Optional[str] = typer.Option(
        None, "--baseline", help="The arm every other arm's seeds are tested against (95% intervals, exact "
        "permutation p-values): an algorithm (the first arm of it), an arm's label as the table prints it, or its "
        "folder, e.g. --baseline runs/smollm-seeds-gate-off/stare. Default: dapo, else grpo, else the first arm "
        "(the table's notes say which)."),
) -> None:
    """Compare training runs and evaluations: comparison.md/.csv and entropy, reward, response-length and
    reflection plots against training step (one line per run, the target band shaded). Missing pieces are
    blank, never invented. Runs that differ in more than algorithm and seed (steps, a setting, the preset) are
    compared with a warning (on stderr and in the table's notes)."""
    from .report.compare import compare as run_compare

    errors.check_out_dir(out)
    try:
        rows = run_compare(list(dirs), out, baseline=baseline, warn=_warning)
    except ValueError as exc:
        fail(str(exc))
    console.print((out / "comparison.md").read_text(), markup=False, highlight=False, soft_wrap=True)
    console.print(f"{len(rows)} row(s) -> {out}/comparison.md, comparison.csv" +
                  (", plots" if (out / "entropy.png").exists() else ""), markup=False, highlight=False)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
