"""Sample-based accuracy metrics (pure Python, no model code), and ``METRICS``: the one table of the evaluation
metrics that both eval harnesses, the summary writer, the comparison and the CLI read (at the end of this file)."""
from __future__ import annotations

from dataclasses import dataclass
from math import comb
from typing import Callable


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n - c, k) / C(n, k) (Chen et al., 2021)."""
    if not (0 <= c <= n) or not (1 <= k <= n):
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


# ---------------------------------------------------------------------------------------------------------------
# Sample-matrix metrics. ``correct[i][j]`` is whether sample j of problem i was judged correct; problems may carry
# different numbers of samples, but each needs at least one.


def _check_matrix(correct, name: str = "correct") -> None:
    if len(correct) == 0:
        raise ValueError(f"{name} is empty: need at least one problem")
    for i, row in enumerate(correct):
        if len(row) == 0:
            raise ValueError(f"{name}[{i}] is empty: every problem needs at least one sample")


def per_problem_accuracy(correct: list[list[bool]]) -> list[float]:
    """Per-problem fraction of correct samples (the per-problem values behind avg@k, for bootstrap_ci)."""
    _check_matrix(correct)
    return [sum(bool(x) for x in row) / len(row) for row in correct]


def avg_at_k(correct: list[list[bool]]) -> float:
    """avg@k: mean over problems of the per-problem mean accuracy over its k samples."""
    acc = per_problem_accuracy(correct)
    return sum(acc) / len(acc)


def pass_at_k_mean(correct: list[list[bool]], k: int) -> float:
    """Mean over problems of the unbiased pass@k (``pass_at_k(n, c, k)`` with n samples, c correct, per problem)."""
    _check_matrix(correct)
    vals = [problem_pass_at_k(row, [], k) for row in correct]
    return sum(vals) / len(vals)


def majority_votes(extracted: list[list[str | None]], correct: list[list[bool]]) -> list[bool]:
    """Per-problem majority-vote correctness (the per-problem values behind maj@k).

    The majority answer is the most frequent non-None extracted answer (ties go to the answer that occurs first);
    None (no answer) wins only when every sample is None, and then the problem counts as wrong. The problem is
    correct when the first sample carrying the majority answer is marked correct (samples with the same extracted
    answer are expected to be judged alike).
    """
    _check_matrix(correct)
    if len(extracted) != len(correct):
        raise ValueError(f"extracted has {len(extracted)} problems but correct has {len(correct)}")
    out = []
    for i, (answers, flags) in enumerate(zip(extracted, correct)):
        if len(answers) != len(flags):
            raise ValueError(f"problem {i}: {len(answers)} extracted answers but {len(flags)} correctness flags")
        counts: dict[str, int] = {}
        first: dict[str, int] = {}
        for j, a in enumerate(answers):
            if a is None:
                continue
            counts[a] = counts.get(a, 0) + 1
            first.setdefault(a, j)
        if not counts:
            out.append(False)
            continue
        best = max(counts, key=lambda a: (counts[a], -first[a]))
        out.append(bool(flags[first[best]]))
    return out


def maj_at_k(extracted: list[list[str | None]], correct: list[list[bool]]) -> float:
    """maj@k (cons@k): fraction of problems whose majority-vote answer is correct (see ``majority_votes``)."""
    votes = majority_votes(extracted, correct)
    return sum(votes) / len(votes)


def bootstrap_ci(per_problem: list[float], *, n_boot: int = 2000, alpha: float = 0.05,
                 seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap (1 - alpha) interval of the mean, resampling problems with replacement."""
    import numpy as np

    if len(per_problem) == 0:
        raise ValueError("per_problem is empty: need at least one value")
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    if not (0.0 < alpha < 1.0):
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    x = np.asarray(per_problem, dtype=np.float64)
    n = x.size
    rng = np.random.default_rng(seed)
    means = np.empty(n_boot, dtype=np.float64)
    chunk = max(1, 4_000_000 // n)  # bound memory at ~32 MB of indices per chunk
    for start in range(0, n_boot, chunk):
        stop = min(n_boot, start + chunk)
        idx = rng.integers(0, n, size=(stop - start, n))
        means[start:stop] = x[idx].mean(axis=1)
    lo, hi = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    # float rounding in the means must not push the interval outside the data's range
    lo = float(min(max(lo, x.min()), x.max()))
    hi = float(min(max(hi, x.min()), x.max()))
    return lo, hi


EXACT_LIMIT = 200_000  # permutation test: enumerate every split up to this many, else sample this many


def permutation_test(a: list[float], b: list[float]) -> float:
    """One-sided permutation p-value for mean(a) > mean(b).

    The share of the ways of splitting a + b into groups of len(a) and len(b) whose first group's sum is at least
    sum(a) (the observed split counts). Every split is enumerated when there are at most 200000 of them; beyond
    that 200000 random permutations (fixed seed) give (hits + 1) / (200000 + 1).
    """
    import itertools
    import math

    import numpy as np

    a, b = [float(x) for x in a], [float(x) for x in b]
    if not a or not b:
        raise ValueError("permutation_test needs at least one value in each group")
    pool = a + b
    observed = sum(a)
    tol = 1e-12 * max(1.0, sum(abs(x) for x in pool))  # equal sums added in another order still count
    n, na = len(pool), len(a)
    total = math.comb(n, na)
    if total <= EXACT_LIMIT:
        hits = sum(sum(pool[i] for i in idx) >= observed - tol for idx in itertools.combinations(range(n), na))
        return hits / total
    rng = np.random.default_rng(0)
    arr = np.asarray(pool)
    hits, done = 0, 0
    while done < EXACT_LIMIT:
        chunk = min(10_000, EXACT_LIMIT - done)
        perms = rng.permuted(np.tile(arr, (chunk, 1)), axis=1)
        hits += int((perms[:, :na].sum(axis=1) >= observed - tol).sum())
        done += chunk
    return (hits + 1) / (EXACT_LIMIT + 1)


def mid_ranks(values: list[float]) -> list[float]:
    """Ranks 1..n, tied values sharing the mean of the ranks they span."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for t in range(i, j + 1):
            ranks[order[t]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman_trend(x: list[float], y: list[float]) -> dict | None:
    """Spearman's rho of ``y`` against ``x`` (Pearson's r of their mid-ranks) and its two-sided permutation p-value:
    the share of the ways of handing the ``y`` values to the runs (runs of one ``x`` are interchangeable, so each
    way is a split of the ``y`` values into groups of the ``x`` values' sizes) whose |rho| is at least the observed
    one. Every split is enumerated when there are at most ``EXACT_LIMIT``; beyond that ``EXACT_LIMIT`` random
    permutations (fixed seed) give (hits + 1) / (EXACT_LIMIT + 1). Returns {"rho", "p", "n", "exact"}, or None when
    either side has a single value (no order to test) or there are under three pairs."""
    import itertools
    import math

    import numpy as np

    if len(x) != len(y):
        raise ValueError(f"spearman_trend needs pairs: {len(x)} x values and {len(y)} y values")
    n = len(x)
    if n < 3 or len(set(x)) < 2 or len(set(y)) < 2:
        return None
    rx, ry = mid_ranks([float(v) for v in x]), mid_ranks([float(v) for v in y])
    cx = [r - (n + 1) / 2 for r in rx]  # mid-ranks average (n + 1) / 2 however they tie
    cy = [r - (n + 1) / 2 for r in ry]
    norm = math.sqrt(sum(c * c for c in cx) * sum(c * c for c in cy))
    observed = sum(a * b for a, b in zip(cx, cy))
    tol = 1e-9 * norm
    groups: dict[float, int] = {}
    for r in cx:
        groups[r] = groups.get(r, 0) + 1
    levels, sizes = list(groups), list(groups.values())
    total = math.factorial(n) // math.prod(math.factorial(g) for g in sizes)
    if total <= EXACT_LIMIT:
        def splits(remaining: tuple[int, ...], k: int):
            if k == len(sizes) - 1:  # the last group takes what is left
                yield levels[k] * sum(cy[i] for i in remaining)
                return
            for chosen in itertools.combinations(remaining, sizes[k]):
                part = levels[k] * sum(cy[i] for i in chosen)
                rest = tuple(i for i in remaining if i not in chosen)
                for tail in splits(rest, k + 1):
                    yield part + tail

        hits = sum(abs(t) >= abs(observed) - tol for t in splits(tuple(range(n)), 0))
        p, exact = hits / total, True
    else:
        rng = np.random.default_rng(0)
        arr, weights = np.asarray(cy), np.asarray(cx)
        hits = done = 0
        while done < EXACT_LIMIT:
            chunk = min(10_000, EXACT_LIMIT - done)
            t = rng.permuted(np.tile(arr, (chunk, 1)), axis=1) @ weights
            hits += int((np.abs(t) >= abs(observed) - tol).sum())
            done += chunk
        p, exact = (hits + 1) / (EXACT_LIMIT + 1), False
    return {"rho": observed / norm, "p": p, "n": n, "exact": exact}


# Reflection words and phrases, matched as whole words, case-insensitively; "-" also matches a space or nothing
# ("double-check", "double check", "doublecheck"). Longer phrases are tried first and matches do not overlap, so
# "let me check" counts once.
REFLECTION_PHRASES: tuple[str, ...] = (
    "wait", "hmm", "however", "alternatively", "let me check", "check again", "verify", "re-check",
    "re-examine", "double-check", "re-evaluate", "reconsider", "hold on", "on second thought",
)


def _reflection_regex():
    import re

    parts = []
    for p in sorted(REFLECTION_PHRASES, key=len, reverse=True):
        words = [re.escape(w) for w in p.split()]
        parts.append(r"\s+".join(words).replace(r"\-", "[- ]?"))
    return re.compile(r"\b(?:" + "|".join(parts) + r")\b", re.IGNORECASE)


_REFLECTION_RE = _reflection_regex()


def count_reflections(text: str) -> int:
    """Number of reflection words/phrases (``REFLECTION_PHRASES``) in one response."""
    return sum(1 for _ in _REFLECTION_RE.finditer(text))


def reflection_rate(responses: list[str], num_tokens: list[int]) -> float:
    """Reflection words/phrases per 1k generated tokens, pooled over all responses (0.0 when there are no tokens)."""
    if len(responses) != len(num_tokens):
        raise ValueError(f"{len(responses)} responses but {len(num_tokens)} token counts")
    if any(t < 0 for t in num_tokens):
        raise ValueError("token counts must be >= 0")
    total = sum(num_tokens)
    if total == 0:
        return 0.0
    return 1000.0 * sum(count_reflections(r) for r in responses) / total


# ---------------------------------------------------------------------------------------------------------------
# THE table of evaluation metrics. Every reader takes its metrics from here, in this order:
# - both harnesses compute them (``stare.eval.summary.summarise``; ``stare.eval.lm_eval_tasks.utils.process_results``
#   per problem and ``stare.eval.lm_eval_harness.summarise``), ``problem_values`` and ``sample_values`` below;
# - ``stare.eval.summary`` writes them to summary.json (key, ``ci95`` for those with an interval) and summary.md
#   (name, digits, interval);
# - ``stare eval`` prints the ``printed`` ones (``stare.eval.summary.scores_line``);
# - the comparison (``stare.cli.report.runs.summarise_benches``, ``stare.cli.report.tables``) shows the ``compare`` ones.
# A new metric is one row in ``METRICS`` (and, when it is per problem, one entry in the lm-eval tasks' metric_list,
# which lm-eval needs to aggregate it: eval/lm_eval_tasks/_stare_aime_base.yaml; a test checks the two agree).


def problem_accuracy(correct: list[bool], extracted: list[str | None], k: int) -> float:
    """One problem's share of correct samples (avg@k is its mean over problems)."""
    return per_problem_accuracy([correct])[0]


def problem_pass_at_k(correct: list[bool], extracted: list[str | None], k: int) -> float:
    """One problem's unbiased pass@k from its samples (``pass_at_k``)."""
    return pass_at_k(len(correct), sum(bool(x) for x in correct), k)


def problem_majority(correct: list[bool], extracted: list[str | None], k: int) -> float:
    """1.0 when the problem's majority answer is correct (``majority_votes``), else 0.0."""
    return float(majority_votes([extracted], [correct])[0])


def mean_response_tokens(responses: list[str], num_tokens: list[int]) -> float:
    """Mean tokens per response (0.0 when there are no responses)."""
    return sum(num_tokens) / len(num_tokens) if num_tokens else 0.0


@dataclass(frozen=True)
class Metric:
    """One evaluation metric, as every reader of it sees it.

    ``key``: its summary.json key. ``name``: how summary.md, the CLI and the comparison name it ("{k}" is k).
    Computed either ``per_problem`` (the problem's correctness flags, extracted answers and k -> the problem's value;
    the metric is the mean over problems) or ``over_samples`` (the attempted samples' responses and token counts ->
    the value; None in summary.json where it cannot be measured). ``digits``: decimals in summary.md and on the CLI
    line; ``interval``: a 95% bootstrap interval over problems (summary.json ``ci95``, summary.md); ``printed``: on
    the line ``stare eval`` prints. ``compare``: how the comparison shows it: ``"bench"`` (a column per benchmark;
    the first such metric is the headline, with its interval and k), ``"pooled"`` (one column, from the first
    benchmark that measured it, under ``compare_name`` in comparison.json and ``compare_header`` in comparison.md,
    with ``compare_digits`` decimals), or None.
    """

    key: str
    name: str
    per_problem: Callable[[list[bool], list[str | None], int], float] | None = None
    over_samples: Callable[[list[str], list[int]], float] | None = None
    digits: int = 4
    interval: bool = False
    printed: bool = False
    compare: str | None = None
    compare_name: str | None = None
    compare_header: str | None = None
    compare_digits: int = 3

    def label(self, k) -> str:
        return self.name.format(k=k)


METRICS: list[Metric] = [
    Metric("avg_at_k", "avg@{k}", per_problem=problem_accuracy, interval=True, printed=True, compare="bench"),
    Metric("pass_at_k", "pass@{k}", per_problem=problem_pass_at_k, interval=True, printed=True, compare="bench"),
    Metric("maj_at_k", "maj@{k}", per_problem=problem_majority, interval=True, printed=True),
    Metric("mean_response_tokens", "mean response tokens", over_samples=mean_response_tokens, digits=1),
    Metric("reflection_per_1k_tokens", "reflection words per 1k tokens", over_samples=reflection_rate, digits=2,
           compare="pooled", compare_name="reflection", compare_header="reflection /1k tok", compare_digits=2),
]
PER_PROBLEM_ROW = "avg_at_k"  # the metric summary.json's per_problem rows carry, as "accuracy"


# The readers select from the table when they run (a row added to it, even by a test, reaches all of them).
def problem_metrics() -> list[Metric]:
    """The metrics computed per problem (a mean over problems), in table order."""
    return [m for m in METRICS if m.per_problem is not None]


def sample_metrics() -> list[Metric]:
    """The metrics computed over the attempted samples, in table order."""
    return [m for m in METRICS if m.over_samples is not None]


def compared(how: str) -> list[Metric]:
    """The metrics the comparison shows ``how`` ("bench": per benchmark, the first one the headline; "pooled")."""
    return [m for m in METRICS if m.compare == how]


def problem_values(correct: list[list[bool]], extracted: list[list[str | None]], k: int) -> dict[str, list[float]]:
    """Each per-problem metric's values, one per problem (``correct[i][j]``, ``extracted[i][j]``: sample j of
    problem i)."""
    _check_matrix(correct)
    if len(extracted) != len(correct):
        raise ValueError(f"extracted has {len(extracted)} problems but correct has {len(correct)}")
    return {m.key: [m.per_problem(c, e, k) for c, e in zip(correct, extracted)] for m in problem_metrics()}


def problem_means(values: dict[str, list[float]]) -> dict[str, float]:
    """Each per-problem metric as summary.json and eval.json report it: the mean of its per-problem values."""
    return {key: sum(v) / len(v) for key, v in values.items()}


def sample_values(responses: list[str], num_tokens: list[int]) -> dict[str, float]:
    """Each over-samples metric of the attempted samples' responses and token counts."""
    return {m.key: m.over_samples(responses, num_tokens) for m in sample_metrics()}
