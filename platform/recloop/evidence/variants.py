"""What one model version did over a period, as the serving journal counts it: the record the canary
judges and the monitor reads (``recloop.journal`` computes it; ``recloop.canary.decision`` decides on it).

Example::

    stats = VariantStats(requests=1200, errors=3, impressions=9000, clicks=420)
    stats.error_rate, stats.ctr   # 0.0025, 0.0467
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class VariantStats:
    """What one model version did over a period, from the serving journal: its evaluations (requests,
    errors, NaN answers, p99 of its own scoring time), the feedback on requests it served (impressions,
    clicks) and its online AUC over every impression it scored."""

    requests: int = 0
    errors: int = 0
    nan_responses: int = 0
    p99_ms: float = 0.0
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
        return {**asdict(self), "ctr": None if math.isnan(self.ctr) else self.ctr, "error_rate": self.error_rate}
