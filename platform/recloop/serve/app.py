"""The serving API (FastAPI under uvicorn): ``/rank``, ``/recommend``, ``/feedback``, ``/healthz``, ``/metrics``,
``/admin/*``.

- ``POST /rank`` scores up to 1000 candidates for a user with the live deployment: the champion, or the
  challenger for the sticky canary share of users (``canary.route``). A challenger that errors or
  returns NaN is never what the user gets: the champion answers instead and the failure is counted
  against the challenger. In shadow mode the challenger scores every request and the champion answers.
  In interleave mode (the canary's default) both score the share's requests and the answer is their
  team-draft interleaving; the journal keeps which model (team) put each shown item there, so a click
  is credited to it. ``RECLOOP_EXPLORE_SHARE`` of the other requests are served in a Plackett-Luce
  draw over the scores, with each position's propensity in the journal (off-policy estimates).
- ``POST /recommend`` answers a user id alone with a catalog-wide recommendation: retrieve (the
  retriever's champion or challenger), filter, rank (the ranker's), order (``recloop.serve.recommend``).
- ``POST /feedback`` records impressions and clicks of a request (each event once) and, every
  ``RECLOOP_FEEDBACK_FLUSH_SECONDS``, the serving process writes new events to the landing zone as a
  parquet file in the dataset spec's columns: served traffic feeds the next retrain.
- ``/admin/*`` needs ``Authorization: Bearer $RECLOOP_ADMIN_TOKEN``.

Example::

    app = create_app(Settings())            # what `recloop serve` runs
    uvicorn.run(app, host="127.0.0.1", port=8000)
"""


import gc
import json
import logging
import math
import secrets
import threading
import time
import uuid
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

import numpy as np
import torch
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from recloop import canary
from recloop.endpoints import ServiceUnavailable
from recloop.evidence import interleaving, offpolicy
from recloop.features.config import FeatureConfig
from recloop.schema import DatasetSpec
from recloop.serve.body_limit import BodyLimit
from recloop.serve.features import OnlineReader, RequestError, RequestFeatures, online_reader
from recloop.serve.health import Readiness
from recloop.serve.journal import FeedbackError, JournalBusy, UnknownRequest, open_journal
from recloop.serve.metrics import DegradedCollector, ServingMetrics
from recloop.serve.models import Deployment, LoadFailure, ModelPool, load_retriever, registry_wanted, score
from recloop.settings import Settings

log = logging.getLogger("recloop.serve")

MAX_CANDIDATES = 1000
INT64_MAX = 2**63 - 1
EXACT_INT = 2**53  # integers beyond this lose precision as float64, which is what the model computes in
MAX_TEXT = 1024
PLACEHOLDER_TOKENS = frozenset({"change-me"})  # what infra/k8s/recloop.yaml ships: anyone could send it
Id = Annotated[int, Field(ge=0, le=INT64_MAX)]


def _text(value: str) -> str:
    """Text of at most ``MAX_TEXT`` characters that is valid Unicode (JSON's ``"\\ud800"`` escape decodes to a
    lone surrogate, which no column can store)."""
    if len(value) > MAX_TEXT:
        raise ValueError(f"text of {len(value)} characters: at most {MAX_TEXT}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"text with a lone surrogate at character {err.start}: not valid Unicode") from None
    return value


def _context_value(value: Any, depth: int = 0) -> Any:
    """A context value as the model can take it, or a ValueError saying what is wrong with it.

    Numbers must be finite (Python's JSON parser reads ``Infinity``, ``NaN`` and ``1e999``) and integers
    exact as float64, which is what the model computes in; text is at most ``MAX_TEXT`` characters; a
    list gives one value per candidate, or is a multi-hot value (a list of lists per candidate). The
    spec's own bounds are checked per column when the features are built.
    """
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if abs(value) > EXACT_INT:
            raise ValueError(f"integer {value} is beyond ±2^53: not exact as a model input")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"must be a finite number, not {value}")
        return value
    if isinstance(value, str):
        return _text(value)
    if isinstance(value, list) and depth < 2:
        if len(value) > MAX_CANDIDATES:
            raise ValueError(f"a list of {len(value)} values: at most {MAX_CANDIDATES}")
        return [_context_value(v, depth + 1) for v in value]
    raise ValueError(f"a context value is a number, text, true/false, null or a list of them, not {type(value).__name__}")


ContextValue = Annotated[Any, AfterValidator(_context_value)]
ContextKey = Annotated[str, Field(max_length=128)]  # pydantic's str already refuses a lone surrogate


class RankRequest(BaseModel):
    """A ranking request. ``context`` holds the spec's categorical, numeric and list columns, each one
    value for all candidates or a list with one value per candidate; ``ts`` (default: now) is the event
    time the features are computed at."""

    model_config = ConfigDict(extra="forbid", strict=False)
    user_id: Id
    item_ids: list[Id] = Field(min_length=1, max_length=MAX_CANDIDATES)
    context: dict[ContextKey, ContextValue] = Field(default_factory=dict, max_length=64)
    ts: datetime | None = None
    top_k: int | None = Field(default=None, ge=1, le=MAX_CANDIDATES)


class RankedItem(BaseModel):
    item_id: int
    score: float


class RankResponse(BaseModel):
    request_id: str
    model_version: str
    variant: Literal["champion", "challenger", "interleave"]
    items: list[RankedItem]


class FeedbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    impressions: list[Id] = Field(min_length=1, max_length=MAX_CANDIDATES)
    clicks: list[Id] = Field(default_factory=list, max_length=MAX_CANDIDATES)


ModelName = Literal["recloop-ranker", "recloop-retriever"]


class CanaryRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    share: float = Field(ge=0.0, le=1.0)
    mode: Literal["interleave", "canary", "shadow"] | None = None
    model: ModelName = "recloop-ranker"


class ReasonRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: str = Field(default="by an operator", max_length=500)
    model: ModelName = "recloop-ranker"


class Service:
    """Everything a request touches, built once per process."""

    def __init__(self, settings: Settings, spec: DatasetSpec, online: OnlineReader | None = None,
                 pool: ModelPool | None = None, retrievers: ModelPool | None = None):
        from functools import partial

        from recloop.registry import RETRIEVER_NAME
        from recloop.serve.recommend import UnavailableItems

        self.settings, self.spec = settings, spec
        self.metrics = ServingMetrics(settings.home)
        self.features = RequestFeatures(settings, spec, FeatureConfig.for_spec(spec),
                                        online or online_reader(settings))
        self.pool = pool or ModelPool(settings)
        self.pool.on_swap = lambda old, new: self._deployed(new)
        self.pool.on_load_failure = self._load_failed
        # The retriever of /recommend: its own registered model, aliases, canary split (its own salt) and watcher.
        self.retrievers = retrievers or ModelPool(settings, loader=load_retriever, salt="recloop-retriever-canary",
                                                  source=partial(registry_wanted, model_name=RETRIEVER_NAME),
                                                  name="retriever", model_name=RETRIEVER_NAME)
        self.metrics.registry.register(DegradedCollector({"ranker": self.pool, "retriever": self.retrievers}))
        self.retrievers.on_swap = lambda old, new: self._retriever_deployed(new)
        self.retrievers.on_load_failure = partial(self._load_failed, model_name=RETRIEVER_NAME)
        self.unavailable = UnavailableItems(settings.unavailable_items_path)
        self.readiness = Readiness(self.pool, self.features)
        self.journal = open_journal(settings, spec)  # RECLOOP_JOURNAL: SQLite, or PostgreSQL for replicas
        self._stop = threading.Event()
        self._flusher: threading.Thread | None = None
        self._rng = np.random.default_rng()  # interleaving's coin and exploration's draws

    def _deployed(self, live: Deployment) -> None:
        self.metrics.swaps.inc()
        self.metrics.deployment(live.versions, live.share, live.mode == "shadow")

    def _retriever_deployed(self, live: Deployment) -> None:
        self.metrics.retriever_swaps.inc()
        self.metrics.retriever_deployment(live.versions, live.share)

    def _load_failed(self, failure: LoadFailure, model_name: str | None = None) -> None:
        """Mark the version in the registry: the canary controller rolls back a challenger so marked."""
        from recloop import registry
        from recloop.canary.tag import LOAD_FAILED_TAG

        try:
            registry.tag(self.settings, failure.version, {LOAD_FAILED_TAG: json.dumps(
                {"reason": failure.reason[:4000], "at": failure.at})}, model_name or registry.MODEL_NAME)
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
        self.journal.close()

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


# --- routes: every handler reads the process's Service from the app's state -----------------------------------

public = APIRouter()
admin = APIRouter(prefix="/admin")
bearer = HTTPBearer(auto_error=False)


def current_service(request: Request) -> Service:
    return request.app.state.service


ServiceDep = Annotated[Service, Depends(current_service)]


def require_admin(svc: ServiceDep,
                  credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> None:
    token = svc.settings.admin_token.get_secret_value()
    if not token:
        raise HTTPException(403, "admin endpoints are disabled: set RECLOOP_ADMIN_TOKEN")
    if token in PLACEHOLDER_TOKENS:
        raise HTTPException(403, "admin endpoints are disabled: RECLOOP_ADMIN_TOKEN is the placeholder of the "
                                 "shipped manifests; set a secret of your own")
    if credentials is None or not secrets.compare_digest(credentials.credentials.encode(), token.encode()):
        raise HTTPException(401, "a valid admin bearer token is required", headers={"WWW-Authenticate": "Bearer"})


@public.post("/rank", response_model=RankResponse)
def rank(body: RankRequest, svc: ServiceDep) -> RankResponse:
    try:
        return svc.rank(body)
    except HTTPException as err:
        if err.status_code < 500:
            svc.metrics.invalid.labels("/rank", str(err.status_code)).inc()
        raise


@public.post("/feedback")
def feedback(body: FeedbackRequest, svc: ServiceDep) -> dict:
    try:
        result = svc.journal.add_feedback(body.request_id, body.impressions, body.clicks)
    except UnknownRequest as err:
        svc.metrics.invalid.labels("/feedback", "404").inc()
        raise HTTPException(404, str(err)) from err
    except JournalBusy as err:  # may be accepted on a retry: not a client error
        raise HTTPException(503, str(err), headers={"Retry-After": "1"}) from err
    except FeedbackError as err:
        svc.metrics.invalid.labels("/feedback", "422").inc()
        raise HTTPException(422, str(err)) from err
    if result["accepted"]:
        svc.metrics.feedback(result["served_version"], result["accepted"], result["clicks"])
    svc.metrics.duplicates.inc(result["duplicates"])
    return result


@public.get("/healthz")
def healthz(svc: ServiceDep) -> JSONResponse:
    live, verdict = svc.pool.live, svc.readiness.check()
    body = {"ready": verdict.ready, "reasons": list(verdict.reasons), "versions": live.versions,
            "share": live.share, "mode": live.mode, "feature_state": svc.features.state_version,
            "swaps": svc.pool.swaps, "watcher_error": svc.pool.last_error,
            "load_failures": {v: f.reason for v, f in svc.pool.failures.items()},
            "retriever": _retriever_health(svc),
            # ready but degraded: scoring works, versions cannot change until the registry answers again
            "degraded": [f"{name}: {pool.degraded}" for name, pool in (("ranker", svc.pool),
                                                                      ("retriever", svc.retrievers)) if pool.degraded]}
    return JSONResponse(body, status_code=200 if verdict.ready else 503)


def _retriever_health(svc: Service) -> dict:
    """The retriever's deployment (``/recommend``; ``/rank`` does not need one, so readiness does not either)."""
    pool = svc.retrievers
    return {"versions": pool.live.versions, "share": pool.live.share, "mode": pool.live.mode, "swaps": pool.swaps,
            "watcher_error": pool.last_error, "load_failures": {v: f.reason for v, f in pool.failures.items()}}


@public.get("/metrics")
def metrics(svc: ServiceDep) -> Response:
    return Response(generate_latest(svc.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@admin.post("/reload", dependencies=[Depends(require_admin)])
def reload(svc: ServiceDep) -> dict:
    try:
        swapped = svc.pool.sync(force=True)  # versions that failed to load are tried (and fetched) again
        retriever_swapped = svc.retrievers.sync(force=True)
    except ServiceUnavailable as err:
        raise HTTPException(503, str(err)) from err
    svc.features.refresh()
    return {"swapped": swapped, "versions": svc.pool.live.versions, "share": svc.pool.live.share,
            "feature_state": svc.features.state_version,
            "load_failures": {v: f.reason for v, f in svc.pool.failures.items()},
            "retriever": {**_retriever_health(svc), "swapped": retriever_swapped}}


@admin.post("/canary", dependencies=[Depends(require_admin)])
def set_canary(body: CanaryRequest, svc: ServiceDep) -> dict:
    from recloop.canary import controller

    try:
        state = controller.set_share(svc.settings, body.share, body.mode, who="admin-api", model_name=body.model)
    except controller.NoCanary as err:
        raise HTTPException(409, str(err)) from err
    except controller.CanaryModeError as err:
        raise HTTPException(422, str(err)) from err
    except ServiceUnavailable as err:
        raise HTTPException(503, str(err)) from err
    if body.model == "recloop-retriever":
        live = svc.retrievers.set_share(state["share"], state["mode"])
        svc.metrics.retriever_deployment(live.versions, live.share)
    else:
        live = svc.pool.set_share(state["share"], state["mode"])
        svc.metrics.deployment(live.versions, live.share, live.mode == "shadow")
    return state


def _manual(action: Literal["promote", "rollback"], body: ReasonRequest, svc: Service) -> dict:
    from recloop.canary import controller

    try:
        result = controller.manual(svc.settings, action, body.reason, who="admin-api", model_name=body.model)
    except controller.NoCanary as err:
        raise HTTPException(409, str(err)) from err
    except ServiceUnavailable as err:
        raise HTTPException(503, str(err)) from err
    # the aliases moved; a version that does not load is reported by /healthz
    (svc.retrievers if body.model == "recloop-retriever" else svc.pool).try_sync()
    return result.to_dict()


@admin.post("/promote", dependencies=[Depends(require_admin)])
def promote(body: ReasonRequest, svc: ServiceDep) -> dict:
    return _manual("promote", body, svc)


@admin.post("/rollback", dependencies=[Depends(require_admin)])
def rollback(body: ReasonRequest, svc: ServiceDep) -> dict:
    return _manual("rollback", body, svc)


@admin.post("/flush", dependencies=[Depends(require_admin)])
def flush(svc: ServiceDep) -> dict:
    try:
        return {"landed": svc.land_feedback(raise_errors=True)}
    except Exception as err:  # noqa: BLE001 - the operator asked: say why, the events stay in the journal
        raise HTTPException(503, f"landing feedback failed (kept in the journal, retried at the next flush): "
                                 f"{type(err).__name__}: {err}") from err


async def invalid_request(request: Request, err: RequestValidationError) -> JSONResponse:
    service = getattr(request.app.state, "service", None)
    if service is not None:
        service.metrics.invalid.labels(request.url.path, "422").inc()
    errors = [{"loc": list(e.get("loc", ())), "msg": e.get("msg"), "type": e.get("type")} for e in err.errors()]
    return JSONResponse({"detail": errors}, status_code=422)


def create_app(settings: Settings | None = None, spec: DatasetSpec | str | None = None, *,
               online: OnlineReader | None = None, pool: ModelPool | None = None,
               retrievers: ModelPool | None = None) -> FastAPI:
    """The serving app: the service starts with the app (models loaded, watcher and feedback threads) and
    stops with it. ``spec``: a spec, a name or a path; None: the home's (``recloop.datasets``)."""
    from recloop import datasets

    settings = settings or Settings()
    spec = datasets.resolve(settings, spec, remember=False)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        import anyio.to_thread

        # Requests beyond this many wait in the event loop instead of adding threads that fight over the GIL:
        # past capacity, dozens of threads make every request slower and the throughput collapse.
        anyio.to_thread.current_default_thread_limiter().total_tokens = settings.serve_threads
        service = Service(settings, spec, online, pool, retrievers)
        service.start()
        app.state.service = service
        yield
        service.stop()

    app = FastAPI(title="recloop serving", version="1", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=settings.serve_max_body_bytes)
    app.add_exception_handler(RequestValidationError, invalid_request)
    from recloop.serve.recommend import router as recommend  # it imports this module's request types

    app.include_router(public)
    app.include_router(recommend)
    app.include_router(admin)
    return app


class ServerThread:
    """Run an app under uvicorn in a background thread (tests, the demo, benchmarks)::

        with ServerThread(create_app(settings), port=0) as server:
            httpx.get(f"{server.url}/healthz")
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        import socket

        import uvicorn

        if port == 0:
            with socket.socket() as probe:
                probe.bind((host, 0))
                port = probe.getsockname()[1]
        self.url = f"http://{host}:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                                    access_log=False))
        self.thread = threading.Thread(target=self.server.run, name="recloop-uvicorn", daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.time() > deadline:
                raise RuntimeError("the serving API did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
