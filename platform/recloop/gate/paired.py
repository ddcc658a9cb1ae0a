"""The gate's paired comparison (pure): candidate and champion scored on the same held-out rows, compared
per group, overall by its estimate and per slice by a test over users with the family-wise error controlled.

- **Metric**: grouped AUC (``evidence.ranking.grouped_auc``): the AUC within each group (a request when
  the rows carry one, else a user), weighted by impressions — what a ranker does within a request,
  not how well it separates active users from quiet ones. NDCG@10 within groups is reported beside it.
- **Overall: a non-inferiority test against a stated margin** (``margin``: the thresholds'
  ``auc_margin``), on the paired-bootstrap interval over users (``evidence.ranking.paired_bootstrap``,
  95 %: each side 2.5 %). Three outcomes:

  - *passed*: the interval's bottom is above ``-margin`` (shown non-inferior): a candidate worse than
    the champion by more than the margin passes at most 2.5 % of the time;
  - *refused*: not shown non-inferior and the interval's top is below 0 (shown worse): a candidate at
    least as good is refused at most 2.5 % of the time;
  - *insufficient evidence*: neither (the interval holds both 0 and ``-margin``). Only a window too small
    for the margin can say this: its **power** (the chance that a candidate exactly as good as the
    champion is shown non-inferior, from the interval's width) is computed and reported with every
    verdict, with the users a window would need for ``power``. What the loop does with it:
    ``gate.runner`` hands such a candidate to the canary (the ``challenger`` alias, tagged "insufficient
    evidence"), whose always-valid interleaved test promotes only on online non-inferiority — neither a
    pass on a coin nor a silent refusal of a good model.

  The rule it replaces judged the point estimate (refuse below the allowed drop): on simulated worlds it
  refused 8 % of better candidates and passed 9 % of worse ones over all candidates on a day's window (18 %
  and 12 % on the demo's 6 hours).
- **Slices: significantly worse.** A slice is noisier (fewer rows) and there are several: each slice's
  paired test is one-sided, "worse by more than ``max_slice_auc_drop``", Holm-adjusted across the judged
  slices at ``alpha`` — a slice refuses only a drop it can show (fixed per-slice thresholds refused
  better models on the noise of a 632-row slice).
- **Slice size**: a slice is judged only with enough rows to tell ``max_slice_auc_drop`` apart with
  ``power`` (``evidence.ranking.min_rows_for_auc_difference``, at the slice's own base rate): as the test's
  margin is that drop too, a drop of twice it is found with ``power`` at ``alpha`` (less after Holm's
  adjustment across slices; one just past it barely more often than ``alpha``); a smaller slice's AUC
  moves by more than that on noise alone.

Served-feedback rows (the champion's own top-k, without propensities) are left out of the comparison by
the runner before it gets here; ``HeldOut.served_excluded`` says how many.

Example::

    result = compare(held_out, thresholds, mode="full")
    result.failures, result.figures
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from recloop.evidence.ranking import (
    grouped_auc,
    holm,
    min_rows_for_auc_difference,
    ndcg_at_k,
    paired_bootstrap,
    per_group_auc,
)


@dataclass(frozen=True)
class HeldOut:
    """Both models' scores on the same held-out rows: labels, scores, the group of each row (request or
    user), the user (the bootstrap's unit) and slice labels per row."""

    labels: np.ndarray
    candidate: np.ndarray
    champion: np.ndarray
    groups: np.ndarray
    users: np.ndarray
    slices: dict[str, np.ndarray] = field(default_factory=dict)
    served_excluded: int = 0


@dataclass(frozen=True)
class PairedConfig:
    """``min_groups``: groups holding both classes needed for grouped AUC; with fewer (a simulated world's
    impressions are not requests, and a user-hour rarely holds a click and a non-click) the comparison is
    pooled AUC, still resampled by user."""

    min_groups: int = 100
    alpha: float = 0.05
    power: float = 0.8
    resamples: int = 500
    seed: int = 0


@dataclass(frozen=True)
class PairedResult:
    """``failures``: what refuses the candidate; ``insufficient``: why the overall test could not decide
    (empty when it did); ``figures``: every test's figures, the overall power among them."""

    failures: tuple[str, ...]
    figures: dict[str, dict[str, float | None]]
    skipped_slices: tuple[str, ...]
    insufficient: tuple[str, ...] = ()


Z_SIDE = 1.959963984540054  # the 95 % interval's quantile: each side 2.5 %


def window_power(low: float, high: float, margin: float) -> float:
    """The chance that a candidate exactly as good as the champion is shown non-inferior on this window
    (its interval's bottom above ``-margin``), from the interval's width: ``Phi(margin / se - z)``."""
    from scipy.stats import norm

    se = (high - low) / (2 * Z_SIDE)
    if not np.isfinite(se) or margin <= 0:
        return 0.0
    if se <= 0:
        return 1.0
    return float(norm.cdf(margin / se - Z_SIDE))


def users_for_power(users: int, low: float, high: float, margin: float, power: float) -> int:
    """The users a window like this one would need for ``power`` (the interval narrows as 1/sqrt(users))."""
    from scipy.stats import norm

    se = (high - low) / (2 * Z_SIDE)
    if not np.isfinite(se) or se <= 0 or margin <= 0:
        return users
    return int(np.ceil(users * ((Z_SIDE + norm.ppf(power)) * se / margin) ** 2))


def compare(
    held: HeldOut,
    max_drop: float,
    max_slice_drop: float,
    config: PairedConfig | None = None,
    top_k_slices: int = 5,
) -> PairedResult:
    """The paired tests (see the module docstring): failures (after Holm), why the overall test could not
    decide (if so) and the figures of each test. ``max_drop``: the overall non-inferiority margin."""
    config = config or PairedConfig()
    rng = np.random.default_rng(config.seed)
    tests, names = [], []
    usable = len(per_group_auc(held.labels, held.champion, held.groups)[0])
    metric = "gauc" if usable >= config.min_groups else "auc"
    overall = paired_bootstrap(
        held.labels,
        held.candidate,
        held.champion,
        held.groups,
        held.users,
        margin=max_drop,
        resamples=config.resamples,
        rng=rng,
        metric=metric,
    )
    tests.append(overall)
    names.append("overall")
    figures: dict[str, dict[str, float | None]] = {
        "grouped_auc": {
            "candidate": overall.candidate,
            "champion": overall.champion,
            "difference": overall.difference,
            "low": overall.low,
            "high": overall.high,
            "allowed_drop": max_drop,
            "users": float(overall.units),
            "usable_groups": float(usable),
            "pooled": float(metric == "auc"),
            "served_rows_excluded": float(held.served_excluded),
        },
        "ndcg@10": {
            "candidate": ndcg_at_k(held.labels, held.candidate, held.groups),
            "champion": ndcg_at_k(held.labels, held.champion, held.groups),
        },
    }
    skipped = []
    for column, values in held.slices.items():
        values = np.asarray(values)
        kinds, counts = np.unique(values, return_counts=True)
        for value in kinds[np.argsort(-counts, kind="stable")][:top_k_slices]:
            mask = values == value
            name = f"{column}={value}"
            rows = int(mask.sum())
            base = float(held.labels[mask].mean()) if rows else 0.0
            reference = (
                grouped_auc(held.labels[mask], held.champion[mask], held.groups[mask])
                if metric == "gauc"
                else float("nan")
            )
            needed = min_rows_for_auc_difference(
                max_slice_drop,
                auc=reference if reference == reference else 0.7,
                positive_rate=min(max(base, 1e-3), 0.5),
                alpha=config.alpha,
                power=config.power,
            )
            if rows < needed:
                skipped.append(f"{name} ({rows} rows < {needed} needed)")
                continue
            result = paired_bootstrap(
                held.labels[mask],
                held.candidate[mask],
                held.champion[mask],
                held.groups[mask],
                held.users[mask],
                margin=max_slice_drop,
                resamples=config.resamples,
                rng=rng,
                metric=metric,
            )
            tests.append(result)
            names.append(name)
            figures[f"slice {name}"] = {
                "candidate": result.candidate,
                "champion": result.champion,
                "difference": result.difference,
                "low": result.low,
                "high": result.high,
                "rows": float(rows),
                "min_rows": float(needed),
                "allowed_drop": max_slice_drop,
            }
    failures, insufficient = [], []
    label = "grouped auc" if metric == "gauc" else "auc (resampled by user)"
    power = window_power(overall.low, overall.high, max_drop)
    needed = users_for_power(overall.units, overall.low, overall.high, max_drop, config.power)
    figures["grouped_auc"].update(p_worse=float(overall.p_worse), margin=max_drop, power=power,
                                  users_for_power=float(needed))
    interval = f"{label} {overall.difference:+.4f} [{overall.low:+.4f}, {overall.high:+.4f}] vs the champion"
    if overall.low > -max_drop:
        pass  # shown non-inferior
    elif overall.high < 0:
        failures.append(
            f"{interval}: shown worse and not shown within the non-inferiority margin {max_drop} (the window's "
            f"power {power:.0%})"
        )
    else:
        insufficient.append(
            f"{interval}: insufficient evidence, neither shown within the margin {max_drop} nor shown worse: the "
            f"window's power to show an equal model non-inferior is {power:.0%} ({overall.units} users; about "
            f"{needed} would give {config.power:.0%})"
        )
    adjusted = holm([t.p_worse for t in tests[1:]]) if len(tests) > 1 else []
    for name, test, p in zip(names[1:], tests[1:], adjusted, strict=True):
        figures[f"slice {name}"].update(p_worse=float(test.p_worse), p_worse_holm=float(p))
        if p < config.alpha:
            failures.append(
                f"slice {name}: {label} {test.difference:+.4f} [{test.low:+.4f}, {test.high:+.4f}] vs the "
                f"champion: worse by more than {test.margin} (Holm-adjusted p {p:.3g} < {config.alpha})"
            )
    return PairedResult(tuple(failures), figures, tuple(skipped), tuple(insufficient))
