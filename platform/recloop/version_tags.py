"""The names of the tags recloop keeps on registered versions: the vocabulary the registry, the canary, serving
and the monitor share (what each tag holds is described where it is written), and how a tag is kept both readable
and machine-readable (``readable``, ``record``).
"""

import json
from collections.abc import Mapping

CANARY_TAG = "canary"  # the canary's state on a challenger (recloop.canary.tag.CanaryTag), one JSON tag
LOAD_FAILED_TAG = "serving.load_failed"  # set by serving: {"reason", "at"}; the controller rolls back on it
KPI_BASELINE_TAG = "kpi.baseline"  # set at promotion: {"ctr", "auc", "impressions"} the champion earned
ROLLED_BACK_TAG = "rolled_back"  # set on a champion rolled back: who, why, when

# Each of these tags is two on the version: ``<name>`` says it in a short line a person reads in MLflow's version
# page ("passed vs champion v1: ...", "by gate at 2026-11-27 10:00 UTC: passed the gate"), and ``<name>.json`` holds
# the record programs read. The UI showed the JSON itself before (issue 43). A version tagged before the split
# has the JSON under ``<name>``: ``record`` reads either.
RECORD_SUFFIX = ".json"
SUMMARY_CHARACTERS = 250  # a tag a person reads at a glance; the record keeps everything


def readable(name: str, summary: str, record: object) -> dict[str, str]:
    """``{<name>.json: the record as JSON, <name>: summary on one line}`` for ``registry.tag``: the record first,
    so a reader never meets a summary newer than its record.

    Example::

        registry.tag(settings, "3", readable("rolled_back", "by ops: bad CTR", {"by": "ops", "why": "bad CTR"}))
    """
    line = " ".join(str(summary).split())
    if len(line) > SUMMARY_CHARACTERS:
        line = line[:SUMMARY_CHARACTERS - 1] + "…"
    return {f"{name}{RECORD_SUFFIX}": json.dumps(record, default=str, separators=(",", ":")), name: line}


def record(tags: Mapping[str, str], name: str) -> str | None:
    """The JSON record of tag ``name`` (``<name>.json``; on a version tagged before the split, ``<name>``
    itself); None when the version has neither."""
    found = tags.get(f"{name}{RECORD_SUFFIX}")
    return found if found is not None else tags.get(name)


def both(name: str) -> tuple[str, str]:
    """The two tags of ``name`` (what removing it removes)."""
    return name, f"{name}{RECORD_SUFFIX}"
