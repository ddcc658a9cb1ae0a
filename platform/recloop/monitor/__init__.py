"""Drift and KPI monitoring, and the trigger that turns a finding into a full retrain.

- ``decision``: the pure core (findings → ``MonitorDecision``, ``choose_windows``, ``should_retrain``);
- ``drift``: Evidently's drift figures over two windows of data;
- ``runner``: one check's IO (lake, serving journal, champion, MLflow, the Evidently workspace) and the
  trigger's recorded history;
- ``dashboards``: the Evidently workspace and its panels.
"""

from recloop.monitor.decision import (
    MonitorConfig,
    MonitorDecision,
    TriggerConfig,
    TriggerVerdict,
    choose_windows,
    decide,
    kpi_findings,
    should_retrain,
)

__all__ = ["MonitorConfig", "MonitorDecision", "TriggerConfig", "TriggerVerdict", "choose_windows", "decide",
           "kpi_findings", "should_retrain"]
