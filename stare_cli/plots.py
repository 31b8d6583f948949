"""The comparison plots: one curve per arm against RL step (``entropy.png``, ``reward.png``, ...)."""
from __future__ import annotations

from pathlib import Path

from .runs import Run, _num
from .tables import _common, _group, _reference_band

SMOOTH = 5  # trailing moving average of the plotted curves, in steps


# ---- 5. curves --------------------------------------------------------------------------------------------------
def _smoothed(run: Run, key: str) -> dict[int, float]:
    """step -> trailing mean of the last ``SMOOTH`` logged values of ``key`` (steps without the key skipped)."""
    pts = [(r["step"], v) for r in run.metrics if (v := _num(r.get(key))) is not None]
    out = {}
    for i, (step, _) in enumerate(pts):
        window = [v for _, v in pts[max(0, i - SMOOTH + 1):i + 1]]
        out[step] = sum(window) / len(window)
    return out


CURVES = (("entropy", "mean token entropy", "entropy.png"),
          ("reward_mean", "mean reward", "reward.png"),
          ("response_length", "mean response length (tokens)", "response_length.png"))


def plot_curves(out_dir, runs: list[Run], curves=CURVES) -> list[Path]:
    """Write entropy.png, reward.png and response_length.png (or ``curves``: (metric key, axis label, file name)
    triples) in ``out_dir``; returns their paths.

    One line per arm: the mean over seeds of each seed's trailing 5-step mean, with a light min..max band over
    the seeds when there are several; the target entropy band is shaded on entropy.png.
    """
    import matplotlib
    # the Agg backend, set on each figure: no display needed, and pyplot's global backend is left alone
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    arms = _group(runs)
    palette = matplotlib.colormaps["tab10"].colors
    colours = {name: palette[i % len(palette)] for i, name in enumerate(arms)}  # the same in every plot
    band = _reference_band(runs)
    preset = _common(r.config.get("preset") for r in runs)
    task = _common((r.config.get("settings") or {}).get("task") for r in runs)
    written = []
    for key, label, filename in curves:
        fig = Figure(figsize=(7, 4), dpi=110)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        if key == "entropy" and band:
            ax.axhspan(band[0], band[1], color="0.5", alpha=0.15, lw=0,
                       label=f"target band [{band[0]:.2f}, {band[1]:.2f}]")
        drawn = False
        for name, group in arms.items():
            curves = [c for c in (_smoothed(r, key) for r in group) if c]
            if not curves:
                continue
            steps = sorted(set().union(*curves))
            at = [[c[s] for c in curves if s in c] for s in steps]
            ax.plot(steps, [sum(v) / len(v) for v in at], color=colours[name], lw=1.6,
                    label=name if len(curves) == 1 else f"{name} ({len(curves)} seeds)")
            if len(curves) > 1:
                ax.fill_between(steps, [min(v) for v in at], [max(v) for v in at], color=colours[name],
                                alpha=0.18, lw=0)
            drawn = True
        if not drawn:
            ax.text(0.5, 0.5, f"no {key} in the metrics", transform=ax.transAxes, ha="center", va="center")
        ax.set_xlabel("RL step")
        ax.set_ylabel(label)
        ax.set_title(f"{label[0].upper() + label[1:]} ({preset}, {task}; trailing {SMOOTH}-step mean)", fontsize=10)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / filename
        fig.savefig(path)
        written.append(path)
    return written
