"""Prometheus metrics of the serving API (``GET /metrics``), on a registry of its own per app."""

from __future__ import annotations

import json
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.002, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


class LoopCollector:
    """The loop's own metrics, read at scrape time from what the monitor, the trigger and the flows record
    under ``$RECLOOP_HOME/loop``: last drift share, monitoring decisions, full retrains requested, and the
    outcomes of retrain and canary runs (``flow_support.record_outcome``)."""

    def __init__(self, home: Path):
        self.folder = Path(home).resolve() / "loop"

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        monitor_file, triggers_file = self.folder / "monitor.json", self.folder / "triggers.json"
        monitor = json.loads(monitor_file.read_text()) if monitor_file.exists() else {"decisions": {}}
        triggers = json.loads(triggers_file.read_text()) if triggers_file.exists() else []
        share = GaugeMetricFamily("recloop_drift_share", "Share of monitored columns drifted in the last check")
        share.add_metric([], float((monitor.get("last") or {}).get("drift_share", 0.0)))
        yield share
        decisions = CounterMetricFamily("recloop_monitor_decisions", "Monitoring checks by decision",
                                        labels=["decision"])
        for decision, count in monitor["decisions"].items():
            decisions.add_metric([decision], count)
        yield decisions
        retrains = CounterMetricFamily("recloop_retrains_triggered", "Full retrains requested by drift or KPI decay")
        retrains.add_metric([], len(triggers))
        yield retrains
        outcomes_file = self.folder / "outcomes.json"
        outcomes = json.loads(outcomes_file.read_text()) if outcomes_file.exists() else {}
        runs = CounterMetricFamily("recloop_loop_outcomes", "Orchestrated runs by stage and outcome: retrain "
                                   "(champion, challenger, refused, skipped, cancelled, failed), canary (start, "
                                   "hold, step, promote, rollback...)", labels=["stage", "outcome"])
        for stage, counts in sorted(outcomes.items()):
            for outcome, count in sorted(counts.items()):
                runs.add_metric([stage, outcome], count)
        yield runs
        # Two clocks, each named: the monitor judges in event time (the monitored events' own, simulated in the
        # demo), Prometheus, Prefect and MLflow stamp wall-clock time; one gauge mixing them read as days apart.
        last = GaugeMetricFamily("recloop_last_retrain_request_timestamp_seconds", "When the last full retrain "
                                 "was requested, in event time (the monitored events' clock; simulated in the demo)")
        last.add_metric([], max((t["at"] for t in triggers), default=0.0))
        yield last
        wall = GaugeMetricFamily("recloop_last_retrain_request_wallclock_timestamp_seconds", "When the last full "
                                 "retrain was requested, in wall-clock time (as Prefect, MLflow and Prometheus)")
        wall.add_metric([], max((t.get("wall_at", 0.0) for t in triggers), default=0.0))
        yield wall


class DegradedCollector:
    """Whether each model is served without its registry, read from the pools at scrape time:
    ``recloop_serving_degraded{model}`` is 1 while the versions served may not be the registry's (a replica
    started from its cache during an MLflow outage, or polls failing since), and
    ``recloop_registry_read_timestamp_seconds{model}`` when the registry last answered a poll."""

    def __init__(self, pools: dict[str, object], journal=None):
        self.pools = pools  # model label -> ModelPool (``degraded``, ``registry_read_at``)
        self.journal = journal  # the serving journal (``degraded``, ``unwritten_requests``)

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        degraded = GaugeMetricFamily("recloop_serving_degraded", "1 while a model serves versions its registry "
                                     "could not confirm (the registry unreachable: last known versions from the "
                                     "verified cache, or the last poll's)", labels=["model"])
        read = GaugeMetricFamily("recloop_registry_read_timestamp_seconds", "When the registry last answered "
                                 "the model's poll (0: not since start-up)", labels=["model"])
        for model, pool in self.pools.items():
            degraded.add_metric([model], 1.0 if pool.degraded else 0.0)
            read.add_metric([model], float(pool.registry_read_at or 0.0))
        yield degraded
        yield read
        if self.journal is not None:
            journal = GaugeMetricFamily("recloop_journal_degraded", "1 while the serving journal's store cannot "
                                        "record (requests kept in memory, feedback refused with 503)")
            journal.add_metric([], 1.0 if self.journal.degraded else 0.0)
            yield journal
            unwritten = GaugeMetricFamily("recloop_journal_unwritten_requests", "Request rows served but not in the "
                                          "journal's store yet (queued, or kept while it is down)")
            unwritten.add_metric([], float(self.journal.unwritten_requests))
            yield unwritten


class ServingMetrics:
    def __init__(self, home: Path | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        if home is not None:
            r.register(LoopCollector(home))
        self.requests = Counter("recloop_requests", "Ranking requests by routed variant, answering version and "
                                "outcome (ok, fallback = challenger failed and the champion answered, error)",
                                ["variant", "version", "status"], registry=r)
        self.latency = Histogram("recloop_request_seconds", "Ranking latency by routed variant and version",
                                 ["variant", "version"], buckets=LATENCY_BUCKETS, registry=r)
        self.evaluations = Counter("recloop_model_evaluations", "Model scoring calls by version, role "
                                   "(served, shadow) and status (ok, nan, error)", ["version", "role", "status"],
                                   registry=r)
        self.invalid = Counter("recloop_invalid_requests", "Requests refused with a 4xx answer",
                               ["endpoint", "status"], registry=r)
        self.fallbacks = Counter("recloop_feature_fallbacks", "Entities missing from the online store, served "
                                 "with the never-seen defaults", ["entity"], registry=r)
        self.impressions = Counter("recloop_impressions", "Feedback impressions by serving version", ["version"],
                                   registry=r)
        self.clicks = Counter("recloop_clicks", "Feedback clicks by serving version", ["version"], registry=r)
        self.online_ctr = Gauge("recloop_online_ctr", "Clicks / impressions by serving version since start",
                                ["version"], registry=r)
        self.feedback_refused = Counter("recloop_feedback_refused", "Feedback calls refused with 503 because the "
                                        "journal's store could not be reached (the client sends them again)",
                                        registry=r)
        self.duplicates = Counter("recloop_feedback_duplicates", "Feedback events already recorded (ignored)",
                                  registry=r)
        self.landed = Counter("recloop_feedback_landed_events", "Feedback events written to the landing zone",
                              registry=r)
        self.canary_share = Gauge("recloop_canary_share", "Share of users routed to the challenger", registry=r)
        self.shadow = Gauge("recloop_canary_shadow", "1 when the challenger runs in shadow mode", registry=r)
        self.model_info = Gauge("recloop_model_info", "The version serving under each alias (value 1)",
                                ["alias", "version"], registry=r)
        self.swaps = Counter("recloop_model_swaps", "Deployments swapped in", registry=r)
        # The recommendation path (/recommend): its stages, its answers, the retriever's deployment.
        self.stage_latency = Histogram("recloop_recommend_stage_seconds", "Time of each stage of /recommend "
                                       "(retrieve, filter, rank, order; total: the whole request)", ["stage"],
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.stage_cpu = Counter("recloop_recommend_stage_cpu_seconds", "CPU time of the request's thread in each "
                                 "stage of /recommend (total: the whole request)", ["stage"], registry=r)
        self.recommendations = Counter("recloop_recommendations", "/recommend answers by routed retriever "
                                       "variant, retriever version and source (retrieval, popularity)",
                                       ["variant", "version", "source"], registry=r)
        self.retriever_info = Gauge("recloop_retriever_info", "The retriever version serving under each alias "
                                    "(value 1)", ["alias", "version"], registry=r)
        self.retriever_share = Gauge("recloop_retriever_canary_share", "Share of users routed to the challenger "
                                     "retriever", registry=r)
        self.retriever_swaps = Counter("recloop_retriever_swaps", "Retriever deployments swapped in", registry=r)
        self._retriever_labels: list[tuple[str, str]] = []
        self._counts: dict[str, list[int]] = {}
        self._info_labels: list[tuple[str, str]] = []

    def feedback(self, version: str, impressions: int, clicks: int) -> None:
        self.impressions.labels(version).inc(impressions)
        self.clicks.labels(version).inc(clicks)
        total = self._counts.setdefault(version, [0, 0])
        total[0] += impressions
        total[1] += clicks
        if total[0]:
            self.online_ctr.labels(version).set(total[1] / total[0])

    def deployment(self, versions: dict[str, str | None], share: float, shadow: bool) -> None:
        for labels in self._info_labels:  # (not ``remove``: Feast switches prometheus_client to multiprocess mode)
            self.model_info.labels(*labels).set(0)
        self._info_labels = [(alias, version) for alias, version in versions.items() if version is not None]
        for labels in self._info_labels:
            self.model_info.labels(*labels).set(1)
        self.canary_share.set(share)
        self.shadow.set(1 if shadow else 0)

    def retriever_deployment(self, versions: dict[str, str | None], share: float) -> None:
        for labels in self._retriever_labels:
            self.retriever_info.labels(*labels).set(0)
        self._retriever_labels = [(alias, version) for alias, version in versions.items() if version is not None]
        for labels in self._retriever_labels:
            self.retriever_info.labels(*labels).set(1)
        self.retriever_share.set(share)
