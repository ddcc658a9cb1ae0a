"""Sequential tests that stay valid however often they are looked at, and the variance reductions
that make them short.

A canary is judged at every controller step: a fixed-sample test looked at repeatedly rolls back an
identical challenger far more often than its nominal level. The mixture sequential probability ratio
test (mSPRT, Johari et al. 2017) with a normal mixture gives an *always-valid* confidence interval: the
probability that the true difference ever leaves it, over all looks, is at most ``alpha``.

For an estimate ``d`` of a difference with variance ``v`` (approximately normal) and a mixing scale
``tau`` (the effect size the test is tuned to: the canary's stated minimum effect)::

    Lambda(delta0) = sqrt(v / (v + tau^2)) * exp(tau^2 (d - delta0)^2 / (2 v (v + tau^2)))
    interval     = {delta0 : Lambda(delta0) < 1 / alpha}
                 = d ± sqrt(2 v (v + tau^2) / tau^2 * log(sqrt((v + tau^2) / v) / alpha))

Variances come from clusters (users), not from requests: one heavy user's requests are not
independent evidence (``cluster_mean``). ``cuped`` removes the part of a per-user metric that a
pre-experiment covariate predicts (Deng et al. 2013).

Example::

    mean, variance = cluster_mean(per_request_difference, user_ids)
    low, high = confidence_sequence(mean, variance, tau=0.01, alpha=0.05)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def confidence_sequence(estimate, variance, tau: float, alpha: float = 0.05):
    """The always-valid interval ``(low, high)`` around ``estimate`` (arrays broadcast).

    Args:
        estimate: the difference measured so far.
        variance: its variance (of the estimate, not of one observation).
        tau: the mixing scale, in the estimate's units: the test is most powerful against effects of
            about this size (the stated minimum effect).
        alpha: the probability, over every look, that the true value ever leaves the interval.
    """
    estimate = np.asarray(estimate, dtype=np.float64)
    v = np.maximum(np.asarray(variance, dtype=np.float64), 1e-300)
    t2 = float(tau) ** 2
    radius = np.sqrt(2.0 * v * (v + t2) / t2 * np.log(np.sqrt((v + t2) / v) / alpha))
    return estimate - radius, estimate + radius


def always_valid_p(estimate, variance, tau: float, null: float = 0.0):
    """The mSPRT p-value of ``estimate == null`` at this look: ``min(1, 1 / Lambda)`` (take the running
    minimum over looks for the sequence's p-value)."""
    d = np.asarray(estimate, dtype=np.float64) - null
    v = np.maximum(np.asarray(variance, dtype=np.float64), 1e-300)
    t2 = float(tau) ** 2
    log_lambda = 0.5 * np.log(v / (v + t2)) + t2 * d * d / (2.0 * v * (v + t2))
    return np.minimum(1.0, np.exp(-log_lambda))


def cluster_mean(values, clusters, weights=None) -> tuple[float, float]:
    """The mean of ``values`` (weighted) and its cluster-robust variance (clusters: e.g. user ids).

    The sandwich estimator of a ratio ``sum(w y) / sum(w)``: each cluster's residual
    ``sum_c w (y - mean)`` squared, summed, over ``(sum w)^2``, with the small-sample factor G/(G-1).
    """
    y = np.asarray(values, dtype=np.float64)
    w = np.ones_like(y) if weights is None else np.asarray(weights, dtype=np.float64)
    total = w.sum()
    if total <= 0:
        return float("nan"), float("nan")
    mean = float((w * y).sum() / total)
    _, index = np.unique(np.asarray(clusters), return_inverse=True)
    residual = np.bincount(index, weights=w * (y - mean))
    groups = len(residual)
    if groups < 2:
        return mean, float("inf")
    variance = float((residual**2).sum() / total**2 * groups / (groups - 1))
    return mean, variance


def cluster_totals(numerator, denominator, clusters) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each cluster's id (``np.unique`` order) and its summed numerator and denominator."""
    ids, index = np.unique(np.asarray(clusters), return_inverse=True)
    num = np.bincount(index, weights=np.asarray(numerator, dtype=np.float64), minlength=len(ids))
    den = np.bincount(index, weights=np.asarray(denominator, dtype=np.float64), minlength=len(ids))
    return ids, num, den


def linearized_totals(num: np.ndarray, den: np.ndarray) -> tuple[np.ndarray, float]:
    """The delta-method linearization of the ratio ``sum(num) / sum(den)`` over per-cluster totals: each
    cluster's ``(num - R * den) / mean den`` and ``R``."""
    if not len(num):  # no evidence yet
        return np.zeros(0), 0.0
    ratio = num.sum() / max(den.sum(), 1e-300)
    return (num - ratio * den) / max(den.mean(), 1e-300), float(ratio)


def ratio_linearized(numerator, denominator, clusters) -> tuple[np.ndarray, np.ndarray, float]:
    """Per-cluster totals and the delta-method linearization of a ratio metric (CTR = clicks / impressions).

    Returns the clusters' ids, each cluster's linearized value ``(clicks - R * impressions) / mean
    impressions`` (mean zero, variance = the ratio's variance times the number of clusters) and ``R``.
    """
    ids, num, den = cluster_totals(numerator, denominator, clusters)
    linear, ratio = linearized_totals(num, den)
    return ids, linear, ratio


def cuped(metric, covariate) -> tuple[np.ndarray, float]:
    """CUPED: ``metric - theta (covariate - mean covariate)`` with ``theta = cov / var`` (per unit, e.g.
    per user; the covariate measured before the experiment, so it cannot depend on the assignment).
    Returns the adjusted values and theta. Pool both arms when computing theta (``ab_difference`` does)."""
    y = np.asarray(metric, dtype=np.float64)
    x = np.asarray(covariate, dtype=np.float64)
    spread = x.var()
    theta = float(np.cov(x, y, bias=True)[0, 1] / spread) if spread > 0 else 0.0
    return y - theta * (x - x.mean()), theta


@dataclass(frozen=True)
class Difference:
    """A challenger − champion difference, its variance, and the always-valid interval at this look."""

    estimate: float
    variance: float
    low: float
    high: float
    units: int  # clusters (users) or requests it rests on
    method: str

    def to_dict(self) -> dict:
        return {
            "estimate": self.estimate,
            "variance": self.variance,
            "low": self.low,
            "high": self.high,
            "units": self.units,
            "method": self.method,
        }


def ab_difference(
    clicks_a,
    impressions_a,
    users_a,
    clicks_b,
    impressions_b,
    users_b,
    *,
    tau: float,
    alpha: float = 0.05,
    pre_a=None,
    pre_b=None,
    cap_quantile: float | None = 0.9,
    small_sample: bool = True,
) -> Difference:
    """Relative CTR difference ``CTR_b / CTR_a - 1`` of an A/B split by user, with per-user (cluster)
    errors, CUPED when pre-experiment per-user covariates are given (``pre_a``/``pre_b``: one value per
    *distinct* user of each arm in ``np.unique`` order, e.g. the user's CTR or clicks before the canary)
    and the always-valid interval (``tau``: the minimum relative effect).

    An A/B split compares different users, so a few very active users can make an arm's CTR theirs: the
    plain delta-method variance then claims far more certainty than there is (identical arms "significantly
    different" up to 69x more often than ``alpha`` at a canary's 5 % share; ``benchmarks/ab_validity.py``).
    Two guards, each off by its argument (both off: the plain delta method):

    - ``cap_quantile``: each user's impressions count at most the pooled ``cap_quantile`` quantile of users'
      impressions (their clicks scaled with them; capping a user's contribution, the usual winsorization
      of online experiments). Under identical models any weighting is centred on 0; the estimate is then
      the CTR with heavy users' weight capped (the cap is the data's, so it moves a little from look to look).
    - ``small_sample``: for the variance only (CUPED and the estimate use the plain values), each user's
      linearized value is divided by ``1 - h`` (``h``: the user's share of the arm's impressions; the
      jackknife's leverage correction: a dominant user pulls the arm's CTR to itself and hides its own
      residual), an arm without a click borrows the other arm's per-user spread (its own is 0, which
      claimed certainty), and the variance is widened so that the interval's normal tail at ``alpha``
      becomes Student's t (``student_widening``) with the Welch–Satterthwaite degrees of freedom of the two
      arms' *effective* numbers of users (Kish: ``(sum n)^2 / sum n^2``): 15 users of whom 3 make most
      requests are about 3 units of evidence, not 15. The degrees of freedom are a heuristic and the t
      quantile is matched at one look's ``alpha``, not derived for the always-valid boundary: what is
      measured is that identical arms' false significance stays at or below ``alpha`` where the plain
      interval was 4-69x over (``benchmarks/ab_validity.py``), with as much power where users are many.
    """
    per_user = [cluster_totals(clicks_a, impressions_a, users_a)[1:],
                cluster_totals(clicks_b, impressions_b, users_b)[1:]]
    method = "ratio, user clusters"
    if cap_quantile is not None and len(per_user[0][1]) and len(per_user[1][1]):
        cap = float(np.quantile(np.concatenate([per_user[0][1], per_user[1][1]]), cap_quantile))
        if cap > 0:
            scaled = []
            for clicks, shown in per_user:
                factor = np.minimum(shown, cap) / np.maximum(shown, 1e-300)
                scaled.append((clicks * factor, shown * factor))
            per_user = scaled
            method += f", impressions capped at p{cap_quantile * 100:g}"
    (num_a, den_a), (num_b, den_b) = per_user
    la, ra = linearized_totals(num_a, den_a)
    lb, rb = linearized_totals(num_b, den_b)
    if pre_a is not None and pre_b is not None and len(la) > 2 and len(lb) > 2:
        adjusted, _ = cuped(np.concatenate([la, lb]), np.concatenate([pre_a, pre_b]))
        la, lb = adjusted[: len(la)], adjusted[len(la) :]
        # The linearized values have mean zero per arm; after CUPED each arm's mean is its CTR's adjustment
        # (-theta times its covariate's distance from the pooled mean). The estimate takes it too: an
        # adjusted variance around the raw ratio made the interval narrower than the estimate's spread
        # (identical arms: 1.1 % "significantly worse" at one look against alpha's share of 0.1 %).
        ra, rb = ra + float(la.mean()), rb + float(lb.mean())
        la, lb = la - la.mean(), lb - lb.mean()
        method += ", CUPED"
    if ra <= 0 or len(la) < 2 or len(lb) < 2 or not den_b.sum():
        return Difference(float("nan"), float("inf"), -np.inf, np.inf, len(la) + len(lb), method)
    if small_sample:  # the leverage correction widens the variance only: CUPED and the estimate used the plain values
        la = la / np.maximum(1.0 - den_a / den_a.sum(), 1e-3)
        lb = lb / np.maximum(1.0 - den_b / den_b.sum(), 1e-3)
    # Variance of CTR_b / CTR_a by the delta method, from each arm's CTR variance:
    # var_b / ra^2 + (rb / ra)^2 var_a / ra^2 (the same as the log-ratio's, times the ratio squared).
    var_a = la.var(ddof=1) / len(la)
    var_b = lb.var(ddof=1) / len(lb)
    if small_sample and rb <= 0:  # no clicks in b: its own spread is 0, so borrow a's per-user spread
        var_b = max(var_b, la.var(ddof=1) / len(lb))
    part_a, part_b = (rb / ra) ** 2 * var_a / ra**2, var_b / ra**2
    estimate = rb / ra - 1.0
    variance = part_a + part_b
    if small_sample and variance > 0:
        degrees = welch_degrees(part_a, part_b, effective_units(den_a), effective_units(den_b))
        variance *= student_widening(alpha, degrees)
        method += f", t({degrees:.0f})"
    if not np.isfinite(variance):
        return Difference(float(estimate), float("inf"), -np.inf, np.inf, len(la) + len(lb), method)
    low, high = confidence_sequence(estimate, variance, tau, alpha)
    return Difference(float(estimate), float(variance), float(low), float(high), len(la) + len(lb), method)


def effective_units(weights) -> float:
    """Kish's effective number of units of a weighted mean: ``(sum w)^2 / sum w^2`` (all equal: their
    count; one dominant: about 1)."""
    w = np.asarray(weights, dtype=np.float64)
    squares = float((w * w).sum())
    return float(w.sum() ** 2 / squares) if squares > 0 else 0.0


def welch_degrees(part_a: float, part_b: float, units_a: float, units_b: float) -> float:
    """Welch–Satterthwaite degrees of freedom of a sum of two variances estimated from ``units_a`` and
    ``units_b`` (effective) units; at least 1."""
    a, b = part_a**2 / max(units_a - 1.0, 1.0), part_b**2 / max(units_b - 1.0, 1.0)
    return max(1.0, (part_a + part_b) ** 2 / (a + b)) if a + b > 0 else 1.0


def student_widening(alpha: float, degrees: float) -> float:
    """The factor by which to multiply a variance estimated from ``degrees`` degrees of freedom so that a
    normal interval at level ``alpha`` becomes Student's t's: ``(t_{alpha/2, degrees} / z_{alpha/2})^2``
    (1 for many degrees of freedom; 2.2 at alpha 0.05 and 3.6 degrees; 8.9 at alpha 0.001). Matched at
    ``alpha`` rather than at the always-valid boundary's own (far smaller) one-look tail: the latter widened
    a few-user arm's interval by 10^4 and its power to nothing, while this keeps identical arms' false
    significance at or below alpha (``benchmarks/ab_validity.py``)."""
    from scipy import stats

    with np.errstate(over="ignore"):
        return float(np.square(stats.t.isf(alpha / 2.0, degrees) / stats.norm.isf(alpha / 2.0)))


def paired_difference(
    difference,
    clusters,
    *,
    tau: float,
    alpha: float = 0.05,
    scale: float = 1.0,
    method: str = "paired, user clusters",
) -> Difference:
    """The mean of per-unit differences (e.g. per interleaved request: challenger's credited clicks −
    champion's), its cluster-robust variance and the always-valid interval, all divided by ``scale``
    (e.g. the champion's clicks per request, so the effect is relative)."""
    mean, variance = cluster_mean(difference, clusters)
    mean, variance = mean / scale, variance / scale**2
    low, high = confidence_sequence(mean, variance, tau, alpha)
    return Difference(
        float(mean), float(variance), float(low), float(high), int(len(np.unique(clusters))), method
    )


def interleaving_difference(
    champion_clicks, challenger_clicks, clusters, *, tau: float, alpha: float = 0.05
) -> Difference:
    """Relative preference of an interleaving experiment: ``sum(challenger credit) / sum(champion credit) - 1``
    over the interleaved requests, with the delta-method variance over user clusters and the always-valid
    interval (``tau``: the minimum relative effect)."""
    ids, linear, ratio = ratio_linearized(challenger_clicks, champion_clicks, clusters)
    if len(ids) < 2 or not np.asarray(champion_clicks).sum():
        return Difference(
            float("nan"), float("inf"), -np.inf, np.inf, len(ids), "interleaving, user clusters"
        )
    variance = float(linear.var(ddof=1) / len(ids))
    low, high = confidence_sequence(ratio - 1.0, variance, tau, alpha)
    return Difference(
        float(ratio - 1.0), variance, float(low), float(high), len(ids), "interleaving, user clusters"
    )


def _auc_influence(labels: np.ndarray, scores: np.ndarray) -> tuple[float, np.ndarray]:
    """Pooled AUC (ties half) and each row's first-order influence on it (the DeLong structural components:
    a positive row's share of negatives it outranks minus the AUC, over the positives; a negative row's share
    of positives above it minus the AUC, over the negatives). Summed per cluster, they give the AUC's
    cluster-robust variance."""
    positive = labels.astype(bool)
    pos, neg = np.sort(scores[positive]), np.sort(scores[~positive])
    m, n = len(pos), len(neg)
    below = (np.searchsorted(neg, scores[positive], "left") + np.searchsorted(neg, scores[positive], "right")) / 2
    above = m - (np.searchsorted(pos, scores[~positive], "left") + np.searchsorted(pos, scores[~positive], "right")) / 2
    v10, v01 = below / n, above / m
    value = float(v10.mean())
    influence = np.empty(len(scores))
    influence[positive] = (v10 - value) / m
    influence[~positive] = (v01 - value) / n
    return value, influence


def paired_auc_difference(labels, champion_scores, challenger_scores, clusters, *, tau: float,
                          alpha: float = 0.05) -> Difference:
    """Online AUC of the challenger − the champion's, *on the same impressions* (both models scored every
    request the difference rests on: interleaved, shadowed or paired requests), with a user-cluster
    variance (each user's summed DeLong influences of both AUCs' difference) and the always-valid interval
    (``tau``: the AUC difference the test is tuned to, the guardrail's margin).

    Paired on the same rows, the user mix cancels: the champion's AUC pooled over every request against the
    challenger's over its share of users compared two populations, and moved by 0.02 on user mix alone in a
    quarter of an identical challenger's canaries. An identical challenger's difference is exactly 0.
    """
    y = np.asarray(labels).astype(bool)
    a = np.asarray(champion_scores, dtype=np.float64)
    b = np.asarray(challenger_scores, dtype=np.float64)
    groups = np.asarray(clusters)
    users = int(len(np.unique(groups))) if len(groups) else 0
    method = "paired online AUC, user clusters"
    if users < 2 or y.all() or not y.any():
        return Difference(float("nan"), float("inf"), -np.inf, np.inf, users, method)
    auc_a, influence_a = _auc_influence(y, a)
    auc_b, influence_b = _auc_influence(y, b)
    _, index = np.unique(groups, return_inverse=True)
    per_user = np.bincount(index, weights=influence_b - influence_a)
    variance = float((per_user**2).sum() * users / (users - 1))
    estimate = auc_b - auc_a
    low, high = confidence_sequence(estimate, variance, tau, alpha)
    return Difference(float(estimate), variance, float(low), float(high), users, method)
