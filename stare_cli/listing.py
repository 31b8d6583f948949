"""What ``stare presets``, ``stare algos`` and ``stare --version`` print: the shipped presets and the algorithms, one
row each, and the installed version."""
from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, version

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from stare.algorithms import ALGORITHMS

from . import errors
from .presets import PresetError, load_preset, preset_names, shipped_preset_text, shipped_presets_dir


def print_presets(console: Console, *, show: str | None = None) -> None:
    """Every shipped preset with its backend and description (an invalid one says why), then where they are;
    ``show``: that shipped preset's YAML instead."""
    if show is not None:
        try:
            sys.stdout.write(shipped_preset_text(show))
        except PresetError as exc:
            errors.fail(str(exc))
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


def print_algos(console: Console, *, settings: bool) -> None:
    """Every algorithm of the registry with its description; ``settings``: then every ``--set`` key."""
    table = Table(title="stare algorithms")
    table.add_column("algo", style="bold cyan")
    table.add_column("description")
    for cfg in ALGORITHMS.values():
        table.add_row(cfg.name, escape(cfg.description))
    console.print(table)
    if settings:
        from .settings_doc import print_settings

        print_settings(console)  # every --set key: algorithm and run settings, defaults, meaning


def version_line() -> str:
    """``stare X.Y.Z``, the installed package's version (``unknown`` in a source tree that is not installed)."""
    try:
        return f"stare {version('stare')}"
    except PackageNotFoundError:
        return "stare unknown"
