"""The gate's paired comparison (pure): candidate and champion scored on the same held-out rows, compared
per group, overall by its estimate and per slice by a test over users with the family-wise error controlled.

- **Metric**: grouped AUC (``evidence.ranking.grouped_auc``): the AUC within each group (a request when
  the rows carry one, else a user), weighted by impressions — what a ranker does within a request,
  not how well it separates active users from quiet ones. NDCG@10 within groups is reported beside it.
- **Overall: hold or beat.** The candidate's overall difference (its point estimate) may not fall below
  the allowed drop (``max_auc_drop_incremental`` or ``max_auc_drop_full``: 0, a full retrain may not be
  worse); its paired-bootstrap interval over users (``evidence.ranking.paired_bootstrap``) and one-sided
  p-value are reported beside it. On simulated worlds against the truth of the evaluation panel
  (``benchmarks/loop.py``, gate part, 10 seeds × 20 candidates) this rule refused 3 % of the candidates
  more than 5 % better and passed 4 % of those more than 5 % worse; refusing only what is significantly
  worse passed 12 % of those (24 % of all worse ones): with a day's held-out rows most candidates near
  the champion are within noise, and "not shown worse" is then a pass.
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
    failures: tuple[str, ...]
    figures: dict[str, dict[str, float | None]]
    skipped_slices: tuple[str, ...]


def compare(
    held: HeldOut,
    max_drop: float,
    max_slice_drop: float,
    config: PairedConfig | None = None,
    top_k_slices: int = 5,
) -> PairedResult:
    """The paired tests (see the module docstring): failures (after Holm) and the figures of each test."""
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
    failures = []
    label = "grouped auc" if metric == "gauc" else "auc (resampled by user)"
    figures["grouped_auc"]["p_worse"] = float(overall.p_worse)
    if overall.difference < -max_drop:  # hold or beat: judged on the estimate, its interval beside it
        failures.append(
            f"{label} {overall.difference:+.4f} [{overall.low:+.4f}, {overall.high:+.4f}] vs the champion: "
            f"below it by more than the allowed {max_drop} (a candidate must hold or beat the champion overall; "
            f"one-sided p {overall.p_worse:.3g})"
        )
    adjusted = holm([t.p_worse for t in tests[1:]]) if len(tests) > 1 else []
    for name, test, p in zip(names[1:], tests[1:], adjusted, strict=True):
        figures[f"slice {name}"].update(p_worse=float(test.p_worse), p_worse_holm=float(p))
        if p < config.alpha:
            failures.append(
                f"slice {name}: {label} {test.difference:+.4f} [{test.low:+.4f}, {test.high:+.4f}] vs the "
                f"champion: worse by more than {test.margin} (Holm-adjusted p {p:.3g} < {config.alpha})"
            )
    return PairedResult(tuple(failures), figures, tuple(skipped))
