"""Filtering and ordering rules of the recommendation path."""

from __future__ import annotations

import numpy as np
import pytest

from recloop.evidence.interleaving import CHALLENGER, CHAMPION
from recloop.retrieval.rules import (
    FilterConfig,
    OrderConfig,
    filter_candidates,
    order_interleaved,
    order_items,
)

NOW = 1_800_000_000.0


def test_filter_drops_excluded_unavailable_and_recently_seen_and_counts_each():
    candidates = np.array([10, 11, 12, 13, 14, 15, 16, -1])  # -1: index padding
    recent = {12: (NOW - 3600, True), 13: (NOW - 7200, False), 14: (NOW - 48 * 3600, True)}
    kept, dropped = filter_candidates(candidates, FilterConfig(seen_hours=24), now_s=NOW, recent=recent,
                                      unavailable={11, 10}, excluded={10, 16})
    assert kept.tolist() == [14, 15]  # order kept; 14 was clicked two days ago: outside the look-back
    assert (dropped.excluded, dropped.unavailable, dropped.seen, dropped.total) == (2, 1, 2, 5)


def test_the_lake_history_drops_items_whatever_their_time_counting_only_what_the_journal_left():
    candidates = np.array([10, 11, 12, 13, 14])
    recent = {12: (NOW - 3600, True)}
    history = np.array([12, 13, 99, 10])  # 12: the journal drops it first; 10: excluded by the request first
    kept, dropped = filter_candidates(candidates, FilterConfig(seen_hours=24), now_s=NOW, recent=recent,
                                      history=history, excluded={10})
    assert kept.tolist() == [11, 14]
    assert (dropped.excluded, dropped.seen, dropped.seen_history, dropped.total) == (1, 1, 1, 3)
    kept, dropped = filter_candidates(candidates, FilterConfig(seen_hours=0), now_s=NOW, history=history)
    assert kept.tolist() == [11, 14] and dropped.seen_history == 3  # the journal's rule off: not this one


def test_shown_but_not_clicked_items_stay_unless_configured():
    candidates = np.array([1, 2, 3])
    recent = {1: (NOW - 60, False), 2: (NOW - 60, True)}
    kept, _ = filter_candidates(candidates, FilterConfig(drop_shown=False), now_s=NOW, recent=recent)
    assert kept.tolist() == [1, 3]
    kept, _ = filter_candidates(candidates, FilterConfig(seen_hours=0), now_s=NOW, recent=recent)
    assert kept.tolist() == [1, 2, 3]


def test_order_caps_categories_applies_boosts_and_backfills():
    items = np.array([1, 2, 3, 4, 5, 6])
    scores = np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
    categories = np.array([0, 0, 0, 1, 1, 2])
    top, _ = order_items(items, scores, categories, OrderConfig(category_cap=2), k=4)
    assert top.tolist() == [1, 2, 4, 5]  # item 3 is a third of category 0
    top, boosted = order_items(items, scores, categories, OrderConfig(category_cap=2, boosts={2: 3.0}), k=3)
    assert top.tolist() == [6, 1, 2] and boosted[0] == pytest.approx(1.2)
    top, _ = order_items(items[:3], scores[:3], categories[:3], OrderConfig(category_cap=1), k=3)
    assert top.tolist() == [1, 2, 3]  # one category only: backfilled in score order
    top, _ = order_items(items[:3], scores[:3], categories[:3], OrderConfig(category_cap=1, backfill=False), k=3)
    assert top.tolist() == [1]


def test_ties_are_broken_by_id_and_bad_configs_refused():
    top, _ = order_items(np.array([9, 4, 7]), np.array([0.5, 0.5, 0.5]), np.array([0, 1, 2]),
                         OrderConfig(category_cap=None), k=3)
    assert top.tolist() == [4, 7, 9]
    with pytest.raises(ValueError):
        OrderConfig(category_cap=0)
    with pytest.raises(ValueError):
        OrderConfig(boosts={1: -1.0})


def test_interleaved_order_takes_turns_under_the_same_cap_and_scores_each_item_by_its_team():
    items = np.arange(100, 112)
    champion = np.linspace(1.0, 0.1, 12)  # prefers the low ids
    challenger = champion[::-1].copy()  # prefers the high ids
    categories = np.array([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2])
    config = OrderConfig(category_cap=2, boosts={1: 2.0})
    seen_teams = []
    for seed in range(20):
        placed, teams, scores = order_interleaved(items, champion, challenger, categories, config, 6,
                                                  np.random.default_rng(seed))
        assert len(placed) == 6 == len(set(placed.tolist()))
        assert np.bincount(categories[placed]).max() <= 2  # the cap holds on the merged list
        for position, team, score in zip(placed, teams, scores, strict=True):
            own = (challenger if team == CHALLENGER else champion)[position]
            assert score == pytest.approx(own * (2.0 if categories[position] == 1 else 1.0))
        first = placed[0]
        # each team's first pick is the best item of its own boosted order
        best = {CHAMPION: 4, CHALLENGER: 7}  # category 1 doubled: 0.67 x 2 beats either 1.0
        assert first == best[int(teams[0])]
        seen_teams.append(teams.tolist())
        assert abs(int((teams == CHALLENGER).sum()) - int((teams == CHAMPION).sum())) <= 2
    assert {t[0] for t in seen_teams} == {CHAMPION, CHALLENGER}  # a coin, not a fixed team, leads
    same, _, _ = order_interleaved(items, champion, champion, categories, config, 6, np.random.default_rng(0))
    assert items[same].tolist() == order_items(items, champion, categories, config, 6)[0].tolist()



def test_a_negative_boost_is_refused_when_the_settings_are_read(monkeypatch):
    """``RECLOOP_RECOMMEND_BOOSTS`` with a negative (or non-finite) multiplier is a configuration error at
    start-up, not a 500 on every /recommend."""
    from recloop.settings import Settings, SettingsError

    for bad in ('{"5": -1.0}', '{"5": "inf"}'):
        monkeypatch.setenv("RECLOOP_RECOMMEND_BOOSTS", bad)
        with pytest.raises(SettingsError, match="RECLOOP_RECOMMEND_BOOSTS"):
            Settings()
    monkeypatch.setenv("RECLOOP_RECOMMEND_BOOSTS", '{"5": 1.2}')
    assert Settings().recommend_boosts == {5: 1.2}


def test_text_categories_are_capped_and_never_boosted():
    """A category column that holds text (a retriever warm-started from one that kept it as text) reached the
    ordering as NaN checks on objects, and every /recommend failed: text gets codes of its own (the cap
    holds; boosts, keyed by integer categories, do not reach them); numbers are as before."""
    import numpy as np

    from recloop.serve.recommend import _category_codes

    text = _category_codes(np.array(["shoes", None, "hats", "shoes"], dtype=object))
    assert text[1] == -1 and text[0] == text[3] != text[2] and (text[[0, 2]] < -1).all()
    np.testing.assert_array_equal(_category_codes(np.array([3.0, np.nan, 5.0])), [3, -1, 5])
