"""The dose-response of a ``stare run --sweep``: each measure against the swept value, with a trend test.

A series is the arms of one algorithm that differ in one swept key only (``algo[KEY=V]`` arms, the other swept keys
held at one value; ``stare.cli.sweep``). Per value: the mean and the 95% interval over seeds (t, as the seed
table's) of late entropy, band share, held-out avg@k, final reward and each benchmark's avg@k; per measure: Spearman's
rho of the per-run values against the swept value over every run of the series (seeds x values) with its exact
two-sided permutation p (``stare.eval.metrics.spearman_trend``). Non-numeric values (a controller name) get the
per-value rows but no trend. ``stare run`` and ``stare compare`` both write it (``tables``), and
``plot`` draws ``dose_response.png``.
"""
from __future__ import annotations

from pathlib import Path

from stare.eval.metrics import spearman_trend

from .runs import num, ordered_benches

# (measure, header): per-run numbers of tables.summarise_arm's runs; benchmarks' avg@k come after
MEASURES = (("late_entropy", "late H"), ("band_share", "band share"), ("avg_at_k", "avg@k"),
            ("final_reward", "final reward"))


def _numeric(values) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def _per_run(arm: dict, group) -> list[dict]:
    """Each run's dose-response numbers: the table's measures and each benchmark's avg@k."""
    out = []
    for p, run in zip(arm["runs"], group):
        row = {m: p.get(m) for m, _ in MEASURES}
        for bench, summary in run.evals.items():
            row[f"{bench}_avg_at_k"] = num(summary.get("avg_at_k"))
        out.append(row)
    return out


def build(arms: list[dict], groups: list) -> list[dict]:
    """The series of the arms that carry a sweep (``arm["sweep"]``: {key: value}); ``groups`` are the arms' runs
    in the same order. Each series: {"algo", "key", "fixed" (the other swept keys' values), "measures" ([name,
    header]), "rows" (per value: "value", "label", "n_seeds", and per measure "mean", "ci95", "n"), "trend" (per
    measure: spearman_trend's dict, or None)}."""
    from .seeds import measure_range, t_interval

    series: dict[tuple, dict] = {}
    for arm, group in zip(arms, groups):
        if not arm.get("sweep"):
            continue
        for key, value in arm["sweep"].items():
            fixed = {k: v for k, v in arm["sweep"].items() if k != key}
            s = series.setdefault((arm["arm"], key, tuple(sorted(fixed.items(), key=str))),
                                  {"algo": arm["arm"], "key": key, "fixed": fixed, "arms": []})
            s["arms"].append((value, arm, _per_run(arm, group)))
    out = []
    for s in series.values():
        if len({repr(v) for v, _, _ in s["arms"]}) < 2:
            continue
        numeric = _numeric([v for v, _, _ in s["arms"]])
        if numeric:
            s["arms"].sort(key=lambda t: t[0])
        benches = ordered_benches({k[:-len("_avg_at_k")] for _, _, runs in s["arms"] for r in runs for k in r
                                   if k.endswith("_avg_at_k")})
        names = [(m, h) for m, h in MEASURES] + [(f"{b}_avg_at_k", f"{b} avg@k") for b in benches]
        names = [(m, h) for m, h in names if any(r.get(m) is not None for _, _, runs in s["arms"] for r in runs)]
        rows, trend = [], {}
        for value, arm, runs in s["arms"]:
            row = {"value": value, "label": arm["label"], "n_seeds": arm["n_seeds"]}
            for m, _ in names:
                vals = [r[m] for r in runs if r.get(m) is not None]
                row[m] = {"mean": sum(vals) / len(vals) if vals else None, "ci95": t_interval(vals, measure_range(m)),
                          "n": len(vals)}
            rows.append(row)
        for m, _ in names:
            pairs = [(value, r[m]) for value, _, runs in s["arms"] for r in runs if r.get(m) is not None]
            trend[m] = spearman_trend([x for x, _ in pairs], [y for _, y in pairs]) if numeric else None
        out.append({"algo": s["algo"], "key": s["key"], "fixed": s["fixed"], "measures": [list(n) for n in names],
                    "rows": rows, "trend": trend})
    return out


def _f(x: float | None) -> str:
    return "" if x is None else f"{x:.3f}"


def _p(p: float | None) -> str:
    return "" if p is None else (f"{p:.2g}" if p < 0.001 else f"{p:.3f}")


def markdown(series: list[dict], kk: str) -> list[str]:
    """The "Dose-response" section of comparison.md (no lines without a sweep of two values or more)."""
    if not series:
        return []
    md = ["", "## Dose-response", ""]
    for s in series:
        fixed = "".join(f", {k}={v}" for k, v in s["fixed"].items())
        headers = [h.replace("@k", f"@{kk}") for _, h in s["measures"]]
        md += [f"{s['algo']} against {s['key']}{fixed}:", "",
               "| " + " | ".join([s["key"], "seeds"] + headers) + " |", "|" + "---|" * (len(headers) + 2)]
        for row in s["rows"]:
            cells = [str(row["value"]), str(row["n_seeds"])]
            for m, _ in s["measures"]:
                c = row[m]
                text = _f(c["mean"])
                if c["ci95"] is not None:
                    text += f" [{_f(c['ci95'][0])}, {_f(c['ci95'][1])}]"
                cells.append(text)
            md.append("| " + " | ".join(cells) + " |")
        trends = [(h, s["trend"][m]) for (m, _), h in zip(s["measures"], headers) if s["trend"].get(m)]
        if trends:
            md += ["", "| trend | " + " | ".join(h for h, _ in trends) + " |", "|" + "---|" * (len(trends) + 1),
                   "| Spearman rho | " + " | ".join(f"{t['rho']:+.3f}" for _, t in trends) + " |",
                   "| p (two-sided) | " + " | ".join(_p(t["p"]) + ("" if t["exact"] else " (sampled)")
                                                    for _, t in trends) + " |",
                   "| runs | " + " | ".join(str(t["n"]) for _, t in trends) + " |"]
        md.append("")
    md += ["Per value: mean [95% interval of the mean over seeds, t, clipped to the measure's range: [0, 1] for "
           "avg@k and band share, >= 0 for entropy]. Trend: Spearman's rho of the per-run values "
           "against the swept value over seeds x values, and the permutation p of |rho| (every split of the "
           "values over the runs enumerated up to 200000, else 200000 sampled: marked). A blank trend: the "
           "values are not numbers, or a measure took one value."]
    return md


def _reference(arm: dict, m: str) -> float | None:
    """An arm's mean of a dose-response measure (from tables.summarise_arm's summary)."""
    if m.endswith("_avg_at_k"):
        cell = (arm.get("benches") or {}).get(m[:-len("_avg_at_k")])
        return cell["avg_at_k"]["mean"] if cell else None
    return (arm.get("metrics") or {}).get(m, {}).get("mean")


def plot(out_dir: Path, series: list[dict], arms: list[dict] = ()) -> Path | None:
    """``dose_response.png``: late entropy, band share and avg@k (the held-out one, else the first benchmark's)
    against the swept value, one line per series with its 95% intervals, and each arm of ``arms`` outside the
    sweep (``arm["sweep"]`` empty: dapo, stare-phi beside it) as a dashed level; the value axis is logarithmic when
    the values are positive and span a factor of 8 or more. None when there is no series."""
    if not series:
        return None
    others = [a for a in arms if not a.get("sweep")]
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wanted = ["late_entropy", "band_share"]
    head = next((m for m in ["avg_at_k"] + [m for s in series for m, _ in s["measures"] if m.endswith("_avg_at_k")]
                 if any(m in dict(map(tuple, s["measures"])) for s in series)), None)
    panels = [m for m in wanted + ([head] if head else []) if any(m in dict(map(tuple, s["measures"]))
                                                                  for s in series)]
    if not panels:
        return None
    keys = list(dict.fromkeys(s["key"] for s in series))  # one row of panels per swept key
    fig, axes = plt.subplots(len(keys), len(panels), figsize=(4.2 * len(panels), 3.4 * len(keys)), squeeze=False)
    for row, key in enumerate(keys):
        for ax, m in zip(axes[row], panels):
            header = next(h for s in series for mm, h in s["measures"] if mm == m)
            for s in series:
                if s["key"] != key or m not in dict(map(tuple, s["measures"])):
                    continue
                values = [r["value"] for r in s["rows"]]
                xs = values if _numeric(values) else list(range(len(values)))
                pts = [(x, r[m]["mean"], r[m]["ci95"]) for x, r in zip(xs, s["rows"]) if r[m]["mean"] is not None]
                err = [[y - ci[0] if ci else 0 for _, y, ci in pts], [ci[1] - y if ci else 0 for _, y, ci in pts]]
                fixed = "".join(f", {k}={v}" for k, v in s["fixed"].items())
                ax.errorbar([x for x, _, _ in pts], [y for _, y, _ in pts], yerr=err, marker="o", capsize=3,
                            label=f"{s['algo']}{fixed}")
                if not _numeric(values):
                    ax.set_xticks(xs, [str(v) for v in values])
            for i, a in enumerate(others):
                level = _reference(a, m)
                if level is not None:
                    ax.axhline(level, linestyle="--", linewidth=1, color=f"C{(i + 1) % 10}", label=a["label"])
            values = [r["value"] for s in series if s["key"] == key for r in s["rows"]]
            if _numeric(values) and min(values) > 0 and max(values) / min(values) >= 8:
                ax.set_xscale("log")
                ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
                ticks = sorted(set(values))
                ax.set_xticks(ticks, [f"{v:g}" for v in ticks], fontsize=7)
            ax.set_xlabel(key)
            ax.set_ylabel(header)
            ax.set_title(f"{header} against {key} (mean, 95% interval)", fontsize=10)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(out_dir) / "dose_response.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
