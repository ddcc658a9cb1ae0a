"""A seeded synthetic world of users, items and clicks, with known ground truth and drift scenarios.

The world is recloop's embedded data source: the demo, the tests and the benchmarks run on it, and
because every click is drawn from a known probability (written as column ``p_click``), a model's AUC
can be compared with the oracle's on the same rows.

How a click happens::

    logit = base + taste · item_vector + item_quality + device_effect - 0.35·log(position)
            - 0.25·(log price - mean log price)
    p_click = sigmoid(logit);  label ~ Bernoulli(p_click)

Users are drawn by activity (heavy-tailed), items by popularity (Zipf-like); a user's ``history`` is
their last clicked items as of the start of the hour. One parquet file per simulated hour, under
``OUT/YYYY-MM-DD/``. Deterministic for a seed: each hour has its own random stream.

Drift scenarios, starting on day ``drift_day`` (days count from 0):

- ``none``: the world stays as it is.
- ``gradual``: user tastes rotate toward new directions, a quarter turn over ``GRADUAL_DAYS`` days.
- ``sudden``: a new catalog wave (new item ids) takes most of the exposure, and the popularity of the
  old catalog is reshuffled.
- ``covariate``: the context mix changes (devices, and which countries are active); the click model
  for a given context stays the same.
- ``broken_column``: an upstream column (``price``) arrives null.

Example::

    world = World(WorldConfig(seed=7, days=2, events_per_day=10_000, drift="sudden", drift_day=1))
    summary = world.write(Path("landing/"))
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

DriftScenario = Literal["none", "gradual", "sudden", "covariate", "broken_column"]
DRIFT_SCENARIOS: tuple[str, ...] = ("none", "gradual", "sudden", "covariate", "broken_column")

DEVICES = ("mobile", "desktop", "tablet")
DEVICE_MIX = (0.60, 0.32, 0.08)
DEVICE_MIX_AFTER_COVARIATE_DRIFT = (0.25, 0.25, 0.50)
DEVICE_EFFECT = (0.0, 0.25, -0.35)
COUNTRIES = ("US", "GB", "DE", "FR", "BR", "IN", "JP", "MX", "ES", "IT")
COUNTRY_MIX = (0.30, 0.12, 0.10, 0.09, 0.09, 0.10, 0.06, 0.05, 0.05, 0.04)
# Under covariate drift these countries' users become this many times more active.
COVARIATE_BOOSTED_COUNTRIES = ("BR", "IN", "MX")
COVARIATE_ACTIVITY_BOOST = 6.0
GRADUAL_DAYS = 5.0
SUDDEN_WAVE_FRACTION = 0.4  # new items, relative to the original catalog
SUDDEN_WAVE_EXPOSURE = 0.6  # share of impressions the new wave gets
BROKEN_COLUMN = "price"
MAX_POSITION = 20
BASE_LOGIT = -2.3
TASTE_SCALE = 2.2


@dataclass(frozen=True)
class WorldConfig:
    """What a synthetic world looks like.

    Args:
        seed: everything is a function of it.
        days: number of simulated days.
        events_per_day: impressions per day (spread over hours with a daily rhythm).
        start: the first simulated midnight (UTC).
        num_users, num_items: population sizes; by default they scale with ``events_per_day``.
        num_categories: item categories (tastes cluster around them).
        latent_dim: size of the taste / item vectors.
        history_length: items kept in a user's ``history``.
        drift: the drift scenario (see the module docstring).
        drift_day: first affected day, counted from 0.
    """

    seed: int = 0
    days: int = 7
    events_per_day: int = 100_000
    start: datetime = datetime(2026, 1, 1, tzinfo=UTC)
    num_users: int | None = None
    num_items: int | None = None
    num_categories: int = 24
    latent_dim: int = 8
    history_length: int = 10
    drift: DriftScenario = "none"
    drift_day: int = 3

    def __post_init__(self) -> None:
        if self.days < 1 or self.events_per_day < 1:
            raise ValueError("days and events_per_day must be at least 1")
        if self.drift not in DRIFT_SCENARIOS:
            raise ValueError(f"unknown drift scenario {self.drift!r}; choose one of {DRIFT_SCENARIOS}")
        if self.drift_day < 0:
            raise ValueError("drift_day counts from 0 and cannot be negative")
        if self.start.tzinfo is None:
            object.__setattr__(self, "start", self.start.replace(tzinfo=UTC))

    @property
    def users(self) -> int:
        return self.num_users or max(200, self.events_per_day // 10)

    @property
    def items(self) -> int:
        return self.num_items or max(100, self.events_per_day // 50)


@dataclass
class SimulationSummary:
    out_dir: str
    files: int = 0
    events: int = 0
    clicks: int = 0
    days: int = 0
    drift: str = "none"
    drift_day: int = 0
    first_ts: str = ""
    last_ts: str = ""
    paths: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


class World:
    """The simulated population and its click model; ``hour_events`` draws one hour of impressions."""

    def __init__(self, config: WorldConfig):
        self.config = config
        rng = np.random.default_rng(np.random.SeedSequence([config.seed, 0]))
        k, n_users = config.latent_dim, config.users
        n_items = config.items
        n_wave = int(round(n_items * SUDDEN_WAVE_FRACTION)) if config.drift == "sudden" else 0
        self.num_original_items = n_items

        centroids = rng.normal(0.0, 1.0, (config.num_categories, k)) / np.sqrt(k)
        category = rng.integers(0, config.num_categories, n_items)
        vector = centroids[category] + rng.normal(0.0, 0.5, (n_items, k)) / np.sqrt(k)
        quality = rng.normal(0.0, 0.4, n_items)
        category_price = rng.lognormal(3.0, 0.6, config.num_categories)
        price = np.round(category_price[category] * rng.lognormal(0.0, 0.3, n_items), 2)
        # The drift's new items come from their own stream: a world and its no-drift twin (same seed) agree
        # on everything before the drift day.
        wave_rng = np.random.default_rng(np.random.SeedSequence([config.seed, 2]))
        wave_category = wave_rng.integers(0, config.num_categories, n_wave)
        self.item_category = np.concatenate([category, wave_category])
        self.item_vector = np.concatenate(
            [vector, centroids[wave_category] + wave_rng.normal(0.0, 0.5, (n_wave, k)) / np.sqrt(k)])
        self.item_quality = np.concatenate([quality, wave_rng.normal(0.0, 0.4, n_wave)])
        self.item_price = np.concatenate(
            [price, np.round(category_price[wave_category] * wave_rng.lognormal(0.0, 0.3, n_wave), 2)])
        self.mean_log_price = float(np.log(self.item_price[:n_items]).mean())

        # Zipf-like exposure; the wave items have none until the drift day.
        popularity = 1.0 / np.arange(1, n_items + 1) ** 0.9
        self.popularity_before = np.concatenate([rng.permutation(popularity), np.zeros(n_wave)])
        reshuffled = rng.permutation(self.popularity_before[:n_items])  # drawn in every scenario (twins agree)
        wave = 1.0 / np.arange(1, n_wave + 1) ** 0.9
        self.popularity_after = np.concatenate(
            [
                reshuffled / reshuffled.sum() * (1 - SUDDEN_WAVE_EXPOSURE if n_wave else 1.0),
                wave / wave.sum() * SUDDEN_WAVE_EXPOSURE if n_wave else wave,
            ]
        )

        user_category = rng.integers(0, config.num_categories, n_users)
        self.user_taste = centroids[user_category] + rng.normal(0.0, 0.6, (n_users, k)) / np.sqrt(k)
        self.user_taste_target = rng.normal(0.0, 1.0, (n_users, k)) / np.sqrt(k)
        self.user_country = rng.choice(len(COUNTRIES), n_users, p=COUNTRY_MIX)
        self.activity_before = rng.pareto(1.5, n_users) + 0.1
        boosted = np.isin(self.user_country, [COUNTRIES.index(c) for c in COVARIATE_BOOSTED_COUNTRIES])
        self.activity_after = self.activity_before * np.where(boosted, COVARIATE_ACTIVITY_BOOST, 1.0)

        # Last clicked items per user, oldest first, -1 = empty slot.
        self.history = np.full((n_users, config.history_length), -1, dtype=np.int64)
        self._hour_counts = _hourly_counts(config.events_per_day)

    # --- the world at a point in time --------------------------------------------------------------------

    def drifted(self, day: int) -> bool:
        return self.config.drift != "none" and day >= self.config.drift_day

    def tastes(self, day: float) -> np.ndarray:
        """User taste vectors on (fractional) day ``day``: rotated under gradual drift."""
        if self.config.drift != "gradual" or day < self.config.drift_day:
            return self.user_taste
        angle = min((day - self.config.drift_day + 1) / GRADUAL_DAYS, 1.0) * np.pi / 2
        return np.cos(angle) * self.user_taste + np.sin(angle) * self.user_taste_target

    def click_probability(
        self, day: float, users: np.ndarray, items: np.ndarray, device: np.ndarray, position: np.ndarray
    ) -> np.ndarray:
        """The ground truth: P(click) for these impressions (``device`` as indices into DEVICES)."""
        taste = np.einsum("nk,nk->n", self.tastes(day)[users], self.item_vector[items])
        logit = (
            BASE_LOGIT
            + TASTE_SCALE * taste
            + self.item_quality[items]
            + np.asarray(DEVICE_EFFECT)[device]
            - 0.35 * np.log(position)
            - 0.25 * (np.log(self.item_price[items]) - self.mean_log_price)
        )
        return 1.0 / (1.0 + np.exp(-logit))

    # --- drawing events ------------------------------------------------------------------------------------

    def replay(self, days: int | None = None) -> World:
        """Draw (and drop) the events of the first ``days`` (default: all of them), so the world is in the state
        they leave it in, click histories included: what serving's simulated users meet next. Returns self."""
        for day in range(self.config.days if days is None else days):
            for hour in range(24):
                self.hour_events(day, hour)
        return self

    def hour_events(self, day: int, hour: int) -> pa.Table:
        """Draw the impressions of one simulated hour (and update users' histories with its clicks)."""
        cfg = self.config
        n = int(self._hour_counts[hour])
        rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, 1, day, hour]))
        drifted = self.drifted(day)
        hour_start = cfg.start + timedelta(days=day, hours=hour)

        offsets_us = np.sort(rng.integers(0, 3_600_000_000, n))
        activity = self.activity_after if drifted and cfg.drift == "covariate" else self.activity_before
        users = rng.choice(cfg.users, n, p=activity / activity.sum())
        popularity = self.popularity_after if drifted and cfg.drift == "sudden" else self.popularity_before
        items = rng.choice(len(popularity), n, p=popularity / popularity.sum())
        device_mix = DEVICE_MIX_AFTER_COVARIATE_DRIFT if drifted and cfg.drift == "covariate" else DEVICE_MIX
        device = rng.choice(len(DEVICES), n, p=device_mix)
        position = np.minimum(rng.geometric(0.18, n), MAX_POSITION)
        p_click = self.click_probability(day + hour / 24.0, users, items, device, position)
        label = (rng.random(n) < p_click).astype(np.int8)

        history = self._history_column(users)
        self._record_clicks(users[label == 1], items[label == 1])

        prefix = f"s{cfg.seed}-d{day:04d}h{hour:02d}-"
        event_id = pc.binary_join_element_wise(prefix, pc.cast(pa.array(np.arange(n)), pa.string()), "")
        price = pa.array(self.item_price[items], pa.float64())
        if drifted and cfg.drift == "broken_column":
            price = pa.nulls(n, pa.float64())
        base_us = int(hour_start.timestamp() * 1_000_000)
        return pa.table(
            {
                "event_id": event_id,
                "ts": pa.array(base_us + offsets_us, pa.timestamp("us", tz="UTC")),
                "user_id": pa.array(users, pa.int64()),
                "item_id": pa.array(items, pa.int64()),
                "label": pa.array(label, pa.int8()),
                "device": pa.DictionaryArray.from_arrays(pa.array(device, pa.int32()), list(DEVICES)).cast(
                    pa.string()
                ),
                "country": pa.DictionaryArray.from_arrays(
                    pa.array(self.user_country[users], pa.int32()), list(COUNTRIES)
                ).cast(pa.string()),
                "category": pa.array(self.item_category[items], pa.int64()),
                "price": price,
                "position": pa.array(position, pa.int64()),
                "history": history,
                "p_click": pa.array(p_click, pa.float64()),
            }
        )

    def _history_column(self, users: np.ndarray) -> pa.ListArray:
        rows = self.history[users]  # (n, K), -1 = empty
        valid = rows >= 0
        offsets = np.concatenate([[0], np.cumsum(valid.sum(axis=1))]).astype(np.int32)
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(rows[valid], pa.int64()))

    def _record_clicks(self, users: np.ndarray, items: np.ndarray) -> None:
        """Append clicks (in time order) to each user's history, keeping the last K."""
        if len(users) == 0:
            return
        k = self.config.history_length
        order = np.argsort(users, kind="stable")  # per user, still in time order
        users, items = users[order], items[order]
        unique, first, counts = np.unique(users, return_index=True, return_counts=True)
        kept = np.minimum(counts, k)
        rank = np.arange(len(users)) - np.repeat(first, counts)  # 0.. within each user
        skip = np.repeat(counts - kept, counts)  # older clicks that fall out
        keep = rank >= skip
        row = np.repeat(np.arange(len(unique)), counts)[keep]
        new = np.full((len(unique), k), -1, dtype=np.int64)
        new[row, (rank - skip)[keep]] = items[keep]
        # Last K of [old history, new clicks]: take columns kept..kept+K of the concatenation.
        combined = np.concatenate([self.history[unique], new], axis=1)
        self.history[unique] = combined[np.arange(len(unique))[:, None], kept[:, None] + np.arange(k)]

    # --- writing -------------------------------------------------------------------------------------------

    def write(
        self, out_dir: Path, on_hour: Callable[[int, int], None] | None = None
    ) -> SimulationSummary:
        """Write every simulated hour as ``OUT/YYYY-MM-DD/events-YYYY-MM-DDTHH.parquet``.

        Each file is written under a hidden temporary name and renamed into place, so a reader of the
        landing zone never sees half a file. ``on_hour(day, hour)`` is called after each file.
        """
        cfg = self.config
        out_dir = Path(out_dir)
        summary = SimulationSummary(out_dir=str(out_dir), days=cfg.days, drift=cfg.drift, drift_day=cfg.drift_day)
        for day in range(cfg.days):
            date = (cfg.start + timedelta(days=day)).strftime("%Y-%m-%d")
            folder = out_dir / date
            folder.mkdir(parents=True, exist_ok=True)
            for hour in range(24):
                table = self.hour_events(day, hour)
                path = folder / f"events-{date}T{hour:02d}.parquet"
                _write_parquet_atomically(table, path)
                summary.files += 1
                summary.events += table.num_rows
                summary.clicks += int(pc.sum(table["label"]).as_py() or 0)
                summary.paths.append(str(path))
                if on_hour:
                    on_hour(day, hour)
        summary.first_ts = cfg.start.isoformat()
        summary.last_ts = (cfg.start + timedelta(days=cfg.days)).isoformat()
        meta = {k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in asdict(cfg).items()}
        (out_dir / "_world.json").write_text(json.dumps(meta, indent=2) + "\n")
        return summary


def _hourly_counts(events_per_day: int) -> np.ndarray:
    """Split a day's events over 24 hours with a daily rhythm (busiest in the evening), summing exactly."""
    hours = np.arange(24)
    weight = 1.0 + 0.6 * np.sin(2 * np.pi * (hours - 14) / 24)
    share = weight / weight.sum() * events_per_day
    counts = np.floor(share).astype(np.int64)
    remainder = events_per_day - counts.sum()
    counts[np.argsort(-(share - counts), kind="stable")[:remainder]] += 1
    return counts


def _write_parquet_atomically(table: pa.Table, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def simulate(config: WorldConfig, out_dir: Path, on_hour: Callable[[int, int], None] | None = None) -> SimulationSummary:
    """Build the world for ``config`` and write all of its days to ``out_dir``."""
    return World(config).write(out_dir, on_hour=on_hour)
