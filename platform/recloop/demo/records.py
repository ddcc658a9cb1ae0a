"""What the demo is configured with (``DemoConfig``) and what it records of each day (``DayRecord``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from recloop.canary import CanaryConfig
from recloop.canary.decision import shipped
from recloop.gate import GateThresholds


@dataclass(frozen=True)
class DemoConfig:
    """Args:
    days: simulated days (day 0 bootstraps the first model).
    events_per_day: the world's own impressions per day (the logged traffic every retrain learns from).
    requests_per_day: ranking requests simulated users send to the serving API per day.
    rounds: the day's requests come in this many rounds; the canary is judged after each.
    drift, drift_day: the world's drift scenario and its first day (counted from 0; within ``days`` unless the
        scenario is ``none``: a drift past the last day would be a world without one, under another name).
    cooldown_days: after a drift-triggered retrain, no other for this long (simulated time).
    """

    days: int = 5
    events_per_day: int = 20_000
    requests_per_day: int = 400
    rounds: int = 4
    seed: int = 0
    drift: str = "sudden"
    drift_day: int = 2
    cooldown_days: float = 1.5
    full_epochs: int = 3
    # an incremental retrain also replays older hours, this share of its new ones (TrainConfig.replay_fraction;
    # the retrain flow's default: +0.018 held-out AUC [0.005, 0.030] over none along the loop's chain)
    replay_fraction: float = 1.0
    # a scheduled retrain starts over from scratch once the champion's chain of incremental runs spans this
    # many days (the retrain flow's ``full_every_hours``; 0: never): a chain trails a full retrain over the
    # same days, by 0.05 normalized reward on the panel on average over 6 days (benchmarks/RESULTS.md)
    full_every_days: float = 3.0
    batch_size: int | None = None  # default: about 32 steps per day of events
    candidates: int = 100
    shown: int = 10
    panel_requests: int = 300
    twin: bool = False
    # The upper reference: each day also a full retrain from scratch on every day so far (not registered, not
    # served), scored on the next day's panel beside the live champion ("daily_full").
    daily_full: bool = False
    # The reference's seeds: "daily_full" on the panel is the mean, request by request, of this many full
    # retrains differing only in their seed. On 10,000-event days two retrains of the same rows land 0.05 apart
    # in normalized reward (sd; benchmarks/RESULTS.md, "One retrain is one draw"), so against one seed "the
    # loop − the daily full retrain" is mostly that seed's luck.
    reference_seeds: int = 1
    # The ranker's training seed in every retrain (TrainConfig.seed); the reference's are train_seed + 0..K-1.
    # Seeds are not exchangeable across worlds (benchmarks/RESULTS.md, "The grid again"): a grid over world
    # seeds varies this with them, so that no one seed's luck sits in the loop or in its reference.
    train_seed: int = 0
    # The recommendation path: this share of each round's requests goes to /recommend, which retrieves
    # ``retrieve_k`` of the catalog (a few hundred items in this small world) for the ranker.
    # Items shown to a user within ``seen_hours`` (simulated) are not recommended again: a few hours, as
    # this small world's catalog would be exhausted by its most active users within a day.
    recommend_share: float = 0.5
    retrieve_k: int = 100
    seen_hours: float = 3.0
    # The shipped canary's margins (``canary.decision.shipped``: 5 % minimum effect, paired online AUC), at
    # the pace of a small world judged a few hundred requests at a time: the ranker's canary starts at half
    # of the users (interleaved lists: half of each list is still the champion's) and is judged without a
    # bake. A few hundred interleaved requests a day cannot show a 5 % non-inferiority: such a challenger is
    # held at the last step ("not yet shown within 5 %") rather than promoted on a margin that admits worse
    # models, and the next day's retrain replaces it once it has waited a day (the retrain flow's
    # ``canary_wait_hours``).
    canary: CanaryConfig = field(default_factory=lambda: shipped(
        steps=(0.5, 1.0), bake_seconds=0, min_requests=15, min_feedback=100))
    # Held-out windows of a few thousand rows: an incremental model may lose up to 0.01 AUC, and calibration
    # is measured within ±25 % (noise at this size; the defaults suit production windows). The baselines are
    # reported, not enforced: the first day's model learns from one simulated day, and the demo shows the
    # loop from there (the shipped gate refuses a model that loses to logistic regression).
    gate: GateThresholds = field(default_factory=lambda: GateThresholds(
        max_auc_drop_incremental=0.01, max_slice_auc_drop=0.03, calibration_range=(0.75, 1.33),
        baseline_auc_margin=None, baseline_logloss_margin=None))

    def __post_init__(self) -> None:
        if self.drift != "none" and not 0 <= self.drift_day < self.days:
            raise ValueError(f"drift_day {self.drift_day} is outside the {self.days} simulated days (0..{self.days - 1}): "
                             f"the '{self.drift}' world would hold no drift")


@dataclass
class DayRecord:
    day: int
    events: int = 0
    requests: int = 0
    drift: str = "-"
    drift_reasons: list[str] = field(default_factory=list)
    trigger: str = "-"  # the retrain trigger's verdict on the drift check (why a finding did or did not retrain)
    retrain: str = "-"
    candidate_version: str | None = None
    candidate_auc: float | None = None
    champion_auc: float | None = None
    oracle_auc: float | None = None
    gate: str = "-"
    retriever_version: str | None = None
    retriever_gate: str = "-"
    retriever_oracle_recall: float | None = None
    popularity_oracle_recall: float | None = None
    retriever_champion: str | None = None
    recommend_requests: int = 0
    recommend_clicks: int = 0
    recommend_vs_oracle: float | None = None
    popularity_answers: int = 0
    canary: list[str] = field(default_factory=list)
    # each canary move of the day (start, step, promote, rollback) with the evidence that decided it
    # (``canary.explain``'s columns, and ``day``, ``model``, ``version``, ``champion``)
    decisions: list[dict] = field(default_factory=list)
    champion: str | None = None
    online_ctr: dict[str, float] = field(default_factory=dict)
    # the champion's CTR on its served feedback in the night's monitored window (/rank and /recommend): the
    # figure the drift monitor judges and Evidently's KPI panels plot (``dashboards.online_ctr``)
    monitor_ctr: float | None = None
    vs_oracle: float | None = None
    baseline_vs_oracle: float | None = None
    panel: dict[str, dict[str, float]] = field(default_factory=dict)
    seconds: float = 0.0
