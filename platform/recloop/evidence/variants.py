"""What one model version did over a period, as the serving journal counts it: the record the canary
judges and the monitor reads (``recloop.journal`` computes it; ``recloop.canary.decision`` decides on it).

Example::

    stats = VariantStats(requests=1200, errors=3, impressions=9000, clicks=420)
    stats.error_rate, stats.ctr   # 0.0025, 0.0467
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class VariantStats:
    """What one model version did over a period, from the serving journal: its evaluations (requests,
    errors, NaN answers, p99 of its own scoring time), the feedback on requests it served (impressions,
    clicks) and its online AUC over every impression it scored."""

    requests: int = 0
    errors: int = 0
    nan_responses: int = 0
    p99_ms: float = 0.0
    # One-sided 95 % bounds on the true p99 (``p99_bounds``): the latency guardrail rolls back only when the
    # challenger's lower bound exceeds the allowed multiple of the champion's upper bound. None: not computed
    # (hand-built figures; ``p99_ms`` stands for both); 0 and inf: too few requests to bound it.
    p99_low_ms: float | None = None
    p99_high_ms: float | None = None
    impressions: int = 0
    clicks: int = 0
    online_auc: float | None = None

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    @property
    def ctr(self) -> float:
        return self.clicks / self.impressions if self.impressions else math.nan

    def to_dict(self) -> dict:
        record = {**asdict(self), "ctr": None if math.isnan(self.ctr) else self.ctr, "error_rate": self.error_rate}
        if record["p99_high_ms"] == math.inf:  # JSON has no infinity: no upper bound
            record["p99_high_ms"] = None
        return record


def p99_bounds(latencies_ms, confidence: float = 0.95, quantile: float = 0.99) -> tuple[float, float]:
    """Distribution-free one-sided ``confidence`` bounds on the ``quantile`` of the latencies' law, from their
    order statistics: the k-th smallest of n is below the quantile exactly when at least k of the n are, a
    Binomial(n, quantile) count. Lower: the largest k with P(count >= k) >= confidence; upper: the smallest k
    with P(count <= k - 1) >= confidence. Too few latencies give 0.0 and inf (for the p99's upper bound at 95 %
    that takes 299), so a guardrail built on them waits instead of acting on the maximum of a few requests:
    in the demo a healthy retriever was rolled back on 126 ms against 65 ms while training shared its cores."""
    from scipy.stats import binom

    x = np.sort(np.asarray(latencies_ms, dtype=np.float64))
    n = len(x)
    if n == 0:
        return 0.0, math.inf
    k = np.arange(1, n + 1)
    lower = np.nonzero(binom.sf(k - 1, n, quantile) >= confidence)[0]  # P(count >= k)
    upper = np.nonzero(binom.cdf(k - 1, n, quantile) >= confidence)[0]  # P(count <= k - 1)
    return (float(x[lower[-1]]) if len(lower) else 0.0), (float(x[upper[0]]) if len(upper) else math.inf)
