"""``benchmarks/loop.py --loop-table``: the full-loop grid's rows summarized by scenario (no run, seconds)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmark_scripts import benchmark_script


@pytest.fixture(scope="module")
def loop():
    return benchmark_script("loop")


def _row(seed: int, champion: float, served: float, challenger: float | None, reference: float) -> dict:
    day4 = {"never_retrained": 0.2, "champion": champion, "served": served, "daily_full": reference}
    if challenger is not None:
        day4["challenger"] = challenger
    return {"scenario": "none", "seed": seed, "days": 5, "events_per_day": 100, "requests_per_day": 10,
            "reference_seeds": 3, "seeded_training": True, "loop_minus_frozen": champion - 0.2,
            "loop_minus_daily_full": champion - reference, "served_minus_frozen": served - 0.2,
            "served_minus_daily_full": served - reference, "detection_delay_days": None, "false_alarms": 0,
            "panel_by_day": {"3": {"champion": 0.1, "daily_full": 0.1}, "4": day4}}


def test_the_table_reads_the_loop_as_served_and_its_newest_model_beside_the_champion(loop, tmp_path: Path):
    """While a canary runs at the panel, the champion alone understates what the loop serves and what it trained:
    the table gives the ranking as served and the newest model (the canary's challenger, else the champion)
    beside it, each against the daily full retrain."""
    rows = [_row(0, champion=0.30, served=0.36, challenger=0.40, reference=0.41),
            _row(1, champion=0.50, served=0.50, challenger=None, reference=0.48)]
    assert loop.newest_minus_daily_full(rows[0]) == pytest.approx(-0.01)
    assert loop.newest_minus_daily_full(rows[1]) == pytest.approx(0.02)  # no canary: the champion is the newest
    assert loop.newest_minus_daily_full({"panel_by_day": {}}) is None
    older = {"panel_by_day": {"4": {"champion": 0.3, "daily_full": 0.4}}}  # before the panel kept the challenger
    assert loop.newest_minus_daily_full(older) is None
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (entry,) = loop.loop_table([str(path)]).values()
    assert entry["loop_minus_daily_full"]["mean"] == pytest.approx((-0.11 + 0.02) / 2)
    assert entry["served_minus_daily_full"]["mean"] == pytest.approx((-0.05 + 0.02) / 2)
    assert entry["newest_minus_daily_full"]["mean"] == pytest.approx((-0.01 + 0.02) / 2)
    assert entry["false_alarm_checks"] == 0 and entry["checks"] == 8
