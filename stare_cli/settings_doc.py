"""What every ``--set`` key means, and its defaults: ``stare algos --settings`` and the generated docs tables.

Three tables of ``Setting`` rows (name, type, default, valid values, meaning), one per scope: the algorithm
settings (``stare.algorithms.registry.ALGO_SETTINGS``, read off ``AlgoConfig``'s fields; one default per algorithm), the local presets' run settings
(``local_schema.LOCAL_SETTINGS``) and the GPU presets' (``gpu_schema.GPU_SETTINGS``), one default per preset.
``--set key=value`` accepts all of them; this module renders them for the terminal and as docs/settings.md and
docs/local-settings.md (tests keep the files equal to what it renders).
"""
from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from stare.algorithms import ALGORITHMS
from stare.algorithms.registry import ALGO_SETTINGS
from stare.algorithms.settings import Setting

from .gpu_schema import GPU_SETTINGS
from .local_schema import LOCAL_SETTINGS

# The meaning of every key, by scope (the tables' own words).
ALGO_SETTING_HELP = {s.name: s.help for s in ALGO_SETTINGS}
LOCAL_RUN_SETTING_HELP = {s.name: s.help for s in LOCAL_SETTINGS}
GPU_RUN_SETTING_HELP = {s.name: s.help for s in GPU_SETTINGS}


def _fmt(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _per_owner(values: dict[str, object]) -> str:
    """The most common value, then the owners that differ: '0.28 (grpo, dr-grpo: 0.2)'."""
    groups: dict[str, list[str]] = {}
    for owner, value in values.items():
        groups.setdefault(_fmt(value), []).append(owner)
    common = max(groups, key=lambda v: len(groups[v]))  # ties: the first seen
    others = "; ".join(f"{', '.join(owners)}: {value}" for value, owners in groups.items() if value != common)
    return f"{common} ({others})" if others else common


def algo_settings_table() -> Table:
    table = Table(title="algorithm settings (--set key=value; default per algorithm)")
    table.add_column("setting", style="bold cyan", no_wrap=True)
    table.add_column("default")
    table.add_column("meaning; valid values")
    for s in ALGO_SETTINGS:
        table.add_row(s.name, escape(_algo_defaults(s)), escape(f"{s.help}; valid: {s.valid()}"))
    return table


def _algo_defaults(s: Setting) -> str:
    return _per_owner({name: getattr(cfg, s.name) for name, cfg in ALGORITHMS.items()})


def local_run_settings_table() -> Table:
    """The local presets' settings, from the schema (``local_schema.LOCAL_SETTINGS``): the default per preset and
    the valid values."""
    from .presets import local_presets

    presets = local_presets()
    table = Table(title="run settings of the local presets (--set key=value; default per preset)")
    table.add_column("setting", style="bold cyan", no_wrap=True)
    table.add_column("default")
    table.add_column("meaning; valid values")
    for s in LOCAL_SETTINGS:
        values = {p.name: p.settings[s.name] for p in presets if s.name in p.settings}
        table.add_row(s.name, escape(_per_owner(values) if values else _fmt(s.default)),
                      escape(f"{s.help}; valid: {s.valid()}"))
    return table


def gpu_run_settings_table() -> Table:
    table = Table(title="run settings of the GPU presets (--set key=value; default, or required: each preset "
                        "sets it)")
    table.add_column("setting", style="bold cyan", no_wrap=True)
    table.add_column("default")
    table.add_column("meaning; valid values")
    for s in GPU_SETTINGS:
        table.add_row(s.name, escape(f"{_default_text(s, _fmt)} ({s.type.__name__})"),
                      escape(f"{s.help}; valid: {s.valid()}"))
    return table


def _default_text(s: Setting, fmt) -> str:
    """A row's own default: 'required', '' (quoted) or the value as ``fmt`` writes it."""
    return "required" if s.required else repr(s.default) if s.default == "" else fmt(s.default)


def _yaml_text(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def markdown_table(rows, default=None) -> str:
    """Settings rows as a markdown table: setting, type, default, valid values, meaning. ``default`` gives a row's
    default column (a row's own default, in backquotes, when None)."""
    lines = ["| setting | type | default | valid | meaning |", "|---|---|---|---|---|"]
    for s in rows:
        shown = default(s) if default else f"`{_default_text(s, _yaml_text)}`"
        cells = [f"`{s.name}`", s.type.__name__, shown, s.valid(), s.help]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def local_settings_markdown() -> str:
    """docs/local-settings.md: the local presets' settings table, rendered from the schema (a test keeps the file
    equal to this; regenerate with ``python -m stare.cli.settings_doc > docs/local-settings.md``)."""
    from .presets import local_presets

    names = ", ".join(f"`{p.name}`" for p in local_presets())
    return ("# Settings of the local presets\n\n"
            "Generated from `stare_cli/local_schema.py` (`LOCAL_SETTINGS`, the one table `stare algos --settings` "
            "prints too) by `python -m stare.cli.settings_doc > docs/local-settings.md`. Every local preset "
            f"({names}) is checked against it when it is loaded and again after "
            "`--set`; a value outside it is one line naming the setting, the value and what is valid, and nothing "
            "is written. The defaults are what a preset that leaves a setting out gets; `stare algos --settings` shows each "
            "preset's own values.\n\n"
            + markdown_table(LOCAL_SETTINGS))


def settings_markdown() -> str:
    """docs/settings.md: every key ``--set`` accepts, in three tables rendered from the three settings tables (a
    test keeps the file equal to this; regenerate with ``python -m stare.cli.settings_doc settings >
    docs/settings.md``)."""
    names = ", ".join(f"`{n}`" for n in ALGORITHMS)
    return ("# Settings\n\n"
            "Generated from the three settings tables by `python -m stare.cli.settings_doc settings > "
            "docs/settings.md`; `stare algos --settings` prints the same tables. `--set key=value` takes any key "
            "below (`stare train`, `stare run`); a value outside its row is one line naming the setting, the value "
            "and what is valid, and nothing is written.\n\n"
            "## Algorithm settings\n\n"
            "The fields of `AlgoConfig` (`algorithms/registry.py`), each declared with its meaning and valid values "
            "(`ALGO_SETTINGS` reads them off), checked by `AlgoConfig.validate` with the rules between settings. The default is each algorithm's "
            f"({names}): the common value, then the algorithms that differ.\n\n"
            + markdown_table(ALGO_SETTINGS, _algo_defaults)
            + "\n## Run settings of the local presets\n\n"
            "`stare_cli/local_schema.py` (`LOCAL_SETTINGS`; docs/local-settings.md has this table alone). A preset "
            "that leaves a setting out gets the default.\n\n"
            + markdown_table(LOCAL_SETTINGS)
            + "\n## Run settings of the GPU presets\n\n"
            "`stare_cli/gpu_schema.py` (`GPU_SETTINGS`); `openrlhf_backend/argv.py` adds the rules between them "
            "(GPU layout, batch sizes) that OpenRLHF asserts. Every GPU preset gives the required ones.\n\n"
            + markdown_table(GPU_SETTINGS))


def print_settings(console: Console) -> None:
    """Every key ``--set`` accepts, with its defaults and meaning."""
    console.print(algo_settings_table())
    console.print(local_run_settings_table())
    console.print(gpu_run_settings_table())
    console.print("A preset's own values: `stare train --preset NAME --dry-run` prints them all, resolved.")


if __name__ == "__main__":
    import sys

    docs = {"local-settings": local_settings_markdown, "settings": settings_markdown}
    which = sys.argv[1] if len(sys.argv) > 1 else "local-settings"
    if which not in docs:
        sys.exit(f"error: unknown table {which!r}; valid: {', '.join(docs)}")
    sys.stdout.write(docs[which]())
