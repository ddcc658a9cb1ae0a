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


import logging
import secrets
import threading
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from recloop.endpoints import ServiceUnavailable
from recloop.features.online import OnlineReader
from recloop.journal import FeedbackError, JournalBusy, JournalUnavailable, UnknownRequest
from recloop.schema import DatasetSpec
from recloop.serve.body_limit import BodyLimit
from recloop.serve.models import ModelPool
from recloop.serve.recommend import router as recommend
from recloop.serve.requests import CanaryRequest, FeedbackRequest, RankRequest, RankResponse, ReasonRequest
from recloop.serve.service import Service, ServiceDep
from recloop.settings import Settings

log = logging.getLogger("recloop.serve")

PLACEHOLDER_TOKENS = frozenset({"change-me"})  # what the manifests shipped before issue 40: anyone could send it

# --- routes: every handler reads the process's Service from the app's state -----------------------------------

public = APIRouter()
admin = APIRouter(prefix="/admin")
bearer = HTTPBearer(auto_error=False)


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
    except JournalUnavailable as err:  # the store is down: nothing recorded, the client keeps it and retries
        svc.metrics.feedback_refused.inc()
        raise HTTPException(503, f"feedback not recorded: the serving journal cannot be reached, send it again "
                                 f"later ({err})", headers={"Retry-After": str(int(err.retry_after + 0.999))}) from err
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
            # past its TTL, every user and item is served as never seen (a stopped feature job, an old home)
            "feature_state_age": svc.features.state_age(datetime.now(UTC)),
            "swaps": svc.pool.swaps, "watcher_error": svc.pool.last_error,
            "load_failures": {v: f.reason for v, f in svc.pool.failures.items()},
            "retriever": _retriever_health(svc),
            # ready but degraded: scoring works; versions cannot change until the registry answers again, feedback
            # is refused until the journal's store does
            "degraded": [f"{name}: {pool.degraded}" for name, pool in (("ranker", svc.pool),
                                                                      ("retriever", svc.retrievers)) if pool.degraded]
            + ([f"journal: {svc.journal.degraded}"] if svc.journal.degraded else [])}
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
def promote(svc: ServiceDep, body: ReasonRequest | None = None) -> dict:
    return _manual("promote", body or ReasonRequest(), svc)  # no body: every field has its default


@admin.post("/rollback", dependencies=[Depends(require_admin)])
def rollback(svc: ServiceDep, body: ReasonRequest | None = None) -> dict:
    return _manual("rollback", body or ReasonRequest(), svc)


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

    # /docs and /redoc load Swagger UI's and ReDoc's files from this app (fastapi-offline ships them), not from
    # a CDN: a serving host without internet access showed a blank page.
    from fastapi_offline import FastAPIOffline

    app = FastAPIOffline(title="recloop serving", version="1", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=settings.serve_max_body_bytes)
    app.add_exception_handler(RequestValidationError, invalid_request)
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
        from recloop.readiness import wait_until

        self.thread.start()
        wait_until(lambda: self.server.started, what="the serving API starting", timeout=60, interval=0.02,
                   gone=lambda: None if self.thread.is_alive() else "its thread ended")
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
