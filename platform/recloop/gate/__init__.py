"""The gate: a candidate replaces the champion only if it is at least as good on the same held-out window.

``decision`` is the pure rule over metrics; ``runner`` scores registered versions, decides and records the
verdict in MLflow.
"""

from recloop.gate.decision import GateDecision, GateThresholds, ModelScores, decide, report_markdown
from recloop.gate.runner import GateError, GateOutcome, run_gate

__all__ = ["GateDecision", "GateError", "GateOutcome", "GateThresholds", "ModelScores", "decide",
           "load_thresholds", "report_markdown", "run_gate"]


def load_thresholds(path) -> GateThresholds:
    """Thresholds from a YAML or JSON file of ``GateThresholds`` fields (others keep their defaults)."""
    from recloop.config_files import load_dataclass

    return load_dataclass(path, GateThresholds)
