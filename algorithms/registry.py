"""The algorithm settings (``AlgoConfig``, each field a setting with its valid values and meaning) and the named
algorithms: what a user types after ``--algo``, mapped to a full set of settings.

Every setting can be overridden (``get_algorithm("stare", w=1.5)``); ``AlgoConfig.validate`` checks the
result against the settings' table (``ALGO_SETTINGS``, read off the fields) and the rules between settings.
Engines read an ``AlgoConfig`` and nothing else about the algorithm; ``AlgoConfig.rule`` is its token rule
(``token_rules.py``).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

# no torch import on this path (stare algos / presets stay fast): the choices' names live in _plain
from ._plain import (
    AGGREGATIONS,
    CONTROLLERS,
    KERNELS,
    MASK_DENOMINATORS,
    STEER_MAPPINGS,
    SCOPES,
    SELECTIONS,
    TELEMETRY,
    VARIANTS,
    check_range,
)
from .controllers import BandGate, EntropyCoef, PaperGate
from .settings import Setting, schema, setting, settings_of

# The token rules of the entropy baselines and STARE's relatives, computed once per step over the whole batch
# (token_rules.py: its RULES registry, and any registered with register_token_rule); AlgoConfig.rule is the one a
# config names.
from .token_rules import RULES, TOKEN_RULES, TokenRule, get_token_rule

_STARE_ONLY = "with stare: "  # the valid values of a setting that only STARE's controller checks


@dataclass(frozen=True)
class AlgoConfig:
    """One algorithm's settings. Each field but name and description is a setting, defined once, here:
    ``setting(default, meaning, valid values)`` (``settings.setting``), its type the field's (``X | None``: null is
    valid too). ``ALGO_SETTINGS`` (below) reads the rows off the fields, for ``validate``, ``--set``,
    ``stare algos --settings`` and docs/settings.md. A default is what an AlgoConfig that leaves the setting out
    gets; each named algorithm sets its own (``ALGORITHMS``)."""
    name: str
    description: str = ""
    # advantages and loss
    std_norm: bool = setting(True, "divide group advantages by the group's reward std (false: Dr.GRPO's unnormalised "
                             "advantages)")
    clip_low: float = setting(0.2, "PPO clip below: the ratio may fall to 1 - clip_low", low=0, high=1)
    clip_high: float = setting(0.2, "PPO clip above: the ratio may rise to 1 + clip_high (DAPO's clip-higher: 0.28)",
                               low=0)
    dual_clip: float | None = setting(None, "dual clip: an A < 0 token's loss is capped at dual_clip x |A| (null: "
                                      "off)", low=1, low_open=True)
    agg: str = setting("token-mean", "how token losses become one loss", choices=AGGREGATIONS, label="aggregation")
    # DAPO reward-side settings
    dynamic_sampling: bool = setting(False, "drop prompts whose samples all got the same reward and sample more "
                                     "(DAPO)")
    max_gen_rounds: int = setting(10, "dynamic sampling: generation rounds per step before training on what there is",
                                  low=1)
    overlong_shaping: bool = setting(False, "penalise responses that reach the last overlong_buffer_len tokens of "
                                     "the limit (DAPO)")
    overlong_buffer_len: int = setting(4096, "overlong shaping: length of the penalised zone before the response "
                                       "limit, in tokens", low=0,
                                       valid_text="integer >= 0, at most the response limit")
    overlong_penalty: float = setting(1.0, "overlong shaping: the penalty at the limit (it grows linearly across the "
                                      "zone)", low=0)
    # STARE (ignored unless stare is True)
    stare: bool = setting(False, "reweight selected tokens' advantages (STARE); false: a plain baseline")
    selection: str = setting("quantile", "which tokens STARE reweights: quantile (top share by surprisal, the paper) "
                             "or phi (sign of the entropy sensitivity)", choices=SELECTIONS)
    variant: str = setting("O1", "O1: weight W on selected A > 0 tokens only; C2: also weight M on selected A < 0 "
                           "tokens", choices=VARIANTS)
    top_ratio: float = setting(0.1, "share of the A > 0 (and A < 0) tokens selected by surprisal, the paper's P",
                               low=0, high=1)
    w: float = setting(1.1, "weight on the selected A > 0 tokens (raises entropy), the paper's W",
                       valid_text=_STARE_ONLY + "number > 0 (adaptive paper gate: in [1, w_max]; band gate: >= 1)")
    m: float = setting(0.9, "weight on the selected A < 0 tokens (C2), the paper's M",
                       valid_text=_STARE_ONLY + "number > 0 (adaptive paper gate: in [m_min, 1]; band gate: "
                                                "in (0, 1])")
    damp: float = setting(1.0, "phi selection: weight on the entropy-lowering A > 0 tokens (1: untouched)", low=0,
                          low_open=True, valid_text="number > 0 (band gate: in (0, 1])")
    phi_cap: float | None = setting(None, "phi selection: keep only this top share by Phi (null: every token with "
                                    "the right sign)", low=0, high=1)
    phi_tol: float = setting(0.0, "phi selection: within this share of the step's mean |A Phi| of zero, a token's "
                             "weight moves linearly between the two the sign of Phi picks from (0: the sign decides "
                             "alone)", low=0)
    scope: str = setting("global", "where the selection is made: global (the step's whole batch) or micro_batch (the "
                         "reference's rule)", choices=SCOPES)
    controller: str = setting("paper", "the entropy gate: paper (on while entropy < target_entropy) or band "
                              "(proportional, band_low..band_high)", choices=CONTROLLERS)
    target_entropy: float = setting(0.3, "paper gate: reweighting is on while the batch entropy is below this",
                                    valid_text=_STARE_ONLY + "number > 0")
    adaptive: bool = setting(False, "paper gate: move W and M by alpha each step towards the target (within w_max, "
                             "m_min)")
    alpha: float = setting(0.01, "adaptive paper gate: step size of W and M per RL step",
                           valid_text=_STARE_ONLY + "number >= 0")
    w_max: float = setting(1.5, "adaptive paper gate: the largest W", valid_text=_STARE_ONLY + "number >= 1")
    m_min: float = setting(0.5, "adaptive paper gate: the smallest M", valid_text=_STARE_ONLY + "number in (0, 1]")
    band_low: float = setting(0.3, "band gate: full strength when the batch entropy is at or below this",
                              valid_text=_STARE_ONLY + "number > 0, at most band_high")
    band_high: float = setting(0.45, "band gate: top of the band; above it the gate is off (or pushes down with "
                               "two_sided)", valid_text=_STARE_ONLY + "number > 0")
    band_target: float | None = setting(None, "band gate: strength starts below this (null: band_high)",
                                        valid_text=_STARE_ONLY + "number in [band_low, band_high], or null")
    gain: float = setting(1.0, "band gate: strength per unit of shortfall (1: full strength exactly at band_low)",
                          valid_text=_STARE_ONLY + "number > 0")
    two_sided: bool = setting(False, "band gate: above band_high, push entropy down (mirrored selection)")
    # every algorithm
    telemetry: str = setting("full", "what each step logs: full (entropy, shares, Phi forecasts), entropy (batch "
                             "entropy only) or off", choices=TELEMETRY)
    stats_kernel: str = setting("auto", "kernel for the per-token entropy and Phi: auto (fused Triton on CUDA, eager "
                                "torch elsewhere), torch, triton, compiled (torch.compile fuses them on any device; "
                                "a compilation per process) or cpp (a C++ loop for the CPU, about 3.5x torch there; "
                                "built once per machine with its C++ compiler)", choices=KERNELS)
    # the entropy baselines' token rule (token_rules.py) and the settings the rules read (80-20 reuses top_ratio)
    token_rule: str = setting("none", "an entropy baseline's token rule, once per step over the whole batch (none: "
                              "no rule); " + "; ".join(f"{r.name} reads {', '.join(r.settings)}"
                                                       for r in RULES.values() if r.active), choices=TOKEN_RULES)
    clip_ratio: float = setting(2e-4, "clip-cov: share of the response tokens whose gradient is dropped (random "
                                "among the candidates)", low=0, high=1, low_open=True)
    cov_low: float = setting(1.0, "clip-cov: candidates have a log-prob/advantage covariance above this")
    cov_high: float = setting(5.0, "clip-cov: candidates have a log-prob/advantage covariance below this",
                              valid_text="number > cov_low")
    k_ratio: float = setting(2e-3, "kl-cov: share of the response tokens, the top ones by covariance, that get the "
                             "|log-ratio| penalty", low=0, high=1, low_open=True)
    kl_cov_coef: float = setting(1.0, "kl-cov: coefficient of the |log p - log p_old| penalty (the surrogate is "
                                 "unclipped)", low=0)
    mask_denominator: str = setting("all", "80-20: the loss divided by the selected tokens (selected, the 80/20 "
                                    "paper's code) or by every response token (all, TRL's choice)",
                                    choices=MASK_DENOMINATORS)
    entropy_adv_alpha: float = setting(0.4, "entropy-adv: the shaping term's scale, A + min(alpha H, |A| / kappa) "
                                       "with H the old policy's token entropy", low=0, low_open=True)
    entropy_adv_kappa: float = setting(2.0, "entropy-adv: the term is at most |A| / kappa (kappa > 1: no advantage "
                                       "changes sign)", low=1, low_open=True)
    dg_eta: float = setting(1.0, "dg: the delight gate's temperature, sigmoid(A (-log p) / eta) with log p the old "
                            "policy's log-prob of the sampled token", low=0, low_open=True)
    steer_mapping: str = setting("exp", "steer: how the size of a token's estimated entropy change |A (1 - p) (log p + "
                                 "H)| becomes its weight: exp (exp(-k |change|) down to steer_weight_min for the "
                                 "step's largest, at most 1) or linear (steer_weight_max for the smallest to "
                                 "steer_weight_min for the largest)", choices=STEER_MAPPINGS)
    steer_weight_min: float = setting(0.8, "steer: the weight of the step's largest estimated entropy change",
                                      valid_text="number in (0, 1) with steer_mapping exp; > 0 with linear")
    steer_weight_max: float = setting(1.2, "steer, linear mapping only: the weight of the step's smallest estimated "
                                      "entropy change", valid_text="number > steer_weight_min")
    # the entropy bonus in the loss (any algorithm; entropy-adaptive adapts its coefficient: controllers.EntropyCoef)
    entropy_coef: float = setting(0.0, "entropy bonus: the loss minus this times the current policy's token entropy "
                                  "(aggregated as the loss; 0: no bonus); adaptive: the value before the first step",
                                  low=0)
    entropy_adaptive: bool = setting(False, "entropy bonus: adapt entropy_coef each step towards entropy_target "
                                     "(Skywork-OR1's adaptive entropy control, TRL's use_adaptive_entropy)")
    entropy_target: float = setting(0.2, "adaptive entropy bonus: the target batch entropy; the coefficient rises at "
                                    "or below it (and applies), falls above it (and does not)", low=0, low_open=True)
    entropy_coef_delta: float = setting(0.005, "adaptive entropy bonus: the coefficient's change per RL step", low=0)
    entropy_coef_min: float = setting(0.0, "adaptive entropy bonus: the smallest coefficient", low=0)
    entropy_coef_max: float = setting(1.0, "adaptive entropy bonus: the largest coefficient",
                                      valid_text="number >= entropy_coef_min (and >= entropy_coef when adaptive)")

    def validate(self) -> "AlgoConfig":
        """Every setting against its row of ``ALGO_SETTINGS`` (type, range, choices), then the rules between
        settings; returns self, or raises ValueError naming the setting, the value and what is valid."""
        for row in ALGO_SETTINGS:
            row.require(getattr(self, row.name))
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
        if self.stare and self.controller == "band":  # the rules between band settings, in the settings' names
            if self.band_low > self.band_high:
                raise ValueError(f"band_low {self.band_low!r} must be at most band_high {self.band_high!r} (the band "
                                 "gate's bottom and top); lower band_low or raise band_high")
            if self.band_target is not None:
                check_range("band_target", self.band_target, self.band_low, self.band_high)
        if self.stare:
            self.make_controller()  # the controller validates W, M, target and band
        self._entropy_coef()  # the bonus's coefficient range (checked whether or not there is a bonus)
        return self

    @property
    def entropy_bonus(self) -> bool:
        """True when the loss has an entropy bonus (a coefficient above 0, or an adaptive one)."""
        return self.entropy_adaptive or self.entropy_coef > 0

    def make_entropy_coef(self) -> EntropyCoef | None:
        """The entropy bonus's coefficient controller (None without a bonus)."""
        return self._entropy_coef() if self.entropy_bonus else None

    def _entropy_coef(self) -> EntropyCoef:
        return EntropyCoef(self.entropy_coef, adaptive=self.entropy_adaptive, target=self.entropy_target,
                           delta=self.entropy_coef_delta, coef_min=self.entropy_coef_min,
                           coef_max=self.entropy_coef_max)

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
        changes no weight and no logged number but its own echo (``stare/m``) (a test runs ``stare_step`` both
        ways); ``stare run --sweep`` refuses to sweep one. A setting not listed may still be inert in some states
        (W while the gate is closed): this lists what the settings alone decide."""
        out = {}
        if not self.entropy_adaptive:
            out.update({name: "only the adaptive entropy bonus uses it (entropy_adaptive is false)"
                        for name in _ADAPTIVE_BONUS_SETTINGS})
        if not self.stare:  # but what its token rule reads (80-20's top_ratio)
            why = f"only STARE algorithms use it (stare is off for {self.name})"
            return {**out, **{name: why for name in STARE_OWN_SETTINGS if name not in self.rule.settings}}
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
        reads it (80-20's selection, entropy-adv's term), the adaptive bonus's input, or any telemetry beyond
        "off"."""
        return self.stare or self.rule.needs_entropy or self.entropy_bonus or self.telemetry != "off"

    def to_dict(self) -> dict:
        return asdict(self)


ALGO_SETTINGS: tuple[Setting, ...] = settings_of(AlgoConfig)  # THE algorithm settings, in the fields' order
ALGO_SCHEMA: dict[str, Setting] = schema(ALGO_SETTINGS)
SETTING_NAMES = tuple(f.name for f in fields(AlgoConfig) if f.name not in ("name", "description"))
# what AlgoConfig.unused_settings names: the "# STARE" block of AlgoConfig (all of it for a baseline), each gate's own
STARE_OWN_SETTINGS = SETTING_NAMES[SETTING_NAMES.index("stare") + 1:SETTING_NAMES.index("telemetry")]
_PAPER_SETTINGS = ("target_entropy", "adaptive", "alpha", "w_max", "m_min")
_BAND_SETTINGS = ("band_low", "band_high", "band_target", "gain", "two_sided", "damp")
_ADAPTIVE_BONUS_SETTINGS = ("entropy_target", "entropy_coef_delta", "entropy_coef_min", "entropy_coef_max")
BONUS_SETTINGS = ("entropy_coef", "entropy_adaptive", *_ADAPTIVE_BONUS_SETTINGS)  # the entropy bonus's settings

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
        AlgoConfig("entropy-adaptive", "Skywork-OR1's adaptive entropy control (Skywork-OR1 report 2025; TRL's "
                   "use_adaptive_entropy): an entropy bonus whose coefficient starts at 0 and moves by 0.005 per "
                   "step within [0, 1], up while the batch entropy is at or below 0.2 (and then applied), down above "
                   "it; token-mean, clip 0.2/0.2, no dual clip, dynamic sampling", entropy_adaptive=True,
                   clip_low=0.2, clip_high=0.2, **_COV_BASE),
        AlgoConfig("entropy-adv", "Entropy-based advantage shaping (Cheng et al. 2025, Reasoning with Exploration: "
                   "An Entropy Perspective): A + min(0.4 H, |A| / 2) per token, H the old policy's entropy "
                   "(detached); GRPO's clip 0.2/0.2 with a token-mean loss", token_rule="entropy-adv",
                   clip_low=0.2, clip_high=0.2, agg="token-mean"),
        AlgoConfig("dg", "Delightful Policy Gradient (Osband 2026): each token's loss times sigmoid(A (-log p) / 1), "
                   "the sigmoid of advantage times surprisal (the old policy's log-prob, detached); GRPO's clip "
                   "0.2/0.2 with a token-mean loss", token_rule="dg", clip_low=0.2, clip_high=0.2, agg="token-mean"),
        AlgoConfig("steer", "STEER (Hao et al. 2025, Rethinking Entropy Interventions in RLVR): each token's loss "
                   "times exp(-k |A (1 - p) (log p + H)|), its estimated entropy change, clamped to [0.8, 1] with the "
                   "step's largest at 0.8; GRPO advantages, clip 0.2/0.28, dual clip 10, token-mean, no dynamic "
                   "sampling", token_rule="steer", **{**_DAPO_BASE, "dynamic_sampling": False}),
    )
}


def unknown_algorithm(name: str) -> str:
    """The one line for a name that is no algorithm of the registry, listing the valid ones (every check of an
    algorithm name, in the registry and on the command line, says this)."""
    return f"unknown algorithm {name!r}; valid algorithms: {', '.join(ALGORITHMS)}"


def parse_algorithm_list(text: str) -> list[str]:
    """The algorithms of a comma-separated list (``stare run --algos``, the ``algos`` setting); ``ValueError`` (one
    line) for none, an unknown one or one named twice."""
    arms = [a.strip() for a in text.split(",") if a.strip()]
    if not arms:
        raise ValueError(f"no algorithm named; give one or more, comma-separated, of: {', '.join(ALGORITHMS)}")
    unknown = [a for a in arms if a not in ALGORITHMS]
    if unknown:
        raise ValueError(unknown_algorithm(unknown[0]))
    if len(set(arms)) != len(arms):
        raise ValueError(f"lists an algorithm twice: {text!r}")
    return arms


def get_algorithm(name: str, **overrides) -> AlgoConfig:
    """The named algorithm's settings with ``overrides`` applied, validated.

    Raises ``ValueError`` naming an unknown algorithm or setting and listing the valid ones.
    """
    if name not in ALGORITHMS:
        raise ValueError(unknown_algorithm(name))
    unknown = [k for k in overrides if k not in SETTING_NAMES]
    if unknown:
        raise ValueError(f"unknown algorithm setting {unknown[0]!r}; valid settings: {', '.join(SETTING_NAMES)}")
    return replace(ALGORITHMS[name], **overrides).validate()
