"""What Evidently shows a reviewer (issue #20): columns typed by the dataset spec, and each check's
decision with the figures it was held to (the unseen-id share, the drift share, their thresholds)."""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np
import pandas as pd
import pytest

from recloop.monitor.decision import MonitorConfig
from recloop.monitor.drift import ColumnDrift, column_drift, evidently_drift
from recloop.settings import Settings


def _windows():
    rng = np.random.default_rng(0)
    return [
        pd.DataFrame({"item_category": rng.integers(0, 50, 400), "price": rng.random(400)}) for _ in range(2)
    ]


def _methods(snapshot) -> dict[str, str]:
    names = [str(m.get("metric_name")) for m in snapshot.dict()["metrics"]]
    return {
        n.split("column=")[1].split(",")[0]: n.split("method=")[1].split(",")[0]
        for n in names
        if n.startswith("ValueDrift(")
    }


def test_a_spec_categorical_integer_column_is_tested_as_a_category():
    reference, current = _windows()
    _, _, _, inferred = evidently_drift(reference, current, ["item_category", "price"], MonitorConfig())
    _, _, _, typed = evidently_drift(
        reference, current, ["item_category", "price"], MonitorConfig(), categorical={"item_category"}
    )
    assert _methods(inferred)["item_category"].startswith("K-S")  # 50 integer values: taken for a quantity
    assert _methods(typed)["item_category"] == "jensenshannon" and _methods(typed)["price"].startswith(
        "K-S"
    )


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # the chi-square below meets empty reference cells
def test_a_category_missing_from_a_small_reference_is_not_drift():
    """The same 26-value category mix: a few hours of reference lack its rarest values. Chi-square (Evidently's
    choice below 1000 rows) calls that drift; the Jensen-Shannon distance that categorical columns get does not."""
    rng = np.random.default_rng(2)
    shares = np.geomspace(1, 0.01, 26) / np.geomspace(1, 0.01, 26).sum()
    reference, current = (pd.DataFrame({"category": rng.choice(26, rows, p=shares)}) for rows in (600, 4000))
    assert set(current["category"]) - set(reference["category"])  # values the reference never saw
    _, drifted, scores, snapshot = evidently_drift(reference, current, ["category"], MonitorConfig(),
                                                   categorical={"category"})
    assert drifted == [] and scores["category"] < 0.1 and _methods(snapshot)["category"] == "jensenshannon"
    chi = MonitorConfig(per_column_method={"category": "chisquare"})
    assert evidently_drift(reference, current, ["category"], chi, categorical={"category"})[1] == ["category"]


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # chi-square over empty reference cells
def test_the_drift_tests_without_the_report_give_the_reports_figures():
    """``snapshot=False`` runs each column's test as the report's ValueDrift does, without its plots: every
    share, verdict, score, method and threshold the same, for inferred, typed, overridden and drifted columns."""
    rng = np.random.default_rng(5)
    shares = np.geomspace(1, 0.01, 26) / np.geomspace(1, 0.01, 26).sum()

    def window(rows: int, shift: float) -> pd.DataFrame:
        return pd.DataFrame({"category": rng.choice(26, rows, p=shares), "price": rng.normal(shift, 1, rows),
                             "slot": rng.integers(0, 5, rows), "code": rng.integers(0, 50, rows).astype(float),
                             "country": rng.choice(["fr", "de", None], rows)})

    reference, current = window(600, 0.0), window(1500, 0.8)  # price drifts
    columns = ["category", "price", "slot", "code", "country"]
    configs = [MonitorConfig(), MonitorConfig(per_column_method={"category": "chisquare", "price": "psi"},
                                              per_column_threshold={"code": 0.01, "price": 0.05})]
    for config in configs:
        typed = {"categorical": {"category", "country"}, "numeric": {"slot"}}
        share, drifted, scores, snapshot = evidently_drift(reference, current, columns, config, **typed)
        fast = evidently_drift(reference, current, columns, config, **typed, snapshot=False)
        assert fast[:2] == (share, drifted) and fast[3] is None and "price" in drifted
        assert fast[2] == pytest.approx(scores, rel=1e-12)
        from recloop.monitor.drift import dataset_frame, value_drift

        frames = [dataset_frame(f, columns, typed["categorical"]) for f in (reference, current)]
        reported = column_drift(snapshot)
        for column in columns:
            alone = value_drift(*frames, column, column in ("price", "slot", "code"),
                                {"category": "jensenshannon", "country": "jensenshannon",
                                 **config.per_column_method}.get(column), config.per_column_threshold.get(column))
            assert alone == reported[column], column


def test_each_check_records_its_decision_with_the_thresholds(tmp_path):
    from recloop.monitor import dashboards

    settings = Settings(home=tmp_path)
    reference, current = _windows()
    _, _, _, snapshot = evidently_drift(
        reference, current, ["item_category", "price"], MonitorConfig(), categorical={"item_category"}
    )
    when = datetime(2026, 1, 3, tzinfo=UTC)
    dashboards.record_run(
        settings,
        snapshot,
        kpis=None,
        version="3",
        when=when,
        decision="drift",
        columns=("item_category", "price"),
        config=MonitorConfig(new_id_share=0.25),
        figures={"user_id_unseen_share": 0.4, "item_id_unseen_share": 0.1, "user_id_unseen_expected": 0.05,
                 "drift_share": 0.5},
    )
    workspace, found = dashboards.project(settings)
    runs = workspace.list_runs(found.id)
    assert len(runs) == 2  # the drift report and the decision's figures
    values = {}
    for run in runs:
        for result in workspace.get_run(found.id, run).metric_results.values():
            if str(result.display_name).startswith("Mean value of "):
                values[result.display_name.removeprefix("Mean value of ").strip("'")] = float(result.value)
    assert values["user_id_unseen_share"] == 0.4 and values["new_id_share_threshold"] == 0.25
    assert values["user_id_unseen_limit"] == pytest.approx(0.05 + 0.25 * 0.95)  # a stable world's + new ids
    assert (
        values["decision_code"] == 1.0
        and values["drift_share"] == 0.5
        and values["drift_share_threshold"] == 0.3
    )
    panels = workspace.get_dashboard(found.id).panels
    titles = [panel.title for panel in panels]
    assert {"Unseen-id share vs its threshold", "Drift share vs its threshold"} <= set(titles)
    assert any(title.startswith("Decisions:") for title in titles)
    # Each column against its own test's threshold, the test named: no p-value beside a distance on one axis.
    (per_column,) = [p for p in panels if p.title.startswith("Per-column drift")]
    legends = [m.legend for m in per_column.values]
    assert legends == ["item_category (jensenshannon)", "price (K-S p_value)"], legends
    results = column_drift(snapshot)
    for column, result in results.items():
        assert values[f"{column}_drift_over_threshold"] == result.over_threshold()
        assert (result.over_threshold() >= 1) == result.drifted


def test_p_values_and_distances_meet_on_one_scale():
    """Drifted columns score above 1 whichever test judged them: a p-value below its threshold, a distance above."""
    rng = np.random.default_rng(3)
    reference = pd.DataFrame({"price": rng.random(400), "category": rng.integers(0, 8, 400)})
    shifted = pd.DataFrame({"price": rng.random(400) + 0.3, "category": rng.integers(4, 12, 400)})
    same = pd.DataFrame({"price": rng.random(400), "category": rng.integers(0, 8, 400)})
    for current, drifted in ((shifted, True), (same, False)):
        _, _, _, snapshot = evidently_drift(reference, current, ["price", "category"], MonitorConfig(),
                                            categorical={"category"})
        results = column_drift(snapshot)
        assert results["price"].p_value and not results["category"].p_value  # K-S beside Jensen-Shannon
        for result in results.values():
            assert result.drifted is drifted and (result.over_threshold() > 1) is drifted, result
    assert ColumnDrift("K-S p_value", 0.0, 0.05, True).over_threshold() == 10.0  # capped
    assert ColumnDrift("K-S p_value", 0.5, 0.05, False).over_threshold() == 0.1
    assert ColumnDrift("jensenshannon", 0.05, 0.1, False).over_threshold() == 0.5


def test_the_online_ctr_panels_show_the_champions_ctr_whenever_it_had_feedback(tmp_path):
    """The "Online CTR" panel plotted nothing (read as 0) on a day the demo reported a CTR: the KPI snapshot was
    written only past the decision's ``min_impressions``. It now holds clicks / impressions whenever there was
    feedback, a counter panel shows the last check's value, and snapshot names say their time is event time."""
    from recloop.monitor import dashboards

    settings = Settings(home=tmp_path)
    reference, current = _windows()
    _, _, _, snapshot = evidently_drift(reference, current, ["price"], MonitorConfig())
    dashboards.record_run(settings, snapshot, kpis={"impressions": 1200.0, "clicks": 135.0}, version="1",
                          when=datetime(2026, 1, 3, tzinfo=UTC), decision="ok", columns=("price",))
    workspace, found = dashboards.project(settings)
    runs = [workspace.get_run(found.id, run) for run in workspace.list_runs(found.id)]
    assert len(runs) == 3  # the drift report, the decision's figures and the KPIs
    clicked = [float(r.value) for run in runs for r in run.metric_results.values()
               if str(r.display_name).strip("'").endswith("clicked")]
    assert clicked == [pytest.approx(135 / 1200)]
    assert dashboards.online_ctr({"impressions": 0.0, "clicks": 0.0}) is None
    assert dashboards.online_ctr({"impressions": 3000.0, "clicks": 300.0, "ctr": 0.1}) == 0.1
    (counter,) = [p for p in workspace.get_dashboard(found.id).panels if p.title.endswith("last check")]
    assert counter.plot_params["plot_type"] == "counter" and counter.plot_params.get("aggregation") == "last"
    names = [str(getattr(run, "name", "") or "") for run in workspace.list_runs(found.id)]
    assert all("(event time)" in name for name in names if name), names
