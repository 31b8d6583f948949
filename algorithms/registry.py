"""Named algorithms: what a user types after ``--algo``, mapped to a full set of settings.

Every setting can be overridden (``get_algorithm("stare", w=1.5)``); ``AlgoConfig.validate`` checks the
result against the settings' table (``settings.ALGO_SETTINGS``) and the rules between settings. Engines read an
``AlgoConfig`` and nothing else about the algorithm; ``AlgoConfig.rule`` is its token rule (``token_rules.py``).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

# no torch import on this path (stare algos / presets stay fast): the choices' names live in _plain
from ._plain import check_range
from .controllers import BandGate, PaperGate
from .settings import ALGO_SCHEMA, ALGO_SETTINGS

# The token rules of the entropy baselines, computed once per step over the whole batch (token_rules.py, the
# registry: none, clip-cov, kl-cov, 80-20 and any registered with register_token_rule); AlgoConfig.rule is the one a
# config names.
from .token_rules import RULES, TokenRule, get_token_rule


@dataclass(frozen=True)
class AlgoConfig:
    """One algorithm's settings. Each field but name and description has its row in ``settings.ALGO_SETTINGS``
    (same order, type and default; a test keeps them equal): its valid values and meaning are there."""
    name: str
    description: str = ""
    # advantages and loss
    std_norm: bool = True
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    agg: str = "token-mean"
    # DAPO reward-side settings
    dynamic_sampling: bool = False
    max_gen_rounds: int = 10
    overlong_shaping: bool = False
    overlong_buffer_len: int = 4096
    overlong_penalty: float = 1.0
    # STARE (ignored unless stare is True)
    stare: bool = False
    selection: str = "quantile"
    variant: str = "O1"
    top_ratio: float = 0.1
    w: float = 1.1
    m: float = 0.9
    damp: float = 1.0
    phi_cap: float | None = None
    phi_tol: float = 0.0
    scope: str = "global"
    controller: str = "paper"
    target_entropy: float = 0.3
    adaptive: bool = False
    alpha: float = 0.01
    w_max: float = 1.5
    m_min: float = 0.5
    band_low: float = 0.3
    band_high: float = 0.45
    band_target: float | None = None
    gain: float = 1.0
    two_sided: bool = False
    # every algorithm
    telemetry: str = "full"
    stats_kernel: str = "auto"
    # the entropy baselines' token rule (token_rules.py) and the settings the rules read (80-20 reuses top_ratio)
    token_rule: str = "none"
    clip_ratio: float = 2e-4
    cov_low: float = 1.0
    cov_high: float = 5.0
    k_ratio: float = 2e-3
    kl_cov_coef: float = 1.0
    mask_denominator: str = "all"

    def validate(self) -> "AlgoConfig":
        """Every setting against its row of ``settings.ALGO_SETTINGS`` (type, range, choices), then the rules between
        settings; returns self, or raises ValueError naming the setting, the value and what is valid."""
        for setting in ALGO_SETTINGS:
            setting.require(getattr(self, setting.name))
        rule = self.rule
        for other in RULES.values():  # a rule's own settings keep their default under any other rule
            for key in other.exclusive:
                default = ALGO_SCHEMA[key].default
                if other is not rule and getattr(self, key) != default:
                    raise ValueError(f"{key} {getattr(self, key)!r} applies to token_rule {other.name} only "
                                     f"(this algorithm's is {self.token_rule!r}); set {key} to {default}")
        check_range("cov_high", self.cov_high, self.cov_low, None, low_open=True)  # Clip-Cov's band is not empty
        rule.validate(self)
        if self.stare and rule.active:
            raise ValueError(f"token_rule {self.token_rule!r} is a baseline's rule and cannot be combined with stare; "
                             "set token_rule to none or stare to false")
        if self.stare:
            self.make_controller()  # the controller validates W, M, target and band
        return self

    def make_controller(self) -> PaperGate | BandGate | None:
        """The entropy controller these settings ask for (None for a baseline)."""
        if not self.stare:
            return None
        if self.controller == "paper":
            return PaperGate(self.target_entropy, self.w, self.m, adaptive=self.adaptive, alpha=self.alpha,
                             w_max=self.w_max, m_min=self.m_min)
        return BandGate(self.band_low, self.band_high, target=self.band_target, w=self.w, m=self.m,
                        damp=self.damp, gain=self.gain, two_sided=self.two_sided)

    def selection_kwargs(self) -> dict:
        """Fixed keyword arguments for ``stare_token_weights`` (the controller supplies gate/W/M/damp)."""
        return {"top_ratio": self.top_ratio, "variant": self.variant, "selection": self.selection,
                "phi_cap": self.phi_cap, "phi_tol": self.phi_tol}

    def unused_settings(self) -> dict[str, str]:
        """The STARE settings these settings make inert, each with why: every one of them for a baseline (but those
        its token rule reads), the other controller's (damp is the band gate's: the paper gate never damps), the
        adaptive gate's without ``adaptive``, M under O1, the Phi selection's under the quantile one. Changing one
        changes no weight and no logged number but its own echo (``stare/m``) (a test runs ``stare_step`` both ways); ``stare run --sweep``
        refuses to sweep one. A setting not listed may still be inert in some states (W while the gate is
        closed): this lists what the settings alone decide."""
        if not self.stare:  # but what its token rule reads (80-20's top_ratio)
            why = f"only STARE algorithms use it (stare is off for {self.name})"
            return {name: why for name in _STARE_SETTINGS if name not in self.rule.settings}
        out = {}
        if self.controller == "paper":
            out.update({name: "only the band controller uses it (controller is paper)" for name in _BAND_SETTINGS})
            if not self.adaptive:
                out.update({name: "only the adaptive paper gate uses it (adaptive is false)"
                            for name in ("alpha", "w_max", "m_min")})
        else:
            out.update({name: "only the paper gate uses it (controller is band)" for name in _PAPER_SETTINGS})
        if self.variant == "O1":
            out["m"] = "only variant C2 lowers A<0 tokens (variant is O1)"
        if self.selection == "quantile":
            out.update({name: "only the phi selection uses it (selection is quantile)"
                        for name in ("phi_cap", "phi_tol")})
        return out

    @property
    def needs_phi(self) -> bool:
        return self.stare and (self.selection == "phi" or self.damp != 1.0)

    @property
    def rule(self) -> TokenRule:
        """The token rule ``token_rule`` names (token_rules.py): what it reads, needs and computes."""
        return get_token_rule(self.token_rule)

    @property
    def unclipped(self) -> bool:
        """True when the surrogate is -A r for every token (no clip, no dual clip): the token rule's (kl-cov)."""
        return self.rule.unclipped

    @property
    def needs_entropy(self) -> bool:
        """True when the engine must compute the old policy's per-token entropy: STARE's gate, a token rule that
        reads it (80-20's selection), or any telemetry beyond "off"."""
        return self.stare or self.rule.needs_entropy or self.telemetry != "off"

    def to_dict(self) -> dict:
        return asdict(self)


SETTING_NAMES = tuple(f.name for f in fields(AlgoConfig) if f.name not in ("name", "description"))
# what AlgoConfig.unused_settings names: the "# STARE" block of AlgoConfig (all of it for a baseline), each gate's own
_STARE_SETTINGS = SETTING_NAMES[SETTING_NAMES.index("stare") + 1:SETTING_NAMES.index("telemetry")]
_PAPER_SETTINGS = ("target_entropy", "adaptive", "alpha", "w_max", "m_min")
_BAND_SETTINGS = ("band_low", "band_high", "band_target", "gain", "two_sided", "damp")

_DAPO_BASE = dict(clip_low=0.2, clip_high=0.28, dual_clip=10.0, agg="token-mean", dynamic_sampling=True)
# Clip-Cov / KL-Cov as the entropy paper's scripts (verl recipe/entropy, 7B): GRPO advantages, token-mean, group
# filtering (dynamic sampling), no overlong shaping; their loss functions apply no dual clip.
_COV_BASE = dict(dual_clip=None, agg="token-mean", dynamic_sampling=True)

ALGORITHMS: dict[str, AlgoConfig] = {
    cfg.name: cfg
    for cfg in (
        AlgoConfig("grpo", "GRPO: group-normalised advantages, symmetric clip 0.2, seq-mean-token-mean",
                   clip_low=0.2, clip_high=0.2, agg="seq-mean-token-mean"),
        AlgoConfig("dr-grpo", "Dr.GRPO: no std normalisation, sequence sums over a constant length",
                   std_norm=False, clip_low=0.2, clip_high=0.2, agg="seq-mean-token-sum-norm"),
        AlgoConfig("dapo", "DAPO: clip-higher 0.2/0.28, dual clip 10, token-mean, dynamic sampling, overlong shaping",
                   overlong_shaping=True, **_DAPO_BASE),
        AlgoConfig("stare", "STARE O1 as published: DAPO-style base without overlong shaping, W 1.1 on the top 10% "
                   "surprisal A>0 tokens while entropy < 0.3", stare=True, **_DAPO_BASE),
        AlgoConfig("stare-c2", "STARE C2 as published: also M 0.9 on the top 10% surprisal A<0 tokens",
                   stare=True, variant="C2", **_DAPO_BASE),
        AlgoConfig("stare-phi", "This project's variant: exact Phi-sign selection (C2: W 2 / M 0.05), majority "
                   "damping 0.2, band gate 0.30-0.45", stare=True, selection="phi", variant="C2", w=2.0, m=0.05,
                   damp=0.2, phi_tol=0.01,
                   controller="band", band_low=0.3, band_high=0.45, **_DAPO_BASE),
        AlgoConfig("clip-cov", "Clip-Cov (Cui et al. 2025, The Entropy Mechanism of RL for Reasoning LMs): drop the "
                   "gradient of a random 2e-4 share of the tokens with log-prob/advantage covariance in (1, 5); "
                   "clip 1/1, token-mean, dynamic sampling", token_rule="clip-cov", **_COV_BASE,
                   clip_low=1.0, clip_high=1.0),
        AlgoConfig("kl-cov", "KL-Cov (Cui et al. 2025, The Entropy Mechanism of RL for Reasoning LMs): unclipped "
                   "surrogate, |log-ratio| penalty (coef 1) on the top 2e-3 tokens by covariance; token-mean, "
                   "dynamic sampling", token_rule="kl-cov", **_COV_BASE, clip_low=0.2, clip_high=0.2),
        AlgoConfig("80-20", "80/20 (Wang et al. 2025, Beyond the 80/20 Rule): policy gradient only through the top "
                   "20% tokens by entropy, on DAPO's settings", token_rule="80-20", top_ratio=0.2,
                   mask_denominator="selected", overlong_shaping=True, **_DAPO_BASE),
    )
}


def get_algorithm(name: str, **overrides) -> AlgoConfig:
    """The named algorithm's settings with ``overrides`` applied, validated.

    Raises ``ValueError`` naming an unknown algorithm or setting and listing the valid ones.
    """
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; valid algorithms: {', '.join(ALGORITHMS)}")
    unknown = [k for k in overrides if k not in SETTING_NAMES]
    if unknown:
        raise ValueError(f"unknown algorithm setting {unknown[0]!r}; valid settings: {', '.join(SETTING_NAMES)}")
    return replace(ALGORITHMS[name], **overrides).validate()
