"""The ``stare`` command line. Thin: each command parses and validates its flags and calls the module that does the
work: ``train`` and ``run`` ``stare.cli.run_command`` (both engines; the arms from ``stare.cli.run_set``), ``eval``
``stare.cli.eval_plan.evaluate``, ``compare`` ``stare.cli.run_command.compare_dirs``, ``presets`` and ``algos``
``stare.cli.listing``.

Errors the user can fix (an unknown preset, algorithm or setting, a bad value) print one line naming the bad value
and the valid choices, and exit with code 2, without a traceback: ``errors.fail``, and ``errors.CliError`` raised by
those modules (printed by ``errors.StareGroup``).
"""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

from stare.eval.batching import BATCHING
from stare.eval.data import BENCHES

from . import errors
from .errors import fail  # one line, escaped: rich would eat [...] in user values and hints
from .presets import DEFAULT_PRESET, PresetError, resolve
from .stopping import stoppable

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
BATCHING_HELP = "; ".join(f"{mode}: {what}" for mode, what in BATCHING.items())  # each mode, from its owner


def _print_version(value: bool) -> None:
    if value:
        from .listing import version_line

        console.print(version_line())
        raise typer.Exit()


@app.callback()
def _root(
    show_version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
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
    from .listing import print_presets

    print_presets(console, show=show)


@app.command()
def algos(
    settings: bool = typer.Option(False, "--settings", help="Also list every setting --set can override, with its defaults and meaning."),
) -> None:
    """List the algorithms --algo accepts and what each one means."""
    from .listing import print_algos

    print_algos(console, settings=settings)


def _warn_inert(sets: list[str], resolved: dict[str, dict]) -> None:
    """One ``warning:`` line per ``--set`` that no arm reads (``run_set.inert_sets``)."""
    from .run_set import inert_sets

    for line in inert_sets(sets, resolved):
        errors.warning(line)


@app.command()
@stoppable
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
    try:
        resolved = resolve(preset, algo, set_ or [])
    except PresetError as exc:
        fail(str(exc))
    _warn_inert(set_ or [], {algo: resolved})
    if ray_address is not None and not ray_address.strip():  # given empty: not "start a head here"
        fail("--ray-address '': expected HOST:PORT, ray://HOST:PORT or auto (leave the flag out to start a Ray head "
             "here)")
    from .run_command import train_one

    train_one(resolved, out, algo=algo, preset=preset, resume=resume, dry_run=dry_run, ray_address=ray_address,
              console=console)


@app.command()
@stoppable
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
    from .run_command import EvalFlags, run_arm_set
    from .run_set import check_flags_against_sets, resolve_run_set

    try:
        check_flags_against_sets(set_ or [], {"--algos": algos, "--seeds": seeds, "--bench": bench})
        arm_set = resolve_run_set(preset, set_ or [], algos=algos, seeds=seeds, sweeps=sweep)
    except PresetError as exc:
        fail(str(exc))
    _warn_inert(set_ or [], arm_set.resolved)
    run_arm_set(arm_set, out or Path("runs") / arm_set.preset, preset=preset, sets=set_ or [], parallel=parallel,
                resume=resume, dry_run=dry_run, console=console,
                flags=EvalFlags(bench=bench, ray_address=ray_address, backend=backend, k=k, max_tokens=max_tokens,
                                limit=limit, engines=engines, tp=tp, batching=batching))


@app.command("eval")
@stoppable
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
                                           "promises across --resume and --engines. " + BATCHING_HELP + ". Default: "
                                           "all, or with --resume the folder's (eval_settings.json), which --resume "
                                           "refuses to change."),
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
    from .eval_plan import evaluate

    evaluate(console, checkpoints=checkpoints, bench=bench, model=model, out=out, protocol=protocol, k=k,
             temperature=temperature, top_p=top_p, max_tokens=max_tokens, backend=backend, harness=harness, tp=tp,
             data_file=data_file, limit=limit, seed=seed, resume=resume, tools=tools, engines=engines,
             ray_address=ray_address, batching=batching)


@app.command(cls=errors.PlainUsage)
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
    from .run_command import compare_dirs

    compare_dirs(dirs, out, baseline=baseline, console=console)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
