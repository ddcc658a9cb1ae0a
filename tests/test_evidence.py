"""The statistics behind the loop's decisions (recloop.evidence): small arrays, seconds in all."""

from __future__ import annotations

import numpy as np
import pytest

from recloop.evaluate import auc
from recloop.evidence.calibration import apply_platt, fit_platt
from recloop.evidence.interleaving import CHAMPION, credit, team_draft, team_draft_batch
from recloop.evidence.offpolicy import epsilon_greedy, estimate, plackett_luce, softmax
from recloop.evidence.ranking import (
    grouped_auc,
    holm,
    min_rows_for_auc_difference,
    ndcg_at_k,
    paired_bootstrap,
    paired_logloss,
)
from recloop.evidence.sequential import (
    ab_difference,
    always_valid_p,
    cluster_mean,
    confidence_sequence,
    cuped,
    effective_units,
    student_widening,
    welch_degrees,
)


def test_team_draft_takes_turns_and_credits_clicks_to_the_contributing_team():
    rng = np.random.default_rng(0)
    champion, challenger = [1, 2, 3, 4, 5, 6], [6, 5, 4, 3, 2, 1]
    items, teams = team_draft(champion, challenger, k=4, rng=rng)
    assert len(set(items)) == 4 and sorted(teams) == [0, 0, 1, 1]
    for item, team in zip(items, teams, strict=True):  # each team placed its own best remaining item
        assert item in (champion if team == CHAMPION else challenger)[:3]
    clicked = [item == 6 for item in items]  # only the challenger's top item gets a click
    assert credit(teams, clicked) == (0, 1)
    assert credit(teams, [True] * 4) == (2, 2)
    # identical rankings: the list is that ranking, the teams alternate in pairs
    same, same_teams = team_draft([7, 8, 9, 10], [7, 8, 9, 10], k=4, rng=rng)
    assert same == [7, 8, 9, 10] and sorted(same_teams[:2]) == [0, 1] and sorted(same_teams[2:]) == [0, 1]
    with pytest.raises(ValueError):
        credit([0, 1], [True])


def test_team_draft_never_favours_a_team_for_the_top_slot():
    rng = np.random.default_rng(1)
    a = np.tile(np.arange(8), (4000, 1))
    b = a[:, ::-1].copy()
    items, teams = team_draft_batch(a, b, k=4, rng=rng)
    assert abs(teams[:, 0].mean() - 0.5) < 0.03
    assert (np.isin(items, [0, 1, 6, 7])).all()  # two picks each: the two best of each ranking
    assert (teams.sum(axis=1) == 2).all()


def test_the_sequential_test_keeps_its_error_rate_over_every_look():
    """5,000 null A/A canaries looked at 100 times each, with clustered heavy-tailed users: the share whose
    always-valid interval ever excludes 0 stays at most alpha (a naive z-test at each look would be ~40 %)."""
    rng = np.random.default_rng(0)
    runs, looks, per_look = 5000, 100, 20
    effect = rng.normal(0, 1, (runs, looks * per_look)) * rng.pareto(3.0, (runs, looks * per_look)).clip(
        0.2, 20
    )
    sums = effect.cumsum(axis=1)[:, per_look - 1 :: per_look]
    squares = (effect**2).cumsum(axis=1)[:, per_look - 1 :: per_look]
    n = np.arange(1, looks + 1) * per_look
    mean = sums / n
    variance = (squares / n - mean**2) / n
    low, high = confidence_sequence(mean, variance, tau=0.1, alpha=0.05)
    ever = ((low > 0) | (high < 0)).any(axis=1).mean()
    naive = (np.abs(mean / np.sqrt(variance)) > 1.96).any(axis=1).mean()
    assert ever <= 0.05, ever
    assert naive > 0.2  # the reason the test exists
    # and it finds a real effect of the size it is tuned to
    shifted_low, _ = confidence_sequence(mean + 0.3, variance, tau=0.1, alpha=0.05)
    assert (shifted_low > 0).any(axis=1).mean() > 0.9
    assert always_valid_p(0.0, 1.0, tau=1.0) == 1.0


def test_cluster_robust_variance_counts_users_not_requests():
    rng = np.random.default_rng(2)
    users = np.repeat(np.arange(50), 40)  # 50 users × 40 requests, each user's values moving together
    values = np.repeat(rng.normal(0, 1, 50), 40) + rng.normal(0, 0.1, 2000)
    _, clustered = cluster_mean(values, users)
    _, naive = cluster_mean(values, np.arange(2000))
    assert clustered > 20 * naive


def test_cuped_shrinks_variance_and_keeps_the_effect():
    rng = np.random.default_rng(3)
    users = 4000
    pre = rng.gamma(2.0, 1.0, 2 * users)
    clicks = rng.poisson(pre * 3)
    impressions = np.full(2 * users, 30)
    clicks[users:] = rng.poisson(pre[users:] * 3 * 1.1)  # the challenger's users click 10 % more
    ids = np.arange(2 * users)
    plain = ab_difference(
        clicks[:users],
        impressions[:users],
        ids[:users],
        clicks[users:],
        impressions[users:],
        ids[users:],
        tau=0.05,
    )
    adjusted = ab_difference(
        clicks[:users],
        impressions[:users],
        ids[:users],
        clicks[users:],
        impressions[users:],
        ids[users:],
        tau=0.05,
        pre_a=pre[:users],
        pre_b=pre[users:],
    )
    assert adjusted.variance < 0.5 * plain.variance
    assert adjusted.low > 0 and abs(adjusted.estimate - 0.1) < 0.05
    _, theta = cuped(np.arange(10.0), np.arange(10.0))
    assert theta == pytest.approx(1.0)


def test_cuped_adjusts_the_estimate_its_variance_describes():
    """Identical arms, a predictive covariate: the spread of CUPED's estimate over many experiments is the
    variance it reports (it reported the adjusted variance around the raw ratio: about half the spread)."""
    rng = np.random.default_rng(0)
    estimates, reported = [], []
    for _ in range(300):
        n = 1000
        own = rng.beta(1, 12, size=2 * n)  # each user's CTR
        pre = rng.binomial(50, own) / 50  # the week before
        shown = rng.integers(5, 40, size=2 * n).astype(float)
        clicks = rng.binomial(shown.astype(int), own).astype(float)
        ids = np.arange(2 * n)
        a, b = slice(0, n), slice(n, 2 * n)
        d = ab_difference(clicks[a], shown[a], ids[a], clicks[b], shown[b], ids[b], tau=0.05,
                          pre_a=pre[a], pre_b=pre[b])
        estimates.append(d.estimate)
        reported.append(d.variance)
    assert 0.75 < np.var(estimates) / np.mean(reported) < 1.33


def _canary_look(rng, *, users=300, share=0.05, challenger_requests=2000, sigma=2.0, effect=0.0):
    """One A/B canary look at a few-user arm: users' activity lognormal(0, sigma) (2.0: a handful make most
    requests), each user's own CTR Beta(2, 10), 10 items a request, the challenger's users at ``share``."""
    activity, rate = rng.lognormal(0.0, sigma, users), rng.beta(2, 10, users)
    arm = rng.random(users) < share
    arm[0] = True
    share_of_requests = max(activity[arm].sum() / activity.sum(), 0.01)  # at most 100x the challenger's requests
    who = rng.choice(users, int(challenger_requests / share_of_requests), p=activity / activity.sum())
    inside = arm[who]
    clicks = rng.binomial(10, np.minimum(rate[who] * np.where(inside, 1.0 + effect, 1.0), 1.0))
    shown = np.full(len(who), 10)
    return (clicks[~inside], shown[~inside], who[~inside]), (clicks[inside], shown[inside], who[inside])


def test_an_ab_split_with_a_few_dominant_users_keeps_its_error_rate():
    """Identical arms, a canary's 5 % share, a handful of users making most requests: the plain delta-method
    interval called them different in ~5 % of single looks at alpha 0.1 % (an identical challenger rolled
    back in tests/test_serve.py); the shipped one (impressions capped, leverage, Student's t) stays at alpha
    (0.1 % over 2,000 such looks; benchmarks/ab_validity.py)."""
    rng = np.random.default_rng(11)
    plain = shipped = 0
    for _ in range(200):
        a, b = _canary_look(rng, challenger_requests=500)
        d = ab_difference(*a, *b, tau=1.0, alpha=0.001, cap_quantile=None, small_sample=False)
        plain += d.high < 0 or d.low > 0
        d = ab_difference(*a, *b, tau=1.0, alpha=0.001)
        shipped += d.high < 0 or d.low > 0
        assert "capped at p90" in d.method and ", t(" in d.method
    assert plain >= 4  # the situation bites: >= 2 % against alpha's 0.1 %
    assert shipped <= 1


def test_the_guarded_ab_interval_finds_a_worse_challenger_as_often_where_users_are_many():
    """Many users, even activity: the guards cost (almost) no power against a 20 %-worse challenger."""
    rng = np.random.default_rng(5)
    plain = shipped = 0
    for _ in range(20):
        a, b = _canary_look(rng, users=3000, sigma=0.5, challenger_requests=8000, effect=-0.2)
        plain += ab_difference(*a, *b, tau=0.05, alpha=0.05, cap_quantile=None, small_sample=False).high < 0
        shipped += ab_difference(*a, *b, tau=0.05, alpha=0.05).high < 0
    assert shipped >= 10 and shipped >= plain - 2


def test_the_guards_leave_cuped_and_the_estimate_alone_and_a_clickless_arm_is_not_certain():
    """The leverage correction widens the variance only: a covariate CUPED cannot use (constant) leaves the
    estimate exactly as without it (the corrected values once fed CUPED and moved the estimate 0.19 -> 0.96).
    An arm without a click is not known exactly (its own spread is 0)."""
    rng = np.random.default_rng(2)
    a, b = _canary_look(rng, users=400, share=0.3, challenger_requests=300, sigma=1.5)
    plain = ab_difference(*a, *b, tau=0.05, alpha=0.05)
    flat = ab_difference(*a, *b, tau=0.05, alpha=0.05, pre_a=np.zeros(len(np.unique(a[2]))),
                         pre_b=np.zeros(len(np.unique(b[2]))))
    assert flat.estimate == pytest.approx(plain.estimate, abs=1e-12) and "CUPED" in flat.method
    assert flat.variance == pytest.approx(plain.variance, rel=1e-9)
    clickless = ab_difference(*a, np.zeros_like(b[0]), b[1], b[2], tau=0.05, alpha=0.05)
    assert clickless.estimate == -1.0 and clickless.variance > 0.2 * plain.variance
    assert np.isinf(ab_difference(*a, b[0], np.zeros_like(b[1]), b[2], tau=0.05).high)  # nothing shown in b


def test_effective_users_and_the_t_widening():
    assert effective_units(np.ones(10)) == pytest.approx(10.0)
    assert effective_units([100.0, 1.0, 1.0]) == pytest.approx(102**2 / 10002)
    # equal parts from 5 and 5 units: 8 degrees of freedom; one part alone: its units - 1
    assert welch_degrees(1.0, 1.0, 5, 5) == pytest.approx(8.0)
    assert welch_degrees(1.0, 0.0, 4, 100) == pytest.approx(3.0)
    assert student_widening(0.05, 1e6) == pytest.approx(1.0, abs=1e-4)
    assert student_widening(0.05, 4.0) == pytest.approx((2.776 / 1.960) ** 2, rel=1e-3)
    assert student_widening(0.001, 3.0) > student_widening(0.05, 3.0) > 1.0


def test_grouped_auc_and_ndcg():
    labels = np.array([1, 0, 0, 1, 0, 1, 1])
    scores = np.array([0.9, 0.1, 0.5, 0.2, 0.3, 0.4, 0.4])
    groups = np.array([0, 0, 0, 1, 1, 2, 2])  # group 2 has one class: left out
    expected = (3 * auc(labels[:3], scores[:3]) + 2 * auc(labels[3:5], scores[3:5])) / 5
    assert grouped_auc(labels, scores, groups) == pytest.approx(expected)
    gains = np.array([0.5, 0.1, 0.2])
    assert ndcg_at_k(gains, np.array([3.0, 1.0, 2.0]), np.zeros(3), k=10) == pytest.approx(1.0)
    assert ndcg_at_k(gains, np.array([1.0, 3.0, 2.0]), np.zeros(3), k=10) < 0.9


def _requests(rng, users=400, per_user=5, size=10):
    groups = np.repeat(np.arange(users * per_user), size)
    user = groups // per_user
    truth = rng.normal(0, 1, len(groups))
    labels = (rng.random(len(groups)) < 1 / (1 + np.exp(-(truth - 1.5)))).astype(int)
    return labels, truth, groups, user


def test_the_paired_test_tells_noise_from_a_worse_model():
    rng = np.random.default_rng(4)
    labels, truth, groups, user = _requests(rng)
    champion = truth + rng.normal(0, 0.5, len(truth))
    same = truth + rng.normal(0, 0.5, len(truth))  # as good, different noise
    worse = truth + rng.normal(0, 2.0, len(truth))
    tie = paired_bootstrap(labels, same, champion, groups, user, rng=rng, resamples=400)
    loss = paired_bootstrap(labels, worse, champion, groups, user, rng=rng, resamples=400)
    assert tie.p_worse > 0.05 and tie.low < 0 < tie.high
    assert loss.p_worse < 0.001 and loss.high < 0
    tolerated = paired_bootstrap(labels, worse, champion, groups, user, rng=rng, resamples=400, margin=0.5)
    assert tolerated.p_worse > 0.5  # a drop within the margin is not a failure
    ndcg = paired_bootstrap(
        truth.clip(0), worse, champion, groups, user, metric="ndcg", rng=rng, resamples=200
    )
    assert ndcg.difference < 0


def test_a_candidate_scoring_exactly_as_the_champion_is_not_worse():
    """The same scores on every row leave no spread to resample: the one-sided p of "worse by more than the
    margin" is then 1 (it read 0, and a slice where an incremental run scored as its champion refused it)."""
    rng = np.random.default_rng(4)
    labels, truth, groups, user = _requests(rng)
    champion = truth + rng.normal(0, 0.5, len(truth))
    for metric in ("gauc", "auc"):
        same = paired_bootstrap(labels, champion.copy(), champion, groups, user, rng=rng, resamples=200,
                                margin=0.01, metric=metric)
        assert (same.difference, same.low, same.high) == (0.0, 0.0, 0.0) and same.p_worse == 1.0, (metric, same)
    worse = paired_bootstrap(labels, champion - 10 * (labels > 0), champion, groups, user, rng=rng, resamples=200,
                             margin=0.01, metric="auc")  # every positive below every negative, every resample
    assert worse.high < -0.01 and worse.p_worse < 0.001


def test_holm_matches_statsmodels_and_slices_need_power():
    from statsmodels.stats.multitest import multipletests

    p = np.array([0.01, 0.04, 0.03, 0.2, 0.001])
    np.testing.assert_allclose(holm(p), multipletests(p, method="holm")[1])
    small, large = min_rows_for_auc_difference(0.05), min_rows_for_auc_difference(0.01)
    assert 100 < small < large and large > 10 * small


def test_off_policy_estimates_recover_a_candidates_ctr_from_exploration_logs():
    rng = np.random.default_rng(5)
    requests, m = 20000, 8
    truth = rng.uniform(0.02, 0.4, (requests, m))
    logging = softmax(rng.normal(0, 1, (requests, m)), 1.0)  # the logging policy's top-slot probabilities
    shown = (logging.cumsum(axis=1) > rng.random((requests, 1))).argmax(axis=1)
    rows = np.arange(requests)
    rewards = (rng.random(requests) < truth[rows, shown]).astype(float)
    target = epsilon_greedy(truth + rng.normal(0, 0.05, truth.shape), 0.1)  # the candidate's top-slot policy
    true_ctr = (target * truth).sum(axis=1).mean()
    q = truth + rng.normal(0, 0.05, truth.shape)  # a decent reward model
    result = estimate(
        rewards, logging[rows, shown], target[rows, shown], q[rows, shown], (target * q).sum(axis=1)
    )
    for value in (result.ips, result.snips, result.dr):
        assert abs(value - true_ctr) < 0.03, (value, true_ctr)
    assert abs(result.snips - true_ctr) < 4 * result.snips_se + 0.005
    order, propensity = plackett_luce(np.array([2.0, 1.0, 0.0]), k=3, temperature=1.0, rng=rng)
    assert sorted(order) == [0, 1, 2] and propensity[-1] == pytest.approx(1.0)


def test_platt_scaling_fixes_the_level_fitted_on_training_rows():
    rng = np.random.default_rng(6)
    p = rng.uniform(0.01, 0.3, 50000)
    labels = rng.random(50000) < p
    overconfident = np.clip(p * 1.5, 0, 0.99)  # calibration 1.5
    a, b = fit_platt(labels, overconfident)  # slope and intercept
    fixed = apply_platt(overconfident, a, b)
    assert fixed.mean() / labels.mean() == pytest.approx(1.0, abs=0.03)
    assert auc(labels, fixed) == pytest.approx(auc(labels, overconfident), abs=1e-9)


def test_no_evidence_yet_is_an_unbounded_interval_without_warnings():
    import warnings

    from recloop.evidence.sequential import interleaving_difference

    empty = np.zeros(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nothing = interleaving_difference(empty, empty, empty, tau=0.05)
        also = ab_difference(empty, empty, empty, empty, empty, empty, tau=0.05)
    assert nothing.low == -np.inf and nothing.high == np.inf and also.high == np.inf


def test_the_pooled_auc_bootstrap_matches_the_plain_auc_and_resamples_users():
    from recloop.evidence.ranking import _pooled_auc_resamples

    rng = np.random.default_rng(8)
    labels = rng.random(3000) < 0.2
    scores = np.round(rng.normal(0, 1, 3000) + labels, 1)  # with ties
    ones = np.ones((2, 3000))
    np.testing.assert_allclose(_pooled_auc_resamples(labels, scores, ones), auc(labels, scores))
    users = rng.integers(0, 300, 3000)
    worse = scores + rng.normal(0, 2, 3000)
    result = paired_bootstrap(labels, worse, scores, users, users, metric="auc", rng=rng, resamples=200)
    assert result.high < 0 and result.p_worse < 0.001 and result.metric == "auc"


def test_the_base_rate_correction_moves_only_the_level():
    rng = np.random.default_rng(9)
    p = rng.uniform(0.01, 0.3, 50000)
    labels = rng.random(50000) < p
    a, b = fit_platt(labels, np.clip(p * 0.8, 1e-4, 0.99), slope=False)
    assert a == 1.0 and b > 0
    assert apply_platt(np.clip(p * 0.8, 1e-4, 0.99), a, b).mean() / labels.mean() == pytest.approx(1.0, abs=0.02)


def test_the_paired_log_loss_interval_tells_a_sharper_model_from_noise():
    """Over users: a model with the true probabilities beats a blurred copy (its interval below zero); against
    itself the difference is zero."""
    rng = np.random.default_rng(0)
    users = rng.integers(0, 300, 20_000)
    truth = 1 / (1 + np.exp(-rng.normal(0, 1.5, len(users))))
    labels = (rng.random(len(users)) < truth).astype(float)
    blurred = 0.5 * truth + 0.25
    result = paired_logloss(labels, truth, blurred, users, resamples=400)
    assert result.difference < 0 and result.low <= result.difference <= result.high < 0, result
    assert result.units == 300 and result.p_worse < 0.01
    same = paired_logloss(labels, truth, truth, users, resamples=200)
    assert same.difference == 0 and same.low == same.high == 0
