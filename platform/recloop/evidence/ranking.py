"""Ranking metrics per request, paired comparisons of two models over users, multiple comparisons, power.

Pooled AUC over all rows rewards separating users (an active user's clicks against a quiet user's
non-clicks) as much as ranking within a request. ``grouped_auc`` averages the AUC within each group
(a request, or a user when the data has no requests), weighted by the group's impressions; groups with
one class only say nothing and are left out. ``ndcg_at_k`` uses a gain per row (a label, or the true
click probability in simulation).

``paired_bootstrap`` compares two models scored on the same rows: it resamples *users* (clusters), so a
heavy user's many rows count as one unit of evidence, and returns the difference with its interval and a
one-sided p-value of "the candidate is worse by more than ``margin``". ``holm`` controls the
family-wise error across slices; ``min_rows_for_auc_difference`` is the rows a slice needs before a
drop of the gate's size can be told from noise (Hanley–McNeil variance, paired correlation).

Example::

    result = paired_bootstrap(labels, cand, champ, groups=users, metric="gauc", rng=rng)
    result.difference, result.low, result.high, result.p_worse
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import stats


def _group_index(groups) -> tuple[np.ndarray, int]:
    _, index = np.unique(np.asarray(groups), return_inverse=True)
    return index, int(index.max()) + 1 if len(index) else 0


def per_group_auc(labels, scores, groups) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """AUC within each group (ties half), vectorised. Returns the group index of each usable group (both
    classes present), its AUC and its weight (impressions)."""
    y = np.asarray(labels).astype(bool)
    s = np.asarray(scores, dtype=np.float64)
    index, count = _group_index(groups)
    if not count:
        return np.array([], dtype=np.int64), np.array([]), np.array([])
    # rank within group: sort by (group, score), average ranks for ties within a group
    order = np.lexsort((s, index))
    g, ss, yy = index[order], s[order], y[order]
    n = len(g)
    boundary = np.ones(n, dtype=bool)
    boundary[1:] = (g[1:] != g[:-1]) | (ss[1:] != ss[:-1])
    run = np.cumsum(boundary) - 1
    run_start = np.flatnonzero(boundary)
    run_len = np.diff(np.append(run_start, n))
    group_start = np.zeros(count, dtype=np.int64)
    firsts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
    group_start[g[firsts]] = firsts
    # 1-based average rank within the group
    rank = run_start[run] - group_start[g] + (run_len[run] + 1) / 2.0
    pos = np.bincount(g, weights=yy, minlength=count)
    size = np.bincount(g, minlength=count).astype(np.float64)
    neg = size - pos
    rank_sum = np.bincount(g, weights=rank * yy, minlength=count)
    usable = (pos > 0) & (neg > 0)
    auc = np.where(usable, (rank_sum - pos * (pos + 1) / 2) / np.maximum(pos * neg, 1), np.nan)
    keep = np.flatnonzero(usable)
    return keep, auc[keep], size[keep]


def grouped_auc(labels, scores, groups) -> float:
    """Impression-weighted mean of the per-group AUC (NaN when no group has both classes)."""
    _, auc, weight = per_group_auc(labels, scores, groups)
    return float((auc * weight).sum() / weight.sum()) if len(auc) else float("nan")


def per_group_ndcg(gains, scores, groups, k: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """NDCG@k within each group: the rows ranked by ``scores``, ``gains`` as relevance (2^g - 1 not used:
    gains are probabilities or labels). Returns the group index of groups with any gain, and their NDCG."""
    gain = np.asarray(gains, dtype=np.float64)
    s = np.asarray(scores, dtype=np.float64)
    index, count = _group_index(groups)
    if not count:
        return np.array([], dtype=np.int64), np.array([])

    def dcg(key):
        order = np.lexsort((-key, index))
        g = index[order]
        firsts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
        start = np.zeros(count, dtype=np.int64)
        start[g[firsts]] = firsts
        position = np.arange(len(g)) - start[g]
        weight = np.where(position < k, 1.0 / np.log2(position + 2.0), 0.0)
        return np.bincount(g, weights=gain[order] * weight, minlength=count)

    ideal = dcg(gain)
    got = dcg(s)
    keep = np.flatnonzero(ideal > 0)
    return keep, got[keep] / ideal[keep]


def ndcg_at_k(gains, scores, groups, k: int = 10) -> float:
    _, values = per_group_ndcg(gains, scores, groups, k)
    return float(values.mean()) if len(values) else float("nan")


@dataclass(frozen=True)
class PairedResult:
    """Candidate − champion on the same rows: the difference, its bootstrap interval, and the one-sided
    p-value that the candidate is worse by more than the margin (small: it is)."""

    metric: str
    candidate: float
    champion: float
    difference: float
    low: float
    high: float
    p_worse: float
    margin: float
    units: int

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _unit_contributions(metric: str, labels, candidate, champion, groups, units, k: int):
    """Per unit (cluster): numerator and weight of each model's metric, so a resampled metric is
    ``sum(count * num) / sum(count * weight)``."""
    unit_index, n_units = _group_index(units)
    group_index, _ = _group_index(groups)
    # each group belongs to one unit (a request to its user): take the first row's unit
    group_unit = np.zeros(group_index.max() + 1 if len(group_index) else 0, dtype=np.int64)
    group_unit[group_index] = unit_index
    out = []
    for scores in (candidate, champion):
        if metric == "gauc":
            keep, value, weight = per_group_auc(labels, scores, group_index)
        elif metric == "ndcg":
            keep, value = per_group_ndcg(labels, scores, group_index, k)
            weight = np.ones_like(value)
        else:
            raise ValueError(f"unknown metric {metric!r}: gauc or ndcg")
        num = np.bincount(group_unit[keep], weights=value * weight, minlength=n_units)
        den = np.bincount(group_unit[keep], weights=weight, minlength=n_units)
        out.append((num, den))
    return out, n_units


def _pooled_auc_resamples(labels, scores, row_weights: np.ndarray, chunk: int = 50) -> np.ndarray:
    """Pooled AUC under each row of ``row_weights`` (resamples × rows): weighted Mann-Whitney, ties half."""
    y = np.asarray(labels).astype(bool)
    s = np.asarray(scores, dtype=np.float64)
    order = np.argsort(s, kind="stable")
    y, s = y[order], s[order]
    # rows with equal scores form one run: a positive gets half the negatives of its own run
    new_run = np.r_[True, s[1:] != s[:-1]]
    starts = np.flatnonzero(new_run)
    run = np.cumsum(new_run) - 1
    out = []
    for begin in range(0, len(row_weights), chunk):
        w = row_weights[begin : begin + chunk][:, order]
        negative = w * ~y
        positive = w * y
        run_negative = np.add.reduceat(negative, starts, axis=1)
        below = np.cumsum(run_negative, axis=1) - run_negative  # negatives in lower runs
        credit = below[:, run] + 0.5 * run_negative[:, run]
        total = positive.sum(axis=1) * negative.sum(axis=1)
        out.append((positive * credit).sum(axis=1) / np.maximum(total, 1e-300))
    return np.concatenate(out)


def paired_bootstrap(
    labels,
    candidate,
    champion,
    groups,
    units=None,
    *,
    metric: str = "gauc",
    margin: float = 0.0,
    resamples: int = 1000,
    k: int = 10,
    confidence: float = 0.95,
    rng: np.random.Generator | None = None,
) -> PairedResult:
    """Paired bootstrap over ``units`` (users; default: the groups themselves) of the candidate − champion
    difference in grouped AUC (``gauc``), NDCG@k (``ndcg``; ``labels`` are the gains) or pooled AUC
    (``auc``: for data whose groups rarely hold both classes; still resampled by user).

    Each resample draws every unit's multiplicity from Poisson(1) (vectorised), so both models see the
    same users the same number of times.
    """
    rng = rng or np.random.default_rng(0)
    units = groups if units is None else units
    if metric == "auc":
        return _paired_pooled_auc(labels, candidate, champion, units, margin, resamples, confidence, rng)
    ((cn, cd), (hn, hd)), n_units = _unit_contributions(metric, labels, candidate, champion, groups, units, k)
    cand, champ = cn.sum() / max(cd.sum(), 1e-300), hn.sum() / max(hd.sum(), 1e-300)
    diff = float(cand - champ)
    if n_units < 2 or cd.sum() == 0:
        return PairedResult(metric, float(cand), float(champ), diff, -np.inf, np.inf, 1.0, margin, n_units)
    draws = rng.poisson(1.0, size=(resamples, n_units)).astype(np.float64)
    boot = draws @ cn / np.maximum(draws @ cd, 1e-300) - draws @ hn / np.maximum(draws @ hd, 1e-300)
    tail = (1 - confidence) / 2
    low, high = np.quantile(boot, [tail, 1 - tail])
    # one-sided p of "difference <= -margin" being the truth vs not: share of resamples not below -margin,
    # centred (basic bootstrap): H0 "drop is at most margin", rejected when the whole mass is below -margin.
    se = float(boot.std(ddof=1))
    # with no spread (the same scores on every resample) the limit of the above: 1 unless the drop exceeds margin
    p_worse = float(stats.norm.sf((-margin - diff) / se)) if se > 0 else float(diff >= -margin)
    return PairedResult(
        metric, float(cand), float(champ), diff, float(low), float(high), p_worse, margin, n_units
    )


def _paired_pooled_auc(
    labels, candidate, champion, units, margin, resamples, confidence, rng
) -> PairedResult:
    """Pooled AUC of both models, resampling users (each row weighted by its user's Poisson draw)."""
    from recloop.evaluate import auc

    index, n_units = _group_index(units)
    cand, champ = auc(labels, candidate), auc(labels, champion)
    diff = float(cand - champ)
    if n_units < 2 or not np.isfinite(diff):
        return PairedResult("auc", float(cand), float(champ), diff, -np.inf, np.inf, 1.0, margin, n_units)
    boot = np.empty(resamples)
    for start in range(0, resamples, 50):  # (50, rows) weights at a time: the same draws, bounded memory
        weights = rng.poisson(1.0, size=(min(50, resamples - start), n_units)).astype(np.float64)[:, index]
        boot[start:start + len(weights)] = _pooled_auc_resamples(labels, candidate, weights) - _pooled_auc_resamples(
            labels, champion, weights
        )
    tail = (1 - confidence) / 2
    low, high = np.quantile(boot, [tail, 1 - tail])
    se = float(boot.std(ddof=1))
    # with no spread (the same scores on every resample) the limit of the above: 1 unless the drop exceeds margin
    p_worse = float(stats.norm.sf((-margin - diff) / se)) if se > 0 else float(diff >= -margin)
    return PairedResult(
        "auc", float(cand), float(champ), diff, float(low), float(high), p_worse, margin, n_units
    )


def paired_logloss(labels, candidate, champion, units, *, resamples: int = 1000, confidence: float = 0.95,
                   rng: np.random.Generator | None = None) -> PairedResult:
    """Candidate − champion log loss on the same rows (negative: the candidate is better), with a paired
    bootstrap interval over ``units`` (users, or rows: every row its own unit), each unit's rows weighted by
    its Poisson(1) draw. ``p_worse``: the one-sided p-value that the candidate's log loss is higher.

    Example::

        paired_logloss(labels, model_p, logistic_p, users).high < 0   # the model's log loss is lower
    """
    from recloop.evaluate import log_loss

    rng = rng or np.random.default_rng(0)
    y = np.asarray(labels, dtype=np.float64)
    clip = lambda p: np.clip(np.asarray(p, dtype=np.float64), 1e-7, 1 - 1e-7)  # noqa: E731
    a, b = clip(candidate), clip(champion)
    per_row = -(y * np.log(a) + (1 - y) * np.log(1 - a)) + (y * np.log(b) + (1 - y) * np.log(1 - b))
    index, n_units = _group_index(units)
    cand, champ = log_loss(y, a), log_loss(y, b)
    diff = float(cand - champ)
    if n_units < 2 or not np.isfinite(diff):
        return PairedResult("logloss", cand, champ, diff, -np.inf, np.inf, 1.0, 0.0, n_units)
    unit_sum = np.bincount(index, weights=per_row, minlength=n_units)
    unit_rows = np.bincount(index, minlength=n_units).astype(np.float64)
    boot = np.empty(resamples)
    for start in range(0, resamples, 100):  # (chunk, units) Poisson weights at a time: bounded memory
        weights = rng.poisson(1.0, size=(min(100, resamples - start), n_units)).astype(np.float64)
        boot[start:start + len(weights)] = (weights @ unit_sum) / np.maximum(weights @ unit_rows, 1.0)
    tail = (1 - confidence) / 2
    low, high = np.quantile(boot, [tail, 1 - tail])
    se = float(boot.std(ddof=1))
    p_worse = float(stats.norm.sf(-diff / se)) if se > 0 else float(diff > 0)
    return PairedResult("logloss", cand, champ, diff, float(low), float(high), p_worse, 0.0, n_units)


def holm(p_values) -> np.ndarray:
    """Holm–Bonferroni adjusted p-values (family-wise error control at any level)."""
    p = np.asarray(p_values, dtype=np.float64)
    m = len(p)
    if not m:
        return p
    order = np.argsort(p)
    adjusted = np.minimum(1.0, np.maximum.accumulate(p[order] * (m - np.arange(m))))
    out = np.empty(m)
    out[order] = adjusted
    return out


def auc_variance(auc: float, positives: float, negatives: float) -> float:
    """Hanley & McNeil's variance of an AUC estimate."""
    q1, q2 = auc / (2 - auc), 2 * auc * auc / (1 + auc)
    return max(
        (auc * (1 - auc) + (positives - 1) * (q1 - auc * auc) + (negatives - 1) * (q2 - auc * auc))
        / max(positives * negatives, 1e-300),
        0.0,
    )


def min_rows_for_auc_difference(
    delta: float,
    auc: float = 0.7,
    positive_rate: float = 0.1,
    alpha: float = 0.05,
    power: float = 0.8,
    correlation: float = 0.5,
    design_effect: float = 1.0,
) -> int:
    """Rows a slice needs so that a paired AUC drop of ``delta`` is found with ``power`` by a one-sided
    test at ``alpha`` (both models on the same rows, their AUCs correlated ``correlation``; clustered
    rows inflate the variance by ``design_effect``)."""
    z = stats.norm.ppf(1 - alpha) + stats.norm.ppf(power)
    low, high = 10, 10_000_000
    while low < high:
        n = (low + high) // 2
        pos = max(n * positive_rate, 1.0)
        var = 2 * (1 - correlation) * auc_variance(auc, pos, n - pos) * design_effect
        if delta >= z * np.sqrt(var):
            high = n
        else:
            low = n + 1
    return int(low)
