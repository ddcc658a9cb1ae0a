"""Dynamic tables (issue 42): a 60-day churning world, bounded vs unbounded, and lookup+update throughput.

Part ``loop``: a compact churning world (users and items are born every day and leave after a few days;
ids are random 62-bit numbers; clicks follow latent tastes and item quality). Each day the model first
scores the day's events (never trained on: next-day, held-out AUC), then trains on them, hour by hour.
Three arms per seed on the same events, batches and order, the same model shape and seed:

- ``bounded`` (what ships: ``ModelConfig.max_rows``): the user and item tables as
  ``DynamicEmbeddingBagCollection`` under a row budget (admission, a hashed fallback range, eviction), fed
  the raw ids;
- ``unbounded``: the same dynamic tables with a budget the world never fills, and nothing else changed (the
  bounded arm's initial scale, sketch, fallback and category rows; an admitted id starts from the same row in
  both, a hash of the id). The two are equal, bit for bit, until the first eviction (checked): their
  difference is the budget's effect, which the issue bounds (within 0.005 of held-out AUC);
- ``append-only`` (recloop's vocabularies, the first baseline of this script): an id gets an index once seen
  ``min_count`` (2) times, unseen ids share the OOV row, tables grow 1.5x when full and never shrink.

It reports rows held per table per day, the AUC differences paired by seed (a t-interval over the seeds'
means; by seed-day beside it), and the bytes of the bounded run's hourly table checkpoints
(``recloop.checkpoint.write_tables``: a full one a day, deltas between) against a full checkpoint every hour.

Part ``throughput``: forward + backward with the fused row-wise Adagrad, static ``EmbeddingBagCollection``
vs ``DynamicEmbeddingBagCollection`` on the same batches in the same process (steady state: every id
admitted; churn: ids from a universe 4x the budget, admissions and evictions every batch), and the host
tier (a device cache of a quarter of the rows) vs the whole table; outputs are checked equal first.

    python benchmarks/dynamic_tables.py                       # both parts, small defaults (~6 min, shared 2 cores)
    python benchmarks/dynamic_tables.py --part loop --seeds 10 --model shipped   # the bound (~8 min)
    python benchmarks/dynamic_tables.py --part throughput --device cuda --rows 10000000 --dim 128 --batch 65536
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from common import machine, report, use_source_tree

use_source_tree()

from recloop import checkpoint  # noqa: E402
from recloop.evaluate import metrics  # noqa: E402
from recloop.model import ModelConfig, RankingModel  # noqa: E402
from recloop_kernels import (  # noqa: E402
    DynamicEmbeddingBagCollection,
    DynamicTableConfig,
    EmbeddingBagCollection,
    HostCachedEmbeddingBagCollection,
    TableConfig,
)
from recloop_kernels.dynamic import KEYED_INIT_SALT, keyed_initial_rows  # noqa: E402
from recloop_kernels.slot_map import mix64_int  # noqa: E402

CATEGORIES = 20
EMBEDDING_LR, DENSE_LR = 0.3, 1e-2  # of 0.1/3e-3 and 0.3/1e-2 on 12 days, the better for both runs (AUC 0.64 vs 0.61)


# --- the churning world ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChurnConfig:
    days: int = 60
    events_per_day: int = 4000
    new_users_per_day: int = 150
    user_days: float = 10.0  # mean lifetime (geometric)
    new_items_per_day: int = 80
    item_days: float = 6.0
    taste_dim: int = 6


class ChurnWorld:
    """Users and items born daily with random 62-bit ids, gone after a geometric lifetime; heavy-tailed
    activity and popularity; P(click) = sigmoid(1.5·⟨taste_u, taste_i⟩ + quality_i − 1.2), an item's taste
    near its category's."""

    def __init__(self, config: ChurnConfig, seed: int):
        self.config, self.rng = config, np.random.default_rng(seed)
        self.centers = self.rng.normal(0, 1, (CATEGORIES, config.taste_dim)) / math.sqrt(config.taste_dim)
        self.users: dict[str, np.ndarray] = {k: np.zeros(0) for k in ("id", "taste", "birth", "death", "activity")}
        self.items: dict[str, np.ndarray] = {k: np.zeros(0) for k in ("id", "taste", "birth", "death", "pop",
                                                                      "quality", "category")}

    def _born(self, group: dict, n: int, day: int, lifetime: float, extra: dict) -> None:
        fresh = {"id": self.rng.integers(0, 2**62, n, dtype=np.int64), "birth": np.full(n, day),
                 "death": day + 1 + self.rng.geometric(1 / lifetime, n), **extra}
        for key, value in fresh.items():
            group[key] = np.concatenate([group[key], value]) if group[key].size else value

    def day(self, day: int) -> dict[str, np.ndarray]:
        c, rng = self.config, self.rng
        self._born(self.users, c.new_users_per_day * (3 if day == 0 else 1), day, c.user_days,
                   {"taste": rng.normal(0, 1, (c.new_users_per_day * (3 if day == 0 else 1), c.taste_dim))
                    / math.sqrt(c.taste_dim), "activity": rng.lognormal(0, 1.2, c.new_users_per_day * (3 if day == 0
                                                                                                      else 1))})
        n_items = c.new_items_per_day * (3 if day == 0 else 1)
        category = rng.integers(0, CATEGORIES, n_items)
        self._born(self.items, n_items, day, c.item_days,
                   {"taste": self.centers[category] + rng.normal(0, 0.5, (n_items, c.taste_dim)) / math.sqrt(c.taste_dim),
                    "pop": rng.lognormal(0, 1.5, n_items), "quality": rng.normal(0, 0.7, n_items),
                    "category": category})
        users = np.flatnonzero((self.users["birth"] <= day) & (self.users["death"] > day))
        items = np.flatnonzero((self.items["birth"] <= day) & (self.items["death"] > day))
        u = rng.choice(users, c.events_per_day, p=self.users["activity"][users] / self.users["activity"][users].sum())
        freshness = np.exp(-(day - self.items["birth"][items]) / 3.0)
        weight = self.items["pop"][items] * freshness
        i = rng.choice(items, c.events_per_day, p=weight / weight.sum())
        logit = 1.5 * (self.users["taste"][u] * self.items["taste"][i]).sum(1) * math.sqrt(c.taste_dim) \
            + self.items["quality"][i] - 1.2
        label = (rng.random(c.events_per_day) < 1 / (1 + np.exp(-logit))).astype(np.float32)
        hour = np.sort(rng.integers(0, 24, c.events_per_day))
        return {"user": self.users["id"][u], "item": self.items["id"][i], "category": self.items["category"][i],
                "label": label, "hour": hour, "p_click": 1 / (1 + np.exp(-logit))}


# --- the two runs ------------------------------------------------------------------------------------------


class AppendOnlyVocabulary:
    """recloop's vocabulary rule: an id gets the next index once seen ``min_count`` times; 1 is OOV."""

    def __init__(self, min_count: int = 2):
        self.min_count, self.index, self.counts = min_count, {}, {}

    def update(self, ids: np.ndarray) -> dict[int, int]:
        """Count ``ids``; returns the ids admitted now, with their indices."""
        admitted = {}
        for key, n in zip(*np.unique(ids, return_counts=True), strict=True):
            key = int(key)
            self.counts[key] = self.counts.get(key, 0) + int(n)
            if key not in self.index and self.counts[key] >= self.min_count:
                self.index[key] = admitted[key] = 2 + len(self.index)
        return admitted

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        return np.array([self.index.get(int(k), 1) for k in ids], dtype=np.int64)

    @property
    def size(self) -> int:
        return 2 + len(self.index)


ARMS = ("bounded", "unbounded", "append-only")


class Run:
    """One model over the world, one arm (module docstring): ``bounded`` (what ships: ``ModelConfig.max_rows``),
    ``unbounded`` (the same dynamic tables with a budget the world never fills, built to differ from the
    bounded arm ``like`` in nothing else) or ``append-only`` (vocabularies)."""

    def __init__(self, arm: str, model: ModelConfig, budgets: dict[str, int], seed: int, never_full: dict[str, int],
                 dense_lr: float, like: Run | None = None, keyed_init: bool = True):
        self.arm, self.bounded = arm, arm != "append-only"
        self.vocab = {name: AppendOnlyVocabulary() for name in ("user", "item")}
        fallback_rows = model.fallback_rows
        config = replace(model, max_rows=tuple(budgets.items())) if self.bounded else model
        # The append-only tables start with the bounded run's rows (fallback + budget): the same initial scale
        # of their rows (uniform ±1/sqrt(rows)) and the same memory on day one; they then grow.
        start = [(name, fallback_rows + budgets[name]) for name in ("user", "item")]
        self.model = RankingModel(config, 1, [*start, ("category", CATEGORIES)], seed=seed)
        self.seed, self.keyed_init = seed, keyed_init
        # an admitted id's initial row, as the dynamic tables draw it: a hash of (seed, table, id), at the scale
        # of the bounded tables (uniform ±1/sqrt(fallback + budget))
        self.init_tables = [TableConfig(name, rows, model.embedding_dim) for name, rows in start]
        if arm == "unbounded":
            self.model.sparse_arch.embeddings = _never_evicting(like.model, never_full, seed)
            for name, value in like.model.state_dict().items():  # the same dense init (the same seed) ...
                if not name.startswith("sparse_arch.") and not torch.equal(value, self.model.state_dict()[name]):
                    raise SystemExit(f"the unbounded arm's {name} differs from the bounded arm's at the start")
        self.optimizer = torch.optim.Adam(self.model.dense_parameters(), lr=dense_lr)

    def batch(self, events: dict, rows: slice) -> tuple[torch.Tensor, ...]:
        user, item = events["user"][rows], events["item"][rows]
        if not self.bounded:
            user, item = self.vocab["user"].lookup(user), self.vocab["item"].lookup(item)
        values = torch.from_numpy(np.concatenate([user, item, events["category"][rows]]).astype(np.int64))
        n = len(user)
        return (torch.ones(n, 1), values, torch.arange(3 * n + 1), torch.from_numpy(events["label"][rows]))

    def score(self, events: dict) -> np.ndarray:
        self.model.eval()
        with torch.no_grad():
            dense, values, offsets, _ = self.batch(events, slice(None))
            out = torch.sigmoid(self.model(dense, values, offsets)).numpy()
        self.model.train()
        return out

    def train_hour(self, events: dict, rows: np.ndarray, batch_size: int = 256) -> None:
        if not self.bounded:  # the feature job's vocabulary update before the window trains
            for t, name in enumerate(("user", "item")):
                admitted = self.vocab[name].update(events[name][rows])
                if self.vocab[name].size > self.model.embeddings.layout.rows[t]:
                    self.model.embeddings.grow(name, self.vocab[name].size)
                if self.keyed_init and admitted:  # the same start as the dynamic tables give the same id
                    keys = torch.tensor(list(admitted), dtype=torch.int64)
                    initial = keyed_initial_rows(self.init_tables[t], keys, mix64_int(self.seed, KEYED_INIT_SALT + t))
                    with torch.no_grad():
                        self.model.embeddings.weight(name)[torch.tensor(list(admitted.values()))] = initial
        for start in range(rows[0], rows[-1] + 1, batch_size):
            dense, values, offsets, label = self.batch(events, slice(start, min(start + batch_size, rows[-1] + 1)))
            loss = torch.nn.functional.binary_cross_entropy_with_logits(self.model(dense, values, offsets), label)
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()

    def rows_held(self) -> dict[str, int]:
        if self.bounded:
            return self.model.embeddings.rows_held()
        return {name: self.vocab[name].size for name in ("user", "item")}

    def table_bytes(self) -> int:
        """Bytes the embeddings hold on the device, as allocated: rows, optimizer state and, bounded, the map,
        slot scores and sketch (the append-only run's host vocabularies are not counted)."""
        return sum(t.numel() * t.element_size() for t in self.model.embeddings.state_dict().values())


def _never_evicting(bounded: RankingModel, never_full: dict[str, int], seed: int) -> DynamicEmbeddingBagCollection:
    """The bounded model's tables with budgets the world never fills, and nothing else changed: the same
    initial scale of admitted rows (the default follows fallback + budget: fixed here to the bounded one's),
    the same sketch (its width defaults to the total budget), the same fallback and category rows (drawn
    after the budgeted tables, so elsewhere in the generator's stream). Admitted rows start alike in both:
    a hash of the id (``DynamicEmbeddingBagCollection._reset_rows``)."""
    old = bounded.embeddings
    tables = [replace(t, init_scale=t.init_scale if t.init_scale is not None else t.num_embeddings ** -0.5)
              for t in old.tables]
    dynamic = {name: replace(config, max_rows=never_full[name]) for name, config in old.dynamic.items()}
    inner = old.inner
    new = DynamicEmbeddingBagCollection(tables, dynamic, sketch_depth=old.sketch.depth, sketch_width=old.sketch.width,
                                        count_half_life=old.count_half_life, optimizer=inner.optimizer.name,
                                        lr=inner.optimizer.lr, seed=seed, backend=inner.backend)
    with torch.no_grad():
        for t in old.tables:
            shared = old.dynamic[t.name].fallback_rows if t.name in old.dynamic else t.num_embeddings
            new.weight(t.name)[:shared] = old.weight(t.name)[:shared]
    return new


def loop_part(args) -> dict:
    """Every arm over the same worlds (module docstring); AUC differences paired by seed (and seed-day)."""
    config = ChurnConfig(days=args.days, events_per_day=args.events_per_day)
    budgets = {"user": args.user_budget, "item": args.item_budget}
    never_full = {"user": config.new_users_per_day * (config.days + 2),  # every id the world makes
                  "item": config.new_items_per_day * (config.days + 2)}
    model = model_config(args)
    arms = [arm for arm in ARMS[1:] if arm in args.arms.split(",")]  # the bounded arm always runs
    per_seed, rows_by_day, traces = [], [], []
    checkpoint_bytes: dict[str, list[int]] = {"delta": [], "full": [], "full_hourly": []}
    for seed in range(args.seeds):
        world = ChurnWorld(config, seed)
        runs: dict[str, Run] = {"bounded": Run("bounded", model, budgets, seed, never_full, args.dense_lr)}
        for arm in arms:
            runs[arm] = Run(arm, model, budgets, seed, never_full, args.dense_lr, like=runs["bounded"],
                            keyed_init=args.append_only_init == "keyed")
        aucs: dict[str, list[float]] = {name: [] for name in runs}
        oracle: list[float] = []
        first_eviction_day = None
        with tempfile.TemporaryDirectory() as log_dir:
            for day in range(config.days):
                events = world.day(day)
                if day >= args.warmup_days:
                    for name, run in runs.items():
                        aucs[name].append(metrics(events["label"], run.score(events))["auc"])
                    oracle.append(metrics(events["label"], events["p_click"])["auc"])
                    if first_eviction_day is None and "unbounded" in runs and aucs["bounded"][-1] != aucs["unbounded"][-1]:
                        raise SystemExit(f"seed {seed} day {day + 1}: the bounded and unbounded arms differ before the "
                                         "budget evicted anything: they do not differ by the budget alone")
                for hour in range(24):
                    rows = np.flatnonzero(events["hour"] == hour)
                    if not len(rows):
                        continue
                    for run in runs.values():
                        run.train_hour(events, rows)
                    if seed == 0 and args.checkpoints:  # the bounded run's hourly table checkpoint: full daily
                        entry = checkpoint.write_tables(Path(log_dir), runs["bounded"].model.embeddings, full_every=24)
                        checkpoint_bytes[entry["kind"]].append(entry["bytes"])
                        if hour == 23:
                            checkpoint_bytes["full_hourly"].append(entry["bytes"] if entry["kind"] == "full" else
                                                                   _full_bytes(runs["bounded"]))
                if first_eviction_day is None and runs["bounded"].model.embeddings.evicted:
                    first_eviction_day = day + 1
                if seed == 0:
                    rows_by_day.append({"day": day + 1, **{f"{name} {table}": held for name, run in runs.items()
                                                            for table, held in run.rows_held().items()},
                                        **{f"{name} MB": round(run.table_bytes() / 1e6, 2) for name, run in
                                           runs.items()}})
                print(f"seed {seed} day {day + 1}: " + ", ".join(
                    f"{n} AUC {aucs[n][-1]:.4f}" for n in runs if aucs[n]) + f"; rows {rows_by_day[-1] if seed == 0 else ''}",
                    flush=True)
        per_seed.append({"seed": seed, **{f"{name} AUC": statistics.mean(aucs[name]) for name in runs},
                         **{f"{name} − {base}": statistics.mean(np.subtract(aucs[name], aucs[base]).tolist())
                            for name, base in _pairs(runs)},
                         "oracle AUC": statistics.mean(oracle), "first eviction day": first_eviction_day,
                         "evicted": runs["bounded"].model.embeddings.evicted,
                         "failed_inserts": runs["bounded"].model.embeddings.failed_inserts})
        traces.append({"seed": seed, "oracle": oracle, **aucs})
    differences = {}
    for name, base in _pairs(runs):
        by_seed = [s[f"{name} − {base}"] for s in per_seed]
        by_seed_day = [b - a for t in traces for a, b in zip(t[base], t[name], strict=True)]
        differences[f"{name} − {base}"] = {"by seed": _interval(by_seed), "by seed-day": _interval(by_seed_day)}
    result = {"config": {**config.__dict__, "budgets": budgets, "never_full": never_full, "model": model.to_dict(),
                         "dense_lr": args.dense_lr, "seeds": args.seeds,
                         "warmup_days": args.warmup_days, "arms": list(runs),
                         "append_only_init": args.append_only_init},
              "per_seed": per_seed, "differences": differences, "rows_by_day": rows_by_day, "auc_by_day": traces}
    if checkpoint_bytes["delta"]:
        result["checkpoint_bytes"] = {"delta_mean": statistics.mean(checkpoint_bytes["delta"]),
                                      "full_mean": statistics.mean(checkpoint_bytes["full"]),
                                      "hourly_full_mean": statistics.mean(checkpoint_bytes["full_hourly"]),
                                      "deltas": len(checkpoint_bytes["delta"]), "fulls": len(checkpoint_bytes["full"])}
    return result


def _pairs(runs: dict) -> list[tuple[str, str]]:
    """(arm, baseline) pairs reported: the budget's effect first (bounded − unbounded)."""
    wanted = [("bounded", "unbounded"), ("bounded", "append-only"), ("unbounded", "append-only")]
    return [(a, b) for a, b in wanted if a in runs and b in runs]


def model_config(args) -> ModelConfig:
    """``shipped``: ``ModelConfig()``'s defaults (what the trainer runs without a configuration), on the CPU
    reference backend; ``small``: dim 8 and small MLPs (the first runs of this benchmark). Flags override."""
    base = ModelConfig(embedding_backend="reference") if args.model == "shipped" else ModelConfig(
        embedding_dim=8, bottom_mlp=(8,), top_mlp=(32, 16), embedding_lr=EMBEDDING_LR, fallback_rows=64,
        embedding_backend="reference")
    changes = {key: value for key, value in (("embedding_lr", args.embedding_lr), ("fallback_rows", args.fallback_rows),
                                             ("admit_after", args.admit_after), ("eviction", args.eviction),
                                             ("sketch_width", args.sketch_width))
               if value is not None}
    return replace(base, **changes)


def _full_bytes(run: Run) -> int:
    from safetensors.torch import save

    return len(save({k: v.contiguous() for k, v in run.model.embeddings.state_dict().items()}))


def _interval(values: list[float]) -> dict:
    """Mean and its 95 % t-interval (Student's t with n - 1 degrees of freedom: the seeds are the independent
    units; with 10 of them the normal approximation's 1.96 would be 13 % too narrow)."""
    from scipy import stats

    mean = statistics.mean(values)
    if len(values) < 2:
        return {"mean": mean, "low": float("nan"), "high": float("nan"), "n": len(values)}
    half = stats.t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": len(values), "sd": statistics.stdev(values)}


# --- throughput ----------------------------------------------------------------------------------------------


def zipf_ids(n: int, universe: int, g: torch.Generator, device) -> torch.Tensor:
    """Heavy-tailed ids: rank k with P ∝ 1/k (log-uniform ranks), scrambled over the universe."""
    ranks = torch.floor(torch.exp(torch.rand(n, generator=g) * math.log(universe))).long() - 1
    return ((ranks * 2654435761) % universe).to(device)


def throughput_part(args) -> list[dict]:
    """The four cases on their batches, timed round-robin (one step of each in turn, so that a machine's
    changing load falls on all of them alike); the median step of each."""
    device = torch.device(args.device)
    tables = [TableConfig(f"t{i}", args.rows, args.dim) for i in range(args.tables)]
    g = torch.Generator().manual_seed(0)
    kwargs = dict(optimizer="rowwise_adagrad", lr=0.05, device=device)

    def batches(universe: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(torch.cat([zipf_ids(args.batch, universe, g, device) for _ in tables]),
                 torch.arange(args.tables * args.batch + 1, device=device)) for _ in range(count)]

    head = torch.randn(args.batch, args.dim * args.tables, device=device)
    steady = batches(args.rows, args.repeats + 2)
    static = EmbeddingBagCollection(tables, **kwargs)
    budgets = {t.name: DynamicTableConfig(max_rows=args.rows, admit_after=1, fallback_rows=64) for t in tables}
    dynamic = DynamicEmbeddingBagCollection(tables, budgets, **kwargs)
    for values, offsets in steady:  # admit every id the timed batches use: a steady-state table
        dynamic.rows_for(values, offsets)
    _check_dynamic_equals_static(static, dynamic, steady[-1])
    churning = DynamicEmbeddingBagCollection(tables, {n: DynamicTableConfig(max_rows=args.rows // 4, admit_after=1,
                                                                            fallback_rows=64) for n in budgets}, **kwargs)
    fill(churning, args)  # full before the timing: each batch's new ids evict
    churning.evicted = 0
    cached = HostCachedEmbeddingBagCollection(tables, cache_rows=args.rows // 4, **kwargs)
    whole = EmbeddingBagCollection(tables, **kwargs)
    with torch.no_grad():  # the store's rows were drawn on the host, the whole table's where it lives
        whole.weights.copy_(cached.store.weights)
    values, offsets = steady[0]
    if not torch.allclose(cached(values, offsets), whole(values, offsets), rtol=1e-6, atol=1e-7):
        raise SystemExit("the host tier's output differs from the whole table's: no time reported")
    fill(cached, args)  # a full cache: misses evict (and write back)
    cases = {"static EmbeddingBagCollection": (static, steady),
             "dynamic, steady state (all admitted)": (dynamic, steady),
             "dynamic, churn (budget 1/4 of the ids)": (churning, batches(args.rows, args.repeats + 2)),
             "host tier, cache 1/4 of the rows (prefetching)": (cached, steady)}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for i in range(args.repeats + 2):
        for name, (module, data) in cases.items():
            if i == 2 and module is cached:
                cached.hits = cached.lookups = cached.rows_written_back = 0  # counted over the timed steps only
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = module(*data[i])
            if module is cached and i + 1 < len(data):
                cached.prefetch(*data[i + 1])  # the next batch's rows move while this one trains
            (out * head).sum().backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= 2:  # two warm-up steps (compilation, allocator)
                times[name].append(time.perf_counter() - start)
    base = statistics.median(times["static EmbeddingBagCollection"])
    rows = []
    for name, (module, _) in cases.items():
        seconds = statistics.median(times[name])
        rows.append({"case": name, "ms/batch": round(seconds * 1e3, 2), "vs static": round(base / seconds, 3),
                     "evicted": module.evicted if module in (dynamic, churning) else
                     cached.rows_written_back if module is cached else "",
                     "hit rate": round(cached.hit_rate, 3) if module is cached else "",
                     "lookups/s": f"{args.batch * args.tables / seconds:,.0f}"})
    return rows


def fill(module, args) -> None:
    """Every row of a quarter of the ids, in batches of distinct ids: a full budget (or cache) before timing."""
    with torch.no_grad():
        for start in range(0, args.rows // 4, args.batch):
            ids = torch.arange(start, min(start + args.batch, args.rows // 4)) * 4 + 3  # outside the Zipf head
            values = torch.cat([ids] * args.tables).to(args.device)
            module(values, torch.arange(values.numel() + 1, device=args.device))


def _check_dynamic_equals_static(static, dynamic, batch) -> None:
    """Give each admitted id's slot the static row of that id, then both must pool the same (rule 1)."""
    values, offsets = batch
    with torch.no_grad():
        for table in static.tables:
            d = list(dynamic.dynamic).index(table.name)
            lo = dynamic._slot_offsets[d]
            keys = dynamic.slot_keys[lo:lo + dynamic.dynamic[table.name].max_rows]
            slots = (keys >= 0).nonzero().squeeze(1)
            fallback = dynamic.dynamic[table.name].fallback_rows
            dynamic.weight(table.name)[fallback + slots] = static.weight(table.name)[keys[slots]]
        dynamic.eval()
        ok = torch.equal(dynamic(values, offsets), static(values, offsets))
        dynamic.train()
    if not ok:
        raise SystemExit("the dynamic table's output differs from the static table's: no time reported")


def ops_part(args) -> list[dict]:
    """The tensor operations one steady-state training lookup (``rows_for``, every id admitted) dispatches,
    by kind: on a GPU each is a kernel launch of a few microseconds at these sizes, the fixed cost a batch
    pays over a static table (H200, 2026-11-28: ~4 ms a batch). Counted with a dispatch mode, on any device."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args_=(), kwargs=None):
            self.ops[str(func.overloadpacket.__name__)] = self.ops.get(str(func.overloadpacket.__name__), 0) + 1
            return func(*args_, **(kwargs or {}))

    device = torch.device(args.device)
    tables = [TableConfig(f"t{i}", args.rows, args.dim) for i in range(args.tables)]
    budgets = {t.name: DynamicTableConfig(max_rows=args.rows, admit_after=1, fallback_rows=64) for t in tables}
    dynamic = DynamicEmbeddingBagCollection(tables, budgets, optimizer="rowwise_adagrad", lr=0.05, device=device)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.cat([zipf_ids(args.batch, args.rows, g, device) for _ in tables]),
                torch.arange(args.tables * args.batch + 1, device=device)) for _ in range(3)]
    for values, offsets in batches:  # admit every id: the steady state
        dynamic.rows_for(values, offsets)
    with Count() as counted:
        dynamic.rows_for(*batches[0])
    rows = [{"operation": name, "calls": n} for name, n in sorted(counted.ops.items(), key=lambda kv: -kv[1])]
    return [{"operation": "all", "calls": sum(counted.ops.values())}, *rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("all", "loop", "throughput", "ops"), default="all")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--days", type=int, default=60)
    parser.add_argument("--events-per-day", type=int, default=3000)
    parser.add_argument("--warmup-days", type=int, default=3)
    parser.add_argument("--user-budget", type=int, default=3000)
    parser.add_argument("--item-budget", type=int, default=600)
    parser.add_argument("--arms", default=",".join(ARMS), help="of " + ", ".join(ARMS) + " (bounded always runs)")
    parser.add_argument("--model", choices=("shipped", "small"), default="small")
    parser.add_argument("--fallback-rows", type=int, default=None, help="default: the model's")
    parser.add_argument("--admit-after", type=int, default=None, help="default: the model's")
    parser.add_argument("--eviction", choices=("lru", "lfu"), default=None, help="default: the model's")
    parser.add_argument("--embedding-lr", type=float, default=None, help="default: the model's")
    parser.add_argument("--sketch-width", type=int, default=None, help="default: the model's (from the budget)")
    parser.add_argument("--dense-lr", type=float, default=DENSE_LR)
    parser.add_argument("--append-only-init", choices=("keyed", "table"), default="table",
                        help="an id the vocabulary admits starts from: keyed, the row the dynamic tables give it "
                             "(a hash of seed, table and id); table, its index's row as the table drew it")
    parser.add_argument("--checkpoints", action=argparse.BooleanOptionalAction, default=True,
                        help="seed 0: write the bounded tables' hourly checkpoints and report their bytes")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--tables", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads (1: on a shared 2-core box, OpenMP threads spin against each other)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    info = machine()
    result: dict = {"machine": info}
    if args.part in ("all", "loop"):
        result["loop"] = loop_part(args)
    if args.part in ("all", "throughput"):
        result["throughput"] = throughput_part(args)
    if args.part == "ops":
        result["ops"] = ops_part(args)
    if args.json:
        import json

        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if "loop" in result:
        loop = result["loop"]
        days = [r for r in loop["rows_by_day"] if r["day"] in (1, 10, 20, 30, 40, 50, 60) or r is loop["rows_by_day"][-1]]
        report("rows held per table (seed 0): append-only vs bounded", days, info, None)
        for pair, interval in loop["differences"].items():
            d, pooled = interval["by seed"], interval["by seed-day"]
            print(f"held-out AUC, {pair}: {d['mean']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}] (95 % t-interval over "
                  f"seed means, n={d['n']}; by seed-day {pooled['mean']:+.4f} [{pooled['low']:+.4f}, "
                  f"{pooled['high']:+.4f}], n={pooled['n']}, days of a seed not independent)")
        for row in loop["per_seed"]:
            print(f"seed {row['seed']}: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                                    for k, v in row.items() if k != "seed"))
        if "checkpoint_bytes" in loop:
            b = loop["checkpoint_bytes"]
            print(f"hourly table checkpoints (bounded, seed 0): delta {b['delta_mean'] / 1e3:,.1f} kB, "
                  f"full {b['full_mean'] / 1e3:,.1f} kB ({b['deltas']} deltas, {b['fulls']} fulls)")
    if "ops" in result:
        report("tensor operations in one steady-state training lookup of the dynamic table (rows_for)",
               result["ops"][:16], info, None)
    if "throughput" in result:
        report(f"lookup + update (forward, backward, row-wise Adagrad) on {args.device}, {args.tables} tables × "
               f"{args.rows:,} rows × dim {args.dim}, batch {args.batch}, Zipf ids", result["throughput"], info, None)


if __name__ == "__main__":
    main()
