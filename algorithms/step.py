"""STARE's once-per-step block, shared by both engines: entropy -> controller -> selection -> telemetry.

``stare_step`` runs once per RL step, after the old policy's no-grad pass and before any update. The local
engine (``stare_cli/local/trainer.py``) and the OpenRLHF plugin (``stare_cli/openrlhf_backend/plugin.py``) both
call it, so the two log the same numbers under the same names. In order:

1. the batch entropy: the mean token entropy of the old policy over the step's response tokens, numerator and
   token count summed over the data-parallel ``group`` (so every rank feeds the controller the same number);
   the weight-independent telemetry (quadrants, the unweighted forecast) rides in the same all-reduce and the
   same host read, which is the one read the controller needs;
2. the controller's update (``controller.update``), once;
3. the weights (gate on only): ``stare_token_weights`` once over the whole step's batch, exact across ranks
   (``scope="global"``), or separately inside each micro-batch the engine will train on (``scope="micro_batch"``,
   the reference implementation's rule; the engine passes its micro-batches, or selects inside them later);
   for an entropy baseline or a relative of STARE (``cfg.rule``, the token rule ``cfg.token_rule`` names, one of
   ``token_rules.RULES``) its rule instead, always once over the whole step's batch and whatever the telemetry
   setting: per-token weights (a 0/1 mask for clip-cov and 80-20, smooth weights for entropy-adv, dg and steer) or
   per-token penalty coefficients (kl-cov);
4. the weight-dependent telemetry (one more all-reduce and host read, only when there are weights or a penalty);
5. the measured change of the batch entropy since the previous step, beside what that step forecast
   (``StepMemory`` carries the previous step's two numbers).

Every share is a numerator and a denominator summed over ranks, then divided (in float32, as ``masked_mean``),
so one process gives exactly ``masked_mean`` / ``quadrant_stats`` / ``reweight_stats`` and R ranks give the
same numbers as one process holding all their tokens (up to float32 summation order).

``METRICS`` is the canonical list of the telemetry names with their meanings (``metrics_markdown`` renders it as
a table); both engines log these names
(OpenRLHF as ``train/<name>``, the local engine in ``metrics.jsonl``). ``LEGACY_NAMES`` maps the names older
local runs wrote (``entropy``, ``quadrant/*``, ...) to these; ``upgrade_metric_names`` applies it to a record.

Pure torch: no import of OpenRLHF, Ray or vLLM; ``torch.distributed`` only when a ``group`` is given.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import NamedTuple, Sequence

import torch

from ._checks import broadcast_advantages, check_same_shape
from .controllers import ControllerState
from .entropy import EntropyStats, entropy_forecast_sums, quadrant_sums
from .registry import AlgoConfig
from .selection import reweight_sums, stare_token_weights
from .token_rules import RULES

P = "stare/"

# (name, one-line meaning). Engine column: "both" unless the meaning says otherwise.
METRICS: tuple[tuple[str, str], ...] = (
    # the controller's decision (STARE algorithms only; ControllerState.as_metrics)
    ("stare/gate_on", "1 when the entropy gate is on this step (the weights apply), else 0"),
    ("stare/strength", "controller strength in [0, 1] (the paper's gate: 1 on, 0 off)"),
    ("stare/w", "effective weight W on the selected A > 0 tokens this step"),
    ("stare/m", "effective weight M on the selected A < 0 tokens this step (C2)"),
    ("stare/damp", "effective weight on the A > 0, Phi < 0 tokens this step (1: no damping)"),
    ("stare/direction", "+1 the rule raises entropy, -1 it lowers it (two-sided band gate)"),
    ("stare/target", "the controller's target entropy"),
    # the batch entropy and its change
    ("stare/entropy", "old policy's mean token entropy over the step's response tokens, all ranks (the controller's input)"),
    ("stare/tokens", "number of response tokens in the step's batch, all ranks"),
    ("stare/entropy_change", "this step's stare/entropy minus the previous step's (absent on a run's first step)"),
    ("stare/entropy_change_forecast", "the previous step's stare/entropy_forecast, to read beside stare/entropy_change"),
    ("stare/entropy_change_same_batch", "local engine only: mean entropy of this step's batch under the updated policy "
     "minus under the old one (needs a second forward over the batch; the OpenRLHF plugin does not pay for it)"),
    ("stare/entropy_forecast", "first-order forecast of the entropy change per unit step: token mean of w A Phi "
     "(absent when the weights are chosen later, inside micro-batches the engine forms after this step)"),
    ("stare/entropy_forecast_base", "the same forecast without the weights: token mean of A Phi"),
    # the weights
    ("stare/positive_reweight_ratio", "share of the A > 0 response tokens whose weight is not 1"),
    ("stare/negative_reweight_ratio", "share of the A < 0 response tokens whose weight is not 1"),
    ("stare/mean_weight", "mean weight over the response tokens (1 with the gate off or for a baseline)"),
    ("stare/boosted_phi_pos_share", "of the response tokens with weight > 1, the share with Phi > 0 (absent when "
     "none): does the selection hit entropy-raising tokens?"),
    ("stare/lowered_phi_pos_share", "of the response tokens with weight < 1 or a KL-Cov penalty > 0, the share with "
     "Phi > 0 (absent when none)"),
    ("stare/masked_share", "share of the response tokens whose weight is 0 (clip-cov, 80-20; 0 for the other "
     "algorithms)"),
    ("stare/penalised_share", "kl-cov: share of the response tokens with a penalty coefficient > 0 (absent for the "
     "other algorithms)"),
    # each token rule's own (``TokenRule.telemetry``, in the registry's order: entropy-adv, dg, steer)
    *((P + m.name, f"{rule.name}: {m.meaning}") for rule in RULES.values() for m in rule.telemetry),
    # the entropy bonus (entropy_coef > 0 or entropy_adaptive: entropy-adaptive)
    ("stare/entropy_coef", "the entropy bonus's coefficient applied this step (0 while the adaptive bonus is off)"),
    ("stare/entropy_bonus", "the bonus subtracted from the loss this step: the coefficient times the current "
     "policy's token entropy, aggregated as the loss is (local engine: the optimizer steps' mean; OpenRLHF: times "
     "its own logged entropy_loss)"),
    ("stare/entropy_bonus_share", "|stare/entropy_bonus| / (|policy loss| + |stare/entropy_bonus|): the bonus's "
     "share of the loss's size"),
    ("stare/micro_batch_mean_weight", "OpenRLHF plugin, scope micro_batch only: each micro-batch's mean weight, "
     "averaged over the micro-batches by OpenRLHF's status reduction (weighted by their tokens)"),
    # the four quadrants (advantage sign x surprisal above / not above the position's entropy)
    ("stare/pos_low_share", "share of the A != 0 tokens with A > 0 and surprisal <= entropy (push entropy down)"),
    ("stare/pos_high_share", "share of the A != 0 tokens with A > 0 and surprisal > entropy"),
    ("stare/neg_low_share", "share of the A != 0 tokens with A < 0 and surprisal <= entropy"),
    ("stare/neg_high_share", "share of the A != 0 tokens with A < 0 and surprisal > entropy (push entropy down)"),
    ("stare/pos_low_contrib", "pos_low's part of stare/entropy_forecast_base (the four add up to it)"),
    ("stare/pos_high_contrib", "pos_high's part of stare/entropy_forecast_base"),
    ("stare/neg_low_contrib", "neg_low's part of stare/entropy_forecast_base"),
    ("stare/neg_high_contrib", "neg_high's part of stare/entropy_forecast_base"),
)
METRIC_NAMES: tuple[str, ...] = tuple(name for name, _ in METRICS)

# Names that runs written before the renames logged -> the current name: local runs from before both engines shared
# ``stare_step`` wrote ``entropy``, ``quadrant/*``, ... (their ``entropy_change`` is the same-batch change), and runs
# of both engines from before the boosted-token share was renamed wrote ``stare/boosted_raise_share``.
LEGACY_NAMES: dict[str, str] = {
    "stare/boosted_raise_share": "stare/boosted_phi_pos_share",
    "entropy": "stare/entropy",
    "entropy_change": "stare/entropy_change_same_batch",
    "entropy_forecast": "stare/entropy_forecast",
    "entropy_forecast_base": "stare/entropy_forecast_base",
    **{f"quadrant/{q}_{kind}": f"stare/{q}_{kind}"
       for q in ("pos_low", "pos_high", "neg_low", "neg_high") for kind in ("share", "contrib")},
}


def entropy_bonus_metrics(policy_loss: float, bonus: float) -> dict[str, float]:
    """``stare/entropy_bonus`` and ``stare/entropy_bonus_share`` from a step's policy loss and the bonus subtracted
    from it (each as the engine logs it), the one definition both engines use."""
    size = abs(policy_loss) + abs(bonus)
    return {P + "entropy_bonus": bonus, P + "entropy_bonus_share": abs(bonus) / size if size > 0 else 0.0}


def metrics_markdown() -> str:
    """``METRICS`` as a markdown table (name, meaning), for documentation generated from, or checked against, it."""
    rows = [f"| `{name}` | {meaning} |" for name, meaning in METRICS]
    return "\n".join(["| name | meaning |", "|---|---|", *rows]) + "\n"


def upgrade_metric_names(record: dict) -> dict:
    """A metrics record with ``LEGACY_NAMES`` renamed (a new name already present wins); other keys unchanged."""
    out = {}
    for key, value in record.items():
        new = LEGACY_NAMES.get(key)
        if new is None:
            out[key] = value
        elif new not in record:
            out[new] = value
    return out


@dataclass(frozen=True)
class StepMemory:
    """What the next step needs from this one: the batch entropy and its forecast change (None: unknown)."""

    entropy: float | None = None
    forecast: float | None = None

    def change_metrics(self, entropy: float) -> dict[str, float]:
        """``stare/entropy_change`` (``entropy`` minus the remembered one) and ``stare/entropy_change_forecast``."""
        out = {}
        if self.entropy is not None:
            out[P + "entropy_change"] = entropy - self.entropy
        if self.forecast is not None:
            out[P + "entropy_change_forecast"] = self.forecast
        return out

    def as_dict(self) -> dict:
        return asdict(self)


class StepResult(NamedTuple):
    weights: torch.Tensor | None  # [B, T] float32, or None: every weight is 1 (gate off, baseline, or chosen later)
    metrics: dict[str, float]  # names from METRICS
    state: ControllerState | None  # the controller's decision (None for a baseline)
    memory: StepMemory  # to pass to the next step
    penalty: torch.Tensor | None = None  # [B, T] float32 KL-Cov coefficients for policy_loss(penalty=); kl-cov only
    entropy_coef: float | None = None  # the entropy bonus's coefficient this step (None: no bonus)


def _reduce(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], group) -> tuple[dict[str, float], dict[str, float]]:
    """{name: num / den} and {name: den}, each summed over ``group`` first: one all-reduce, one host read.

    The sums travel in float64 and the quotient is taken in float32 with a denominator of at least 1 (0 over an
    empty set), exactly as ``masked_mean`` does on one process.
    """
    names = list(pairs)
    flat = torch.stack([torch.stack([pairs[k][0].to(torch.float32), pairs[k][1].to(torch.float32)])
                        for k in names]).to(torch.float64)
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    num, den = flat[:, 0].to(torch.float32), flat[:, 1].to(torch.float32)
    values = torch.cat([num / den.clamp(min=1.0), den]).tolist()
    return dict(zip(names, values[: len(names)])), dict(zip(names, values[len(names):]))


def batch_mean(values: torch.Tensor, mask: torch.Tensor, group=None) -> float:
    """Mean of ``values`` ``[B, T]`` over ``mask`` ``[B, T]``, over all ranks of ``group`` (0 for no tokens).

    One all-reduce and one host read; on one process exactly ``float(masked_mean(values, mask))``.
    """
    check_same_shape("values", values, mask=mask)
    m = mask.to(torch.float32)
    means, _ = _reduce({"mean": ((values.to(torch.float32) * m).sum(), m.sum())}, group)
    return means["mean"]


def _check_partition(micro_batches: Sequence[torch.Tensor], n_rows: int) -> list[torch.Tensor]:
    parts = [torch.as_tensor(mb, dtype=torch.long).reshape(-1) for mb in micro_batches]
    rows = torch.cat(parts).cpu() if parts else torch.zeros(0, dtype=torch.long)
    if rows.numel() != n_rows or not torch.equal(rows.sort().values, torch.arange(n_rows)):
        raise ValueError(f"micro_batches must hold every row index 0..{n_rows - 1} exactly once "
                         f"(got {rows.numel()} indices)")
    return parts


def stare_step(
    controller,
    cfg: AlgoConfig,
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    stats: EntropyStats,
    *,
    memory: StepMemory | None = None,
    group=None,
    micro_batches: Sequence[torch.Tensor] | None = None,
    generator: torch.Generator | None = None,
    entropy_coef=None,
) -> StepResult:
    """Once per RL step: batch entropy, the controller's update, the weights and the telemetry.

    Shapes (B sequences of this rank, T response positions):

    - ``logprobs``: ``[B, T]`` float, the old policy's log-probs of the sampled tokens (detached).
    - ``advantages``: ``[B, T]`` per token or ``[B]`` per sequence.
    - ``mask``: ``[B, T]`` bool or 0/1, true on response tokens (padding may hold anything elsewhere).
    - ``stats``: ``EntropyStats`` of the old policy at the same positions, each ``[B, T]`` float: ``entropy`` H
      (feeds the controller), ``surprisal`` s (sorts tokens into the quadrants; ``-logprobs`` when the engine has
      no separate copy) and ``phi`` (the forecasts, the ``phi`` selection and damping; may be None when
      ``cfg.telemetry`` is not ``"full"`` and the algorithm does not select by Phi).
    - ``cfg.telemetry``: ``"full"`` logs every name in METRICS that applies; ``"entropy"`` and ``"off"`` log the
      controller's state, ``stare/entropy``, ``stare/tokens`` and the entropy change only (no Phi, no shares, no
      weight-dependent all-reduce). The engines decide what to compute before this call (``cfg.needs_entropy``;
      a baseline without a token rule and with ``"off"`` needs no step at all).
    - ``controller``: ``cfg.make_controller()`` (None for a baseline, whose weights are None unless it has a token
      rule); its state advances by one step.
    - ``memory``: what the previous call returned as ``StepResult.memory`` (None or ``StepMemory()`` on the
      first step).
    - ``group``: a ``torch.distributed`` process group; every sum and the global selection are then exact over
      all its ranks. Every rank must call with the same ``cfg`` and controller state (the collectives match up
      because every rank takes the same decisions from the same all-reduced numbers).
    - ``micro_batches``: with ``cfg.scope == "micro_batch"``, the row-index tensors (``[b_i]`` long, together
      every row once) of the micro-batches the engine will train on; the selection runs inside each. Without it
      the weights are None and the engine selects inside its micro-batches later (the OpenRLHF plugin, whose
      micro-batches are drawn after this call); the weight-dependent telemetry is then absent. Ignored with
      ``scope == "global"``.
    - ``generator``: a token rule that draws random numbers (``cfg.rule.random``: clip-cov's keys) draws from it
      (the engine's own generator, touched by nothing else; None: torch's global generator). No other algorithm
      draws random numbers here.
    - ``entropy_coef``: ``cfg.make_entropy_coef()`` (an ``EntropyCoef``; None without an entropy bonus), updated
      once from the batch entropy like the gate; its coefficient for this step is ``StepResult.entropy_coef``
      (``loss.entropy_bonus_loss`` takes it) and ``stare/entropy_coef``.
    - ``cfg.rule`` (clip-cov, kl-cov, 80-20): the token rule runs once over the whole step's batch (``scope`` is
      ignored), exact across ``group``'s ranks, whatever ``cfg.telemetry`` says. ``stats.entropy`` may be None
      when ``cfg.needs_entropy`` is False (clip-cov / kl-cov with telemetry off); the step then logs
      ``stare/tokens`` only.

    Returns ``StepResult(weights [B, T] float32 or None, metrics {name: float} with names from METRICS, the
    controller's state or None, the StepMemory for the next step, penalty [B, T] float32 or None)``: clip-cov and
    80-20 return their 0/1 mask as ``weights``, kl-cov its coefficients as ``penalty`` (weights None). Host reads:
    one for the batch entropy (with the weight-independent telemetry), the selection's or token rule's own (STARE:
    gate on only), and one for the weight-dependent telemetry (when there are weights or a penalty). Raises
    ``ValueError`` for mismatched shapes, a controller that does not match ``cfg``, micro-batches that are not a
    partition of the rows or a missing entropy the algorithm needs; ``FloatingPointError`` when the batch entropy is
    not finite.
    """
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be shaped [B, T], got shape {tuple(logprobs.shape)}")
    if not isinstance(stats, EntropyStats):
        raise ValueError(f"stats must be an EntropyStats (entropy, surprisal, phi), got {type(stats).__name__}")
    check_same_shape("logprobs", logprobs, mask=mask, entropy=stats.entropy, surprisal=stats.surprisal,
                     phi=stats.phi)
    if stats.entropy is None and cfg.needs_entropy:
        raise ValueError(f"stats.entropy is None, but {cfg.name!r} with telemetry {cfg.telemetry!r} needs the entropy")
    adv = broadcast_advantages(advantages, logprobs)  # [B, T] (a view for per-sequence advantages)
    if (entropy_coef is None) == cfg.entropy_bonus:
        raise ValueError(f"algorithm {cfg.name!r} {'has' if cfg.entropy_bonus else 'has no'} entropy bonus; pass "
                         "entropy_coef=cfg.make_entropy_coef()")
    if (controller is None) != (not cfg.stare):
        raise ValueError(f"algorithm {cfg.name!r} {'needs' if cfg.stare else 'takes no'} controller; pass "
                         "cfg.make_controller()")
    memory = StepMemory() if memory is None else memory
    parts = None
    if cfg.scope == "micro_batch" and micro_batches is not None:
        parts = _check_partition(micro_batches, logprobs.shape[0])

    full = cfg.telemetry == "full"
    if stats.phi is None and (full or cfg.needs_phi):
        raise ValueError(f"stats.phi is None, but {'telemetry full' if full else repr(cfg.name)} needs Phi "
                         "(set telemetry to entropy or off, or compute Phi)")

    # 1. batch entropy and the weight-independent telemetry: one all-reduce, one host read
    m = mask.to(torch.float32)
    rule = cfg.rule
    if stats.entropy is None:  # a token-rule baseline with telemetry off: the token count only
        pairs = {P + "tokens": (m.sum(), m.sum())}
        _, counts = _reduce(pairs, group)
        weights, penalty = rule.apply(cfg, logprobs, advantages, mask, None, group=group, generator=generator)
        return StepResult(weights, {P + "tokens": counts[P + "tokens"]}, None, memory, penalty)
    pairs = {P + "entropy": ((stats.entropy.to(torch.float32) * m).sum(), m.sum())}
    if full:
        pairs[P + "entropy_forecast_base"] = entropy_forecast_sums(stats.phi, adv, mask)
        pairs.update({P + k: v for k, v in quadrant_sums(stats.surprisal, stats.entropy, adv, mask,
                                                         phi=stats.phi).items()})
    values, counts = _reduce(pairs, group)
    entropy, n_tokens = values[P + "entropy"], counts[P + "entropy"]
    if not math.isfinite(entropy):
        raise FloatingPointError(f"the old policy's batch entropy is {entropy} (non-finite logits?)")

    # 2. the controller, once
    metrics: dict[str, float] = {}
    state = None
    if controller is not None:
        state = controller.update(entropy)
        metrics.update(state.as_metrics(P))
    metrics.update(values)
    metrics[P + "tokens"] = n_tokens
    coef = None
    if entropy_coef is not None:
        coef = entropy_coef.update(entropy)
        metrics[P + "entropy_coef"] = coef

    # 3. the weights (gate on, some tokens anywhere: every rank takes the same branch)
    weights = penalty = None
    deferred = False
    if rule.active:
        weights, penalty = rule.apply(cfg, logprobs, advantages, mask, stats.entropy, group=group,
                                      generator=generator)
    elif state is not None and state.gate_on and n_tokens > 0:
        kwargs = {**cfg.selection_kwargs(), **state.weight_kwargs()}
        if cfg.scope == "global":
            weights = stare_token_weights(logprobs, advantages, mask, phi=stats.phi, group=group, **kwargs)
        elif parts is not None:
            weights = torch.ones(logprobs.shape, dtype=torch.float32, device=logprobs.device)
            per_seq = advantages.dim() == 1
            for rows in parts:
                rows = rows.to(logprobs.device)
                if rows.numel():
                    weights[rows] = stare_token_weights(
                        logprobs[rows], advantages[rows] if per_seq else adv[rows], mask[rows],
                        phi=stats.phi[rows], **kwargs)
        else:
            deferred = True

    # 4. the weight-dependent telemetry (telemetry "full" only): one more all-reduce and host read when there are
    # weights or penalties
    if full and (weights is not None or penalty is not None):
        valid = mask.bool()
        phi_pos = stats.phi > 0
        pairs = {}
        lowered = torch.zeros_like(valid)
        if weights is not None:
            # a baseline's shares count its 0/1 choice, whatever weight its kept tokens carry (80-20's N / S)
            marks = torch.where(weights != 0, 1.0, 0.0) if rule.active and rule.choice else weights
            sums = reweight_sums(marks, adv, mask)
            if marks is not weights:
                sums["mean_weight"] = reweight_sums(weights, adv, mask)["mean_weight"]
            pairs.update({P + k: v for k, v in sums.items()})
            pairs[P + "entropy_forecast"] = entropy_forecast_sums(stats.phi, adv, mask, weights=weights)
            boosted = valid & (marks > 1)
            pairs[P + "boosted_phi_pos_share"] = ((boosted & phi_pos).sum(), boosted.sum())
            pairs[P + "masked_share"] = ((valid & (weights == 0)).sum(), valid.sum())
            lowered = valid & (marks < 1)
            pairs.update({P + k: v for k, v in rule.telemetry_sums(cfg, logprobs, advantages, mask, stats.entropy,
                                                                     weights).items()})
        if penalty is not None:
            penalised = valid & (penalty > 0)
            pairs[P + "penalised_share"] = (penalised.sum(), valid.sum())
            lowered = lowered | penalised
        pairs[P + "lowered_phi_pos_share"] = ((lowered & phi_pos).sum(), lowered.sum())
        w_values, w_counts = _reduce(pairs, group)
        for name in ("boosted_phi_pos_share", "lowered_phi_pos_share",
                     *(m.name for m in rule.telemetry if m.absent_when_none)):
            if w_counts.get(P + name) == 0:
                del w_values[P + name]
        metrics.update(w_values)
    if full and weights is None and not deferred:  # every weight is 1: the weighted numbers are the unweighted ones
        metrics[P + "positive_reweight_ratio"] = 0.0
        metrics[P + "negative_reweight_ratio"] = 0.0
        metrics[P + "mean_weight"] = 1.0 if n_tokens > 0 else 0.0
        metrics[P + "entropy_forecast"] = metrics[P + "entropy_forecast_base"]
    if full and P + "masked_share" not in metrics:  # no weight is ever 0 outside clip-cov and 80-20
        metrics[P + "masked_share"] = 0.0

    # 5. the measured change since the previous step, beside what that step forecast
    metrics.update(memory.change_metrics(entropy))
    return StepResult(weights, metrics, state, StepMemory(entropy, metrics.get(P + "entropy_forecast")), penalty,
                      coef)

