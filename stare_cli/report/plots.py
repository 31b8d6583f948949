"""The comparison plots: one curve per arm against RL step (``entropy.png``, ``reward.png``, ...).

The arms and their labels are the comparison table's (``arms.group_arms``), and each algorithm has
one colour everywhere (``colour``: the registry's order in ``palette()``, matplotlib's tab10 then Dark2), so
``stare run`` and ``stare compare`` draw GRPO, DAPO and each STARE variant alike. A curve that no run logged is not
drawn: no empty frame is written.
"""
from __future__ import annotations

from pathlib import Path

from .runs import Run, num
from .arms import algo_rank, arm_labels, common, group_arms, reference_band

SMOOTH = 5  # trailing moving average of the plotted curves, in steps


# ---- 5. curves --------------------------------------------------------------------------------------------------
def _smoothed(run: Run, key: str) -> dict[int, float]:
    """step -> trailing mean of the last ``SMOOTH`` logged values of ``key`` (steps without the key skipped)."""
    pts = [(r["step"], v) for r in run.metrics if (v := num(r.get(key))) is not None]
    out = {}
    for i, (step, _) in enumerate(pts):
        window = [v for _, v in pts[max(0, i - SMOOTH + 1):i + 1]]
        out[step] = sum(window) / len(window)
    return out


def colour(algo: str | None, palette) -> tuple:
    """The algorithm's colour: its position in the registry (``stare algos``) in ``palette``; one colour for any
    other name."""
    return palette[algo_rank(algo) % len(palette)]


def palette() -> tuple:
    """The arms' colours: matplotlib's tab10, then Dark2's, so that every registered algorithm (up to 17) and the colour
    for other names are distinct."""
    import matplotlib

    return tuple(matplotlib.colormaps["tab10"].colors) + tuple(matplotlib.colormaps["Dark2"].colors)


LINESTYLES = ("-", "--", ":", "-.")  # arms of one algorithm (other settings) share its colour, not its line style

def _arm_styles(groups, palette) -> list[tuple]:
    """(colour, line style) per arm group: the algorithm's colour; a second arm of one algorithm (other settings)
    gets the next line style."""
    styles, used = [], {}
    for group in groups:
        c = colour(group[0].algo, palette)
        styles.append((c, LINESTYLES[used.get(c, 0) % len(LINESTYLES)]))
        used[c] = used.get(c, 0) + 1
    return styles


def _label_axes(ax, xlabel: str, ylabel: str, title: str) -> None:
    """Axis labels, a small title, a light grid, and a legend when something was drawn with a label."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


CURVES = (("stare/entropy", "mean token entropy", "entropy.png"),
          ("reward_mean", "mean reward", "reward.png"),
          ("response_length", "mean response length (tokens)", "response_length.png"))


def plot_curves(out_dir, runs: list[Run], curves=CURVES) -> list[Path]:
    """Write entropy.png, reward.png and response_length.png (or ``curves``: (metric key, axis label, file name)
    triples) in ``out_dir``; returns their paths.

    One line per arm: the mean over seeds of each seed's trailing 5-step mean, with a light min..max band over
    the seeds when there are several; the target entropy band is shaded on entropy.png. A curve whose key no run
    logged is skipped (not written, not returned).
    """
    import matplotlib
    # the Agg backend, set on each figure: no display needed, and pyplot's global backend is left alone
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    groups = group_arms(runs)
    styles = _arm_styles(groups, palette())
    arms = list(zip(arm_labels(groups), groups, styles))
    band = reference_band(runs)
    preset = common(r.config.get("preset") for r in runs)
    task = common((r.config.get("settings") or {}).get("task") for r in runs)
    written = []
    for key, label, filename in curves:
        if not any(num(rec.get(key)) is not None for r in runs for rec in r.metrics):
            continue  # nothing to draw: no empty frame
        fig = Figure(figsize=(7, 4), dpi=110)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        if key == "stare/entropy" and band:
            ax.axhspan(band[0], band[1], color="0.5", alpha=0.15, lw=0,
                       label=f"target band [{band[0]:.2f}, {band[1]:.2f}]")
        for name, group, (col, style) in arms:
            per_seed = [c for c in (_smoothed(r, key) for r in group) if c]
            if not per_seed:
                continue
            steps = sorted(set().union(*per_seed))
            at = [[c[s] for c in per_seed if s in c] for s in steps]
            ax.plot(steps, [sum(v) / len(v) for v in at], color=col, ls=style, lw=1.6,
                    label=name if len(per_seed) == 1 else f"{name} ({len(per_seed)} seeds)")
            if len(per_seed) > 1:
                ax.fill_between(steps, [min(v) for v in at], [max(v) for v in at], color=col, alpha=0.18, lw=0)
        _label_axes(ax, "RL step", label,
                    f"{label[0].upper() + label[1:]} ({preset}, {task}; trailing {SMOOTH}-step mean)")
        fig.tight_layout()
        path = out_dir / filename
        fig.savefig(path)
        written.append(path)
    return written


ACCURACY_PLOT = "accuracy.png"


def plot_accuracy(out_dir, runs: list[Run]) -> Path | None:
    """``accuracy.png``: accuracy over training, one panel per curve (``Run.curves``: a bench's ``stare eval
    --checkpoints`` avg@k, an engine's in-training evaluation), one line per arm against the training step, in the
    arm's colour and line style. The shaded band is the 95% interval: the run's own (a bootstrap over problems) for
    one seed; for several seeds the line is the mean over seeds and the band spans the lowest to the highest of
    their intervals (of their values where no interval was logged). None (nothing written) when no run has a
    curve."""
    keys = sorted({key for r in runs for key in r.curves})
    if not keys:
        return None
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    groups = group_arms(runs)
    styles = _arm_styles(groups, palette())
    fig = Figure(figsize=(7, 3.6 * len(keys)), dpi=110)
    FigureCanvasAgg(fig)
    for i, key in enumerate(keys):
        ax = fig.add_subplot(len(keys), 1, i + 1)
        label = next(r.curves[key]["label"] for r in runs if key in r.curves)
        ks = {p.get("k") for r in runs if key in r.curves for p in r.curves[key]["points"].values()} - {None}
        for name, group, (col, style) in zip(arm_labels(groups), groups, styles):
            per_seed = [r.curves[key]["points"] for r in group if key in r.curves]
            per_seed = [{s: p for s, p in pts.items() if p["value"] is not None} for pts in per_seed]
            per_seed = [pts for pts in per_seed if pts]
            if not per_seed:
                continue
            steps = sorted(set().union(*per_seed))
            at = [[pts[s] for pts in per_seed if s in pts] for s in steps]
            mean = [sum(p["value"] for p in v) / len(v) for v in at]
            low = [min(p["value"] if p["ci_low"] is None else p["ci_low"] for p in v) for v in at]
            high = [max(p["value"] if p["ci_high"] is None else p["ci_high"] for p in v) for v in at]
            ax.plot(steps, mean, color=col, ls=style, lw=1.6, marker="o", ms=3,
                    label=name if len(per_seed) == 1 else f"{name} ({len(per_seed)} seeds)")
            ax.fill_between(steps, low, high, color=col, alpha=0.15, lw=0)
        k_text = f"avg@{ks.pop()}" if len(ks) == 1 else "avg@k"
        _label_axes(ax, "training step", k_text, f"{label}: {k_text} with its 95% interval")
    fig.tight_layout()
    path = out_dir / ACCURACY_PLOT
    fig.savefig(path)
    return path
