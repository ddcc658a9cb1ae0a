"""The gate's pure decision: may a candidate model replace the champion?

Candidate and champion are scored on the same held-out window (newest data, never trained on). The
candidate must pass, overall:

- floors: at least ``min_rows`` held-out rows (fewer cannot judge), AUC at least ``min_auc``, log loss at
  most ``max_logloss_ratio`` × the log loss of predicting the window's base rate (relative: a 48% positive
  rate and a 3% one get their own ceiling; ``max_logloss`` adds an absolute one), calibration (mean
  prediction / mean label) within ``calibration_range``, and no NaN or infinite prediction. Calibration is
  a test where the rows' users are known (``calibration_interval``): refused only when its 95 % interval
  over users lies outside the range (a first model on 2,500 held-out rows, ~230 clicks, measured 0.738
  against a floor of 0.75: its interval is about ±13 %, and the demo aborted on that noise);
- change against the champion: AUC may drop at most ``max_auc_drop_incremental`` for an incremental
  candidate; a full retrain may not be worse (``max_auc_drop_full``);

and per slice (new vs returning users, top item categories, device), each slice with at least
``min_slice_rows`` rows: AUC may drop at most ``max_slice_auc_drop`` against the champion's AUC on the
same slice. The first model ever (no champion) only has to pass the floors.

The runner passes the paired comparison (``gate.paired``): then the change against the champion is judged
on grouped AUC, overall by a non-inferiority test against ``auc_margin`` (passed, refused, or *insufficient
evidence* when the window is too small to tell; its power is reported) and per slice by a paired bootstrap
over users with Holm across the slices, slices sized by power, so a slice's noise alone does not refuse a
better model; the fixed per-mode drops above apply only without the paired comparison.

Three verdicts (``GateDecision.verdict``): ``passed``, ``refused`` (any reason), ``insufficient evidence``
(no reason to refuse, but the overall test could not decide: ``gate.runner`` hands the candidate to the
canary, whose online test decides).

Example::

    decision = decide(candidate, champion, GateThresholds(), mode="incremental")
    decision.passed, decision.reasons
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Literal

import numpy as np

Mode = Literal["full", "incremental"]


@dataclass(frozen=True)
class GateThresholds:
    """The gate's limits (a YAML/JSON file of these keys: ``recloop gate --thresholds``); see the module doc.

    ``max_logloss_ratio``: 1.1 lets a young model that ranks well be a little less sure than the constant base
    rate (a first model on a few thousand rows); the old absolute ceiling (0.6) allowed twice that at a 9 %
    click rate and refused good models at 48 %.
    ``baseline_auc_margin``: the candidate is refused when its AUC is shown below a simple baseline's
    (``recloop.baselines``: the logistic regression on the model's own inputs, the user+item CTR ranking) by
    more than this, on the same held-out rows (the paired bootstrap's 95 % interval over users entirely below
    ``-margin``: ``baselines.paired_failures``); ``baseline_logloss_margin``: the same for its log loss above
    the logistic regression's. On by default (0: a model that loses to logistic regression is not promoted,
    and the report gives each difference with its interval); None: the baselines are reported, not enforced.
    ``auc_margin``: the overall non-inferiority margin of the paired comparison (grouped AUC): a candidate
    passes when its interval's bottom is above ``-auc_margin``; more than this worse is what the gate
    exists to stop.
    ``smoke_latency_ratio``: the serving smoke check's scoring time may be at most this multiple of the
    champion's, both measured in the same fresh process (a busy host slows both alike).
    ``smoke_budget_ms``: a budget for scoring 256 rows where there is no champion to compare with (the first
    model); None: the first model's latency is measured and reported, not judged.
    """

    min_auc: float = 0.55
    max_logloss: float | None = None
    max_logloss_ratio: float = 1.1
    min_rows: int = 200
    baseline_auc_margin: float | None = 0.0
    baseline_logloss_margin: float | None = 0.0
    calibration_range: tuple[float, float] = (0.9, 1.1)
    max_auc_drop_incremental: float = 0.002
    max_auc_drop_full: float = 0.0
    max_slice_auc_drop: float = 0.01
    min_slice_rows: int = 200
    auc_margin: float = 0.01
    smoke_latency_ratio: float = 3.0
    smoke_budget_ms: float | None = None

    def __post_init__(self) -> None:
        """Values that cannot mean what the field says (a file's ``min_auc: 7`` refused every model, ``min_rows:
        -5`` or a calibration range upside down passed nonsense): a ValueError naming them."""
        wrong = []
        if not 0.0 <= self.min_auc <= 1.0:
            wrong.append(f"min_auc {self.min_auc} is not in [0, 1]")
        low, high = self.calibration_range
        if not 0.0 <= low <= high:
            wrong.append(f"calibration_range {list(self.calibration_range)} is not [low, high] with 0 ≤ low ≤ high")
        for name in ("min_rows", "min_slice_rows"):
            if getattr(self, name) < 0:
                wrong.append(f"{name} {getattr(self, name)} is negative")
        for name in ("max_logloss", "max_logloss_ratio", "smoke_latency_ratio", "smoke_budget_ms"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                wrong.append(f"{name} {value} is not positive")
        if self.auc_margin < 0:  # the non-inferiority margin (the margins against baselines may be either sign)
            wrong.append(f"auc_margin {self.auc_margin} is negative")
        if wrong:
            raise ValueError("; ".join(wrong))


@dataclass(frozen=True)
class ModelScores:
    """A model's metrics on the held-out window: overall (``auc``, ``logloss``, ``calibration``,
    ``nan_predictions``, ``rows``) and per slice (``{"device=mobile": {"auc": ..., "rows": ...}}``)."""

    overall: dict[str, float]
    slices: dict[str, dict[str, float]] = field(default_factory=dict)


Verdict = Literal["passed", "refused", "insufficient evidence"]


@dataclass(frozen=True)
class GateDecision:
    """``passed`` only when nothing refuses and the overall test decided; ``insufficient``: why the
    overall test could not (``verdict`` says which of the three it is)."""

    passed: bool
    reasons: tuple[str, ...]
    figures: dict[str, dict[str, float | None]]
    first_model: bool
    insufficient: tuple[str, ...] = ()

    @property
    def verdict(self) -> Verdict:
        return verdict_of(self.reasons, self.insufficient)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["reasons"] = list(self.reasons)
        out["insufficient"] = list(self.insufficient)
        out["verdict"] = self.verdict
        return out


def verdict_of(reasons, insufficient) -> Verdict:
    """Refused when anything refuses; else insufficient evidence when the overall test could not decide."""
    return "refused" if reasons else "insufficient evidence" if insufficient else "passed"


def floor_failures(scores: ModelScores, thresholds: GateThresholds) -> list[str]:
    """The absolute floors a model misses (AUC, log loss, calibration, finite predictions)."""
    overall = scores.overall
    failures = []
    rows = overall.get("rows")
    if rows is not None and rows < thresholds.min_rows:
        failures.append(f"only {int(rows)} held-out rows: at least {thresholds.min_rows} are needed to judge "
                        "(hold out a longer window)")
    nan_count = int(overall.get("nan_predictions", 0))
    if nan_count:
        failures.append(f"{nan_count} NaN or infinite predictions")
    auc, logloss = overall.get("auc", math.nan), overall.get("logloss", math.nan)
    for name, value in (("auc", auc), ("logloss", logloss)):
        if not math.isfinite(value):
            failures.append(f"{name} is {value}")
    if math.isfinite(auc) and auc < thresholds.min_auc:
        failures.append(f"auc {auc:.4f} below the floor {thresholds.min_auc}")
    if math.isfinite(logloss) and thresholds.max_logloss is not None and logloss > thresholds.max_logloss:
        failures.append(f"logloss {logloss:.4f} above the ceiling {thresholds.max_logloss}")
    rate = overall.get("positive_rate", math.nan)
    if math.isfinite(logloss) and math.isfinite(rate) and 0 < rate < 1:
        ceiling = thresholds.max_logloss_ratio * -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
        if logloss > ceiling:
            failures.append(f"logloss {logloss:.4f} above {ceiling:.4f} ({thresholds.max_logloss_ratio} × the log "
                            f"loss of predicting the base rate {rate:.3f})")
    low, high = thresholds.calibration_range
    calibration = overall.get("calibration", math.nan)
    shown = overall.get("calibration_low", math.nan), overall.get("calibration_high", math.nan)
    if all(math.isfinite(v) for v in shown):  # a test: refused when the interval lies outside the range
        if shown[1] < low or shown[0] > high:
            failures.append(f"calibration {calibration:.3f} [{shown[0]:.3f}, {shown[1]:.3f}] outside [{low}, {high}] "
                            "(95 % interval over users)")
    elif math.isfinite(calibration) and not low <= calibration <= high:
        failures.append(f"calibration {calibration:.3f} outside [{low}, {high}]")
    return failures


def calibration_interval(labels, predictions, users, z: float = 1.959964) -> tuple[float, float, float]:
    """Calibration (sum of predictions / sum of labels) and its interval (95 % by default) with user-cluster
    errors: the ratio's delta-method linearization over users (``evidence.sequential.ratio_linearized``, as the
    canary's CTR ratios), on the log of the ratio (a heavy user is one unit of evidence; the label sum's noise
    dominates). NaN bounds without a click or with fewer than two users."""
    from recloop.evidence.sequential import ratio_linearized

    labels = np.asarray(labels, dtype=np.float64)
    if labels.sum() <= 0 or len(labels) != len(predictions) or len(labels) != len(users):
        return float("nan"), float("nan"), float("nan")
    ids, linear, ratio = ratio_linearized(predictions, labels, users)
    if len(ids) < 2 or ratio <= 0:
        return ratio, float("nan"), float("nan")
    spread = z * math.sqrt(float(linear.var(ddof=1)) / len(ids)) / ratio
    return ratio, ratio * math.exp(-spread), ratio * math.exp(spread)


def decide(candidate: ModelScores, champion: ModelScores | None, thresholds: GateThresholds,
           mode: Mode, paired=None) -> GateDecision:
    """Pass or fail, with every reason and the figures compared (see the module docstring).

    ``paired``: the paired comparison on the same rows (``gate.paired.compare``'s result); when given,
    its tests replace the fixed-threshold AUC and slice checks against the champion.
    """
    reasons = floor_failures(candidate, thresholds)
    overall = candidate.overall
    figures: dict[str, dict[str, float | None]] = {
        name: {"candidate": overall.get(name), "champion": champion.overall.get(name) if champion else None}
        for name in ("auc", "logloss", "calibration", "rows")
    }
    insufficient: list[str] = []
    if champion is not None and paired is not None:
        reasons += list(paired.failures)
        insufficient += list(paired.insufficient)
        figures.update(paired.figures)
        if paired.skipped_slices:
            figures["slices too small to judge"] = {s: None for s in paired.skipped_slices}
    elif champion is not None:
        allowed = thresholds.max_auc_drop_incremental if mode == "incremental" else thresholds.max_auc_drop_full
        drop = champion.overall.get("auc", math.nan) - overall.get("auc", math.nan)
        figures["auc"]["allowed_drop"] = allowed
        if math.isfinite(drop) and drop > allowed:
            reasons.append(f"auc dropped {drop:.4f} below the champion's {champion.overall['auc']:.4f} "
                           f"(a {mode} candidate may drop at most {allowed})")
        for name, scores in sorted(candidate.slices.items()):
            theirs = champion.slices.get(name)
            if theirs is None or min(scores.get("rows", 0), theirs.get("rows", 0)) < thresholds.min_slice_rows:
                continue
            slice_drop = theirs.get("auc", math.nan) - scores.get("auc", math.nan)
            figures[f"slice {name}"] = {"candidate": scores.get("auc"), "champion": theirs.get("auc"),
                                        "rows": scores.get("rows")}
            if math.isfinite(slice_drop) and slice_drop > thresholds.max_slice_auc_drop:
                reasons.append(f"slice {name}: auc dropped {slice_drop:.4f} (at most "
                               f"{thresholds.max_slice_auc_drop} allowed per slice)")
    return GateDecision(passed=not reasons and not insufficient, reasons=tuple(reasons), figures=figures,
                        first_model=champion is None, insufficient=tuple(insufficient))


def skipped_slices(candidate: ModelScores, champion: ModelScores | None, thresholds: GateThresholds) -> dict[str, str]:
    """The slices the comparison with the champion did not judge, each with why (too few rows, or the
    champion has no such slice). Empty for a first model: slices are compared with a champion only."""
    if champion is None:
        return {}
    skipped = {}
    for name, scores in sorted(candidate.slices.items()):
        theirs = champion.slices.get(name)
        if theirs is None:
            skipped[name] = "the champion has no such slice"
        elif min(scores.get("rows", 0), theirs.get("rows", 0)) < thresholds.min_slice_rows:
            skipped[name] = (f"{int(min(scores.get('rows', 0), theirs.get('rows', 0)))} rows, fewer than "
                             f"min_slice_rows={thresholds.min_slice_rows}")
    return skipped


def report_markdown(decision: GateDecision, candidate: ModelScores, champion: ModelScores | None,
                    version: str, champion_version: str | None, mode: str,
                    thresholds: GateThresholds | None = None, run_auc: float | None = None) -> str:
    """The review page: the verdict and its reasons, candidate vs champion per metric and slice with the
    threshold each was held to, the slices not judged and why, and every threshold.

    Rendered as the version's description in MLflow: every cell a figure, a rule or ``-`` (no ``None`` or
    ``nan``), the thresholds as a table of their own. ``run_auc``: the training run's ``auc`` metric for the
    same model, named beside the gate's (they are computed on different rows: a reviewer saw 0.6574 and 0.6439
    with no word why)."""
    thresholds = thresholds or GateThresholds()
    verdict = {"passed": "PASSED", "refused": "FAILED", "insufficient evidence": "INSUFFICIENT EVIDENCE (the canary "
               "decides)"}[decision.verdict]
    allowed = thresholds.max_auc_drop_incremental if mode == "incremental" else thresholds.max_auc_drop_full
    lines = [f"# Gate: version {version} ({mode}) vs champion {champion_version or '(none: first model)'}",
             "", f"**{verdict}**", ""]
    lines += [f"- {reason}" for reason in (*decision.reasons, *decision.insufficient)] or ["- every check passed"]
    low, high = thresholds.calibration_range
    paired = decision.figures.get("grouped_auc")
    versus = "; vs champion: the paired comparison below" if paired else f"; drop ≤ {allowed} vs champion"
    logloss_rule = f"≤ {thresholds.max_logloss_ratio} × the base rate's log loss" + (
        f" and ≤ {thresholds.max_logloss}" if thresholds.max_logloss is not None else "")
    shown = candidate.overall.get("calibration_low", math.nan), candidate.overall.get("calibration_high", math.nan)
    calibration_rule = f"in [{low}, {high}]" + (f" (its 95 % interval over users: [{shown[0]:.3f}, {shown[1]:.3f}])"
                                                if all(math.isfinite(v) for v in shown) else "")
    rule = {"auc": f"≥ {thresholds.min_auc}" + (versus if champion else ""),
            "logloss": logloss_rule, "calibration": calibration_rule, "rows": f"≥ {thresholds.min_rows}"}
    lines += ["", "| metric | candidate | champion | threshold |", "| --- | --- | --- | --- |"]
    for name in ("auc", "logloss", "calibration", "rows"):
        theirs = champion.overall.get(name) if champion else None
        mine = candidate.overall.get(name)
        if name == "rows":  # a count, not a figure to 4 decimals
            mine, theirs = (int(v) if isinstance(v, int | float) and math.isfinite(v) else v for v in (mine, theirs))
        lines.append(f"| {name} | {_fmt(mine)} | {_fmt(theirs)} | {rule[name]} |")
    lines += _which_auc(candidate, run_auc, decision.figures)
    if paired:
        lines += _paired_markdown(decision.figures, paired.get("margin", allowed))
    skipped = skipped_slices(candidate, champion, thresholds)
    if paired:  # what the paired comparison judged is above; this table is the slices' plain AUCs
        lines += ["", "Slices' pooled AUC (for reference; the paired comparison above decided):", "",
                  "| slice | rows | candidate AUC | champion AUC |", "| --- | --- | --- | --- |"]
        for name, scores in sorted(candidate.slices.items()):
            theirs = champion.slices.get(name, {}).get("auc") if champion else None
            lines.append(f"| {name} | {int(scores.get('rows', 0))} | {_fmt(scores.get('auc'))} | {_fmt(theirs)} |")
        return "\n".join(lines + _thresholds_markdown(thresholds)) + "\n"
    lines += ["", f"Slices (AUC may drop at most {thresholds.max_slice_auc_drop} vs the champion on slices of at "
              f"least {thresholds.min_slice_rows} rows):", "",
              "| slice | rows | candidate AUC | champion AUC | judged |", "| --- | --- | --- | --- | --- |"]
    for name, scores in sorted(candidate.slices.items()):
        theirs = champion.slices.get(name, {}).get("auc") if champion else None
        judged = "no (first model)" if champion is None else f"no: {skipped[name]}" if name in skipped else "yes"
        lines.append(f"| {name} | {int(scores.get('rows', 0))} | {_fmt(scores.get('auc'))} | {_fmt(theirs)} "
                     f"| {judged} |")
    if skipped:
        lines += ["", f"**{len(skipped)} slice(s) not judged**: " + "; ".join(
            f"{name} ({why})" for name, why in skipped.items())]
    return "\n".join(lines + _thresholds_markdown(thresholds)) + "\n"


def _thresholds_markdown(thresholds: GateThresholds) -> list[str]:
    """Every threshold as a row (one long line of ``key=value`` pairs was cut off on the MLflow page)."""
    def value(v) -> str:
        if v is None:
            return "not enforced"
        return f"[{v[0]}, {v[1]}]" if isinstance(v, tuple | list) else str(v)

    return ["", "Thresholds:", "", "| threshold | value |", "| --- | --- |",
            *(f"| {k} | {value(v)} |" for k, v in asdict(thresholds).items())]


def _which_auc(candidate: ModelScores, run_auc: float | None, figures: dict) -> list[str]:
    """The AUCs of one model a reviewer meets, each named with the rows it is computed on."""
    rows = candidate.overall.get("rows")
    served = (figures.get("grouped_auc") or {}).get("served_rows_excluded")
    lines = ["", "Which AUC is which: the `auc` above (MLflow metric `gate_auc` on the training run) is pooled "
             f"over the {int(rows) if rows is not None and math.isfinite(rows) else '-'} held-out rows the gate scored"
             + (f", {int(served)} served-feedback rows left out (the champion's own picks favour it)" if served
                else "") + "."]
    if run_auc is not None and math.isfinite(run_auc):
        lines[-1] += (f" The training run's `auc` metric ({run_auc:.4f}) is the trainer's validation on the same "
                      "held-out hours, every row of them" + (" (served feedback included)" if served else "")
                      + ", before the gate's fresh-process scoring.")
    if figures.get("grouped_auc"):
        lines[-1] += " The paired comparison's AUC is grouped per user (each user's AUC, averaged)."
    return lines


def _thresholds_line(thresholds: GateThresholds) -> str:
    """Every threshold set, ``name=value``; one not set (``None``) says so in words, never ``None``."""
    return ", ".join(f"{k}={'not set' if v is None else v}" for k, v in asdict(thresholds).items())


def _paired_markdown(figures: dict, allowed: float) -> list[str]:
    """The paired comparison that decided against the champion: overall hold-or-beat on the estimate with
    its interval, the slices judged by a Holm-adjusted one-sided test, and the slices too small to judge."""
    overall = figures["grouped_auc"]
    metric = "pooled AUC (resampled by user)" if overall.get("pooled") else "grouped AUC (per user)"
    lines = ["", f"Paired comparison on the same rows (what decided): {metric}, candidate − champion with a "
             f"95 % paired bootstrap interval over {int(overall.get('users') or 0)} users"
             + (f"; {int(overall['served_rows_excluded'])} served-feedback rows left out"
                if overall.get("served_rows_excluded") else "") + ".", "",
             "| test | candidate | champion | difference [95 % CI] | rule | p (worse) | verdict |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    verdict = "non-inferior" if overall["low"] > -allowed else "REFUSED: worse" if overall["high"] < 0 else \
        "insufficient evidence"
    lines.append(f"| overall | {_fmt(overall['candidate'])} | {_fmt(overall['champion'])} | "
                 f"{overall['difference']:+.4f} [{overall['low']:+.4f}, {overall['high']:+.4f}] | "
                 f"non-inferiority: bottom > −{allowed} | {_fmt(overall.get('p_worse'))} | {verdict} |")

    for key, row in figures.items():
        if not key.startswith("slice "):
            continue
        worse = (row.get("p_worse_holm") or 1.0) < 0.05
        lines.append(f"| {key[6:]} ({int(row.get('rows') or 0)} rows) | {_fmt(row['candidate'])} | "
                     f"{_fmt(row['champion'])} | {row['difference']:+.4f} [{row['low']:+.4f}, {row['high']:+.4f}] | "
                     f"not significantly worse by > {row.get('allowed_drop')} (Holm, alpha 0.05) | "
                     f"{_fmt(row.get('p_worse_holm'))} | "
                     f"{'REFUSED' if worse else 'holds'} |")
    if overall.get("power") is not None:
        lines += ["", f"The window's power (an equal model shown non-inferior at margin {allowed}): "
                  f"{overall['power']:.0%}; about {int(overall.get('users_for_power') or 0)} users would give 80 %."]
    small = list(figures.get("slices too small to judge") or {})
    if small:
        lines += ["", "Slices too small to judge (fewer rows than a power calculation asks for): " + "; ".join(small)]
    return lines


def _fmt(value) -> str:
    """A cell: ``-`` for nothing (None, NaN, infinite: the report showed ``nan``), 4 decimals for a float."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.4f}" if isinstance(value, float) else str(value)
