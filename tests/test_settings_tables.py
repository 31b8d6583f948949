"""The three settings tables (algorithm, local run, GPU run): one row per setting, the code reads them, and the
docs tables are rendered from them."""
from __future__ import annotations

import typing
from dataclasses import fields
from pathlib import Path

import pytest

from stare.algorithms import ALGORITHMS, SETTING_NAMES, AlgoConfig, get_algorithm
from stare.algorithms.registry import ALGO_SCHEMA, ALGO_SETTINGS
from stare.cli import settings_doc
from stare.cli.gpu_schema import GPU_SETTINGS
from stare.cli.local_schema import LOCAL_SETTINGS
from stare.cli.presets import PresetError, resolve

ROOT = Path(__file__).resolve().parents[1]


def test_every_algo_config_field_is_a_setting_with_its_type_and_a_valid_default():
    """AlgoConfig's fields are the algorithm settings (settings.setting on each): a field declared without it would
    escape validation, --set and the docs. The row's type is the annotation's, null valid exactly where the
    annotation admits None."""
    hints = typing.get_type_hints(AlgoConfig)
    plain = [f.name for f in fields(AlgoConfig) if "setting" not in f.metadata]
    assert plain == ["name", "description"], f"declare {plain[2:]} with setting(...)"
    assert tuple(s.name for s in ALGO_SETTINGS) == SETTING_NAMES
    for f in fields(AlgoConfig):
        if f.name in ("name", "description"):
            continue
        row = ALGO_SCHEMA[f.name]
        nullable = type(None) in typing.get_args(hints[f.name])
        assert row.nullable is nullable and (row.type | None if nullable else row.type) == hints[f.name], f.name
        assert row.default == f.default and type(row.default) is type(f.default), f.name
        row.require(row.default)  # the default is valid
        assert row.help and "\n" not in row.help, f.name
    assert ALGO_SCHEMA["dual_clip"].nullable and ALGO_SCHEMA["dual_clip"].problem(None) is None
    assert not ALGO_SCHEMA["w"].nullable and ALGO_SCHEMA["w"].problem(None)  # a number setting refuses null


@pytest.mark.parametrize("rows", [LOCAL_SETTINGS, GPU_SETTINGS], ids=["local", "gpu"])
def test_run_setting_rows_are_unique_and_their_defaults_valid(rows):
    names = [s.name for s in rows]
    assert len(names) == len(set(names))
    for s in rows:
        assert s.help and s.valid(), s.name
        if not s.required:
            assert s.has_type(s.default), s.name
            assert s.choices is None or s.default in s.choices, s.name


def test_every_named_algorithm_fits_the_table():
    for cfg in ALGORITHMS.values():
        for s in ALGO_SETTINGS:
            s.require(getattr(cfg, s.name))


def test_docs_settings_md_is_rendered_from_the_tables():
    doc = (ROOT / "docs" / "settings.md").read_text()
    assert doc == settings_doc.settings_markdown(), \
        "regenerate: python -m stare.cli.settings_doc settings > docs/settings.md"
    for rows in (ALGO_SETTINGS, LOCAL_SETTINGS, GPU_SETTINGS):
        for s in rows:
            assert f"| `{s.name}` | {s.type.__name__} |" in doc, s.name
    assert doc.count("| `seed` |") == 2  # one local, one GPU row: each table lists its own


@pytest.mark.parametrize("row, raw, value", [
    (ALGO_SCHEMA["w"], "2", 2.0), (ALGO_SCHEMA["clip_ratio"], "1e-6", 1e-6), (ALGO_SCHEMA["dual_clip"], "null", None),
    (ALGO_SCHEMA["dual_clip"], "", None), (ALGO_SCHEMA["agg"], "token-mean", "token-mean"),
    (ALGO_SCHEMA["std_norm"], "false", False), (ALGO_SCHEMA["max_gen_rounds"], "3", 3),
    (ALGO_SCHEMA["variant"], "123", "123"), (ALGO_SCHEMA["w"], "x", "x"), (ALGO_SCHEMA["w"], "true", True),
])
def test_parse_reads_set_text_by_the_rows_type_without_checking(row, raw, value):
    got = row.parse(raw)
    assert got == value and type(got) is type(value)


def test_set_values_are_typed_by_the_rows():
    algo = resolve("tiny-cpu", "stare", ["w=2", "dual_clip=null", "clip_ratio=1e-6", "std_norm=false"])["algo"]
    assert (algo["w"], algo["dual_clip"], algo["clip_ratio"], algo["std_norm"]) == (2.0, None, 1e-6, False)
    assert isinstance(algo["w"], float)
    gpu = resolve("qwen-7b-short-cot", "grpo", ["lr=2", "nodes=1"])["settings"]
    assert gpu["lr"] == 2.0 and isinstance(gpu["lr"], float)
    with pytest.raises(PresetError, match=r"--set w=x: expected int or float, got str"):
        resolve("tiny-cpu", "stare", ["w=x"])
    with pytest.raises(PresetError, match=r"--set dual_clip=x: expected int or float or null, got str"):
        resolve("tiny-cpu", "stare", ["dual_clip=x"])


@pytest.mark.parametrize("overrides, message", [
    (dict(std_norm=1), "std_norm must be true or false, got 1"),
    (dict(max_gen_rounds=1.5), "max_gen_rounds must be an integer, got 1.5"),
    (dict(w="x"), "w must be a number, got 'x'"),
    (dict(top_ratio=1.5), "top_ratio must be in \\[0, 1\\], got 1.5"),
    (dict(dual_clip=1.0), "dual_clip must be in \\(1, inf\\], got 1.0"),
])
def test_the_algorithm_table_checks_every_setting_in_its_own_words(overrides, message):
    with pytest.raises(ValueError, match=message):
        get_algorithm("grpo", **overrides)
