"""Simulated users of the synthetic world calling the serving API, clicking by the ground truth.

Each ``/rank`` request: a user drawn by activity, ``candidates`` distinct items drawn by popularity, the
user's device, country and click history as context, each candidate's category and price. Each
``/recommend`` request (``recommend_request``): the user and their context only, asking for ``shown``
items from the whole catalog. The user sees the top ``shown`` items of the answer at positions
1..shown and clicks each with the world's true click probability; the impressions and clicks go back to
``/feedback``. A model that ranks better earns more clicks: the online CTR the canary controller
compares. The oracle of a ``/rank`` request orders its candidates by the true click probability; the
oracle of a ``/recommend`` request picks the best ``shown`` items of the whole catalog.

Example::

    users = SimulatedUsers(world, day=3.5, seed=1)
    summary = asyncio.run(drive(url, users, requests=500, concurrency=32))
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import numpy as np

from recloop.simulate import COUNTRIES, DEVICE_MIX, DEVICES, World


@dataclass
class TrafficSummary:
    requests: int = 0
    failed: int = 0
    errors: Counter = field(default_factory=Counter)
    versions: Counter = field(default_factory=Counter)
    retrievers: Counter = field(default_factory=Counter)
    sources: Counter = field(default_factory=Counter)  # /recommend answers by source (retrieval, popularity)
    impressions: Counter = field(default_factory=Counter)
    clicks: Counter = field(default_factory=Counter)
    expected_clicks: Counter = field(default_factory=Counter)
    oracle_clicks: Counter = field(default_factory=Counter)
    latencies_ms: list[float] = field(default_factory=list)
    seconds: float = 0.0

    def ctr(self, version: str) -> float:
        return self.clicks[version] / self.impressions[version] if self.impressions[version] else float("nan")

    def to_dict(self) -> dict:
        latencies = np.array(self.latencies_ms) if self.latencies_ms else np.zeros(1)
        return {"requests": self.requests, "failed": self.failed, "errors": dict(self.errors),
                "versions": dict(self.versions), "retrievers": dict(self.retrievers), "sources": dict(self.sources), "impressions": dict(self.impressions), "clicks": dict(self.clicks),
                "ctr": {v: self.ctr(v) for v in self.impressions},
                "expected_ctr": {v: self.expected_clicks[v] / n for v, n in self.impressions.items() if n},
                "vs_oracle": {v: self.expected_clicks[v] / self.oracle_clicks[v] for v in self.impressions
                              if self.oracle_clicks[v]},
                "p50_ms": float(np.percentile(latencies, 50)), "p99_ms": float(np.percentile(latencies, 99)),
                "seconds": self.seconds, "rps": self.requests / self.seconds if self.seconds else 0.0}


class SimulatedUsers:
    def __init__(self, world: World, day: float, *, candidates: int = 100, shown: int = 10, seed: int = 0,
                 send_ts: bool = True):
        self.world, self.day = world, day
        self.candidates, self.shown = candidates, shown
        self.rng = np.random.default_rng(seed)
        self.send_ts = send_ts
        drifted = world.drifted(int(day))
        popularity = world.popularity_after if drifted and world.config.drift == "sudden" else world.popularity_before
        self.popularity = popularity / popularity.sum()
        activity = world.activity_after if drifted and world.config.drift == "covariate" else world.activity_before
        self.activity = activity / activity.sum()

    @property
    def ts(self) -> datetime:
        return self.world.config.start + timedelta(days=self.day)

    def request(self) -> tuple[dict, dict]:
        """A request body and what the user needs to react to the answer."""
        world, rng = self.world, self.rng
        user = int(rng.choice(len(self.activity), p=self.activity))
        pool = rng.choice(len(self.popularity), self.candidates * 2, p=self.popularity)
        items = list(dict.fromkeys(int(i) for i in pool))[: self.candidates]
        device = int(rng.choice(len(DEVICES), p=DEVICE_MIX))
        history = [int(i) for i in world.history[user] if i >= 0]
        price = world.item_price[items]
        broken = world.drifted(int(self.day)) and world.config.drift == "broken_column"
        body = {"user_id": user, "item_ids": items, "context": {
            "device": DEVICES[device], "country": COUNTRIES[world.user_country[user]], "history": history,
            "category": [int(c) for c in world.item_category[items]],
            "price": None if broken else [float(p) for p in price]}}
        if self.send_ts:
            body["ts"] = self.ts.isoformat()
        return body, {"user": user, "device": device}

    def recommend_request(self) -> tuple[dict, dict]:
        """A ``/recommend`` body (user and context, no candidates) and what the user needs to react."""
        world, rng = self.world, self.rng
        user = int(rng.choice(len(self.activity), p=self.activity))
        device = int(rng.choice(len(DEVICES), p=DEVICE_MIX))
        history = [int(i) for i in world.history[user] if i >= 0]
        body = {"user_id": user, "k": self.shown, "context": {
            "device": DEVICES[device], "country": COUNTRIES[world.user_country[user]], "history": history}}
        if self.send_ts:
            body["ts"] = self.ts.isoformat()
        return body, {"user": user, "device": device}

    def oracle_expected(self, body: dict, who: dict) -> float:
        """Expected clicks had the ranking followed the true click probabilities (the best possible): of the
        request's candidates, or for a ``/recommend`` request of the whole catalog."""
        items = np.array(body["item_ids"]) if "item_ids" in body else np.arange(len(self.world.item_vector))
        first = self.world.click_probability(self.day, np.full(len(items), who["user"]), items,
                                             np.full(len(items), who["device"]), np.ones(len(items)))
        best = items[np.argsort(-first, kind="stable")[: self.shown]]
        return float(self.world.click_probability(self.day, np.full(len(best), who["user"]), best,
                                                  np.full(len(best), who["device"]), np.arange(1, len(best) + 1)).sum())

    def expected(self, ranked: list[int], who: dict) -> float:
        """Expected clicks on the top ``shown`` of a ranking."""
        shown = np.array(ranked[: self.shown])
        return float(self.world.click_probability(self.day, np.full(len(shown), who["user"]), shown,
                                                  np.full(len(shown), who["device"]), np.arange(1, len(shown) + 1)).sum())

    def react(self, answer: dict, who: dict) -> tuple[list[int], list[int], float]:
        """Impressions (the top ``shown``), the clicked ones, and the expected number of clicks."""
        shown = [item["item_id"] for item in answer["items"][: self.shown]]
        p = self.world.click_probability(self.day, np.full(len(shown), who["user"]), np.array(shown, dtype=np.int64),
                                         np.full(len(shown), who["device"]), np.arange(1, len(shown) + 1))
        clicked = [item for item, hit in zip(shown, self.rng.random(len(shown)) < p, strict=True) if hit]
        return shown, clicked, float(p.sum())


async def drive(url: str, users: SimulatedUsers, requests: int | list[tuple[dict, dict]], concurrency: int = 16,
                feedback: bool = True, timeout: float = 30.0) -> TrafficSummary:
    """Send ranking requests (a number of new ones, or given ``(body, who)`` pairs; ``concurrency`` at a
    time) and their feedback; count everything, with expected and oracle clicks per version. A body
    without ``item_ids`` goes to ``/recommend`` (counted under the ranker version that answered)."""
    import httpx

    summary = TrafficSummary()
    queue: asyncio.Queue = asyncio.Queue()
    for pair in requests if isinstance(requests, list) else (users.request() for _ in range(requests)):
        queue.put_nowait(pair)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            body, who = queue.get_nowait()
            began = time.perf_counter()
            try:
                response = await client.post("/rank" if "item_ids" in body else "/recommend", json=body)
            except httpx.HTTPError as err:
                summary.failed += 1
                summary.errors[type(err).__name__] += 1
                continue
            summary.requests += 1
            summary.latencies_ms.append((time.perf_counter() - began) * 1000)
            if response.status_code != 200:
                summary.failed += 1
                summary.errors[str(response.status_code)] += 1
                continue
            answer = response.json()
            version = answer["model_version"] if "model_version" in answer else answer["ranker"]["version"]
            if "retriever" in answer:
                summary.retrievers[answer["retriever"]["version"]] += 1
                summary.sources[answer["source"]] += 1
            summary.versions[version] += 1
            if not feedback:
                continue
            shown, clicked, expected = users.react(answer, who)
            if not shown:  # e.g. everything the user could be recommended was shown to them already
                summary.errors["empty answer"] += 1
                continue
            reply = await client.post("/feedback", json={"request_id": answer["request_id"], "impressions": shown,
                                                         "clicks": clicked})
            if reply.status_code != 200:
                summary.errors[f"feedback {reply.status_code}"] += 1
                continue
            summary.impressions[version] += len(shown)
            summary.clicks[version] += len(clicked)
            summary.expected_clicks[version] += expected
            summary.oracle_clicks[version] += users.oracle_expected(body, who)

    began = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    summary.seconds = time.perf_counter() - began
    return summary
