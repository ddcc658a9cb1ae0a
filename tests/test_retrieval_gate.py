"""The retriever's gate: floors, the popularity baseline, a paired test against the champion, slices."""

from __future__ import annotations

import numpy as np

from recloop.gate.retrieval import RetrievalThresholds, decide, paired_drop
from recloop.retrieval.evaluate import (
    oracle_recall,
    popularity_ranking,
    recall_and_ndcg,
    retrieval_scores,
    target_ranks,
)

K = 10
THRESHOLDS = RetrievalThresholds(k=K, min_slice_clicks=50, min_clicks=50)


def scores_with_hits(hit: np.ndarray, new_user: np.ndarray | None = None, popular_hit_rate: float = 0.1):
    """Scores whose clicks are hit at rank 0 where ``hit``, missed elsewhere; popularity hits a share."""
    ranks = np.where(hit, 0, -1)
    popular = np.where(np.arange(len(hit)) < popular_hit_rate * len(hit), 3, -1)
    slices = {"user=new": new_user} if new_user is not None else {}
    return retrieval_scores(ranks, (K,), slices, popular)


def test_metrics_of_ranks_by_hand():
    retrieved = np.array([[5, 6, 7], [1, 2, 3], [9, 8, 4]])
    ranks = target_ranks(retrieved, np.array([7, 0, 9]))
    assert ranks.tolist() == [2, -1, 0]
    recall, ndcg = recall_and_ndcg(ranks, 3)
    assert recall == 2 / 3 and np.isclose(ndcg, (1 / np.log2(4) + 1) / 3)
    assert recall_and_ndcg(ranks, 1)[0] == 1 / 3
    assert oracle_recall(np.array([[1, 2, -1]]), np.array([[2, 3, 4]])) == 1 / 3
    assert popularity_ranking(np.array([5, 9, 9, 1]), np.array([10, 30, 20, 40]), 3).tolist() == [20, 30, 10]


def test_the_first_retriever_passes_the_floors_only():
    rng = np.random.default_rng(0)
    good = scores_with_hits(rng.random(1000) < 0.3)
    decision = decide(good, None, THRESHOLDS, "full")
    assert decision.passed and decision.first_model
    weak = scores_with_hits(rng.random(1000) < 0.02, popular_hit_rate=0.2)
    decision = decide(weak, None, THRESHOLDS, "full")
    assert not decision.passed
    assert any("floor" in r for r in decision.reasons) and any("popularity" in r for r in decision.reasons)


def test_a_drop_fails_only_when_beyond_the_tolerance_and_the_noise():
    rng = np.random.default_rng(1)
    champion_hit = rng.random(4000) < 0.4
    champion = scores_with_hits(champion_hit)
    same_but_one = champion_hit.copy()
    same_but_one[np.flatnonzero(champion_hit)[:8]] = False  # 8 of 4000 clicks lost: 0.002 < 0.01 allowed
    assert decide(scores_with_hits(same_but_one), champion, THRESHOLDS, "incremental").passed
    worse = champion_hit & (rng.random(4000) < 0.85)  # loses 15 % of its hits: a drop of about 0.06
    decision = decide(scores_with_hits(worse), champion, THRESHOLDS, "incremental")
    assert not decision.passed and "dropped" in decision.reasons[0]
    drop, error = paired_drop(champion.ranks, np.where(worse, 0, -1), K)
    assert 0.04 < drop < 0.08 and 0 < error < 0.01
    # On 60 clicks, 6 lost and 3 gained is a drop of 0.05 with a paired error near 0.05: not evidence.
    small_champion = np.arange(60) < 24
    small_candidate = small_champion.copy()
    small_candidate[:6], small_candidate[30:33] = False, True
    decision = decide(scores_with_hits(small_candidate), scores_with_hits(small_champion), THRESHOLDS, "full")
    figures = decision.figures[f"recall@{K}"]
    assert np.isclose(figures["drop"], 0.05) and figures["paired_se"] > 0.04
    assert decision.passed, decision.reasons


def test_a_slice_regression_fails_even_when_the_average_holds():
    rng = np.random.default_rng(2)
    new_user = np.arange(2000) < 200
    champion_hit = rng.random(2000) < 0.4
    candidate_hit = champion_hit.copy()
    candidate_hit[new_user] = False  # new users lose every hit...
    candidate_hit[~new_user & (rng.random(2000) < 0.05)] = True  # ...returning users gain as many
    decision = decide(scores_with_hits(candidate_hit, new_user), scores_with_hits(champion_hit, new_user),
                      RetrievalThresholds(k=K, min_slice_clicks=50, max_recall_drop_incremental=0.05),
                      "incremental")
    assert not decision.passed
    assert [r for r in decision.reasons if r.startswith("slice user=new")]
    assert decision.figures["slice user=new"]["clicks"] == 200


def test_a_handful_of_held_out_clicks_is_insufficient_evidence_not_a_verdict():
    """One held-out click (a sparse log's last period) judged a retriever 0.00 vs popularity 1.00 and refused it;
    below ``min_clicks`` the gate says the evidence is insufficient instead of comparing recalls."""
    one_miss = retrieval_scores(np.array([-1]), (K,), {}, np.array([0]))
    decision = decide(one_miss, None, THRESHOLDS, "full")
    assert not decision.passed
    assert len(decision.reasons) == 1 and decision.reasons[0].startswith("insufficient evidence: 1 held-out click")
    assert "popularity" not in decision.reasons[0] and "floor" not in decision.reasons[0]
    assert decision.figures["evidence"] == {"clicks": 1, "min_clicks": THRESHOLDS.min_clicks}
    enough = scores_with_hits(np.random.default_rng(1).random(THRESHOLDS.min_clicks) < 0.3)
    assert decide(enough, None, THRESHOLDS, "full").passed
