"""The serving process's state: models (champion, challenger, retrievers) with their hot swap, request
features, the journal, metrics and readiness, built once per process (``Service``) and read by every
route (``ServiceDep``). ``/rank``'s scoring, the canary's routing and interleaving, exploration and
feedback landing live here; the routes themselves are in ``recloop.serve.app`` and
``recloop.serve.recommend``."""



import gc
import json
import logging
import threading
import time
import uuid
from datetime import UTC, datetime
from typing import Annotated

import numpy as np
import torch
from fastapi import Depends, HTTPException, Request

from recloop import canary
from recloop.evidence import interleaving, offpolicy
from recloop.features.config import FeatureConfig
from recloop.features.online import OnlineReader, RequestError, RequestFeatures, online_reader
from recloop.journal import open_journal
from recloop.schema import DatasetSpec
from recloop.scoring import load_retriever, score
from recloop.serve.catalog import UnavailableItems
from recloop.serve.health import Readiness
from recloop.serve.metrics import DegradedCollector, ServingMetrics
from recloop.serve.models import Deployment, LoadFailure, ModelPool
from recloop.serve.requests import RankedItem, RankRequest, RankResponse
from recloop.settings import Settings

log = logging.getLogger("recloop.serve")


class Service:
    """Everything a request touches, built once per process."""

    def __init__(self, settings: Settings, spec: DatasetSpec, online: OnlineReader | None = None,
                 pool: ModelPool | None = None, retrievers: ModelPool | None = None):
        from functools import partial

        from recloop.registry import RETRIEVER_NAME

        self.settings, self.spec = settings, spec
        self.metrics = ServingMetrics(settings.home)
        self.features = RequestFeatures(settings, spec, FeatureConfig.for_spec(spec),
                                        online or online_reader(settings))
        self.pool = pool or ModelPool(settings)
        self.pool.on_swap = lambda old, new: self._deployed(new)
        self.pool.on_load_failure = self._load_failed
        # The retriever of /recommend: its own registered model, aliases, canary split (its own salt) and watcher.
        self.retrievers = retrievers or ModelPool(settings, loader=load_retriever, salt="recloop-retriever-canary",
                                                  name="retriever", model_name=RETRIEVER_NAME)
        self.retrievers.on_swap = lambda old, new: self._retriever_deployed(new)
        self.retrievers.on_load_failure = partial(self._load_failed, model_name=RETRIEVER_NAME)
        self.unavailable = UnavailableItems(settings.unavailable_items_path)
        self.seen_history = self.features.seen  # /recommend's lake history (the derived history's too)
        self.readiness = Readiness(self.pool, self.features)
        # RECLOOP_JOURNAL: SQLite, or PostgreSQL for replicas. A PostgreSQL down at start-up is not a reason to serve
        # nothing: requests are kept until it answers, feedback is refused meanwhile (``Journal.degraded``).
        self.journal = open_journal(settings, spec, connect_later=True)
        kept = self.journal.queue_kept(self.kept_requests_dir)
        self.journal.spill_folder = self.kept_requests_dir  # an outage's rows past a bound wait on disk
        if kept:
            log.warning("journal: %d request rows an earlier process could not write are queued again", kept)
        self.metrics.registry.register(DegradedCollector({"ranker": self.pool, "retriever": self.retrievers},
                                                         self.journal))
        self._stop = threading.Event()
        self._flusher: threading.Thread | None = None
        self._rng = np.random.default_rng()  # interleaving's coin and exploration's draws

    @property
    def kept_requests_dir(self):
        """Where request rows the journal's store never took wait for the next process (``Journal.keep_unwritten``)."""
        return self.settings.serving_dir / "journal-kept"

    def _deployed(self, live: Deployment) -> None:
        self.metrics.swaps.inc()
        self.metrics.deployment(live.versions, live.share, live.mode == "shadow")

    def _retriever_deployed(self, live: Deployment) -> None:
        self.metrics.retriever_swaps.inc()
        self.metrics.retriever_deployment(live.versions, live.share)

    def _load_failed(self, failure: LoadFailure, model_name: str | None = None) -> None:
        """Mark the version in the registry: the canary controller rolls back a challenger so marked."""
        from recloop import registry
        from recloop.canary.tag import load_failure_tag

        try:
            registry.tag(self.settings, failure.version, load_failure_tag(failure.reason, failure.at),
                         model_name or registry.MODEL_NAME)
        except Exception as err:  # noqa: BLE001 - the registry may be what is down; the watcher retries
            log.warning("could not mark v%s as failing to load: %s", failure.version, err)

    def start(self) -> None:
        torch.set_num_threads(max(1, self.settings.serve_torch_threads))
        self.pool.try_sync()  # a registry that does not answer costs seconds; the watcher retries it
        self._deployed(self.pool.live)
        self.retrievers.try_sync()
        self._retriever_deployed(self.retrievers.live)
        _single_threaded_faiss()
        # The scoring path once (the probe of /healthz): what the first request would build lazily (the
        # online store's client, Feast's registry: ~200k objects) is built now, before the freeze below.
        self.readiness.check()
        # Everything loaded so far (MLflow, Feast, torch, the models) lives as long as the process: move it
        # out of the collector's reach, so a full collection does not pause requests for hundreds of ms.
        gc.collect()
        gc.freeze()
        self.pool.start()
        self.retrievers.start()

        def flush_feedback() -> None:
            while not self._stop.wait(self.settings.feedback_flush_seconds):
                self.land_feedback()
                self.features.refresh()
                self.seen_history.refresh_if_changed()

        self._flusher = threading.Thread(target=flush_feedback, name="recloop-feedback", daemon=True)
        self._flusher.start()

    def stop(self) -> None:
        gc.unfreeze()  # frozen objects are never finalized: native modules would report them as leaked at exit
        self._stop.set()
        self.pool.stop()
        self.retrievers.stop()
        if self._flusher:
            self._flusher.join(timeout=10)
        self.land_feedback()
        try:
            self.journal.close()
        except Exception as err:  # noqa: BLE001 - the store is down: keep its rows for the next process
            path = self.journal.keep_unwritten(self.kept_requests_dir)
            log.error("journal: the store did not answer before stopping (%s); its request rows are kept in %s and "
                      "written by the next serving process", err, path)

    def land_feedback(self, raise_errors: bool = False) -> int:
        """Write the feedback not landed yet to the landing zone; returns its rows. A failure keeps it in the
        journal for the next flush: logged (the periodic flush), or raised (``raise_errors``: the admin's)."""
        try:
            _, rows = self.journal.land_feedback(self.settings.landing_dir)
        except Exception as err:
            log.error("writing feedback to the landing zone failed: %s", err)
            if raise_errors:
                raise
            return 0
        self.metrics.landed.inc(rows)
        return rows

    # --- ranking ----------------------------------------------------------------------------------------

    def rank(self, body: RankRequest) -> RankResponse:
        started = time.perf_counter()
        live = self.pool.live  # this request's models, whatever the watcher swaps meanwhile
        if live.champion is None:
            raise HTTPException(503, self.readiness.check().reasons[0])
        canary_on = live.challenger is not None and live.mode in ("canary", "interleave")
        variant = canary.route(body.user_id, live.share, live.salt) if canary_on else "champion"
        ts = body.ts or datetime.now(UTC)
        ts_us = int((ts if ts.tzinfo else ts.replace(tzinfo=UTC)).timestamp() * 1_000_000)
        try:
            rows, fallbacks = self.features.rows(body.user_id, body.item_ids, body.context, ts_us)
        except RequestError as err:
            raise HTTPException(422, str(err)) from err
        except Exception as err:  # noqa: BLE001 - no feature state, online store gone: unavailable, and why
            log.error("features for a request failed: %s: %s", type(err).__name__, err)
            raise HTTPException(503, f"features unavailable: {type(err).__name__}: {err}") from err
        self.metrics.fallbacks.labels("user").inc(fallbacks.user)
        self.metrics.fallbacks.labels("item").inc(fallbacks.items)

        evaluations, all_scores = [], {}
        routed = live.challenger if variant == "challenger" else live.champion
        served_scores, status = self._evaluate(routed, rows, "served", evaluations, all_scores)
        served = routed
        if status != "ok" and routed is live.challenger:  # never hand the user a broken answer
            served = live.champion
            served_scores, status = self._evaluate(served, rows, "served", evaluations, all_scores)
            status = "fallback" if status == "ok" else status
        if status not in ("ok", "fallback"):
            self.metrics.requests.labels(variant, served.version, "error").inc()
            raise HTTPException(500, f"model v{served.version} could not score this request ({status})")
        if live.challenger is not None and live.mode == "shadow":
            self._evaluate(live.challenger, rows, "shadow", evaluations, all_scores)
        if variant == "challenger" and live.mode == "canary" and status == "ok":
            # the champion scores the challenger's requests too (not shown): the canary's online AUC compares
            # both on the same impressions, never over two different sets of users
            self._evaluate(live.champion, rows, "paired", evaluations, all_scores)

        k = body.top_k or len(body.item_ids)
        extra: dict = {}
        if variant == "challenger" and live.mode == "interleave" and status == "ok":
            # both rankings, merged by team draft; a click is credited to the team that placed the item
            champion_scores, champion_status = self._evaluate(live.champion, rows, "interleave", evaluations,
                                                              all_scores)
            if champion_status == "ok":
                order, teams = interleaving.team_draft(np.argsort(-champion_scores, kind="stable"),
                                                       np.argsort(-served_scores, kind="stable"), k, self._rng)
                order = np.asarray(order)
                item_scores = np.where(np.asarray(teams) == interleaving.CHALLENGER, served_scores[order],
                                       champion_scores[order])
                extra["interleaving"] = {"champion": live.champion.version, "challenger": served.version,
                                         "teams": [int(t) for t in teams]}
                variant = "interleave"
        if not extra:
            order = np.argsort(-served_scores, kind="stable")[:k]
            if variant == "champion" and self.settings.explore_share > 0 and \
                    self._rng.random() < self.settings.explore_share:
                # exploration: a Plackett-Luce draw over the model's logits, each position's propensity logged
                logits = np.log(np.clip(served_scores, 1e-7, 1.0)) - np.log(np.clip(1.0 - served_scores, 1e-7, 1.0))
                order, propensity = offpolicy.plackett_luce(logits, k, self.settings.explore_temperature,
                                                            self._rng)
                extra["exploration"] = {"temperature": self.settings.explore_temperature,
                                        "propensities": [round(float(p), 8) for p in propensity]}
            item_scores = served_scores[order]
        items = [RankedItem(item_id=body.item_ids[i], score=float(s)) for i, s in zip(order, item_scores,
                                                                                     strict=True)]
        request_id = uuid.uuid4().hex
        latency_ms = (time.perf_counter() - started) * 1000
        payload = {"item_ids": body.item_ids, "context": body.context,
                   "per_candidate": self.features.per_candidate(body.context),
                   "scores": {v: journal_scores(s) for v, s in all_scores.items()},
                   "ranked": [body.item_ids[i] for i in order], **extra}
        self.journal.record(
            (request_id, time.time(), ts_us, body.user_id, variant, served.version, latency_ms, json.dumps(payload)),
            [(request_id, *e, time.time()) for e in evaluations])
        self.metrics.requests.labels(variant, served.version, status).inc()
        self.metrics.latency.labels(variant, served.version).observe(latency_ms / 1000)
        return RankResponse(request_id=request_id, model_version=served.version, variant=variant, items=items)

    def _evaluate(self, model, rows, role: str, evaluations: list, all_scores: dict
                  ) -> tuple[np.ndarray, str]:
        began = time.perf_counter()
        try:
            values = score(model, rows).numpy()
            status = "ok" if np.isfinite(values).all() else "nan"
        except Exception as err:  # noqa: BLE001 - a model failing is data for the canary, not a crash
            log.error("model v%s failed to score: %s", model.version, err)
            values, status = np.full(rows.num_rows, np.nan), "error"
        # The model's own time: feature reads are the same for both variants and would only add noise
        # to the canary's latency comparison (the request latency is in the metrics' histograms).
        latency = (time.perf_counter() - began) * 1000
        evaluations.append((model.version, role, status, latency))
        self.metrics.evaluations.labels(model.version, role, status).inc()
        if status == "ok":
            all_scores[model.version] = values  # rounded for the journal where it is written (journal_scores)
        return values, status


def journal_scores(values) -> list[float]:
    """Scores as the journal keeps them (6 decimals)."""
    return [round(float(v), 6) for v in values]


def _single_threaded_faiss() -> None:
    """One FAISS thread per search: requests already run in parallel (``serve_threads``), and OpenMP
    threads on top of them fight over the same cores."""
    try:
        import faiss
    except ImportError:  # no retriever can load either; /recommend says so
        return
    faiss.omp_set_num_threads(1)


def current_service(request: Request) -> Service:
    return request.app.state.service


ServiceDep = Annotated[Service, Depends(current_service)]
