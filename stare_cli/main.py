"""The ``stare`` command line. Thin: parse, validate, call into stare.algorithms and the engines.

Errors the user can fix (an unknown preset, algorithm or setting, a bad value) print one line naming the
bad value and the valid choices, and exit with code 2, without a traceback.
"""
from __future__ import annotations

import json
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table

from stare.algorithms import ALGORITHMS, SETTING_NAMES

from .presets import PresetError, load_preset, preset_names, resolve

app = typer.Typer(
    name="stare",
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
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


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
            table.add_row(name, "?", f"[red]invalid: {exc}[/]")
            continue
        table.add_row(p.name, p.backend, p.description)
    console.print(table)


@app.command()
def algos(
    settings: bool = typer.Option(False, "--settings", help="Also list every setting --set can override."),
) -> None:
    """List the algorithms --algo accepts and what each one means."""
    table = Table(title="stare algorithms")
    table.add_column("algo", style="bold cyan")
    table.add_column("description")
    for cfg in ALGORITHMS.values():
        table.add_row(cfg.name, cfg.description)
    console.print(table)
    if settings:
        console.print("settings (override with --set key=value): " + ", ".join(SETTING_NAMES))


@app.command()
def train(
    preset: str = typer.Option(..., "--preset", "-p", help="Preset name (see `stare presets`)."),
    algo: str = typer.Option("stare", "--algo", "-a", help="Algorithm (see `stare algos`)."),
    set_: Optional[List[str]] = typer.Option(
        None, "--set", help="Override a preset or algorithm setting, e.g. --set w=1.5 --set steps=50. Repeatable."
    ),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="Run directory."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the resolved settings as JSON and exit."),
) -> None:
    """Train one arm: a preset (model, data, engine) with one algorithm.

    Every setting is validated before anything starts. --dry-run prints the resolved settings.
    """
    try:
        resolved = resolve(preset, algo, set_ or [])
    except PresetError as exc:
        fail(str(exc))
    if out is not None:
        resolved["out"] = out
    if dry_run:
        sys.stdout.write(json.dumps(resolved, indent=2) + "\n")
        return
    fail(
        f"the {resolved['backend']!r} training engine is not part of this build yet; "
        "use --dry-run to check the resolved settings",
        code=1,
    )


def main() -> None:
    app()


if __name__ == "__main__":
    main()
