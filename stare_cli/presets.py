"""Presets: YAML files in ``configs/`` (package ``stare.configs``), validated on load, and ``--set`` overrides.

A preset file holds:

    name: <file stem>
    description: <one line>
    backend: local | openrlhf
    settings: {key: value, ...}          # the run's settings; each can be overridden with --set key=value
                                         # (typed tables: local presets local_schema.py, openrlhf presets
                                         # gpu_schema.py; both checked on load and after --set)
    algorithms: {algo: {setting: value}} # per-algorithm overrides on top of the registry

``--set`` accepts a preset setting or an algorithm setting (``stare algos --settings`` lists those). Each value
is read by its setting's row (``Setting.parse``: a YAML scalar of the setting's type) and checked against it.

``--preset`` also takes a path to a preset file of one's own (a name ending in .yaml or .yml, or holding a path
separator), checked by the same schema. Such a file may be a whole preset (a copy of ``stare presets --show NAME``)
or start from a shipped one: ``base: NAME`` takes that preset's fields, and the file's ``settings`` and
``algorithms`` entries replace the base's key by key (the shipped GPU presets are written that way too, on the
paper's recipe ``qwen-7b-short-cot``, so each states only what differs). Its ``name`` defaults to the file's stem. A resolved run
records the file's absolute path and SHA-256 (``preset_file``), so a run stays traceable after the file changes.
"""
from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import yaml

from stare.algorithms import ALGORITHMS, SETTING_NAMES, get_algorithm
from stare.algorithms.registry import ALGO_SCHEMA, unknown_algorithm
from stare.algorithms.settings import Setting
from stare.eval.jsonl import decode_utf8

from .gpu_schema import SCHEMA as GPU_SCHEMA
from .local_schema import SCHEMA as LOCAL_SCHEMA, LocalSettingsError, check_local_settings

BACKENDS = ("local", "openrlhf")
REQUIRED = {"name": str, "description": str, "backend": str, "settings": dict}
PRESET_FILE_SUFFIXES = (".yaml", ".yml")
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # a preset's name is part of run folder names


class PresetError(ValueError):
    """A preset, algorithm or override the user named is not valid (the CLI exits with code 2)."""


@dataclass
class Preset:
    name: str
    description: str
    backend: str
    settings: dict
    algorithms: dict = field(default_factory=dict)
    file: dict | None = None  # a preset file of one's own: {"path": absolute path, "sha256": of its bytes}


def load_yaml(text: str, *, source: str):
    """Parse YAML text: the one YAML reader of presets, run configs (config.yaml) and run-set markers (run.yaml).
    ``PresetError`` (a ValueError) naming ``source`` with the parser's first line when it is not valid YAML."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PresetError(f"{source} is not valid YAML{_where(exc)}: {_problem(exc)}") from None


def _where(exc) -> str:
    """`` at line L, column C`` (1-based) of the parser's mark: where it found the problem."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    return "" if mark is None else f" at line {mark.line + 1}, column {mark.column + 1}"


def _problem(exc) -> str:
    """The parser's words in one line: what it was doing and what it found (``while parsing a flow sequence ...
    expected ',' or ']', but got '<scalar>'``), without its excerpt of the file."""
    parts = [getattr(exc, "context", None), getattr(exc, "problem", None)]
    words = "; ".join(p for p in parts if p)
    return words or str(exc).splitlines()[0]


def read_config(path) -> dict:
    """A YAML file that must hold a mapping (a run's config.yaml, a ``stare run`` folder's run.yaml); an empty file
    is an empty mapping. ``PresetError`` (a ValueError) naming the file otherwise."""
    data = load_yaml(Path(path).read_text(), source=str(path))
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise PresetError(f"{path} is malformed: expected a mapping, got {type(data).__name__}")
    return data


DEFAULT_PRESET = "tiny-cpu"  # the embedded CPU default: what `stare run` takes without --preset


def preset_names() -> list[str]:
    files = resources.files("stare.configs")
    return sorted(p.name[: -len(".yaml")] for p in files.iterdir() if p.name.endswith(".yaml"))


def local_presets() -> list:
    """The shipped presets of the local engine, the embedded default first, then by name."""
    names = sorted(preset_names(), key=lambda n: (n != DEFAULT_PRESET, n))
    return [p for p in (load_preset(n) for n in names) if p.backend == "local"]


def shipped_presets_dir() -> str:
    """Where the shipped preset files are (the installed package's configs/)."""
    return str(resources.files("stare.configs"))


def is_preset_file(name: str) -> bool:
    """``--preset`` names a file (not a shipped preset) when it ends in .yaml/.yml or holds a path separator."""
    return name.lower().endswith(PRESET_FILE_SUFFIXES) or "/" in name or os.sep in name


def shipped_preset_text(name: str) -> str:
    names = preset_names()
    if name not in names:
        raise PresetError(f"unknown preset {name!r}; valid presets: {', '.join(names)} (or a path to a preset "
                          "YAML file)")
    return resources.files("stare.configs").joinpath(f"{name}.yaml").read_text()


def load_preset(name: str) -> Preset:
    """A shipped preset by name, or a preset file by path (``is_preset_file``)."""
    if is_preset_file(name):
        return load_preset_file(Path(name))
    return parse_preset(shipped_preset_text(name), source=f"{name}.yaml", expected_name=name)


def _read_preset_file(path: Path) -> tuple[str, bytes]:
    """A preset file's text and the bytes it was decoded from (read once: the hash is of what was parsed); one-line
    ``PresetError`` naming the file (and the line and byte) when it is missing, a folder, or not UTF-8."""
    if path.is_dir():
        raise PresetError(f"preset file {path} is a folder; expected a file")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise PresetError(f"preset file not found: {path}") from None
    except OSError as exc:
        raise PresetError(f"preset file {path} cannot be read ({exc.strerror or exc})") from None
    try:
        return decode_utf8(data, str(path)), data
    except ValueError as exc:
        raise PresetError(str(exc)) from None


def load_preset_file(path: Path) -> Preset:
    """A preset file of one's own, whole or on a shipped ``base``; the same checks as a shipped preset."""
    text, raw = _read_preset_file(path)
    source = str(path)
    data = load_yaml(text, source=f"preset {source}")
    if not isinstance(data, dict):
        raise PresetError(f"preset {source} must be a mapping of fields, got {type(data).__name__}")
    data = with_base(data, source)
    data.setdefault("name", path.stem)
    if not isinstance(data["name"], str) or not NAME_RE.fullmatch(data["name"]):
        raise PresetError(f"preset {source}: name {data['name']!r} must be letters, digits, '.', '_' or '-' (it "
                          "names run folders)")
    preset = parse_preset_data(data, source=source)
    preset.file = {"path": str(path.absolute()), "sha256": hashlib.sha256(raw).hexdigest()}
    return preset


def with_base(data: dict, source: str, seen: tuple[str, ...] = ()) -> dict:
    """``data`` without its ``base:`` field, on top of that shipped preset (itself resolved the same way, so a base
    may have a base); ``data`` itself when it names none. ``seen``: the shipped presets already on the way here."""
    data = dict(data)
    base = data.pop("base", None)
    if base is None:
        return data
    names = preset_names()
    if base not in names:  # a path or a .yaml name is never one of them
        raise PresetError(f"preset {source}: base {base!r} is not a shipped preset; valid bases: {', '.join(names)}")
    if base in seen:
        raise PresetError(f"preset {source}: base {base!r} leads back to itself ({' -> '.join([*seen, base])})")
    base_source = f"{base}.yaml"
    base_data = load_yaml(shipped_preset_text(base), source=f"preset {base_source}")
    if not isinstance(base_data, dict):
        raise PresetError(f"preset {base_source} must be a mapping of fields, got {type(base_data).__name__}")
    return _on_base(with_base(base_data, base_source, (*seen, base)), data, source)


def _on_base(base: dict, own: dict, source: str) -> dict:
    """The base preset's fields with the file's on top: ``settings`` and each algorithm's overrides key by key."""
    for key in ("settings", "algorithms"):
        if key in own and not isinstance(own[key], dict):
            raise PresetError(f"preset {source}: field {key!r} must be a mapping, got {type(own[key]).__name__}")
    if "backend" in own and own["backend"] != base["backend"]:
        raise PresetError(f"preset {source}: backend {own['backend']!r} differs from its base's "
                          f"({base['backend']!r}); a preset on a base keeps the base's backend")
    merged = {**{k: v for k, v in base.items() if k != "name"},  # the base's name is not this preset's
              **{k: v for k, v in own.items() if k not in ("settings", "algorithms")}}
    merged["settings"] = {**base["settings"], **(own.get("settings") or {})}
    algos = {a: dict(o) for a, o in (base.get("algorithms") or {}).items()}
    for algo, overrides in (own.get("algorithms") or {}).items():
        if not isinstance(overrides, dict):
            raise PresetError(f"preset {source}: algorithms.{algo} must be a mapping of settings")
        algos[algo] = {**algos.get(algo, {}), **overrides}
    merged["algorithms"] = algos
    return merged


def parse_preset(text: str, *, source: str, expected_name: str | None = None) -> Preset:
    """A preset from its YAML text (a shipped preset's when ``expected_name`` is its name), on its ``base`` if it
    names one."""
    data = load_yaml(text, source=f"preset {source}")
    if not isinstance(data, dict):
        raise PresetError(f"preset {source} must be a mapping of fields, got {type(data).__name__}")
    data = with_base(data, source, (expected_name,) if expected_name else ())
    return parse_preset_data(data, source=source, expected_name=expected_name)


def parse_preset_data(data: dict, *, source: str, expected_name: str | None = None) -> Preset:
    """A preset from its fields, ``base:`` already resolved (``with_base``); the unknown-field line names ``base``
    with the valid fields, since every preset may start from one."""
    for key, typ in REQUIRED.items():
        if key not in data:
            raise PresetError(f"preset {source} is missing the field {key!r}")
        if not isinstance(data[key], typ):
            raise PresetError(f"preset {source}: field {key!r} must be a {typ.__name__}, got {type(data[key]).__name__}")
    unknown = sorted(set(data) - set(REQUIRED) - {"algorithms"})
    if unknown:
        raise PresetError(f"preset {source} has unknown field {unknown[0]!r}; valid fields: "
                          f"{', '.join([*REQUIRED, 'algorithms', 'base'])}")
    if expected_name is not None and data["name"] != expected_name:
        raise PresetError(f"preset {source} names itself {data['name']!r}; the name must match the file name")
    if data["backend"] not in BACKENDS:
        raise PresetError(f"preset {source}: unknown backend {data['backend']!r}; valid backends: {', '.join(BACKENDS)}")
    shadowed = sorted(set(data["settings"]) & set(SETTING_NAMES))
    if shadowed:
        raise PresetError(f"preset {source}: setting {shadowed[0]!r} is an algorithm setting; put it under 'algorithms'")
    algos = data.get("algorithms") or {}
    if not isinstance(algos, dict):
        raise PresetError(f"preset {source}: field 'algorithms' must be a mapping of algorithm name to settings")
    for algo, overrides in algos.items():
        if algo not in ALGORITHMS:
            raise PresetError(f"preset {source}: {unknown_algorithm(algo)}")
        if not isinstance(overrides, dict):
            raise PresetError(f"preset {source}: algorithms.{algo} must be a mapping of settings")
        try:
            get_algorithm(algo, **overrides)
        except (ValueError, TypeError) as exc:
            raise PresetError(f"preset {source}: algorithms.{algo}: {exc}") from None
    settings = dict(data["settings"])
    if data["backend"] == "local":  # every setting typed and range-checked, defaults filled in
        try:
            settings = check_local_settings(settings, f"preset {source}: ")
        except LocalSettingsError as exc:
            raise PresetError(str(exc)) from None
    if data["backend"] == "openrlhf":  # GPU presets: every setting typed and checked, defaults filled in
        from .gpu_schema import SettingsError
        from .openrlhf_backend.argv import check_settings

        try:
            settings = check_settings(settings, source)
        except SettingsError as exc:
            raise PresetError(str(exc)) from None
    return Preset(data["name"], data["description"], data["backend"], settings, dict(algos))


_TYPE_NAMES = {bool: "bool", int: "int", float: "int or float", str: "str"}


def _coerce(key: str, raw: str, setting: Setting):
    """``--set key=raw`` read by the setting's row and checked for its type (its range: by the table's checks)."""
    value = setting.parse(raw)
    if value is None and setting.nullable or setting.has_type(value):
        return value
    names = _TYPE_NAMES[setting.type] + (" or null" if setting.nullable else "")
    raise PresetError(f"--set {key}={raw}: expected {names}, got {type(value).__name__}")


def parse_sets(items: list[str]) -> list[tuple[str, str]]:
    out = []
    for item in items:
        if "=" not in item:
            raise PresetError(f"--set expects key=value, got {item!r}")
        key, raw = item.split("=", 1)
        out.append((key.strip(), raw))
    return out


def resolve(preset_name: str, algo: str, sets: list[str] | None = None) -> dict:
    """The fully resolved settings of one run: preset settings + algorithm (registry, preset, --set)."""
    preset = load_preset(preset_name)
    if algo not in ALGORITHMS:
        raise PresetError(unknown_algorithm(algo))
    settings = dict(preset.settings)
    algo_over = dict(preset.algorithms.get(algo, {}))
    given: dict[str, str] = {}  # the run settings set here, with the text given (for the messages)
    for key, raw in parse_sets(sets or []):
        if key in settings:
            given[key] = raw  # checked below, with the table's words for what is valid
            settings[key] = (LOCAL_SCHEMA if preset.backend == "local" else GPU_SCHEMA)[key].parse(raw)
        elif key in SETTING_NAMES:
            algo_over[key] = _coerce(key, raw, ALGO_SCHEMA[key])
        else:
            valid = sorted(settings) + list(SETTING_NAMES)
            raise PresetError(f"unknown --set key {key!r}; valid keys: {', '.join(valid)}")
    try:
        algo_cfg = get_algorithm(algo, **algo_over)
        if preset.backend == "local":  # the schema's types, ranges and choices, after --set
            settings = check_local_settings(settings, "", given=given)
            # as the GPU presets (argv.check_algorithm, OpenRLHF's assert): the penalised zone must fit in the limit
            limit = settings.get("max_new_tokens")
            if algo_cfg.overlong_shaping and isinstance(limit, int) and algo_cfg.overlong_buffer_len > limit:
                raise PresetError(f"preset {preset.name}, algorithm {algo}: overlong_buffer_len "
                                  f"({algo_cfg.overlong_buffer_len}) must be <= max_new_tokens ({limit}) "
                                  "(the penalised zone is the end of the response limit)")
        if preset.backend == "openrlhf" and sets:  # the overrides must still fit together
            from .openrlhf_backend.argv import check_settings

            settings = check_settings(settings, f"{preset.name} (with --set)", given=given)
    except ValueError as exc:
        raise PresetError(str(exc)) from None
    resolved = {"preset": preset.name, "backend": preset.backend, "algo": algo_cfg.to_dict(), "settings": settings}
    if preset.file:
        resolved["preset_file"] = dict(preset.file)
    return resolved
