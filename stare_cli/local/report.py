"""The report of a local comparison (kept for imports that name this module).

The code lives by concept: run records and per-run measures in ``stare.cli.runs``, the permutation test next to
``bootstrap_ci`` in ``stare.eval.metrics``, the comparison table in ``stare.cli.tables`` and the plots in
``stare.cli.plots``.
"""
from stare.eval.metrics import EXACT_LIMIT, permutation_test

from ..plots import CURVES, SMOOTH, plot_curves
from ..runs import (FINAL_PCT, LATE_PCT, MEASURES, SLOPE_PCT, Run, band_share, load_run, run_measures,
                    summarise_arm)
from ..tables import write_comparison

__all__ = ["CURVES", "EXACT_LIMIT", "FINAL_PCT", "LATE_PCT", "MEASURES", "SLOPE_PCT", "SMOOTH", "Run", "band_share",
           "load_run", "permutation_test", "plot_curves", "run_measures", "summarise_arm", "write_comparison"]
