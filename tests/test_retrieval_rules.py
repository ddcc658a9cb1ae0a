"""Filtering and ordering rules of the recommendation path."""

from __future__ import annotations

import numpy as np
import pytest

from recloop.retrieval.rules import FilterConfig, OrderConfig, filter_candidates, order_items

NOW = 1_800_000_000.0


def test_filter_drops_excluded_unavailable_and_recently_seen_and_counts_each():
    candidates = np.array([10, 11, 12, 13, 14, 15, 16, -1])  # -1: index padding
    recent = {12: (NOW - 3600, True), 13: (NOW - 7200, False), 14: (NOW - 48 * 3600, True)}
    kept, dropped = filter_candidates(candidates, FilterConfig(seen_hours=24), now_s=NOW, recent=recent,
                                      unavailable={11, 10}, excluded={10, 16})
    assert kept.tolist() == [14, 15]  # order kept; 14 was clicked two days ago: outside the look-back
    assert (dropped.excluded, dropped.unavailable, dropped.seen, dropped.total) == (2, 1, 2, 5)


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
