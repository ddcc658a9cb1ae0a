"""The monitor's pure core: drift, KPI decay and data quality → a decision, and whether it retrains.

A recent window of events is compared with the newest stretch of the champion's training window
(``choose_windows``).

Findings, in the order they decide:

1. **data quality** — a column that suddenly arrives null or constant is its own finding, not drift:
   retraining on broken data would teach the model the breakage, so it alerts and does not retrain;
2. **KPI decay** — online CTR (and AUC) per model version against the baseline recorded when the
   champion was promoted (fed by serving; none yet: the decision then rests on the data); and **concept
   drift** (``monitor.concept``): the champion's calibration on served feedback, overall and per segment
   (changed tastes move it while the inputs look the same);
3. **drift** — Evidently's ``DataDriftPreset`` over the context and item columns (per-column methods and
   thresholds as Evidently chooses them for the sample size), judged by the share of drifted columns, over
   the world's own events (the impressions serving chose left out of both windows: ``world_rows``);
   and, for entity keys, the share of recent events on ids the reference never saw beyond what an
   unchanged world shows (a new catalog wave is that, more than any distribution distance over thousands
   of ids; ``new_id_findings``); and **prediction drift**: the
   champion's scores on the recent window's feature rows against its scores on the reference window's
   (the same Evidently test, on the one ``prediction`` column) — reported in ``notes``, and deciding
   only when ``prediction_drift_decides`` is set (see ``MonitorConfig``);
4. otherwise **ok**.

Then the trigger (``should_retrain``): ``drift`` and ``kpi_decay`` request a full retrain, ``data_quality``
alerts and does not retrain (training on a broken column teaches the model the breakage). The cool-down
starts when a retrain is *deployed* (passed the gate), so a drift that persists until the new model is
out cannot start a storm of retrains, and while the version it made is still the challenger (its canary
running, the old champion serving) nothing more is asked; a retrain the gate *refused* blocks nothing: the next check asks
again, with the gate's reasons attached. A request whose outcome is not known yet (in flight, or run
elsewhere) holds further requests for the cool-down from the request.

Everything here is pure; ``monitor.drift`` computes the Evidently figures and ``monitor.runner`` does the IO.

Example::

    reference, current = choose_windows(newest_event, hours=24, trained=champion_window, reference_days=7)
    decision = decide(quality, kpi, share, drifted, new_ids, MonitorConfig())
    should_retrain(decision, last_requested_at=None, now=time.time(), config=TriggerConfig()).retrain
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Literal

import pandas as pd

Outcome = Literal["ok", "drift", "kpi_decay", "data_quality", "insufficient_data"]


@dataclass(frozen=True)
class MonitorConfig:
    """What counts as drift, decay or broken data.

    Args:
        drift_share: dataset drift when at least this share of the monitored columns drifted.
        new_id_share: drift when at least this share of recent events come from entity ids outside the
            reference's world (a new catalog, a new user base): their unseen ids beyond the share an
            unchanged world shows (Good-Turing, from the reference; ``new_id_findings``), ``new_id_z``
            standard errors beyond it too.
        null_jump: a column whose null share rose by more than this is broken.
        sample_rows: rows sampled from each window.
        prediction_drift: the champion's scores drifted when their drift score reaches this. Evidently's
            default for one column (0.1) flags ordinary days at tens of thousands of rows: the demo's
            days without drift measure 0.05-0.17, its sudden drift 0.49.
        prediction_drift_decides: whether prediction drift alone makes the decision ``drift``. Off by default:
            the model's inputs include entity counts that grow as history accumulates, so its scores move on
            ordinary days while the world warms up (0.43 on day 1 of a 4,000-events-a-day world); found,
            it is reported in ``notes``, the figures, MLflow and the dashboards.
        max_ctr_drop: relative drop of online CTR against the promotion baseline that counts as decay.
        max_auc_drop: absolute drop of online AUC (from feedback) against the baseline that counts as decay.
        kpi_z: and a CTR or AUC drop must be this many standard errors (both sides' impressions), when known.
        min_impressions: feedback impressions the window needs before its KPIs are judged.
        max_calibration_error, concept_alpha, min_segment_impressions: concept drift (``monitor.concept``):
            the champion's calibration on served feedback (predicted / observed CTR), overall and per
            segment of at least ``min_segment_impressions``, off by more than this, significant at
            ``concept_alpha`` after Holm (user-cluster errors), is KPI decay: a retrain; so is a segment's
            online CTR ``max_ctr_drop`` below the champion's own earlier served traffic. 0.05: gradual drift
            found within 2 days in 92 % of 40 simulated worlds, 0 false alarms in 200 checks without drift
            (``benchmarks/loop.py``; at 0.01, 70 %).
        min_rows: events each window needs before drift is decided at all; below it the decision is
            ``insufficient_data`` (never a retrain): two rows against three say nothing.
        per_column_method, per_column_threshold: Evidently's drift test and threshold for named columns
            (e.g. ``{"price": "psi"}``, ``{"price": 0.2}``); the others get Evidently's choice for their
            type and sample size.
    """

    drift_share: float = 0.3
    new_id_share: float = 0.3
    new_id_z: float = 3.0
    null_jump: float = 0.5
    sample_rows: int = 50_000
    prediction_drift: float = 0.3
    prediction_drift_decides: bool = False
    max_ctr_drop: float = 0.10
    max_auc_drop: float = 0.03
    kpi_z: float = 3.0
    min_impressions: int = 2000
    max_calibration_error: float = 0.2
    concept_alpha: float = 0.05
    min_segment_impressions: int = 1000
    min_rows: int = 200
    seed: int = 0
    per_column_method: dict[str, str] = field(default_factory=dict)
    per_column_threshold: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class MonitorDecision:
    decision: Outcome
    reasons: tuple[str, ...]
    drift_share: float
    drifted_columns: tuple[str, ...]
    kpi: dict[str, float | None] = field(default_factory=dict)
    figures: dict[str, float] = field(default_factory=dict)
    notes: tuple[str, ...] = ()  # findings reported for review that did not take part in the decision

    def to_dict(self) -> dict:
        out = asdict(self)
        out["reasons"], out["drifted_columns"] = list(self.reasons), list(self.drifted_columns)
        out["notes"] = list(self.notes)
        return out


# --- pure checks ---------------------------------------------------------------------------------------------


def quality_findings(reference: pd.DataFrame, current: pd.DataFrame, columns: list[str],
                     config: MonitorConfig) -> list[str]:
    """Columns that went null or constant in the current window (while they were not in the reference)."""
    findings = []
    for column in columns:
        before, now = reference[column].isna().mean(), current[column].isna().mean()
        if now - before > config.null_jump:
            findings.append(f"{column}: {now:.0%} null (reference {before:.0%})")
            continue
        if current[column].nunique(dropna=True) <= 1 < reference[column].nunique(dropna=True):
            findings.append(f"{column}: constant in the current window")
    return findings


def world_rows(reference: pd.DataFrame, current: pd.DataFrame, served: tuple[set[str], set[str]], event_id: str,
               min_rows: int) -> tuple[pd.DataFrame, pd.DataFrame] | None:
    """Each window without the impressions serving chose (``served``: their event ids, from the journal), when
    both keep at least ``min_rows`` rows; None otherwise (the windows are then compared whole: a lake of served
    traffic only has nothing else to compare).

    The items a ranker shows are its choice: their categories and prices follow what it ranks high, not the
    world. Compared with a reference that holds none of them (a bootstrap's window, before anything was
    served), the current window's served share reads as drift: on the demo's first day (1,200 of 5,200 rows
    served, the ranker favouring cheap items of a few categories) ``category`` scored 0.117 and ``price`` 0.110
    against a threshold of 0.1, while the world's own events of the same windows scored well under it."""
    kept = [frame[~frame[event_id].astype(str).isin(ids)] for frame, ids in zip((reference, current), served,
                                                                                strict=True)]
    if min(len(k) for k in kept) < min_rows:
        return None
    return kept[0], kept[1]


def new_id_findings(reference: pd.DataFrame, current: pd.DataFrame, keys: list[str],
                    config: MonitorConfig) -> tuple[list[str], dict[str, float]]:
    """Entity keys whose recent events fall on ids unseen in the reference far more than a stable world's would.

    Even an unchanged world shows unseen ids: every id a sample has not met yet. How many is the
    reference's own missing mass, which Good-Turing estimates as the share of its events on ids seen once
    (``{key}_unseen_expected``, e): 2,000 skewed items, 300 events a window, gave 45 % unseen with nothing
    changed, and 2M events sampled down to 50k 36 %. If a share f of recent events come from outside the
    reference's world (a new catalog), the unseen share is f + (1 - f) e: a key drifts when that f is at
    least ``new_id_share``, the unseen share ``new_id_z`` standard errors beyond e too."""
    findings, figures = [], {}
    for key in keys:
        seen = reference[key].dropna()
        counts = seen.value_counts()
        expected = float((counts == 1).sum() / len(seen)) if len(seen) else 0.0  # no ids at all: all are new
        unseen = float((~current[key].isin(set(counts.index))).mean())
        figures[f"{key}_unseen_share"] = unseen
        figures[f"{key}_unseen_expected"] = expected
        spread = math.sqrt(expected * (1 - expected) / max(len(current), 1) +
                           expected * (1 - expected) / max(len(seen), 1))
        newcomers = (unseen - expected) / (1 - expected) if expected < 1 else 0.0  # f above
        if newcomers >= config.new_id_share and unseen - expected > config.new_id_z * spread:
            findings.append(f"{key}: {unseen:.0%} of recent events on ids unseen in the reference "
                            f"(a stable world: about {expected:.0%})")
    return findings, figures


def kpi_findings(kpis: dict[str, float | None], baseline: dict[str, float | None], config: MonitorConfig) -> list[str]:
    """Online CTR against the baseline recorded at promotion (both optional)."""
    findings = []
    ctr, base = kpis.get("ctr"), baseline.get("ctr")
    if ctr is not None and base is not None and base > 0 and ctr < base * (1 - config.max_ctr_drop) \
            and _significant_drop(ctr, kpis.get("impressions"), base, baseline.get("impressions"), config.kpi_z):
        findings.append(f"online CTR {ctr:.4f} is {1 - ctr / base:.0%} below the baseline {base:.4f}")
    auc, base_auc = kpis.get("auc"), baseline.get("auc")
    if auc is not None and base_auc is not None and base_auc - auc > config.max_auc_drop and _significant_auc_drop(
            auc, kpis.get("impressions"), kpis.get("ctr"), base_auc, baseline.get("impressions"), base, config.kpi_z):
        findings.append(f"online AUC {auc:.4f} is {base_auc - auc:.4f} below the baseline {base_auc:.4f}")
    return findings


def _significant_drop(ctr: float, n: float | None, base: float, base_n: float | None, z: float) -> bool:
    """A two-proportion z-test of the drop (statsmodels', pooled variance), when both sides' impression counts
    are known (else: assume it is).

    The baseline is measured on a canary step's few thousand impressions and the window on a day's: a 10 %
    difference between two such CTRs is often noise.
    """
    if not n or not base_n:
        return True
    from statsmodels.stats.proportion import proportions_ztest

    pooled = (ctr * n + base * base_n) / (n + base_n)
    if pooled in (0.0, 1.0):  # no spread: any drop is real
        return base > ctr
    statistic, _ = proportions_ztest([base * base_n, ctr * n], [base_n, n], alternative="larger")
    return statistic >= z


def _auc_se(auc: float, positives: float, negatives: float) -> float:
    """Hanley & McNeil's standard error of an AUC."""
    q1, q2 = auc / (2 - auc), 2 * auc * auc / (1 + auc)
    variance = (auc * (1 - auc) + (positives - 1) * (q1 - auc * auc) + (negatives - 1) * (q2 - auc * auc)) \
        / (positives * negatives)
    return max(variance, 0.0) ** 0.5


def _significant_auc_drop(auc: float, n: float | None, ctr: float | None, base_auc: float, base_n: float | None,
                          base_ctr: float | None, z: float) -> bool:
    """The AUC drop in standard errors of both measurements, when their sizes are known (else: assume it is)."""
    if not n or not base_n or not ctr or not base_ctr:
        return True
    spread = (_auc_se(auc, ctr * n, (1 - ctr) * n) ** 2 + _auc_se(base_auc, base_ctr * base_n,
                                                                     (1 - base_ctr) * base_n) ** 2) ** 0.5
    return spread == 0 or (base_auc - auc) / spread >= z


def decide(quality: list[str], kpi: list[str], drift_share: float, drifted: list[str], new_ids: list[str],
           config: MonitorConfig, kpis: dict | None = None, figures: dict | None = None,
           prediction: list[str] | None = None) -> MonitorDecision:
    """The typed decision (see the module docstring for the order)."""
    kpis, figures, prediction = kpis or {}, figures or {}, prediction or []
    drifted_columns = tuple(sorted(set(drifted) | {reason.split(":")[0] for reason in [*new_ids, *prediction]}))
    if quality:
        return MonitorDecision("data_quality", tuple(quality), drift_share, drifted_columns, kpis, figures)
    if kpi:
        return MonitorDecision("kpi_decay", tuple(kpi), drift_share, drifted_columns, kpis, figures)
    reasons = [*new_ids, *prediction]
    if drift_share >= config.drift_share:
        reasons.append(f"{drift_share:.0%} of monitored columns drifted: {', '.join(sorted(drifted))}")
    if reasons:
        return MonitorDecision("drift", tuple(reasons), drift_share, drifted_columns, kpis, figures)
    return MonitorDecision("ok", ("no drift, no broken column, no KPI decay",), drift_share, drifted_columns, kpis,
                           figures)


def insufficient(reference_rows: int, current_rows: int, config: MonitorConfig) -> MonitorDecision | None:
    """``insufficient_data`` when either window has fewer than ``config.min_rows`` events, else None."""
    if min(reference_rows, current_rows) >= config.min_rows:
        return None
    reason = (f"too few events to decide: {reference_rows} in the reference window and {current_rows} in the "
              f"current one (at least {config.min_rows} each; choose longer windows)")
    return MonitorDecision("insufficient_data", (reason,), 0.0, (), {},
                           {"reference_rows": float(reference_rows), "current_rows": float(current_rows)})


# --- the windows --------------------------------------------------------------------------------------------


Window = tuple[datetime, datetime]


def choose_windows(newest: datetime, hours: int, trained: Window | None, reference_days: int) -> tuple[Window, Window]:
    """The reference and current windows (each ``[start, end)``) of a check.

    Current: the ``hours`` up to the end of the hour of the newest event. Reference: the newest stretch
    of the champion's data window ``trained`` (its training hours and the held-out hours after them,
    ``runner.data_window``), as long as the current one and ending before it starts (like with like: all of a
    full retrain's week would keep reporting the drift it was retrained on, as long as it holds days from
    before the change). Without a champion, or when its training ended after
    the current window began with nothing before it: the ``reference_days`` (or ``hours``) before.
    """
    end = newest.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
    current = (end - timedelta(hours=hours), end)
    if trained is None:
        return (current[0] - timedelta(days=reference_days), current[0]), current
    last = min(trained[1], current[0])
    reference = (max(trained[0], last - timedelta(hours=hours)), last)
    if reference[0] >= reference[1]:
        reference = (current[0] - timedelta(hours=hours), current[0])
    return reference, current


# --- the trigger --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TriggerConfig:
    """Args:
    cooldown_seconds: after a requested retrain, no other is requested for this long.
    retrain_on: monitoring decisions that request a full retrain.
    canary_hold_seconds: while the last deployed retrain's version is still in its canary, no other is
        requested, for at most this long after it was deployed (a canary without traffic ends nowhere).
    unanswered_seconds: a request that has no outcome (deployed or refused) after this long was lost (its
        event never reached the deployment's trigger, or its run died before the gate): the next check asks
        again rather than wait out the rest of the cool-down. Longer than a full retrain takes.
    """

    cooldown_seconds: float = 6 * 3600
    retrain_on: tuple[str, ...] = ("drift", "kpi_decay")
    canary_hold_seconds: float = 48 * 3600
    unanswered_seconds: float = 4 * 3600


@dataclass(frozen=True)
class TriggerVerdict:
    retrain: bool
    alert: bool
    reason: str
    decision: str

    def to_dict(self) -> dict:
        return asdict(self)


def should_retrain(decision: MonitorDecision, last_requested_at: float | None, now: float,
                   config: TriggerConfig, last_outcome: str | None = None, outcome_at: float | None = None,
                   gate_reasons: tuple[str, ...] | list[str] = (), in_canary: str | None = None) -> TriggerVerdict:
    """Whether a monitoring decision requests a full retrain now (see the module docstring).

    Args:
        last_requested_at: when the last retrain was requested.
        last_outcome: what became of it: ``deployed`` (passed the gate), ``refused`` (the gate said no), or
            None (not known yet); ``outcome_at``: when; ``gate_reasons``: the gate's reasons for a refusal.
        in_canary: the version the last (deployed) retrain made, while it is still the challenger. The
            champion it is meant to replace keeps serving meanwhile, so the drift measured against it persists:
            asking again would supersede that canary and reset its evidence (after every cool-down, so a
            canary needing more than one might never finish). Its canary decides first.
    """
    outcome, detail = decision.decision, "; ".join(decision.reasons)
    if outcome == "data_quality":
        return TriggerVerdict(False, True, f"data quality: alert, no retrain on broken data ({detail})", outcome)
    if outcome not in config.retrain_on:
        return TriggerVerdict(False, False, f"{outcome}: nothing to do", outcome)
    if last_outcome == "refused":
        why = "; ".join(gate_reasons) or "no reason recorded"
        return TriggerVerdict(True, outcome == "kpi_decay", f"{outcome}: full retrain, retrying: the last retrain "
                                                            f"was refused by the gate ({why}) ({detail})", outcome)
    if last_outcome == "deployed" and in_canary is not None and (
            outcome_at is None or now - outcome_at < config.canary_hold_seconds):
        return TriggerVerdict(False, False, f"{outcome}, but v{in_canary}, the last full retrain, is still in its "
                                            "canary: judged online first", outcome)
    if last_outcome == "deployed" and outcome_at is not None:
        if now - outcome_at < config.cooldown_seconds:
            left = config.cooldown_seconds - (now - outcome_at)
            return TriggerVerdict(False, False, f"{outcome}, but a retrain was deployed {now - outcome_at:.0f} s "
                                                f"ago: cool-down, {left:.0f} s left", outcome)
        return TriggerVerdict(True, outcome == "kpi_decay", f"{outcome}: full retrain ({detail})", outcome)
    if last_outcome is None and last_requested_at is not None and \
            config.unanswered_seconds <= now - last_requested_at < config.cooldown_seconds:
        return TriggerVerdict(True, outcome == "kpi_decay", f"{outcome}: full retrain, asking again: the request "
                                                            f"{now - last_requested_at:.0f} s ago has no outcome "
                                                            f"(lost on its way or its run died) ({detail})", outcome)
    if last_requested_at is not None and now - last_requested_at < config.cooldown_seconds:
        left = config.cooldown_seconds - (now - last_requested_at)
        return TriggerVerdict(False, False, f"{outcome}, but a retrain was requested {now - last_requested_at:.0f} s "
                                            f"ago: cool-down, {left:.0f} s left", outcome)
    return TriggerVerdict(True, outcome == "kpi_decay", f"{outcome}: full retrain ({detail})", outcome)
