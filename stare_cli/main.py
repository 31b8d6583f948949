"""The ``stare`` command line. Thin: parse, validate, call into stare.algorithms and the engines.

Errors the user can fix (an unknown preset, algorithm or setting, a bad value) print one line naming the
bad value and the valid choices, and exit with code 2, without a traceback.
"""
from __future__ import annotations

import json
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from stare.algorithms import ALGORITHMS, SETTING_NAMES

from . import errors
from .presets import PresetError, load_preset, parse_sets, preset_names, resolve

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
err_console = Console(stderr=True)


def fail(message: str, code: int = 2) -> None:
    """Print a one-line error and exit (code 2: bad usage)."""
    errors.fail(message, code)  # escaped: rich would eat [...] in user values and hints


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
def presets() -> None:
    """List the presets shipped in configs/, with their backend and a one-line description."""
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


def _parse_algos(text: str, flag: str | None = None) -> list[str]:
    algos = [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in algos if a not in ALGORITHMS]
    if not algos:
        fail(f"{flag or 'algos'} {text!r}: no algorithm named; give one or more, comma-separated, of: "
             f"{', '.join(ALGORITHMS)}")
    if unknown:
        fail(f"{flag + ' ' + repr(text) + ': ' if flag else ''}unknown algorithm {unknown[0]!r}; valid algorithms: "
             f"{', '.join(ALGORITHMS)}")
    if len(set(algos)) != len(algos):
        fail(f"--algos lists an algorithm twice: {text!r}")
    return algos


def _resolve_or_fail(preset: str, algo: str, sets: list[str]) -> dict:
    try:
        return resolve(preset, algo, sets)
    except PresetError as exc:
        fail(str(exc))


def _print_eval(console_: Console, result: dict) -> None:
    k = result["k"]
    line = (f"held-out avg@{k} {result['avg_at_k']:.3f}  pass@{k} {result['pass_at_k']:.3f}  "
            f"greedy {result['greedy_accuracy']:.3f}")
    if result.get("hard"):
        h = result["hard"]
        line += f"  |  hard cases: avg@{k} {h['avg_at_k']:.3f} pass@{k} {h['pass_at_k']:.3f}"
    console_.print(line)


def _check_model_available(resolved: dict, prepare: bool = False) -> None:
    """A preset on a packaged model fails before any folder is made when the package is missing."""
    if resolved["settings"].get("model") != "smollm2-135m":
        return
    from .local.smollm import MissingModelError, ensure_available, smollm_checkpoint

    try:
        ensure_available()
        if prepare:  # convert once here rather than in every worker
            smollm_checkpoint()
    except MissingModelError as exc:
        fail(str(exc), code=1)


def _check_device(resolved: dict) -> None:
    """A local run's ``device`` setting names a device this machine has (``cuda`` needs a visible GPU)."""
    from .local.device import DeviceError, engine_device

    try:
        engine_device(resolved["settings"])
    except DeviceError as exc:
        fail(str(exc))


@app.command()
def train(
    preset: str = typer.Option(..., "--preset", "-p", help="Preset name (see `stare presets`)."),
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

    GPU presets (qwen-7b-short-cot, ...) run OpenRLHF 0.11.2's Ray PPO trainer with STARE plugged into its
    policy actor: checkpoints in OUT/ckpt (resumed automatically with --resume), the final model in
    OUT/final, TensorBoard logs in OUT/tensorboard (keys train/stare/*). Check the exact OpenRLHF command
    first with --dry-run.
    """
    resolved = _resolve_or_fail(preset, algo, set_ or [])
    if ray_address is not None and not ray_address.strip():  # given empty: not "start a head here"
        fail("--ray-address '': expected HOST:PORT, ray://HOST:PORT or auto (leave the flag out to start a Ray head "
             "here)")
    errors.check_out_dir(out or Path("runs") / f"{preset}-{algo}")
    if resolved["backend"] == "openrlhf":
        _train_openrlhf(resolved, out or Path("runs") / f"{preset}-{algo}", ray_address, resume, dry_run)
        return
    if ray_address is not None:
        fail(f"--ray-address {ray_address}: the flag is for GPU presets; {preset!r} is a local preset that trains on "
             "this machine")
    if dry_run:
        if out is not None:
            resolved["out"] = str(out)
        sys.stdout.write(json.dumps(resolved, indent=2) + "\n")
        return
    from .rundir import RunDirError, check_resumable, prepare_run_dir, remove_unstarted_run

    _check_device(resolved)
    _check_model_available(resolved)
    out = out or Path("runs") / f"{preset}-{algo}"
    existed = out.exists()
    try:
        if resume:
            check_resumable(out)  # a cut metrics line, a checkpoint that does not load: one line, before any write
        started = prepare_run_dir(out, resolved, resume)
    except RunDirError as exc:
        fail(str(exc))
    try:
        _train_local(resolved, out, preset, algo, resume)
    except BaseException:
        if not started:
            remove_unstarted_run(out, existed)  # failed before its first checkpoint: nothing blocks the retry
        raise


def _train_local(resolved: dict, out: Path, preset: str, algo: str, resume: bool) -> None:
    from .local.runner import quiet

    quiet()
    from rich.progress import Progress

    from .local.trainer import LocalTrainer

    trainer = LocalTrainer(resolved, out)
    settings = resolved["settings"]
    if settings.get("model", "tiny") == "tiny" and not (trainer.warmstart_dir / "warmstart.json").exists():
        console.print(f"warm start: {settings['warmstart_steps']} supervised steps on noisy demonstrations "
                      f"(cached in {escape(str(trainer.warmstart_dir))})")
    from .local import progress as bars

    with Progress(*bars.columns(), console=console) as progress:  # steps, live reward and entropy, ETA
        task = progress.add_task(f"{algo} on {preset}", total=resolved["settings"]["steps"], status="starting")

        def on_step(step, steps, rec):
            progress.update(task, completed=step, status=bars.live_status(rec))

        result = trainer.run(resume=resume, on_step=on_step)
    _print_eval(console, result)
    console.print(f"run directory: {escape(str(out))}")


def _train_openrlhf(resolved: dict, out: Path, ray_address: Optional[str], resume: bool, dry_run: bool) -> None:
    from .openrlhf_backend import launch as orl
    from .openrlhf_backend.argv import SettingsError

    try:
        plan = orl.plan(resolved, out, ray_address)
    except (SettingsError, orl.LaunchError) as exc:
        fail(str(exc))
    if dry_run:
        sys.stdout.write(json.dumps(plan, indent=2) + "\n")
        return
    from .openrlhf_backend import OpenRLHFVersionError
    from .rundir import RunDirError, check_run_dir, prepare_run_dir

    try:
        check_run_dir(out, resolved, resume)
        if ray_address:
            orl.check_ray_address(ray_address)
    except (RunDirError, orl.LaunchError) as exc:
        fail(str(exc))
    try:
        from .openrlhf_backend import plugin  # noqa: F401 - imports OpenRLHF and checks its version
    except ImportError as exc:
        fail(f"the GPU training stack is not installed ({exc}); pip install 'stare[openrlhf]' or use the "
             "Docker image (see the README)", code=1)
    except OpenRLHFVersionError as exc:
        fail(str(exc), code=1)
    prepare_run_dir(out, resolved, resume)
    console.print(f"[bold]stare train[/] {resolved['preset']} with {resolved['algo']['name']} on OpenRLHF -> {escape(str(out))}")
    try:
        orl.start(resolved, plan, log=errors.plain(console))
    except orl.LaunchError as exc:
        fail(str(exc))


@app.command()
def run(
    preset: str = typer.Option("tiny-cpu", "--preset", "-p", help="A local preset (see `stare presets`)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Output folder (default: runs/PRESET)."),
    algos: Optional[str] = typer.Option(None, "--algos", help="Comma-separated arms (default: the preset's list)."),
    seeds: Optional[int] = typer.Option(None, "--seeds", min=1, help="Seeds per arm (default: the preset's)."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a setting for every arm. Repeatable."),
    parallel: int = typer.Option(2, "--parallel", min=1, help="Arms trained at a time (one CPU thread each)."),
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted run: finished arms are kept."),
) -> None:
    """Train every arm (GRPO, DAPO, STARE, ...) on a local preset, evaluate them, compare, plot.

    Writes DIR/<arm>/ per arm (DIR/<arm>/seed<S>/ with several seeds), DIR/comparison.md and .csv, and
    DIR/entropy.png, reward.png, response_length.png.
    """
    try:
        p = load_preset(preset)
    except PresetError as exc:
        fail(str(exc))
    if p.backend != "local":
        fail(f"stare run trains local presets only; {preset!r} is a {p.backend!r} preset (use stare train)")
    # the arms and seeds: the flags, else `--set algos=... / seeds=...` (the preset settings they override), else
    # the preset's
    try:
        overrides = dict(parse_sets(set_ or []))  # the last --set of a key wins, as in resolve
    except PresetError as exc:
        fail(str(exc))
    if algos is not None:  # given, even empty: what was given is what is checked
        arm_names = _parse_algos(algos, flag="--algos")
    else:
        arm_names = _parse_algos(overrides["algos"], flag="--set algos") if "algos" in overrides else \
            _parse_algos(p.settings.get("algos", "grpo,dapo,stare,stare-phi"))
    if seeds is None and "seeds" in overrides:
        try:
            seeds = int(overrides["seeds"])
        except ValueError:
            seeds = 0
        if seeds < 1:
            fail(f"--set seeds={overrides['seeds']}: expected an integer >= 1")
    n_seeds = seeds or int(p.settings.get("seeds", 1))
    resolved = {a: _resolve_or_fail(preset, a, set_ or []) for a in arm_names}
    _check_device(next(iter(resolved.values())))
    out = out or Path("runs") / preset
    errors.check_out_dir(out)
    from .local.runner import run_arms
    from .plots import plot_curves
    from .rundir import RunDirError, check_run_set_dir, mark_run_set
    from .runs import load_run
    from .tables import write_comparison

    try:
        check_run_set_dir(out, preset)
    except RunDirError as exc:
        fail(str(exc))
    _check_model_available(next(iter(resolved.values())), prepare=True)
    mark_run_set(out, preset, arm_names, n_seeds)
    console.print(f"[bold]stare run[/] {preset}: {', '.join(arm_names)} x {n_seeds} seed(s) -> {escape(str(out))}")
    try:
        dirs = run_arms(resolved, out, seeds=n_seeds, resume=resume, parallel=parallel, console=console)
    except RunDirError as exc:
        fail(str(exc))
    runs = [load_run(d) for d in dirs]
    write_comparison(out, runs)
    plots = plot_curves(out, runs)
    console.print((out / "comparison.md").read_text(), markup=False, highlight=False, soft_wrap=True)
    console.print(f"wrote {out}/comparison.md, comparison.csv" + "".join(f", {p.name}" for p in plots),
                  markup=False, highlight=False)


@app.command("eval")
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
    tp: int = typer.Option(1, "--tp", min=1, help="Tensor parallel size (vllm)."),
    data_file: Optional[Path] = typer.Option(None, "--data-file", help="Local JSONL/parquet with problem and "
                                                                      "answer fields, or 'hub' for the Hugging Face "
                                                                      "hub (default: $STARE_DATA_DIR, else the copy "
                                                                      "shipped for aime24/aime25, else the hub)."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Only the first N problems."),
    seed: int = typer.Option(0, "--seed", help="Sampling seed (sample j of problem i: (seed mod 2**31) * 2**32 + "
                                               "i * k + j)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Output folder (default: evals/BENCH)."),
    resume: bool = typer.Option(False, "--resume", help="Skip samples already in OUT/samples.jsonl."),
    tools: Optional[str] = typer.Option(None, "--tools", help="python: multi-turn tool use, code blocks run in a "
                                                              "sandbox (settings: STARE_TOOL_* variables)."),
) -> None:
    """Evaluate a model on a math benchmark: avg@k, pass@k, maj@k with 95% bootstrap intervals.

    Writes samples.jsonl (one line per sample, as each problem completes), summary.json and summary.md.
    --harness lm-eval runs the shipped lm-eval tasks instead (no --resume) and writes the same summary fields.
    """
    from stare.eval import BENCHES, load_bench
    from stare.eval.data import local_data_file
    from stare.eval.harness import (EvalRefused, check_backend, check_resume, default_backend, eval_record,
                                    make_backend, resolve_protocol, run_eval)

    from .eval_plan import check_harness, check_model_folder, eval_target

    if bench not in BENCHES:
        fail(f"unknown bench {bench!r}; valid benches: {', '.join(BENCHES)}")
    errors.check_out_dir(out or Path("evals") / bench)
    try:
        if backend is not None:
            check_backend(backend)
        check_harness(harness, bench, resume=resume, tools=tools)
        if tools is not None:
            from .agent.loop import ToolConfig
            from .agent.multiturn import ToolUseBackend

            tool_config = ToolConfig.from_env()
        model, out_dir = eval_target(model, out, bench)
    except ValueError as exc:
        fail(str(exc))
    backend = backend or default_backend()
    errors.check_out_dir(out_dir)
    try:
        proto = resolve_protocol(protocol, k=k, temperature=temperature, top_p=top_p, max_tokens=max_tokens)
        local = local_data_file(bench, data_file)
        if harness == "stare" or local is not None:  # lm-eval reads the hub itself
            problems = load_bench(bench, data_file=local if local is not None else "hub", limit=limit)
    except ValueError as exc:
        fail(str(exc))
    data = str(Path(local).resolve()) if local is not None else "hub"
    if resume and harness == "stare":  # the folder's settings, before any model is loaded or anything written
        try:
            check_resume(out_dir, eval_record(proto, seed=seed, model=model, bench=bench, data=data, tools=tools))
        except EvalRefused as exc:
            fail(str(exc))
    if (out_dir / "samples.jsonl").exists() and not resume:
        fail(f"{out_dir} already holds samples; " + ("pass --resume to continue or " if harness == "stare" else "")
             + "use another --out (nothing was changed)")
    try:
        check_model_folder(model)  # a file (README.md), a folder without a readable config.json
    except ValueError as exc:
        fail(str(exc))
    errors.check_model_source(model)  # before loading: a mistyped path is not a hub id to retry for a minute
    from .local.runner import quiet

    quiet()
    if harness == "lm-eval":
        from stare.eval.lm_eval_harness import LmEvalError, run_lm_eval

        console.print(f"lm-eval task for {bench}: {proto.k} samples per problem, {backend} model")
        try:
            summary = run_lm_eval(bench, model, proto, out_dir, backend=backend, tp=tp, data_file=local,
                                  limit=limit, seed=seed)
        except LmEvalError as exc:
            fail(str(exc))
        _print_eval_summary(bench, summary, f"protocol {proto.name}, lm-eval", out_dir)
        return
    engine = make_backend(backend, model, tp, seed)
    if tools is not None:
        try:
            engine = ToolUseBackend(engine, tool_config, tools)
        except ValueError as exc:  # e.g. STARE_TOOL_FORMAT=chat with a tokenizer that has no chat template
            fail(str(exc))
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    total = len(problems) * proto.k
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task(f"{bench} x {proto.k} samples", total=total)
        try:
            summary = run_eval(problems, engine, proto, out_dir, bench=bench, model=model, seed=seed, resume=resume,
                               progress=lambda n: progress.advance(task, n), data=data, tools=tools)
        except EvalRefused as exc:
            progress.stop()
            fail(str(exc))
    _print_eval_summary(bench, summary, f"protocol {proto.name}", out_dir)


def _print_eval_summary(bench: str, summary: dict, how: str, out_dir: Path) -> None:
    from stare.eval.summary import scores_line

    console.print(f"{bench} ({summary['n_problems']} problems, {how}): {scores_line(summary)}  -> "
                  f"{escape(str(out_dir))}/summary.md")


@app.command()
def compare(
    dirs: List[Path] = typer.Argument(..., help="Training runs, eval outputs, or folders holding runs."),
    out: Path = typer.Option(Path("comparison"), "--out", "-o", help="Where the tables and plots go."),
) -> None:
    """Compare training runs and evaluations: comparison.md/.csv and entropy, reward, response-length and
    reflection plots against training step (one line per run, the target band shaded). Missing pieces are
    blank, never invented."""
    from .compare import compare as run_compare

    errors.check_out_dir(out)
    try:
        rows = run_compare(list(dirs), out)
    except ValueError as exc:
        fail(str(exc))
    console.print((out / "comparison.md").read_text(), markup=False, highlight=False, soft_wrap=True)
    console.print(f"{len(rows)} row(s) -> {out}/comparison.md, comparison.csv" +
                  (", plots" if (out / "entropy.png").exists() else ""), markup=False, highlight=False)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
