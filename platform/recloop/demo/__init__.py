"""``recloop demo``: the whole loop over simulated days on embedded defaults, with a report (``loop``: the
days; ``panel``: the reference rankings; ``report``: the summary and the HTML page)."""

from recloop.demo.loop import run_demo
from recloop.demo.panel import rank_panel
from recloop.demo.records import DayRecord, DemoConfig
from recloop.demo.report import write_report

__all__ = ["DayRecord", "DemoConfig", "rank_panel", "run_demo", "write_report"]
