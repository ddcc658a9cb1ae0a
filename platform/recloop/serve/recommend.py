"""``POST /recommend``: a catalog-wide recommendation for a user, through the four stages of the path.

::

    {user_id, context, k, exclude}
      │ retrieve  the retriever champion (or challenger, for its sticky canary share of users) embeds the
      │           user (id, context, history) and takes the ``RECLOOP_RECOMMEND_CANDIDATES`` (500) nearest
      │           catalog items from its index; a user its user table has no row for gets the catalog's
      │           most clicked items instead (``source: popularity``, with the reason)
      │ filter    drops the request's exclusions, items the catalog marks unavailable
      │           (``$RECLOOP_HOME/catalog/unavailable.json``) and items the user was shown or clicked within
      │           ``RECLOOP_RECOMMEND_SEEN_HOURS`` (what ``/feedback`` recorded in the journal, every replica's)
      │           and items the user interacted with in the lake (``recloop.features.seen``: the history the
      │           feature job publishes, newest ``RECLOOP_RECOMMEND_SEEN_HISTORY_ITEMS`` per user)
      │ rank      the ranker champion (or challenger, by its own split) scores what is left, each item with
      │           its catalog attributes as per-candidate context (the answering path of ``/rank``: a failing
      │           challenger is never what the user gets); in the ranker's interleaved canary both score
      │ order     the ranker's scores, on a log of choices times how likely the user picks the item
      │           (``pick_propensity``: the retriever's similarity, or popularity for a user it cannot place);
      │           boosted scores under the per-category cap (``retrieval.rules.order_items``) → top k; in the
      │           interleaved canary, the two rankers' orders merged by team draft under the same cap
      │           (``order_interleaved``), each item's team journaled so a click credits the ranker that
      │           placed it (``variant: interleave``, as on ``/rank``)
      ▼
    {request_id, items, retriever: {version, variant}, ranker: {version, variant}, source, candidates}

``candidates`` counts each stage: ``retrieved``, then what each filter dropped (``excluded``,
``unavailable``, ``seen``: the journal's recent items, ``seen_history``: the lake's, those the journal had
not dropped already), and ``ranked``. A filter that could not run (the journal's store down, no history
file yet) is named in ``skipped_filters`` and the answer comes without it.

The two canaries are independent: the retriever's split hashes the user with its own salt, so its
challenger and the ranker's challenger see unrelated shares of users. Each stage's time goes to
``recloop_recommend_stage_seconds{stage}`` and its CPU to ``recloop_recommend_stage_cpu_seconds``; the
request is journaled like a ``/rank`` request (the top k with their context and scores, so ``/feedback``
works and lands the same events), with one evaluation row for the retriever (``retriever:<version>``)
that its canary controller judges on.

Example::

    httpx.post(f"{url}/recommend", json={"user_id": 17, "context": {"device": "ios", "country": "DE"}, "k": 10})
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from datetime import UTC, datetime
from typing import Literal

import numpy as np
from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, ConfigDict, Field

from recloop import canary
from recloop.features.online import RequestError
from recloop.journal import retriever_key
from recloop.retrieval.data import Rows
from recloop.retrieval.rules import (
    FilterConfig,
    OrderConfig,
    filter_candidates,
    order_interleaved,
    order_items,
)
from recloop.serve.requests import ContextKey, ContextValue, Count, Id
from recloop.serve.service import Service, ServiceDep, journal_scores

log = logging.getLogger("recloop.serve")

MAX_K = 100  # items one answer may hold
MAX_EXCLUDE = 1000


class RecommendRequest(BaseModel):
    """A recommendation request: the user, the request's context (one value per column, a list only for a
    list column such as the click history), how many items, and ids never to return."""

    model_config = ConfigDict(extra="forbid")
    user_id: Id
    context: dict[ContextKey, ContextValue] = Field(default_factory=dict, max_length=64)
    k: Count = Field(default=10, ge=1, le=MAX_K)
    exclude: list[Id] = Field(default_factory=list, max_length=MAX_EXCLUDE)
    ts: datetime | None = None


class RecommendedItem(BaseModel):
    item_id: int
    score: float


class ModelUsed(BaseModel):
    version: str
    # interleave: the ranker challenger's interleaved canary (version is the challenger's; the answer
    # merges its ranking with the champion's)
    variant: Literal["champion", "challenger", "interleave"]


class RecommendResponse(BaseModel):
    request_id: str
    items: list[RecommendedItem]
    retriever: ModelUsed
    ranker: ModelUsed
    source: Literal["retrieval", "popularity"]
    fallback_reason: str | None = None
    candidates: dict[str, int]
    skipped_filters: list[str] = []  # a filter that could not run (its store down): the answer came without it


def user_rows(table, features) -> Rows:
    """The retriever's user row from a request's feature rows (their first row)."""
    columns = {c: table[c].to_numpy()[:1].astype(np.int64) for c in (features.user_id, *features.context)}
    lists = {}
    for name in features.history:
        values = table[name][0].as_py() or []
        lists[name] = (np.array([0, len(values)], dtype=np.int64), np.asarray(values, dtype=np.int64))
    return Rows(columns, lists)


def _candidate_context(retriever, positions: np.ndarray, spec) -> dict[str, list]:
    """Each candidate's raw attributes, as a per-candidate context (ints for integer columns, text as it is,
    None when unknown)."""
    out = {}
    dtypes = {c.name: c.dtype for c in spec.columns}
    for name, values in retriever.attributes.items():
        picked = values[positions]
        if picked.dtype == object:
            out[name] = picked.tolist()
            continue
        integer = dtypes.get(name, "float64").startswith("int")
        out[name] = [None if math.isnan(v) else (int(v) if integer else float(v)) for v in picked.tolist()]
    return out


def _category_codes(values: np.ndarray) -> np.ndarray:
    """The candidates' categories as the ordering rules take them (int64, -1: unknown). Text (a retriever
    warm-started from one whose category column held text) gets codes below -1: the per-category cap holds,
    and no boost (keyed by the integer categories) reaches them."""
    if values.dtype == object:
        known = np.array([v is not None for v in values], dtype=bool)
        codes = np.full(len(values), -1, dtype=np.int64)
        if known.any():
            codes[known] = -2 - np.unique(values[known].astype(str), return_inverse=True)[1]
        return codes
    return np.where(np.isnan(values), -1, values).astype(np.int64)


def recommend(svc: Service, body: RecommendRequest) -> RecommendResponse:
    started, started_cpu = time.perf_counter(), time.thread_time()
    metrics, settings = svc.metrics, svc.settings
    live, retrievers = svc.pool.live, svc.retrievers.live  # this request's models, whatever swaps meanwhile
    if live.champion is None:
        raise HTTPException(503, svc.readiness.check().reasons[0])
    if retrievers.champion is None:
        raise HTTPException(503, _no_retriever(svc))
    attributes = set(retrievers.champion.retriever.attributes)
    given = sorted(attributes & set(body.context))
    if given:
        raise HTTPException(422, f"context {given}: item attributes come from the catalog, not the request")
    ts = body.ts or datetime.now(UTC)
    ts_us = int((ts if ts.tzinfo else ts.replace(tzinfo=UTC)).timestamp() * 1_000_000)

    try:
        per_candidate = sorted(k for k, v in svc.features.per_candidate(body.context).items() if v)
    except KeyError:
        per_candidate = []  # an unknown column: building the features says which
    if per_candidate:
        raise HTTPException(
            422,
            f"context {per_candidate}: /recommend takes one value per column (a list only "
            "for a list column), not one per candidate",
        )

    # --- retrieve --------------------------------------------------------------------------------------
    stage = StageTimer(metrics)
    towers = [r.retriever.features for r in (retrievers.champion, retrievers.challenger) if r is not None]
    try:  # the user towers read the request's own columns only: no entity state
        table = svc.features.request_rows(
            body.user_id, body.context, ts_us, {c for f in towers for c in f.user_tables}
        )
    except RequestError as err:
        raise HTTPException(422, str(err)) from err
    except Exception as err:  # noqa: BLE001 - no feature state, online store gone: unavailable, and why
        log.error("features for a recommendation failed: %s: %s", type(err).__name__, err)
        raise HTTPException(503, f"features unavailable: {type(err).__name__}: {err}") from err
    canary_on = retrievers.challenger is not None and retrievers.mode == "canary"
    retriever_variant = (
        canary.route(body.user_id, retrievers.share, retrievers.salt) if canary_on else "champion"
    )
    routed = retrievers.challenger if retriever_variant == "challenger" else retrievers.champion
    evaluations: list[tuple] = []
    n = settings.recommend_candidates
    (found, similarity), source, reason, served_retriever = _retrieve(routed, table, n, evaluations, "served",
                                                                      metrics)
    if found is None and routed is retrievers.challenger:  # never hand the user a broken answer
        (found, similarity), source, reason, served_retriever = _retrieve(
            retrievers.champion, table, n, evaluations, "served", metrics
        )
    if found is None:
        raise HTTPException(500, f"retriever v{served_retriever.version} could not retrieve for this request")
    if retrievers.challenger is not None and retrievers.mode == "shadow":
        _retrieve(retrievers.challenger, table, n, evaluations, "shadow", metrics)
    retrieved = len(found)
    stage.done("retrieve")

    # --- filter ----------------------------------------------------------------------------------------
    recent, skipped = None, []
    if settings.recommend_seen_hours > 0:
        try:
            recent = svc.journal.recent_items(body.user_id, ts_us - int(settings.recommend_seen_hours * 3600e6))
        except Exception as err:  # noqa: BLE001 - the journal's store down: recommend without the seen filter
            log.warning("seen filter skipped (the journal could not be read): %s: %s", type(err).__name__, err)
            skipped.append(f"seen: the journal could not be read ({type(err).__name__})")
    history = None
    if settings.recommend_seen_history_items > 0:
        history = svc.seen_history.items(body.user_id)  # the file may hold more (a spec's derived history)
        if history is not None:
            history = history[: settings.recommend_seen_history_items]
        if history is None:
            skipped.append(f"seen_history: {svc.seen_history.missing}")
    kept, dropped = filter_candidates(
        found,
        FilterConfig(seen_hours=settings.recommend_seen_hours),
        now_s=ts_us / 1e6,
        recent=recent,
        history=history,
        unavailable=svc.unavailable.ids(),
        excluded=set(body.exclude),
    )
    retriever = served_retriever.retriever
    positions = retriever.positions(kept)
    kept, positions = kept[positions >= 0], positions[positions >= 0]
    stage.done("filter")
    counts = {
        "retrieved": retrieved,
        "excluded": dropped.excluded,
        "unavailable": dropped.unavailable,
        "seen": dropped.seen,
        "seen_history": dropped.seen_history,
        "ranked": len(kept),
    }

    # --- rank ------------------------------------------------------------------------------------------
    ranker_on = live.challenger is not None and live.mode in ("canary", "interleave")
    ranker_variant = canary.route(body.user_id, live.share, live.salt) if ranker_on else "champion"
    ranker = live.challenger if ranker_variant == "challenger" else live.champion
    all_scores: dict[str, np.ndarray] = {}
    per_item = _candidate_context(retriever, positions, svc.spec)
    scores = np.zeros(0)
    if len(kept):
        context = {**body.context, **per_item}
        try:
            # whole_row False: a column the spec requires that neither the request nor the catalog holds is
            # unknown to the model, as before (its rows land in quarantine if fed back)
            rows, fallbacks = svc.features.rows(body.user_id, kept.tolist(), context, ts_us, whole_row=False)
        except RequestError as err:
            raise HTTPException(422, str(err)) from err
        except Exception as err:  # noqa: BLE001
            log.error("features for ranking recommendations failed: %s: %s", type(err).__name__, err)
            raise HTTPException(503, f"features unavailable: {type(err).__name__}: {err}") from err
        metrics.fallbacks.labels("user").inc(fallbacks.user)
        metrics.fallbacks.labels("item").inc(fallbacks.items)
        scores, status = svc._evaluate(ranker, rows, "served", evaluations, all_scores)
        if status != "ok" and ranker is live.challenger:
            ranker = live.champion
            scores, status = svc._evaluate(ranker, rows, "served", evaluations, all_scores)
            status = "fallback" if status == "ok" else status
        if status not in ("ok", "fallback"):
            metrics.requests.labels(ranker_variant, ranker.version, "error").inc()
            raise HTTPException(500, f"model v{ranker.version} could not score this request ({status})")
        if live.challenger is not None and live.mode == "shadow":
            svc._evaluate(live.challenger, rows, "shadow", evaluations, all_scores)
        if ranker_variant == "challenger" and live.mode == "canary" and status == "ok":
            # as on /rank: the champion scores the challenger's candidates too, for the paired online AUC
            svc._evaluate(live.champion, rows, "paired", evaluations, all_scores)
        if ranker_variant == "challenger" and live.mode == "interleave" and status == "ok":
            # the interleaved canary, as on /rank: both rankings, merged by team draft in the order stage
            champion_scores, champion_status = svc._evaluate(live.champion, rows, "interleave", evaluations,
                                                             all_scores)
            if champion_status == "ok":
                ranker_variant = "interleave"
        metrics.requests.labels(ranker_variant, ranker.version, status).inc()
    stage.done("rank")

    # --- order -----------------------------------------------------------------------------------------
    weight = settings.recommend_retrieval_weight
    if weight is None:  # by what the spec's rows are: a log of choices (ratings) or of impressions
        weight = 1.0 if svc.spec.events == "chosen" else 0.0
    if weight > 0 and len(kept):  # times the retriever's propensity (settings)
        propensity = pick_propensity(retriever, found, similarity, kept, weight)
        scores = scores * propensity
        if ranker_variant == "interleave":
            champion_scores = champion_scores * propensity
    category = retriever.features.category
    categories = _category_codes(retriever.attributes.get(category, np.full(len(retriever.catalog), np.nan))[positions])
    order_config = OrderConfig(
        category_cap=settings.recommend_category_cap or None, boosts=settings.recommend_boosts
    )
    interleaved: dict = {}
    if ranker_variant == "interleave":  # a click is credited to the team (ranker) that placed the item
        placed, teams, boosted = order_interleaved(kept, champion_scores, scores, categories, order_config,
                                                   body.k, svc._rng)
        top = kept[placed]
        interleaved["interleaving"] = {"champion": live.champion.version, "challenger": ranker.version,
                                       "teams": teams.tolist()}
    else:
        top, boosted = order_items(kept, scores, categories, order_config, body.k)
    stage.done("order")

    request_id = uuid.uuid4().hex
    latency_ms = (time.perf_counter() - started) * 1000
    chosen = [int(np.flatnonzero(kept == item)[0]) for item in top.tolist()]
    payload = {
        "item_ids": top.tolist(),
        "context": {**body.context, **{k: [v[i] for i in chosen] for k, v in per_item.items()}},
        "per_candidate": {**svc.features.per_candidate(body.context), **{k: True for k in per_item}},
        "scores": {v: journal_scores(s[chosen]) for v, s in all_scores.items()},
        "ranked": top.tolist(),
        "route": "recommend",
        "retriever": served_retriever.version,
        "source": source,
        **interleaved,
    }
    now = time.time()
    svc.journal.record(
        (
            request_id,
            now,
            ts_us,
            body.user_id,
            ranker_variant,
            ranker.version,
            latency_ms,
            json.dumps(payload),
        ),
        [(request_id, *e, now) for e in evaluations],
    )
    metrics.recommendations.labels(retriever_variant, served_retriever.version, source).inc()
    metrics.stage_latency.labels("total").observe(latency_ms / 1000)
    metrics.stage_cpu.labels("total").inc(time.thread_time() - started_cpu)
    return RecommendResponse(
        request_id=request_id,
        items=[RecommendedItem(item_id=int(i), score=float(s)) for i, s in zip(top, boosted, strict=True)],
        retriever=ModelUsed(version=served_retriever.version, variant=retriever_variant),
        ranker=ModelUsed(version=ranker.version, variant=ranker_variant),
        source=source,
        fallback_reason=reason,
        candidates=counts,
        skipped_filters=skipped,
    )


def pick_propensity(retriever, found: np.ndarray, similarity: np.ndarray | None, kept: np.ndarray,
                    weight: float) -> np.ndarray:
    """How likely the user is to pick each ``kept`` item (normalized over them), to the power ``weight``:
    from the retrieval similarities of ``found``, or, for the popular items answered to a user the retriever
    cannot place (``similarity`` None), from the items' share of its training clicks. The ranker scores
    those by "will they like it"; without this, a ratings log's unknown user got the catalog's best-rated
    rarities ahead of what people pick (MovieLens replay, recall@10 0.044 and 0.020 against popularity's
    0.075 and 0.067 in two months of three; 0.125 and 0.087 with it: RESULTS.md)."""
    kept_similarity = None
    if similarity is not None:
        by_id = dict(zip(found.tolist(), similarity.tolist(), strict=True))
        kept_similarity = np.array([by_id[i] for i in kept.tolist()])
    return np.exp(weight * retriever.log_propensity(kept, kept_similarity))


class StageTimer:
    """Each stage's time, from the end of the one before: wall clock into ``recloop_recommend_stage_seconds``,
    this thread's CPU into ``recloop_recommend_stage_cpu_seconds`` (what the request itself computed, which
    a busy machine's waiting for a core does not inflate; FAISS, and torch at the default one thread per
    scoring call, run in the request's thread)."""

    def __init__(self, metrics):
        self.metrics = metrics
        self.wall, self.cpu = time.perf_counter(), time.thread_time()

    def done(self, stage: str) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        self.metrics.stage_latency.labels(stage).observe(wall - self.wall)
        self.metrics.stage_cpu.labels(stage).inc(cpu - self.cpu)
        self.wall, self.cpu = wall, cpu


def _retrieve(loaded, table, n: int, evaluations: list, role: str, metrics):
    """``loaded``'s candidates for the request's user row: ((ids, similarities), source, reason, loaded), ids
    None on failure, similarities None for the popularity answer.

    A user whose index the retriever's user table has no row for (unknown to the vocabularies, admitted after
    the retriever was trained, or, under a row budget, evicted or not yet admitted) gets the catalog's most
    clicked items.
    """
    retriever = loaded.retriever
    began = time.perf_counter()
    user_index = int(table[retriever.features.user_id][0].as_py())
    try:
        if retriever.has_user_row(user_index):
            found, similarity = retriever.retrieve(user_rows(table, retriever.features), n)
            ids, source, reason = (found[0], similarity[0]), "retrieval", None
        else:
            ids, source = (retriever.popular(n), None), "popularity"
            reason = (
                f"the user is unknown to retriever v{loaded.version} (no row in its user table): the "
                "catalog's most clicked items were ranked instead"
            )
        status = "ok"
    except Exception as err:  # noqa: BLE001 - a failing retriever is data for its canary, not a crash
        log.error("retriever v%s failed: %s: %s", loaded.version, type(err).__name__, err)
        ids, source, reason, status = (None, None), "retrieval", None, "error"
    evaluations.append((retriever_key(loaded.version), role, status, (time.perf_counter() - began) * 1000))
    metrics.evaluations.labels(retriever_key(loaded.version), role, status).inc()
    return ids, source, reason, loaded


def _no_retriever(svc: Service) -> str:
    pool = svc.retrievers
    if pool.last_error:
        return f"no retriever is deployed: {pool.last_error}"
    wanted = pool.wanted
    if wanted is None or wanted.champion is None:
        return (
            "no retriever is deployed: the registry has no 'champion' alias of recloop-retriever (train and "
            "gate a retriever first)"
        )
    failure = pool.failures.get(wanted.champion)
    return f"no retriever is deployed: v{wanted.champion} does not load ({failure.reason if failure else 'not yet'})"


# --- the route ----------------------------------------------------------------------------------------------

router = APIRouter()


@router.post("/recommend", response_model=RecommendResponse)
def recommend_route(body: RecommendRequest, svc: ServiceDep) -> RecommendResponse:
    try:
        return recommend(svc, body)
    except HTTPException as err:
        if err.status_code < 500:
            svc.metrics.invalid.labels("/recommend", str(err.status_code)).inc()
        raise
