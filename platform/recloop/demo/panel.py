"""The demo's reference rankings on the evaluation panel: the never-retrained model, a daily full
retrain from scratch, and the twin-world recovery (``recloop.panel``)."""

from __future__ import annotations

import numpy as np

from recloop.demo.records import DemoConfig
from recloop.settings import Settings
from recloop.simulate import World


def twin_recovery(panels: dict[int, dict], twin: dict, config: DemoConfig) -> dict:
    """Per day from the drift on: the champion's normalized reward with the drift over its twin's, with a
    user-cluster interval; the headline is two cycles after the drift."""
    from recloop.panel import twin_recovery

    per_day = {}
    for day, panel in panels.items():
        other = twin.get(day) or twin.get(str(day))
        if day < config.drift_day or other is None:
            continue
        mine = panel["rewards"]
        theirs = {k: np.asarray(v) for k, v in other.items() if k != "users"}
        per_day[day] = {policy: twin_recovery(mine, theirs, panel["users"], policy)
                        for policy in ("champion", "never_retrained", "daily_full") if policy in mine and policy in theirs}
    headline = per_day.get(config.drift_day + 2) or (per_day[max(per_day)] if per_day else None)
    return {"per_day": per_day, "day": config.drift_day + 2 if config.drift_day + 2 in per_day else
            (max(per_day) if per_day else None), "headline": headline,
            "target": "champion's normalized reward >= 0.95 of the no-drift twin within two cycles (95 % CI "
                      "lower bound stated)",
            "met": bool(headline and headline["champion"]["low"] >= 0.95)}


def paired_efficacy(panels: dict[int, dict], config: DemoConfig) -> dict:
    """Per day: the champion's normalized reward minus the never-retrained model's (and the daily full
    retrain's, when there is one) on that day's panel, paired, with a user-cluster interval, and on days when a
    ranker canary was running at the panel the same for ``served`` (the deployment as of the panel, after the
    day's last canary check: the champion, or within the canary's share the challenger or the interleaving);
    the headline is two cycles after the drift (the last day when the run is shorter), as the twin recovery's."""
    from recloop.panel import paired_difference

    per_day = {}
    for day, panel in panels.items():
        rewards = panel["rewards"]
        # "served" only where a canary ran at the panel: elsewhere it is the champion, figure for figure
        policies = ("champion", "served") if "challenger" in rewards else ("champion",)
        per_day[day] = {f"{policy} - {other}": paired_difference(rewards, panel["users"], policy, other)
                        for policy in policies for other in ("never_retrained", "daily_full") if other in rewards}
    wanted = config.drift_day + 2 if config.drift != "none" else max(per_day, default=None)
    day = wanted if wanted in per_day else max(per_day, default=None)
    return {"per_day": per_day, "day": day, "headline": per_day.get(day)}


def train_reference(settings: Settings, day: int, config: DemoConfig, batch_size: int, first: int = 0) -> list:
    """Full retrains from scratch on days 0..``day`` (held-out hours excluded, as the loop's), one per seed
    ``config.train_seed`` + ``first``..``config.reference_seeds`` − 1, loaded for the panel;
    no MLflow run, no version: they serve nobody."""
    from dataclasses import replace

    from recloop.scoring import load_checkpoint
    from recloop.train import TrainConfig, train

    base = TrainConfig(mode="full", days=day + 1, epochs=config.full_epochs, batch_size=batch_size, validation_hours=6)
    return [load_checkpoint(train(settings, replace(base, seed=config.train_seed + i)).checkpoint,
                            f"daily-full-day{day}-{i}")
            for i in range(first, max(config.reference_seeds, 1))]


def served_scores(champion: np.ndarray, challenger: np.ndarray, users: np.ndarray, share: float, salt: str | None,
                  interleave: bool, k: int, seed: int) -> np.ndarray:
    """Scores (requests, candidates) whose order is what each request's user is shown while a canary runs:
    the users ``canary.route`` puts in the challenger's ``share`` (under the experiment's ``salt``) get the
    challenger's ranking, or with ``interleave`` the team draft of the champion's and the challenger's top
    ``k`` (``evidence.interleaving``, the merge ``/rank`` makes; the rest in the champion's order); the others
    the champion's. Rank scores: only their order means anything."""
    from recloop.canary.decision import route
    from recloop.evidence.interleaving import team_draft_batch

    n, m = champion.shape
    kwargs = {"salt": salt} if salt else {}  # no salt: serving's default split
    routed = np.array([route(int(u), share, **kwargs) == "challenger" for u in users.tolist()], dtype=bool)
    orders = {name: np.argsort(-s, axis=1, kind="stable") for name, s in (("champion", champion),
                                                                           ("challenger", challenger))}
    order = orders["champion"].copy()
    if not interleave:
        order[routed] = orders["challenger"][routed]
    ranks = np.empty((n, m))
    np.put_along_axis(ranks, order, np.arange(m, 0, -1, dtype=float)[None, :], axis=1)
    if interleave and routed.any():
        picked, _ = team_draft_batch(orders["champion"][routed], orders["challenger"][routed], k,
                                     np.random.default_rng(seed))
        top = ranks[routed]
        np.put_along_axis(top, picked, (2 * m - np.arange(picked.shape[1], dtype=float))[None, :], axis=1)
        ranks[routed] = top
    return ranks


def rank_panel(features, world: World, panel, models: dict) -> dict[str, np.ndarray]:
    """Each model's click probabilities for the panel's candidates, (requests, candidates), every model
    scoring the same rows: the request's online features (``features``, a ``RequestFeatures``) as served.

    The rows of every request are built first and each model scores them in one call: scoring request by
    request spent most of a simulated day in per-call overhead (``benchmarks/demo_stages.py``)."""
    from recloop.panel import request_bodies

    features.refresh_if_published()
    bodies = list(request_bodies(world, panel))
    return {name: scores.reshape(len(bodies), -1) for name, scores in _score_requests(features, bodies, models).items()}


def _score_requests(features, bodies: list[dict], models: dict) -> dict[str, np.ndarray]:
    """Each model's click probabilities for every candidate of ``bodies``, concatenated in request order:
    one scoring call per model over all the requests' rows."""
    from datetime import datetime

    import pyarrow as pa

    from recloop.scoring import score

    tables = []
    for body in bodies:
        ts_us = int(datetime.fromisoformat(body["ts"]).timestamp() * 1_000_000)
        tables.append(features.rows(body["user_id"], body["item_ids"], body["context"], ts_us)[0])
    rows = pa.concat_tables(tables)
    return {name: score(model, rows).numpy() for name, model in models.items()}


class FrozenRanker:
    """The day-0 model ranking the day's requests offline with the same online features (the baseline),
    and the day's evaluation panel scored by it and by the live champion."""

    def __init__(self, settings: Settings, version: str):
        from recloop.features.config import FeatureConfig
        from recloop.features.online import RequestFeatures, online_reader
        from recloop.schema import load_spec
        from recloop.scoring import load_version

        spec = load_spec("synthetic")
        self.settings = settings
        self.model = load_version(settings, version)
        self.features = RequestFeatures(settings, spec, FeatureConfig.for_spec(spec), online_reader(settings))
        self._models = {version: self.model}
        # the daily full retrain (``DemoConfig.daily_full``), when there is one: a model per reference seed
        self.reference: list | None = None

    def panel(self, world: World, day: int, config: DemoConfig, live) -> dict:
        """The day's panel (drawn on its own stream): per-request expected clicks of the oracle, a random
        ranking, the never-retrained model and the live champion; normalized rewards with intervals.

        ``live``: the ranker's deployment as the registry states it now (``serve.models.Wanted``: champion,
        challenger, share, mode, salt; the demo reads it after the day's last canary check). ``served`` is then
        each panel request as serving routes its user under that deployment: the champion's ranking, or for the
        users the experiment's salt puts in the challenger's share, the challenger's (``canary`` mode) or the
        team-draft interleaving of both (``interleave``, as ``/rank`` merges them). While a canary runs at 95 %
        of users the champion alone is not what the loop serves."""
        from recloop.panel import draw_panel, per_request, score_panel
        from recloop.scoring import load_version

        panel = draw_panel(world, day + 0.5, config.panel_requests, min(config.candidates, 50), seed=config.seed)
        champion = live.champion
        challenger = live.challenger if live.share > 0 and live.mode in ("canary", "interleave") else None
        for version in (champion, challenger):
            if version is not None and version not in self._models:
                self._models[version] = load_version(self.settings, version)
        models = {"never_retrained": self.model, "champion": self._models.get(champion, self.model)}
        if challenger is not None:
            models["challenger"] = self._models[challenger]
        averaged = {}
        if self.reference:  # "daily_full": the mean over its seeds (one draw each would be one seed's luck)
            names = [f"daily_full_seed{i}" for i in range(len(self.reference))]
            models.update(zip(names, self.reference, strict=True))
            averaged["daily_full"] = names
        stacked = rank_panel(self.features, world, panel, models)
        stacked["served"] = stacked["champion"] if challenger is None else served_scores(
            stacked["champion"], stacked["challenger"], panel.users, live.share, live.salt,
            interleave=live.mode == "interleave", k=config.shown, seed=config.seed * 1000 + day)
        rows = per_request(world, panel, stacked, k=config.shown, seed=config.seed, averaged=averaged)
        figures = score_panel(world, panel, stacked, k=config.shown, seed=config.seed, averaged=averaged)
        return {"rewards": {k: v["reward"] for k, v in rows.items()}, "users": panel.users,
                "figures": {k: {m: round(x, 4) for m, x in v.items()} for k, v in figures.items()
                            if k in ("champion", "served", "challenger", "never_retrained", "daily_full")}}

    def rank(self, bodies: list[dict]) -> list[list[int]]:
        """The never-retrained model's order of each request's candidates (one scoring call for all)."""
        self.features.refresh()
        scores = _score_requests(self.features, bodies, {"frozen": self.model})["frozen"]
        orders, start = [], 0
        for body in bodies:
            mine = scores[start:start + len(body["item_ids"])]
            start += len(body["item_ids"])
            orders.append([body["item_ids"][i] for i in np.argsort(-mine, kind="stable")])
        return orders
