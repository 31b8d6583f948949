"""The algorithm settings as one table (``ALGO_SETTINGS``), and ``Setting``, the row every settings table uses.

A row is a setting's name, type, default, valid values (a range or choices) and a one-line meaning. From the
rows come the checks (``AlgoConfig.validate`` here; the local and GPU presets' own tables in
``stare_cli/local_schema.py`` and ``stare_cli/gpu_schema.py``), the parsing of ``--set key=value``
(``Setting.parse``), ``stare algos --settings`` and the generated docs/settings.md. ``ALGO_SETTINGS`` holds one
row per ``AlgoConfig`` field, in the same order (a test keeps them equal); the defaults of the named algorithms
stay in ``registry.ALGORITHMS``. Rules between settings (cov_high above cov_low, a token rule's own settings,
stare against token_rule, the controller's ranges) are ``AlgoConfig.validate``'s.

No torch here (``stare algos`` and ``stare presets`` read it and must stay fast), and no import of stare.cli.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from ._plain import (
    AGGREGATIONS,
    CONTROLLERS,
    KERNELS,
    MASK_DENOMINATORS,
    SCOPES,
    SELECTIONS,
    TELEMETRY,
    VARIANTS,
    check_choice,
    check_range,
)
from .token_rules import RULES, TOKEN_RULES

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


# THE algorithm settings: one row per AlgoConfig field, in its order. A default is what an AlgoConfig that leaves
# the setting out gets; each named algorithm sets its own (registry.ALGORITHMS, stare algos --settings).
_STARE_ONLY = "with stare: "
ALGO_SETTINGS: tuple[Setting, ...] = (
    # advantages and loss
    Setting("std_norm", bool, True, "divide group advantages by the group's reward std (false: Dr.GRPO's "
            "unnormalised advantages)"),
    Setting("clip_low", float, 0.2, "PPO clip below: the ratio may fall to 1 - clip_low", low=0, high=1),
    Setting("clip_high", float, 0.2, "PPO clip above: the ratio may rise to 1 + clip_high (DAPO's clip-higher: 0.28)",
            low=0),
    Setting("dual_clip", float, None, "dual clip: an A < 0 token's loss is capped at dual_clip x |A| (null: off)",
            low=1, low_open=True, nullable=True),
    Setting("agg", str, "token-mean", "how token losses become one loss", choices=AGGREGATIONS, label="aggregation"),
    # DAPO's reward-side settings
    Setting("dynamic_sampling", bool, False, "drop prompts whose samples all got the same reward and sample more "
            "(DAPO)"),
    Setting("max_gen_rounds", int, 10, "dynamic sampling: generation rounds per step before training on what there "
            "is", low=1),
    Setting("overlong_shaping", bool, False, "penalise responses that reach the last overlong_buffer_len tokens of "
            "the limit (DAPO)"),
    Setting("overlong_buffer_len", int, 4096, "overlong shaping: length of the penalised zone before the response "
            "limit, in tokens", low=0, valid_text="integer >= 0, at most the response limit"),
    Setting("overlong_penalty", float, 1.0, "overlong shaping: the penalty at the limit (it grows linearly across "
            "the zone)", low=0),
    # STARE (used only when stare is true)
    Setting("stare", bool, False, "reweight selected tokens' advantages (STARE); false: a plain baseline"),
    Setting("selection", str, "quantile", "which tokens STARE reweights: quantile (top share by surprisal, the "
            "paper) or phi (sign of the entropy sensitivity)", choices=SELECTIONS),
    Setting("variant", str, "O1", "O1: weight W on selected A > 0 tokens only; C2: also weight M on selected A < 0 "
            "tokens", choices=VARIANTS),
    Setting("top_ratio", float, 0.1, "share of the A > 0 (and A < 0) tokens selected by surprisal, the paper's P",
            low=0, high=1),
    Setting("w", float, 1.1, "weight on the selected A > 0 tokens (raises entropy), the paper's W",
            valid_text=_STARE_ONLY + "number > 0 (adaptive paper gate: in [1, w_max]; band gate: >= 1)"),
    Setting("m", float, 0.9, "weight on the selected A < 0 tokens (C2), the paper's M",
            valid_text=_STARE_ONLY + "number > 0 (adaptive paper gate: in [m_min, 1]; band gate: in (0, 1])"),
    Setting("damp", float, 1.0, "phi selection: weight on the entropy-lowering A > 0 tokens (1: untouched)",
            low=0, low_open=True, valid_text="number > 0 (band gate: in (0, 1])"),
    Setting("phi_cap", float, None, "phi selection: keep only this top share by Phi (null: every token with the "
            "right sign)", low=0, high=1, nullable=True),
    Setting("phi_tol", float, 0.0, "phi selection: within this share of the step's mean |A Phi| of zero, a token's "
            "weight moves linearly between the two the sign of Phi picks from (0: the sign decides alone)", low=0),
    Setting("scope", str, "global", "where the selection is made: global (the step's whole batch) or micro_batch "
            "(the reference's rule)", choices=SCOPES),
    Setting("controller", str, "paper", "the entropy gate: paper (on while entropy < target_entropy) or band "
            "(proportional, band_low..band_high)", choices=CONTROLLERS),
    Setting("target_entropy", float, 0.3, "paper gate: reweighting is on while the batch entropy is below this",
            valid_text=_STARE_ONLY + "number > 0"),
    Setting("adaptive", bool, False, "paper gate: move W and M by alpha each step towards the target (within w_max, "
            "m_min)"),
    Setting("alpha", float, 0.01, "adaptive paper gate: step size of W and M per RL step",
            valid_text=_STARE_ONLY + "number >= 0"),
    Setting("w_max", float, 1.5, "adaptive paper gate: the largest W", valid_text=_STARE_ONLY + "number >= 1"),
    Setting("m_min", float, 0.5, "adaptive paper gate: the smallest M", valid_text=_STARE_ONLY + "number in (0, 1]"),
    Setting("band_low", float, 0.3, "band gate: full strength when the batch entropy is at or below this",
            valid_text=_STARE_ONLY + "number > 0, at most band_high"),
    Setting("band_high", float, 0.45, "band gate: top of the band; above it the gate is off (or pushes down with "
            "two_sided)", valid_text=_STARE_ONLY + "number > 0"),
    Setting("band_target", float, None, "band gate: strength starts below this (null: band_high)", nullable=True,
            valid_text=_STARE_ONLY + "number in [band_low, band_high], or null"),
    Setting("gain", float, 1.0, "band gate: strength per unit of shortfall (1: full strength exactly at band_low)",
            valid_text=_STARE_ONLY + "number > 0"),
    Setting("two_sided", bool, False, "band gate: above band_high, push entropy down (mirrored selection)"),
    # every algorithm
    Setting("telemetry", str, "full", "what each step logs: full (entropy, shares, Phi forecasts), entropy (batch "
            "entropy only) or off", choices=TELEMETRY),
    Setting("stats_kernel", str, "auto", "kernel for the per-token entropy and Phi: auto (fused Triton on CUDA, eager "
            "torch elsewhere), torch, triton, compiled (torch.compile fuses them on any device; a compilation per "
            "process) or cpp (a C++ loop for the CPU, about 3.5x torch there; built once per machine with its C++ "
            "compiler)", choices=KERNELS),
    # the entropy baselines' token rules (token_rules.py)
    Setting("token_rule", str, "none", "an entropy baseline's token rule, once per step over the whole batch (none: "
            "no rule); " + "; ".join(f"{r.name} reads {', '.join(r.settings)}" for r in RULES.values()
                                     if r.active), choices=TOKEN_RULES),
    Setting("clip_ratio", float, 2e-4, "clip-cov: share of the response tokens whose gradient is dropped (random "
            "among the candidates)", low=0, high=1, low_open=True),
    Setting("cov_low", float, 1.0, "clip-cov: candidates have a log-prob/advantage covariance above this"),
    Setting("cov_high", float, 5.0, "clip-cov: candidates have a log-prob/advantage covariance below this",
            valid_text="number > cov_low"),
    Setting("k_ratio", float, 2e-3, "kl-cov: share of the response tokens, the top ones by covariance, that get the "
            "|log-ratio| penalty", low=0, high=1, low_open=True),
    # not "kl_coef": that is the GPU presets' reference-KL run setting
    Setting("kl_cov_coef", float, 1.0, "kl-cov: coefficient of the |log p - log p_old| penalty (the surrogate is "
            "unclipped)", low=0),
    Setting("mask_denominator", str, "all", "80-20: the loss divided by the selected tokens (selected, the 80/20 "
            "paper's code) or by every response token (all, TRL's choice)", choices=MASK_DENOMINATORS),
)
ALGO_SCHEMA: dict[str, Setting] = schema(ALGO_SETTINGS)
