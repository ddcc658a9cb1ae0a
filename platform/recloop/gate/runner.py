"""Running the gate: score a registered version and the champion on the candidate's held-out hours, check
that it loads and scores in a fresh process, decide (``gate.decision``), and record the verdict in MLflow.

Both models come from the registry (``checkpoint.resolve``) and are scored on this installation's
feature rows, so the gate never reads a path on the trainer's disk.

Example::

    outcome = run_gate(settings, "7")
    outcome.passed, outcome.alias, outcome.reasons
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from recloop import baselines
from recloop.gate.decision import (
    GateDecision,
    GateThresholds,
    ModelScores,
    calibration_interval,
    decide,
    report_markdown,
    skipped_slices,
    verdict_of,
)
from recloop.gate.paired import HeldOut, PairedConfig, PairedResult, compare
from recloop.hours import parse_hour
from recloop.settings import Settings


class GateError(RuntimeError):
    """The gate cannot judge: no versions, the candidate is the champion, its held-out hours are gone."""


def _unloadable() -> tuple[type[BaseException], ...]:
    from safetensors import SafetensorError

    from recloop.checkpoint import CheckpointError

    # A damaged or inconsistent checkpoint: files that do not match the registered checksums, bytes that
    # are not safetensors, tensors that do not fit the configuration (torch raises RuntimeError).
    return (CheckpointError, SafetensorError, OSError, ValueError, RuntimeError)


@dataclass(frozen=True)
class GateOutcome:
    """What the gate decided about one version, and what it moved."""

    version: str
    passed: bool
    reasons: tuple[str, ...]
    alias: str | None
    champion: str | None
    mode: str
    first_model: bool
    candidate: ModelScores
    champion_scores: ModelScores | None
    figures: dict[str, dict[str, float | None]]
    report: str
    baselines: dict[str, dict] = field(default_factory=dict)  # recloop.baselines on the same held-out rows
    # passed, refused, or insufficient evidence (the candidate goes to the canary: ``alias`` is challenger)
    verdict: str = "passed"
    insufficient: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        """JSON-ready (CLI, flow results): overall figures of both models; the report left out."""
        out = asdict(self)
        out["reasons"] = list(self.reasons)
        out["insufficient"] = list(self.insufficient)
        out["candidate"] = dict(self.candidate.overall)
        out["champion_scores"] = dict(self.champion_scores.overall) if self.champion_scores else None
        del out["report"]
        return out


def score_version(settings: Settings, version: str, files: list[Path], schema, keep: np.ndarray | None = None,
                  arrays: dict | None = None, users: np.ndarray | None = None) -> ModelScores:
    """A registered version's metrics on the given held-out files, overall and per slice.

    ``keep``: the rows to judge on (served feedback left out); ``arrays``: receives the labels, scores and
    slice labels of those rows (for the paired comparison); ``users``: every row's user (``held_out_rows``),
    for the calibration's interval over users (``calibration_low``, ``calibration_high``).
    """
    from recloop import checkpoint
    from recloop.data import ChunkLoader
    from recloop.evaluate import metrics, predict, slice_metrics
    from recloop.features.definition import FeatureLayout
    from recloop.train import slice_values

    model, _ = checkpoint.load_model(checkpoint.resolve(settings, version))
    loader = ChunkLoader(files, schema, 16384, shuffle=False)
    labels, scores, extras = predict(model, loader.epoch(0))
    if keep is not None and len(keep) == len(labels):
        labels, scores, extras = labels[keep], scores[keep], {k: v[keep] for k, v in extras.items()}
    slices = slice_values(extras, FeatureLayout.for_settings(settings))
    if arrays is not None:
        arrays.update(labels=labels, scores=scores, slices=slices)
    overall = metrics(labels, scores, extras.get("p_click"))
    if users is not None and keep is not None and len(users) == len(keep):
        users = users[keep]
    if users is not None and len(users) == len(labels) and overall["nan_predictions"] == 0:
        _, overall["calibration_low"], overall["calibration_high"] = calibration_interval(labels, scores, users)
    return ModelScores(overall, slice_metrics(labels, scores, slices))


SERVED_EVENT_ID = r"^[0-9a-f]{32}-[0-9]+$"  # the journal's event ids: <request id>-<item id>


def held_out_rows(files: list[Path], user_key: str | None, timestamp: str | None, event_id: str | None
                  ) -> dict[str, np.ndarray]:
    """Per held-out row, in the loader's order: whether it is served feedback (the journal's event ids),
    its user and its group (the user's hour: the simulated world has no request ids)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    parts: dict[str, list] = {"served": [], "users": [], "groups": [], "labels": []}
    for path in files:
        present = set(pq.read_schema(path).names)
        columns = [c for c in (event_id, user_key, timestamp, "label") if c and c in present]
        table = pq.read_table(path, columns=columns)
        n = table.num_rows
        served = pc.match_substring_regex(table[event_id], SERVED_EVENT_ID).to_numpy(zero_copy_only=False) \
            if event_id in present else np.zeros(n, dtype=bool)
        users = table[user_key].to_numpy(zero_copy_only=False) if user_key in present else np.zeros(n, np.int64)
        hours = (pc.cast(table[timestamp], "int64").to_numpy() // 3_600_000_000) if timestamp in present \
            else np.zeros(n, dtype=np.int64)
        parts["served"].append(np.asarray(served, dtype=bool))
        parts["users"].append(np.asarray(users))
        del hours  # (a request id, where a dataset has one, is the better group)
        parts["labels"].append(table["label"].to_numpy() if "label" in present else np.zeros(n))
    out = {k: np.concatenate(v) if v else np.zeros(0) for k, v in parts.items()}
    if out["users"].dtype.kind not in "iu":  # string keys (``"u17"``): one integer code per user
        out["users"] = np.unique(out["users"].astype(str), return_inverse=True)[1]
    out["users"] = out["users"].astype(np.int64)
    out["groups"] = out["users"]
    return out


SMOKE_ROWS = 256
SMOKE_REPEATS = 5

# The serving check's fresh process: Python, MLflow's pyfunc, pyarrow and torch imported first (most of its
# seconds), then what to load and score read from its standard input as one JSON line, so that it can be
# started before the gate knows the version (``smoke_process_ahead``).
SMOKE_CODE = (
    "import json, statistics, sys, time, mlflow.pyfunc, pyarrow.parquet as pq, torch\n"
    "line = sys.stdin.readline()\n"
    "if not line:\n"
    "    sys.exit(0)\n"  # stopped unused: nothing to check
    "job = json.loads(line)\n"
    f"rows = pq.read_table(job['example']).slice(0, {SMOKE_ROWS}).to_pandas()\n"
    "models = [mlflow.pyfunc.load_model(f) for f in job['folders']]\n"
    "outs = [m.predict(rows) for m in models]\n"
    "times = [[] for _ in models]\n"
    f"for _ in range({SMOKE_REPEATS}):\n"
    "    for m, t in zip(models, times):\n"
    "        began = time.perf_counter(); m.predict(rows); t.append((time.perf_counter() - began) * 1000)\n"
    "print(json.dumps({'ms': [statistics.median(t) for t in times], 'finite': bool((outs[0] == outs[0]).all())}))\n"
)
_AHEAD: list = []  # a fresh process started by ``smoke_process_ahead``, for the next gate in this process
_AHEAD_LOCK = threading.Lock()


def _spawn_smoke_process():
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-c", SMOKE_CODE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _stop(process) -> None:
    if process.poll() is None:
        process.kill()
    process.communicate()


@contextlib.contextmanager
def smoke_process_ahead():
    """Start the serving check's fresh process now, for a gate that runs later in this process (the retrain
    flow: while the candidate trains). Its imports then run beside the training instead of after it (the gate
    had waited 6 s for them in a loaded simulated day; on a quiet 2-core host the gain is within run-to-run
    noise, as the imports then share the cores with training: benchmarks/RESULTS.md). The process is as fresh as
    ever: it holds nothing of this one and loads the version from its registered files. The next
    ``start_smoke_check`` takes it; one no gate took (training failed, the gate was skipped) is stopped
    when the block ends."""
    process = _spawn_smoke_process()
    with _AHEAD_LOCK:
        _AHEAD.append(process)
    try:
        yield process
    finally:
        with _AHEAD_LOCK:
            untaken = process in _AHEAD
            if untaken:
                _AHEAD.remove(process)
        if untaken:
            _stop(process)


class SmokeCheck:
    """The serving check's fresh process, started by ``start_smoke_check``; ``result`` waits for its verdict.

    The gate starts it before scoring the held-out window, so the fresh process's imports (Python, torch,
    MLflow's pyfunc: most of its seconds) run while this process scores, not after it. ``cancel`` stops it
    when the gate ends without needing it (a candidate that does not load here).
    """

    def __init__(self, process, timing: dict[str, float | None], champion: str | None,
                 thresholds: GateThresholds, problem: str | None = None):
        self._process, self.timing, self._champion = process, timing, champion
        self._thresholds, self._problem = thresholds, problem

    def result(self, timeout: float = 300.0) -> tuple[str | None, dict[str, float | None]]:
        """A reason string if the check fails (None: it passed), and the timings."""
        import subprocess

        if self._process is None:
            return self._problem, self.timing
        try:
            stdout, stderr = self._process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.cancel()
            return f"serving check: the model did not load and score {SMOKE_ROWS} rows within {timeout:.0f} s", \
                self.timing
        if self._process.returncode != 0:
            return f"serving check: the model does not load in a fresh process: {stderr.strip()[-300:]}", self.timing
        result = json.loads(stdout.strip().splitlines()[-1])
        self.timing["candidate_ms"] = float(result["ms"][0])
        if self._champion is not None:
            self.timing["champion_ms"] = float(result["ms"][1])
        if not result["finite"]:
            return "serving check: the loaded model scores NaN", self.timing
        return smoke_latency_failure(self.timing["candidate_ms"], self.timing["champion_ms"], self._thresholds), \
            self.timing

    def cancel(self) -> None:
        if self._process is not None:
            _stop(self._process)


def start_smoke_check(settings: Settings, version: str, example_file: str, champion: str | None = None,
                      thresholds: GateThresholds | None = None) -> SmokeCheck:
    """Start loading the registered version in a fresh process to score a sample (``SmokeCheck.result``: a
    reason string if it fails, and the timings).

    Its speed is judged against the champion's, loaded and timed in the same process on the same rows
    (alternating, median of ``SMOKE_REPEATS``): at most ``smoke_latency_ratio`` times slower. A busy host
    slows both alike, so load alone cannot refuse a healthy model (a fixed 500 ms per 256 rows refused the
    demo's first model twice under load). The first model has no champion: judged by ``smoke_budget_ms``
    from the thresholds file when one is set, else timed and reported only.

    The fresh process opens each version's verified download (``checkpoint.model_folder``: the bytes serving
    loads, fetched here once and scored from by the gate too), so it pays for Python, torch and MLflow's
    pyfunc, not for MLflow's tracking store and a second download (8 s against 12 s on a 2-core CPU); one
    started ahead by ``smoke_process_ahead`` has paid for its imports already."""
    from recloop import checkpoint

    thresholds = thresholds or GateThresholds()
    timing: dict[str, float | None] = {"candidate_ms": None, "champion_ms": None,
                                       "ratio_allowed": thresholds.smoke_latency_ratio,
                                       "budget_ms": thresholds.smoke_budget_ms}
    try:
        folders = [str(checkpoint.model_folder(settings, version))]
    except checkpoint.CheckpointError as err:  # the registry's copy is damaged: this version cannot be served
        return SmokeCheck(None, timing, champion, thresholds, f"serving check: {str(err)[-300:]}")
    try:
        if champion is not None:
            folders.append(str(checkpoint.model_folder(settings, champion)))
    except checkpoint.CheckpointError:  # the champion's copy: not the candidate's fault; no ratio then
        champion = None
    job = json.dumps({"example": example_file, "folders": folders}) + "\n"
    with _AHEAD_LOCK:  # one started ahead of this gate (``smoke_process_ahead``)
        process = _AHEAD.pop() if _AHEAD else None
    if process is not None and not _send(process, job):  # it died before its job
        _stop(process)
        process = None
    if process is None:
        process = _spawn_smoke_process()
        _send(process, job)  # a process that dies at once fails the check with its own error output
    return SmokeCheck(process, timing, champion, thresholds)


def _send(process, job: str) -> bool:
    """Hand the fresh process its job; False if it has already ended."""
    if process.poll() is not None:
        return False
    try:
        process.stdin.write(job)
        process.stdin.flush()
    except (BrokenPipeError, OSError):
        return False
    return True


def smoke_latency_failure(candidate_ms: float, champion_ms: float | None, thresholds: GateThresholds) -> str | None:
    """Why the candidate's scoring time fails the smoke check (None: it does not): against the champion's
    measured beside it, or the thresholds' budget for a first model."""
    if champion_ms is not None and champion_ms > 0:
        if candidate_ms > thresholds.smoke_latency_ratio * champion_ms:
            return (f"serving check: scoring {SMOKE_ROWS} rows took {candidate_ms:.0f} ms, "
                    f"{candidate_ms / champion_ms:.1f}x the champion's {champion_ms:.0f} ms in the same process "
                    f"(at most {thresholds.smoke_latency_ratio}x)")
        return None
    if thresholds.smoke_budget_ms is not None and candidate_ms > thresholds.smoke_budget_ms:
        return (f"serving check: scoring {SMOKE_ROWS} rows took {candidate_ms:.0f} ms (the thresholds' budget for a "
                f"model with no champion to compare with: {thresholds.smoke_budget_ms:.0f} ms)")
    return None


def held_out_files(settings: Settings, info) -> list[Path]:
    """The candidate's validation hours among this installation's training files."""
    from recloop.features.definition import FeatureLayout

    if info.validation_window is None:
        raise GateError(f"version {info.version} has no validation window recorded on its training run")
    first, last = info.validation_window
    training = FeatureLayout.for_settings(settings).training
    files = sorted(p for p in training.glob("*.parquet") if first <= p.stem <= last)
    if not files:
        raise GateError(f"the held-out hours {first}..{last} of version {info.version} are no longer in {training}")
    return files


def off_policy(settings: Settings, candidate: str, champion: str, window: tuple[str, str] | None,
               limit: int = 5000) -> tuple[str | None, dict] | None:
    """The off-policy check (``gate.offpolicy``) on the journal's explored requests with event time in the
    candidate's held-out hours; None when serving logged none."""
    from datetime import timedelta

    from recloop.features.config import FeatureConfig
    from recloop.features.definition import FeatureLayout
    from recloop.features.online import RequestFeatures, online_reader
    from recloop.gate.offpolicy import check, policy_estimate
    from recloop.journal import open_journal
    from recloop.schema import load_spec
    from recloop.scoring import load_version, score

    if window is None:
        return None
    first, last = (parse_hour(h) for h in window)
    bounds = (int(first.timestamp() * 1e6), int((last + timedelta(hours=1)).timestamp() * 1e6))
    journal = open_journal(settings, create=False)
    if journal is None:
        return None
    try:
        logs = journal.exploration_requests(bounds, limit)
    finally:
        journal.close()
    if len(logs) < 50:
        return None
    layout = FeatureLayout.for_settings(settings)
    spec = load_spec(json.loads(layout.schema.read_text()).get("dataset", "synthetic"))
    features = RequestFeatures(settings, spec, FeatureConfig.for_spec(spec), online_reader(settings))
    models = {v: load_version(settings, v) for v in (candidate, champion)}
    scores: dict[str, list] = {candidate: [], champion: []}
    for log in logs:
        # re-scored as they were served (never landed again): a column left out then stays unknown
        rows, _ = features.rows(log["user_id"], log["item_ids"], log["context"], log["ts_us"], whole_row=False)
        for version, model in models.items():
            scores[version].append(score(model, rows).numpy())
    labels = [log["label"] for log in logs]
    logged = [log["propensity"] for log in logs]
    shown = [log["item_ids"].index(log["top"]) for log in logs]
    return check(policy_estimate(labels, logged, shown, scores[candidate]),
                 policy_estimate(labels, logged, shown, scores[champion]))


def _refuse_unloadable(settings: Settings, client, info, champion_version: str | None, mode: str,
                       err: BaseException) -> GateOutcome:
    """A candidate whose checkpoint cannot be loaded fails the gate, tagged with the reason like any other."""
    from recloop import registry

    version = info.version
    reasons = [f"the candidate's checkpoint cannot be loaded: {type(err).__name__}: {err}"[:2000]]
    empty = ModelScores({})
    decision = GateDecision(False, tuple(reasons), {}, champion_version is None)
    report = report_markdown(decision, empty, None, version, champion_version, mode)
    client.log_text(info.run_id, report, f"gate_report_v{version}.md")
    registry.describe(settings, version, report, whole=f"artifact gate_report_v{version}.md of the training run")
    registry.tag(settings, version, registry.gate_tag(False, champion=champion_version,
                                                      window=list(info.validation_window or ()), reasons=reasons))
    return GateOutcome(version, False, tuple(reasons), None, champion_version, mode, champion_version is None,
                       empty, None, {}, report, verdict="refused")


def _log_gate_metrics(client, run_id: str, passed: bool, candidate: ModelScores, champion: ModelScores | None) -> None:
    """The gate's figures as metrics on the candidate's training run (charted and compared in MLflow's UI):
    ``gate_passed``, ``gate_auc``, ``gate_logloss``, ``gate_calibration``, the champion's on the same rows,
    ``gate_auc_delta`` and ``gate_slice_auc_delta.<slice>`` (candidate minus champion)."""
    import math

    from mlflow.entities import Metric

    from recloop import registry

    now = int(time.time() * 1000)
    figures = {"gate_passed": 1.0 if passed else 0.0}
    for name in ("auc", "logloss", "calibration"):
        figures[f"gate_{name}"] = candidate.overall.get(name)
        if champion is not None:
            figures[f"gate_champion_{name}"] = champion.overall.get(name)
    if champion is not None:
        figures["gate_auc_delta"] = candidate.overall.get("auc", math.nan) - champion.overall.get("auc", math.nan)
        for name, scores in candidate.slices.items():
            if name in champion.slices:
                key = registry.metric_name("gate_slice_auc_delta." + name.replace(" ", "_"))
                figures[key] = scores.get("auc", math.nan) - champion.slices[name].get("auc", math.nan)
    metrics = [Metric(k, float(v), now, 0) for k, v in figures.items() if v is not None and math.isfinite(float(v))]
    client.log_batch(run_id, metrics=metrics)


def run_gate(settings: Settings, candidate_version: str | None = None, thresholds: GateThresholds | None = None,
             smoke_check: bool = True) -> GateOutcome:
    """Judge a registered version (default: the newest) against the champion and move the aliases:
    pass → ``challenger`` (the first model ever → ``champion``); fail → tagged with the reasons.

    The baselines (``recloop.baselines``) are scored on the same rows and reported; the candidate is also
    refused when shown below a baseline's AUC by more than the thresholds' ``baseline_auc_margin``, or its log
    loss shown above the logistic regression's by more than ``baseline_logloss_margin``, by the paired test on
    those rows (``baselines.paired_failures``; None: not enforced).
    """
    from mlflow import MlflowClient

    from recloop import registry

    thresholds = thresholds or GateThresholds()
    registry.configure(settings)

    client = MlflowClient()
    versions = client.search_model_versions(f"name='{registry.MODEL_NAME}'")
    if not versions:
        raise GateError("no registered model versions: train a model first (recloop train)")
    if candidate_version is None:
        candidate_version = str(max(int(v.version) for v in versions))
    info = registry.version_info(settings, candidate_version)
    champion_version = registry.version_by_alias(settings, "champion")
    if champion_version == candidate_version:
        raise GateError(f"version {candidate_version} is already the champion")
    files = held_out_files(settings, info)
    schema, rows, keep = _held_out_inputs(settings, files)
    mode = info.mode or "full"
    unloadable = _unloadable()
    mine: dict = {}
    theirs: dict = {}
    smoke = start_smoke_check(settings, candidate_version, str(files[0]), champion_version, thresholds) \
        if smoke_check else None
    try:
        try:
            candidate = score_version(settings, candidate_version, files, schema, keep, mine, rows["users"])
        except unloadable as err:  # the candidate's own files: a verdict on it, not a failure of the gate
            return _refuse_unloadable(settings, client, info, champion_version, mode, err)
        try:
            champion = score_version(settings, champion_version, files, schema, keep, theirs, rows["users"]) \
                if champion_version else None
        except unloadable as err:
            raise GateError(f"the champion v{champion_version} cannot be loaded to compare with: {err}") from err
        return _judge(settings, client, info, candidate_version, champion_version, mode, thresholds, files, schema,
                      rows, keep, mine, theirs, candidate, champion, smoke)
    finally:
        if smoke is not None:
            smoke.cancel()


def _held_out_inputs(settings: Settings, files: list[Path]) -> tuple:
    """The schema to score ``files`` with, their rows' labels, groups, users and served flags
    (``held_out_rows``) and the rows to judge on (``keep``; None: all)."""
    import pyarrow.parquet as pq

    from recloop.data import FeatureSchema
    from recloop.features.definition import FeatureLayout
    from recloop.train import ORACLE_COLUMNS, SLICE_COLUMNS

    present = set(pq.read_schema(files[0]).names)
    layout = FeatureLayout.for_settings(settings)
    schema = FeatureSchema.load(layout.schema,
                                extra=tuple(c for c in (*ORACLE_COLUMNS, *SLICE_COLUMNS) if c in present))
    layout_schema = json.loads(layout.schema.read_text())
    user_key = layout_schema.get("user_key")  # the spec's (``customer``, ``userId``...), not a fixed name
    rows = held_out_rows(files, user_key if user_key in present else None, layout_schema.get("timestamp"),
                         layout_schema.get("event_id"))
    # Served feedback is the champion's own top-k, logged without propensities: judged on, it favours the
    # champion. Left out when the rest is enough to judge on.
    keep = ~rows["served"] if rows["served"].any() and (~rows["served"]).sum() >= 1000 else None
    return schema, rows, keep


@dataclass(frozen=True)
class GrownEvidence:
    """``grown_evidence``'s verdict on the challenger: ``passed`` (now tagged as the gate's pass), ``refused``
    (rolled back), or still ``insufficient evidence``; the paired interval and the hours it rests on."""

    version: str
    champion: str
    verdict: str
    interval: str
    hours: tuple[str, str]
    rows: int

    def to_dict(self) -> dict:
        return asdict(self)


def grown_evidence(settings: Settings, thresholds: GateThresholds | None = None) -> GrownEvidence | None:
    """The challenger the gate handed to the canary on insufficient evidence, judged again on its held-out hours
    and every hour landed since: rows neither it nor the champion (unchanged since that gate) trained on.

    A canary at a few hundred requests a day cannot show non-inferiority online within days, and each day's
    retrain replaced the undecided challenger with another: the loop served one champion for days while a
    daily full retrain moved ahead (benchmarks/RESULTS.md, issue 36). The logged days that land meanwhile are
    more evidence of the same kind the gate judged on. The same paired test on the grown window decides:
    shown non-inferior → the version's gate record becomes a pass on the grown window (``grown_from``), so the
    canary promotes it on its guardrails unless the online evidence shows it worse (``decision.decide``'s
    ``shown_offline``); shown worse (overall or a slice) → rolled back; else nothing changes. None when there
    is nothing to judge: no challenger, one that passed or was made challenger by hand, a champion changed
    since its gate, no hour landed after its window, or
    scorings that do not line up with the rows."""
    from recloop import registry
    from recloop.canary import controller
    from recloop.features.definition import FeatureLayout

    thresholds = thresholds or GateThresholds()
    registry.configure(settings)
    challenger = registry.version_by_alias(settings, "challenger")
    champion = registry.version_by_alias(settings, "champion")
    if challenger is None or champion is None:
        return None
    record = registry.gate_record(registry.version_info(settings, challenger).tags) or {}
    window = record.get("window") or ()
    if not record.get("insufficient_evidence") or str(record.get("champion")) != champion or len(window) != 2:
        return None
    first, last = window
    files = sorted(p for p in FeatureLayout.for_settings(settings).training.glob("*.parquet") if p.stem >= first)
    if not files or files[-1].stem <= last:
        return None
    schema, rows, keep = _held_out_inputs(settings, files)
    mine: dict = {}
    theirs: dict = {}
    score_version(settings, challenger, files, schema, keep, mine)
    score_version(settings, champion, files, schema, keep, theirs)
    paired = _paired_test(rows, keep, mine, theirs, thresholds)
    if paired is None:  # the two scorings do not line up with the rows (or hold a NaN): nothing to judge on
        return None
    overall = paired.figures["grouped_auc"]
    hours = (first, files[-1].stem)
    interval = (f"{overall['difference']:+.4f} [{overall['low']:+.4f}, {overall['high']:+.4f}] vs champion "
                f"v{champion} over {int(overall['users'])} users, hours {hours[0]}..{hours[1]} (its gate's "
                f"{first}..{last} and every hour landed since)")
    verdict = verdict_of(list(paired.failures), paired.insufficient)
    if verdict == "refused":
        controller.manual(settings, "rollback", f"shown worse on the hours landed since its gate: "
                          f"{'; '.join(paired.failures)}", who="gate")
    elif verdict == "passed":
        detail = {k: v for k, v in record.items() if k not in ("verdict", "insufficient_evidence", "reasons")}
        registry.tag(settings, challenger, registry.gate_tag(
            True, **{**detail, "window": list(hours), "grown_from": list(window),
                     "shown": f"non-inferior within {thresholds.auc_margin}: {interval}"}))
    return GrownEvidence(challenger, champion, verdict, interval, hours, len(mine["labels"]))


def _paired_test(rows: dict, keep, mine: dict, theirs: dict, thresholds: GateThresholds) -> PairedResult | None:
    """The paired tests (``gate.paired.compare``) on the held-out rows both versions scored (``score_version``'s
    arrays of the rows ``keep`` kept); None when the scorings do not line up with the rows or hold a NaN."""
    kept = (lambda a: a[keep]) if keep is not None else (lambda a: a)
    if not _lined_up(rows, keep, mine, theirs):
        return None
    held = HeldOut(mine["labels"], mine["scores"], theirs["scores"], kept(rows["groups"]), kept(rows["users"]),
                   mine["slices"], int(rows["served"].sum()) if keep is not None else 0)
    return compare(held, thresholds.auc_margin, thresholds.max_slice_auc_drop, PairedConfig())


def _lined_up(rows: dict, keep, *scorings: dict) -> bool:
    """Whether each scoring (``score_version``'s arrays) holds the labels of the held-out rows ``keep`` kept, in
    their order, and no NaN score."""
    labels = np.asarray(rows["labels"])
    kept = labels[keep] if keep is not None else labels
    return len(labels) == len(rows["served"]) and all(
        "scores" in s and np.array_equal(kept.astype(np.float32), np.asarray(s["labels"]).astype(np.float32))
        and np.isfinite(s["scores"]).all() for s in scorings)


def _judge(settings: Settings, client, info, candidate_version: str, champion_version: str | None, mode: str,
           thresholds: GateThresholds, files: list[Path], schema, rows: dict, keep, mine: dict, theirs: dict,
           candidate, champion, smoke: SmokeCheck | None) -> GateOutcome:
    """``run_gate``'s verdict once both versions are scored: the paired test, off-policy figures, baselines,
    the serving check's result; then the report, tags and aliases."""
    from recloop import registry
    paired = _paired_test(rows, keep, mine, theirs, thresholds) if champion is not None else None
    decision = decide(candidate, champion, thresholds, mode, paired)  # type: ignore[arg-type]
    reasons = list(decision.reasons)
    if champion_version is not None:
        found = off_policy(settings, candidate_version, champion_version, info.validation_window)
        if found is not None:
            reason, figures = found
            decision.figures["off-policy (explored requests)"] = figures
            if reason:
                reasons.append(reason)
    baseline_figures = _baselines(settings, files, schema)
    lost, shown = _baseline_test(rows, keep, mine, candidate.overall, baseline_figures, thresholds)
    reasons += lost
    # the per-row scores stay out of the report and the logged JSON; what the paired test found goes in
    baseline_figures = {name: {**{k: v for k, v in entry.items() if k != "scores"},
                               **({"paired": (shown or {})[name]} if name in (shown or {}) else {})}
                        for name, entry in baseline_figures.items()}
    if smoke is not None:
        problem, timing = smoke.result()
        decision.figures["serving smoke check"] = timing
        if problem:
            reasons.append(problem)
    verdict = verdict_of(reasons, decision.insufficient)
    passed = verdict == "passed"
    decision = GateDecision(passed, tuple(reasons), decision.figures, decision.first_model, decision.insufficient)
    run_auc = client.get_run(info.run_id).data.metrics.get("auc")  # the trainer's: named beside the gate's
    report = report_markdown(decision, candidate, champion, candidate_version, champion_version, mode, thresholds,
                             run_auc)
    report += baselines.report_markdown(candidate.overall, baseline_figures)
    client.log_text(info.run_id, report, f"gate_report_v{candidate_version}.md")
    client.log_dict(info.run_id, baseline_figures, f"gate_baselines_v{candidate_version}.json")
    _log_gate_metrics(client, info.run_id, passed, candidate, champion)
    registry.describe(settings, candidate_version, report,
                      whole=f"artifact gate_report_v{candidate_version}.md of the training run")
    best_name, best_value = baselines.best_auc(baseline_figures)
    registry.tag(settings, candidate_version, registry.gate_tag(
        passed, champion=champion_version, window=list(info.validation_window or ()), reasons=reasons,
        auc=candidate.overall.get("auc"), champion_auc=champion.overall.get("auc") if champion else None,
        best_baseline={"name": best_name, "auc": best_value} if best_name else None,
        skipped_slices=skipped_slices(candidate, champion, thresholds), thresholds=asdict(thresholds),
        **({"insufficient_evidence": list(decision.insufficient)} if verdict == "insufficient evidence" else {})))
    alias = None
    if passed and champion_version is None:
        registry.promote(settings, candidate_version, who="gate", why="first model: passed the absolute floors")
        alias = "champion"
    elif passed:
        from recloop.canary import controller

        controller.set_challenger(settings, candidate_version, who="gate", why="passed the gate")
        alias = "challenger"
    elif verdict == "insufficient evidence":
        # The held-out window could not tell it from the champion within the margin: neither a pass on a coin
        # nor a refusal of what may be a better model. The canary decides: it promotes only on online
        # non-inferiority (always-valid, paired), and rolls back what it shows worse.
        from recloop.canary import controller

        controller.set_challenger(settings, candidate_version, who="gate",
                                  why="insufficient evidence offline: " + "; ".join(decision.insufficient))
        alias = "challenger"
    return GateOutcome(candidate_version, passed, tuple(reasons), alias, champion_version, mode,
                       decision.first_model, candidate, champion, decision.figures, report, baseline_figures,
                       verdict, decision.insufficient)


def _baselines(settings: Settings, held_out: list[Path], schema) -> dict[str, dict]:
    """``recloop.baselines`` on the held-out files, learning from the training files before them (the training
    run that made the candidate scored the same window: its figures and per-row scores are read back, not
    refitted)."""
    from recloop.features.definition import FeatureLayout

    return baselines.window_baselines(FeatureLayout.for_settings(settings), held_out, schema, with_scores=True)


def _baseline_test(rows: dict, keep, mine: dict, overall: dict, figures: dict[str, dict],
                   thresholds: GateThresholds) -> tuple[list[str], dict | None]:
    """The candidate against the baselines on the rows it was judged on: the paired test
    (``baselines.paired_failures``) when its scores and the baselines' line up with the held-out rows (each
    baseline's AUC over them as its cached figures say), else the point estimates (``baselines.failures``)
    from ``overall`` (the candidate's figures). Returns the reasons and the paired figures (None: not paired)."""
    from recloop.evaluate import auc

    labels = np.asarray(rows["labels"])
    scored = {name: entry for name, entry in figures.items() if "scores" in entry}
    kept = (lambda a: np.asarray(a)[keep]) if keep is not None else np.asarray
    aligned = bool(scored) and _lined_up(rows, keep, mine) and \
        all(len(entry["scores"]) == len(labels) and abs(auc(labels, entry["scores"]) - entry["auc"]) < 1e-9
            for entry in scored.values())
    if not aligned:
        return baselines.failures(overall.get("auc", float("nan")), figures, thresholds.baseline_auc_margin,
                                  overall.get("logloss", float("nan")), thresholds.baseline_logloss_margin), None
    judged = {name: {**entry, "scores": kept(entry["scores"])} for name, entry in scored.items()}
    users = rows.get("users")
    return baselines.paired_failures(mine["labels"], mine["scores"], kept(users) if users is not None else None,
                                     judged, thresholds.baseline_auc_margin, thresholds.baseline_logloss_margin)
