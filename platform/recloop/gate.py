"""The gate: may a candidate model replace the champion? A pure decision over metrics.

Candidate and champion are scored on the same held-out window (newest data, never trained on). The
candidate must pass, overall:

- absolute floors: AUC at least ``min_auc`` and log loss at most ``max_logloss`` (judged with MLflow's
  ``MetricThreshold`` / ``validate_evaluation_results``), calibration (mean prediction / mean label)
  within ``calibration_range``, and no NaN or infinite prediction;
- change against the champion: AUC may drop at most ``max_auc_drop_incremental`` for an incremental
  candidate; a full retrain may not be worse (``max_auc_drop_full``). MLflow's ``MetricThreshold``
  only expresses required improvements (its ``min_absolute_change`` must be positive), so tolerated
  drops are judged here;

and per slice (new vs returning users, top item categories, device), each slice with at least
``min_slice_rows`` rows: AUC may drop at most ``max_slice_auc_drop`` against the champion's AUC on the
same slice. The first model ever (no champion) only has to pass the floors.

Example::

    decision = decide(candidate, champion, GateThresholds(), mode="incremental")
    decision.passed, decision.reasons
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal


@dataclass(frozen=True)
class GateThresholds:
    min_auc: float = 0.55
    max_logloss: float = 0.6
    calibration_range: tuple[float, float] = (0.9, 1.1)
    max_auc_drop_incremental: float = 0.002
    max_auc_drop_full: float = 0.0
    max_slice_auc_drop: float = 0.01
    min_slice_rows: int = 200


def load_thresholds(path) -> GateThresholds:
    """Thresholds from a YAML or JSON file of ``GateThresholds`` fields (others keep their defaults)."""
    import yaml

    raw = yaml.safe_load(Path(path).read_text()) or {}
    unknown = sorted(set(raw) - set(GateThresholds.__dataclass_fields__))
    if unknown:
        raise ValueError(f"{path}: unknown gate thresholds {unknown}; known: "
                         f"{sorted(GateThresholds.__dataclass_fields__)}")
    if "calibration_range" in raw:
        raw["calibration_range"] = tuple(raw["calibration_range"])
    return GateThresholds(**raw)


@dataclass(frozen=True)
class ModelScores:
    """A model's metrics on the held-out window: overall (``auc``, ``logloss``, ``calibration``,
    ``nan_predictions``, ``rows``) and per slice (``{"device=mobile": {"auc": ..., "rows": ...}}``)."""

    overall: dict[str, float]
    slices: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass(frozen=True)
class GateDecision:
    passed: bool
    reasons: tuple[str, ...]
    figures: dict[str, dict[str, float | None]]
    first_model: bool

    def to_dict(self) -> dict:
        out = asdict(self)
        out["reasons"] = list(self.reasons)
        return out


def _floor_failures(scores: ModelScores, thresholds: GateThresholds) -> list[str]:
    from mlflow import validate_evaluation_results
    from mlflow.exceptions import MlflowException
    from mlflow.models import MetricThreshold
    from mlflow.models.evaluation import EvaluationResult

    # MLflow logs "Model validation passed!" at INFO for every check; the decision carries the result.
    logging.getLogger("mlflow.models.evaluation.validation").setLevel(logging.WARNING)
    floors = {"auc": MetricThreshold(threshold=thresholds.min_auc, greater_is_better=True),
              "logloss": MetricThreshold(threshold=thresholds.max_logloss, greater_is_better=False)}
    failures = []
    for name, threshold in floors.items():
        value = scores.overall.get(name, math.nan)
        if not math.isfinite(value):
            failures.append(f"{name} is {value}")
            continue
        try:
            validate_evaluation_results(validation_thresholds={name: threshold},
                                        candidate_result=EvaluationResult(metrics={name: value}, artifacts={}))
        except MlflowException:
            bound = "below the floor" if threshold.greater_is_better else "above the ceiling"
            failures.append(f"{name} {value:.4f} {bound} {threshold.threshold}")
    return failures


def decide(candidate: ModelScores, champion: ModelScores | None, thresholds: GateThresholds,
           mode: Literal["full", "incremental"]) -> GateDecision:
    """Pass or fail, with every reason and the figures compared (see the module docstring)."""
    reasons: list[str] = []
    overall = candidate.overall
    nan_count = int(overall.get("nan_predictions", 0))
    if nan_count:
        reasons.append(f"{nan_count} NaN or infinite predictions")
    reasons += _floor_failures(candidate, thresholds)
    low, high = thresholds.calibration_range
    calibration = overall.get("calibration", math.nan)
    if math.isfinite(calibration) and not low <= calibration <= high:
        reasons.append(f"calibration {calibration:.3f} outside [{low}, {high}]")

    figures: dict[str, dict[str, float | None]] = {
        name: {"candidate": overall.get(name), "champion": champion.overall.get(name) if champion else None}
        for name in ("auc", "logloss", "calibration", "rows")
    }
    if champion is not None:
        allowed = thresholds.max_auc_drop_incremental if mode == "incremental" else thresholds.max_auc_drop_full
        drop = champion.overall.get("auc", math.nan) - overall.get("auc", math.nan)
        figures["auc"]["allowed_drop"] = allowed
        if math.isfinite(drop) and drop > allowed:
            reasons.append(f"auc dropped {drop:.4f} below the champion's {champion.overall['auc']:.4f} "
                           f"(a {mode} candidate may drop at most {allowed})")
        for name, scores in sorted(candidate.slices.items()):
            theirs = champion.slices.get(name)
            if theirs is None or min(scores.get("rows", 0), theirs.get("rows", 0)) < thresholds.min_slice_rows:
                continue
            slice_drop = theirs.get("auc", math.nan) - scores.get("auc", math.nan)
            figures[f"slice {name}"] = {"candidate": scores.get("auc"), "champion": theirs.get("auc"),
                                        "rows": scores.get("rows")}
            if math.isfinite(slice_drop) and slice_drop > thresholds.max_slice_auc_drop:
                reasons.append(f"slice {name}: auc dropped {slice_drop:.4f} (at most "
                               f"{thresholds.max_slice_auc_drop} allowed per slice)")
    return GateDecision(passed=not reasons, reasons=tuple(reasons), figures=figures, first_model=champion is None)


# --- running the gate (IO: MLflow, checkpoints, a fresh process) ------------------------------------------


def score_checkpoint(checkpoint: str, files: list, schema) -> ModelScores:
    """A model's metrics on the given held-out files, overall and per slice."""
    from recloop.data import ChunkLoader
    from recloop.evaluate import metrics, predict, slice_metrics
    from recloop.features.job import FeatureLayout
    from recloop.train import _slice_values, load_model

    model, _ = load_model(checkpoint)
    loader = ChunkLoader(files, schema, 16384, shuffle=False)
    labels, scores, extras = predict(model, loader.epoch(0))
    layout = FeatureLayout(Path(files[0]).parent.parent)
    return ModelScores(metrics(labels, scores, extras.get("p_click")),
                       slice_metrics(labels, scores, _slice_values(extras, layout)))


def serving_smoke_check(settings, version: str, example_file: str, budget_ms: float = 500.0) -> str | None:
    """Load the registered version in a fresh process and score a sample; a reason string if it fails."""
    import subprocess
    import sys

    code = (
        "import json, sys, time, mlflow, pyarrow.parquet as pq\n"
        "from recloop import registry\nfrom recloop.settings import Settings\n"
        "registry.configure(Settings(home=sys.argv[1]))\n"
        "model = mlflow.pyfunc.load_model(f'models:/{registry.MODEL_NAME}/' + sys.argv[2])\n"
        "rows = pq.read_table(sys.argv[3]).slice(0, 256).to_pandas()\n"
        "model.predict(rows)\nstarted = time.perf_counter(); out = model.predict(rows)\n"
        "print(json.dumps({'ms': (time.perf_counter() - started) * 1000, 'finite': bool((out == out).all())}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(settings.home.resolve()), version, example_file],
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        return f"serving check: the model does not load in a fresh process: {done.stderr.strip()[-300:]}"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not result["finite"]:
        return "serving check: the loaded model scores NaN"
    if result["ms"] > budget_ms:
        return f"serving check: scoring 256 rows took {result['ms']:.0f} ms (budget {budget_ms:.0f} ms)"
    return None


def report_markdown(decision: GateDecision, candidate: ModelScores, champion: ModelScores | None,
                    version: str, champion_version: str | None, mode: str) -> str:
    """The review table: candidate vs champion per metric and slice, the decision, the reasons."""
    verdict = "PASSED" if decision.passed else "FAILED"
    lines = [f"# Gate: version {version} ({mode}) vs champion {champion_version or '(none: first model)'}",
             "", f"**{verdict}**", ""]
    lines += [f"- {reason}" for reason in decision.reasons] or ["- every check passed"]
    lines += ["", "| metric | candidate | champion |", "| --- | --- | --- |"]
    for name in ("auc", "logloss", "calibration", "rows"):
        theirs = champion.overall.get(name) if champion else None
        lines.append(f"| {name} | {_fmt(candidate.overall.get(name))} | {_fmt(theirs)} |")
    lines += ["", "| slice | rows | candidate AUC | champion AUC |", "| --- | --- | --- | --- |"]
    for name, scores in sorted(candidate.slices.items()):
        theirs = champion.slices.get(name, {}).get("auc") if champion else None
        lines.append(f"| {name} | {int(scores.get('rows', 0))} | {_fmt(scores.get('auc'))} | {_fmt(theirs)} |")
    return "\n".join(lines) + "\n"


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def run_gate(settings, candidate_version: str | None = None, thresholds: GateThresholds | None = None,
             smoke_check: bool = True) -> dict:
    """Judge a registered version against the champion and move the aliases (see the module docstring).

    Returns the decision as a dict with ``passed``, ``reasons``, ``version``, ``alias`` and the figures.
    """
    from mlflow import MlflowClient

    from recloop import registry
    from recloop.data import FeatureSchema
    from recloop.train import ORACLE_COLUMNS, SLICE_COLUMNS

    thresholds = thresholds or GateThresholds()
    client = MlflowClient() if registry.configure(settings) else None
    versions = client.search_model_versions(f"name='{registry.MODEL_NAME}'")
    if not versions:
        raise RuntimeError("no registered model versions: train a model first (recloop train)")
    if candidate_version is None:
        candidate_version = str(max(int(v.version) for v in versions))
    candidate_info = registry.version_info(settings, candidate_version)
    champion_version = registry.version_by_alias(settings, "champion")
    if champion_version == candidate_version:
        raise RuntimeError(f"version {candidate_version} is already the champion")
    run = client.get_run(candidate_info["run_id"])
    checkpoint = candidate_info["checkpoint"]
    validation = run.data.tags["recloop.validation_window"].split("..")
    training_dir = Path(checkpoint).parents[2] / "features" / "training"
    files = sorted(p for p in training_dir.glob("*.parquet") if validation[0] <= p.stem <= validation[1])
    if not files:
        raise RuntimeError(f"the held-out hours {validation} are no longer in {training_dir}")
    import pyarrow.parquet as pq

    present = set(pq.read_schema(files[0]).names)
    schema = FeatureSchema.load(training_dir.parent / "schema.json",
                                extra=tuple(c for c in (*ORACLE_COLUMNS, *SLICE_COLUMNS) if c in present))
    candidate = score_checkpoint(checkpoint, files, schema)
    champion = None
    if champion_version is not None:
        champion = score_checkpoint(registry.version_info(settings, champion_version)["checkpoint"], files, schema)
    mode = candidate_info["mode"] or "full"
    decision = decide(candidate, champion, thresholds, mode)
    reasons = list(decision.reasons)
    if smoke_check:
        problem = serving_smoke_check(settings, candidate_version, str(files[0]))
        if problem:
            reasons.append(problem)
    passed = not reasons
    report = report_markdown(GateDecision(passed, tuple(reasons), decision.figures, decision.first_model),
                             candidate, champion, candidate_version, champion_version, mode)
    client.log_text(candidate_info["run_id"], report, f"gate_report_v{candidate_version}.md")
    registry.describe(settings, candidate_version, report)
    registry.tag(settings, candidate_version, {
        "gate": "passed" if passed else "failed", "gate.reasons": json.dumps(reasons),
        "gate.champion": champion_version or "", "gate.window": f"{validation[0]}..{validation[1]}",
        "gate.auc": candidate.overall.get("auc"), "gate.champion_auc": champion.overall.get("auc") if champion else "",
    })
    alias = None
    if passed and champion_version is None:
        registry.promote(settings, candidate_version, who="gate", why="first model: passed the absolute floors")
        alias = "champion"
    elif passed:
        registry.set_alias(settings, "challenger", candidate_version, who="gate", why="passed the gate")
        alias = "challenger"
    return {"passed": passed, "reasons": reasons, "version": candidate_version, "alias": alias,
            "champion": champion_version, "mode": mode, "first_model": decision.first_model,
            "candidate": candidate.overall, "champion_scores": champion.overall if champion else None,
            "figures": decision.figures, "report": report}
