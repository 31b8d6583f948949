"""``Setting``, the row every settings table uses, and ``setting``, a dataclass field that carries its row.

A row is a setting's name, type, default, valid values (a range or choices) and a one-line meaning. From the
rows come the checks (``AlgoConfig.validate``; the local and GPU presets' own tables in
``stare_cli/local_schema.py`` and ``stare_cli/gpu_schema.py``), the parsing of ``--set key=value``
(``Setting.parse``), ``stare algos --settings`` and the generated docs/settings.md. The algorithm settings are
``AlgoConfig``'s fields (``registry.py``), each declared with ``setting(default, meaning, valid values)``;
``settings_of`` reads the rows off them (``registry.ALGO_SETTINGS``), so a setting is written once. Rules between
settings (cov_high above cov_low, a token rule's own settings, stare against token_rule, the controller's ranges)
are ``AlgoConfig.validate``'s.

No torch here (``stare algos`` and ``stare presets`` read it and must stay fast), and no import of stare.cli.
"""
from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Callable

from ._plain import check_choice, check_range

REQUIRED = ...  # the default of a setting every preset must give (the GPU presets' model, data, ...)
_KINDS = {int: "integer", float: "number", bool: "true or false", str: "text"}


@dataclass(frozen=True)
class Setting:
    """One setting. ``low``/``high`` bound numbers (``low_open``: the low bound itself is not valid); ``choices``
    lists the valid values; ``nullable``: null (None) is valid too; ``check`` is a custom rule (returns why a value
    is bad, or None); ``valid_text`` says what is valid where neither a range nor choices says it (or where
    something else checks more); ``label`` is the word the checks' messages use (default: the name)."""
    name: str
    type: type
    default: Any
    help: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    choices: tuple | None = None
    check: Callable[[Any], str | None] | None = None
    valid_text: str | None = None
    nullable: bool = False
    label: str | None = None

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    def range_text(self) -> str | None:
        """The range in words ('>= 1', 'in (0, 2]'), or None when there is none."""
        if self.low is None:
            return None
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {_num(self.low)}"
        return f"in {'(' if self.low_open else '['}{_num(self.low)}, {_num(self.high)}]"

    def choices_text(self) -> str:
        return ", ".join("''" if c == "" else str(c) for c in self.choices)

    def valid(self) -> str:
        """The valid values, in words: 'integer >= 1', 'number in (0, 2]', 'one of: cpu, cuda'."""
        if self.valid_text:
            return self.valid_text
        if self.choices is not None:
            return "one of: " + self.choices_text()
        text = " ".join(filter(None, [_KINDS[self.type], self.range_text()]))
        return f"{text}, or null" if self.nullable else text

    def has_type(self, value) -> bool:
        """isinstance of the setting's type, where a bool is no number and an int is a float too."""
        if self.type is bool:
            return isinstance(value, bool)
        return not isinstance(value, bool) and isinstance(value, (int, float) if self.type is float else self.type)

    def out_of_range(self, value) -> bool:
        """True when the number ``value`` lies outside ``low``..``high``."""
        return (self.low is not None and (value <= self.low if self.low_open else value < self.low)
                or self.high is not None and value > self.high)

    def problem(self, value) -> str | None:
        """Why ``value`` is not valid for this setting (type, range, choices, check), or None; in the preset
        checks' words ('expected integer >= 1, got 0')."""
        if value is None and self.nullable:
            return None
        if not self.has_type(value):
            got = "nothing" if value is None else f"{type(value).__name__} {value!r}"
            return f"expected {self.valid()}, got {got}"
        if self.type is float and not math.isfinite(value):
            return f"expected a finite {self.valid()}, got {value!r}"
        if self.choices is not None and value not in self.choices:
            return f"unknown value {value!r}; valid choices: {', '.join(map(str, self.choices))}"
        if self.out_of_range(value):
            return f"expected {self.valid()}, got {value!r}"
        if self.check is not None:
            return self.check(value)
        return None

    def require(self, value) -> None:
        """Raise ValueError unless ``value`` is valid, in stare.algorithms' words (``check_range``,
        ``check_choice``): 'clip_ratio must be in (0, 1], got 0.0', "unknown token_rule 'x'; valid choices: ..."."""
        if value is None and self.nullable:
            return
        label = self.label or self.name
        if self.choices is not None:
            check_choice(label, value, self.choices)
        elif self.type in (int, float):
            if self.type is int and not self.has_type(value):
                raise ValueError(f"{label} must be an integer, got {value!r}")
            check_range(label, value, self.low, self.high, low_open=self.low_open)  # a number, not NaN
        elif not self.has_type(value):
            raise ValueError(f"{label} must be {self.valid()}, got {value!r}")
        why = self.check(value) if self.check is not None else None
        if why:
            raise ValueError(f"{label}: {why}")

    def parse(self, raw: str):
        """The value of ``--set name=raw``, not checked: a YAML scalar ("" and "null" are None), text as given
        unless YAML reads it as text too, "1e-6" and "2" numbers for a number setting (a float)."""
        import yaml

        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        if self.type is str:
            return value if isinstance(value, str) else raw  # "--set model=123" means the text 123
        if self.type is float and isinstance(value, str):
            try:  # PyYAML reads "1e-6" (no dot) as text
                value = float(value)
            except ValueError:
                pass
        if self.type is float and self.has_type(value):
            value = float(value)
        return value


def _num(x) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def schema(rows) -> dict[str, Setting]:
    """name -> row, for look-ups."""
    return {s.name: s for s in rows}


def check_settings(rows, settings: dict, where: str, *, given: dict[str, str] | None = None) -> dict:
    """A settings dict checked against its table ``rows`` (the local presets', the GPU presets'), with the defaults
    filled in; a new dict, numbers of a float setting as floats. ValueError with one message shape for every table,
    each starting with ``where`` ("preset tiny-cpu.yaml: "): an unknown name (and the valid ones), a required
    setting missing, or ``setting NAME: <Setting.problem>``; a key in ``given`` (the keys set with --set, with the
    text given) is named ``--set NAME=TEXT`` instead. Rules between settings stay with each table's owner."""
    names = [s.name for s in rows]
    unknown = [k for k in settings if k not in names]
    if unknown:
        raise ValueError(f"{where}unknown setting {unknown[0]!r}; valid settings: {', '.join(names)}")
    out = {}
    for s in rows:
        if s.name not in settings and s.required:
            raise ValueError(f"{where}missing the setting {s.name!r} ({s.valid()})")
        value = settings.get(s.name, s.default)
        why = s.problem(value)
        if why:
            raise ValueError(f"{where}{setting_label(s.name, given)}: {why}")
        out[s.name] = float(value) if s.type is float and value is not None else value
    return out


def setting_label(name: str, given: dict[str, str] | None = None) -> str:
    """How a message names a setting: ``--set NAME=TEXT`` when the user gave it so, else ``setting NAME``."""
    return f"--set {name}={given[name]}" if given is not None and name in given else f"setting {name}"


def setting(default, help: str, **valid) -> Any:
    """A dataclass field that is a setting: its ``default``, its one-line meaning (``help``) and its valid values
    (``Setting``'s ``low``, ``high``, ``low_open``, ``choices``, ``check``, ``valid_text``, ``label``). The row is
    made by ``settings_of``, which takes the name and the type from the field."""
    return field(default=default, metadata={"setting": {"help": help, **valid}})


def settings_of(cls) -> tuple[Setting, ...]:
    """The rows of the dataclass ``cls``'s ``setting`` fields, in their order: the field's name, its annotated type
    (``X | None``: type X, and null is valid), its default and what ``setting`` was given."""
    hints = typing.get_type_hints(cls)
    rows = []
    for f in fields(cls):
        given = f.metadata.get("setting")
        if given is None:
            continue
        kind, nullable = hints[f.name], False
        if type(None) in typing.get_args(kind):
            (kind,) = [a for a in typing.get_args(kind) if a is not type(None)]
            nullable = True
        rows.append(Setting(f.name, kind, f.default, nullable=nullable, **given))
    return tuple(rows)
