"""``stare run --sweep KEY=V1,V2,...``: every arm trained once per value, several sweeps giving their product.

An arm of a sweep is named ``<algo>[KEY=V]`` (``<algo>[KEY=V,KEY2=V2]`` for several, keys in the order given), in
tables and as its folder (``OUT/<algo>[KEY=V]/seed<S>/``); V is the value as typed. The name is safe on every
filesystem: keys are setting names and values may hold only letters, digits and ``. _ + -``. The folder name is
the record: ``arm_sweep`` reads it back from a run's folder (checked against the run's config.yaml), so
``stare compare`` labels a copied run folder the same way, and the dose-response table
(``stare.cli.report.dose_response``) gets its values from the runs' settings.

Refused before anything is written (``PresetError``, one line, exit 2): a key that is not a setting (``--set``'s
words), a key that does nothing for one of the swept arms (``AlgoConfig.unused_settings``: W for grpo), a value its
schema refuses, a value twice (``2`` and ``2.0``), a key also given with ``--set`` or swept twice, the keys that
choose the runs themselves (``algos``, ``seeds``, ``seed``: use ``--algos`` and ``--seeds``).

No torch here: a bad flag fails in a moment.
"""
from __future__ import annotations

import itertools
import re
from pathlib import Path

from .presets import PresetError, resolve

SAFE_VALUE = re.compile(r"[A-Za-z0-9._+-]+")
_LABEL = re.compile(r"(?P<algo>[A-Za-z0-9._-]+)\[(?P<body>[A-Za-z0-9_]+=[A-Za-z0-9._+-]+"
                    r"(?:,[A-Za-z0-9_]+=[A-Za-z0-9._+-]+)*)\]")
NOT_SWEPT = {"algos": "--algos", "seeds": "--seeds", "seed": "--seeds"}


def parse_sweeps(texts: list[str]) -> dict[str, list[str]]:
    """``KEY=V1,V2,...`` per ``--sweep`` -> {key: [value text, ...]} in the order given; ``PresetError`` for a
    malformed one, an empty value, a value that cannot name a folder, a value or a key given twice."""
    sweeps: dict[str, list[str]] = {}
    for text in texts:
        key, sep, rest = text.partition("=")
        key = key.strip()
        if not sep or not key:
            raise PresetError(f"--sweep {text!r}: expected KEY=V1,V2,... (e.g. --sweep w=1.1,2)")
        if key in NOT_SWEPT:
            raise PresetError(f"--sweep {key}: {key} chooses the runs themselves; use {NOT_SWEPT[key]}")
        if key in sweeps:
            raise PresetError(f"--sweep {key} is given twice; give its values once, comma-separated")
        values = [v.strip() for v in rest.split(",")]
        if not rest.strip() or any(not v for v in values):
            raise PresetError(f"--sweep {text!r}: an empty value; expected KEY=V1,V2,... (e.g. --sweep w=1.1,2)")
        bad = next((v for v in values if not SAFE_VALUE.fullmatch(v)), None)
        if bad is not None:
            raise PresetError(f"--sweep {key}: value {bad!r} cannot be part of a folder name; a swept value may hold "
                              "letters, digits and . _ + - only")
        if len(set(values)) != len(values):
            raise PresetError(f"--sweep {text!r} lists a value twice")
        sweeps[key] = values
    return sweeps


def label(algo: str, assignment: dict[str, str]) -> str:
    """The arm's name and folder: ``algo`` alone without a sweep, else ``algo[KEY=V,...]``."""
    if not assignment:
        return algo
    return f"{algo}[{','.join(f'{k}={v}' for k, v in assignment.items())}]"


def parse_label(name: str) -> tuple[str, dict[str, str]] | None:
    """``algo[KEY=V,...]`` -> (algo, {KEY: V text}); None for any other name."""
    m = _LABEL.fullmatch(name)
    if m is None:
        return None
    pairs = [p.split("=", 1) for p in m.group("body").split(",")]
    keys = [k for k, _ in pairs]
    return (m.group("algo"), dict(pairs)) if len(set(keys)) == len(keys) else None


def setting_value(resolved: dict, key: str):
    """A resolved run's value of ``key``: a run setting, else an algorithm setting (``--set``'s order)."""
    settings = resolved.get("settings") or {}
    return settings[key] if key in settings else (resolved.get("algo") or {}).get(key)


def _same(a, b) -> bool:
    """One setting value: equal, a bool only to a bool (True is not 1), an int to the float it equals."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return type(a) is type(b) and a == b or all(isinstance(x, (int, float)) for x in (a, b)) and a == b


def _typed(text: str):
    """A value as typed, read as ``--set`` reads it: a YAML scalar, or a number YAML 1.1 reads as text (1e-3)."""
    import yaml

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, str):
        try:
            return float(text)
        except ValueError:
            return value
    return value


def expand(preset: str, algos: list[str], sets: list[str], sweeps: dict[str, list[str]]) -> dict[str, dict]:
    """{arm label: resolved settings} for every algorithm x every combination of the swept values (algorithm
    first, then the sweeps' values in the order given); ``PresetError`` for any refusal of the module docstring."""
    from .presets import parse_sets

    given = {k for k, _ in parse_sets(sets)}
    both = next((k for k in sweeps if k in given), None)
    if both is not None:
        raise PresetError(f"--sweep {both} and --set {both} are both given; sweep it or set it")
    arms: dict[str, dict] = {}
    for algo in algos:
        for combo in itertools.product(*sweeps.values()):
            assignment = dict(zip(sweeps, combo))
            extra = [f"{k}={v}" for k, v in assignment.items()]
            try:
                resolved = resolve(preset, algo, [*sets, *extra])
            except PresetError as exc:
                raise PresetError(f"--sweep {', '.join(extra)} for {algo}: {exc}") from None
            unused = resolved_unused(resolved)
            for key in assignment:
                if key in unused:
                    raise PresetError(f"--sweep {key}: not a setting of {algo}: {unused[key]}; sweep it over "
                                      "arms that use it (--algos)")
            for key, v in assignment.items():  # two texts of one value (2 and 2.0) would train one arm twice
                for other in sweeps[key][:sweeps[key].index(v)]:
                    twin = arms.get(label(algo, {**assignment, key: other}))
                    if twin is not None and _same(setting_value(twin, key), setting_value(resolved, key)):
                        raise PresetError(f"--sweep {key}: {other} and {v} are the same value")
            arms[label(algo, assignment)] = resolved
    return arms


def resolved_unused(resolved: dict) -> dict[str, str]:
    """``AlgoConfig.unused_settings`` of a resolved run (its algorithm settings as resolved)."""
    from stare.algorithms.registry import AlgoConfig

    return AlgoConfig(**resolved["algo"]).unused_settings()


def arm_sweep(path: Path, config: dict, algo: str | None) -> tuple[str, dict] | None:
    """(label, {key: value as in config.yaml}) when the run's folder, or a folder above it (``seed<S>/``, an OpenRLHF
    run's log folders), is named ``algo[KEY=V,...]`` for its algorithm with values its config.yaml holds; else
    None (an arm named by its algorithm)."""
    if algo is None:
        return None
    resolved = {"settings": config.get("settings") or {}, "algo": config.get("algo") or {}}
    for folder in [Path(path), *Path(path).parents][:5]:  # an OpenRLHF run: seed<S>/tensorboard/<name>
        parsed = parse_label(folder.name)
        if parsed is None or parsed[0] != algo:
            continue
        values = {}
        for key, text in parsed[1].items():
            value = setting_value(resolved, key)
            if not _same(value, _typed(text)):
                return None
            values[key] = value
        return folder.name, values
    return None
