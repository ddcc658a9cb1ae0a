"""What Evidently shows a reviewer (issue #20): columns typed by the dataset spec, and each check's
decision with the figures it was held to (the unseen-id share, the drift share, their thresholds)."""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np
import pandas as pd

from recloop.monitor.decision import MonitorConfig
from recloop.monitor.drift import evidently_drift
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
    assert _methods(typed)["item_category"].startswith("chi-square") and _methods(typed)["price"].startswith(
        "K-S"
    )


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
        figures={"user_id_unseen_share": 0.4, "item_id_unseen_share": 0.1, "drift_share": 0.5},
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
    assert (
        values["decision_code"] == 1.0
        and values["drift_share"] == 0.5
        and values["drift_share_threshold"] == 0.3
    )
    titles = [panel.title for panel in workspace.get_dashboard(found.id).panels]
    assert {"Unseen-id share vs its threshold", "Drift share vs its threshold"} <= set(titles)
    assert any(title.startswith("Decisions:") for title in titles)
