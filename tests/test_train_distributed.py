"""Training under torchrun: 2 real gloo processes with sharded tables and DDP train the same model as one
process on the same data shards; no rank holds every table (each allocates its shards only, and writes
only them, the last checkpoint too); the process that launched them puts the whole model together, and
its checkpoint warm-starts a single-process run, as a single-process champion warm-starts 2 ranks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient
from safetensors import safe_open
from safetensors.torch import load_file

from recloop import checkpoint, registry
from recloop.data.loader import Batch
from recloop.distributed import concat_batches, shard_row_groups
from recloop.model import ModelConfig, RankingModel
from recloop.model.sharded import _state_views, plan_sharding
from recloop.settings import Settings
from recloop.simulate import WorldConfig
from recloop.tracking import TrainingRun
from recloop.train import TrainConfig, TrainSummary, complete, train

CHECKOUT = Path(__file__).resolve().parents[1]
ROW_WISE_ABOVE = 200  # the user table (~260 rows) and the crosses go row-wise, the small ones table-wise
CONFIG = TrainConfig(days=2, epochs=1, batch_size=256, validation_hours=8, device="cpu", deterministic=True,
                     checkpoint_every=7, data_shards=2, row_wise_above=ROW_WISE_ABOVE,
                     model=ModelConfig(embedding_dim=8, bottom_mlp=(16,), top_mlp=(32,)))
# Two processes sum their gradients in another order than one: fp32 rounding, ~1e-7 after 19 steps here.
WEIGHT_TOLERANCE = 1e-5
TABLES = "sparse_arch.embeddings."

RANK_SCRIPT = """
import json, os, sys
from pathlib import Path
from recloop.tracking import TrainingRun
from recloop.settings import Settings
from recloop.train import TrainConfig, train
from recloop.model import ModelConfig
raw = json.loads(sys.argv[2])
config = TrainConfig(**{**raw, "model": ModelConfig.from_dict(raw["model"])})
settings = Settings(home=sys.argv[1], frame_backend="pandas")
summary = train(settings, config, tracker=TrainingRun(settings))  # every rank has one; rank 0 alone tells it
Path(sys.argv[3], f"rank-{os.environ['RANK']}.json").write_text(json.dumps({  # a file each: no interleaved lines
    "rank": int(os.environ["RANK"]), "world": int(os.environ["WORLD_SIZE"]), "summary": summary.to_dict()}))
"""


@pytest.fixture(scope="module")
def lake(tmp_path_factory, lake_factory) -> Settings:
    return lake_factory(tmp_path_factory.mktemp("dist-lake"), WorldConfig(seed=8, days=2, events_per_day=3000))


def _copy(lake: Settings, target: Path) -> Settings:
    shutil.copytree(lake.home, target)
    return Settings(home=target, frame_backend="pandas")


@pytest.fixture(scope="module")
def two_ranks(lake: Settings, tmp_path_factory) -> tuple[Path, list[dict]]:
    """One 2-rank run of ``CONFIG`` on a copy of the lake, completed here as ``recloop train --nproc`` does once
    its ranks are done, and what its ranks reported (plus ``"completed"``: the completed run's summary): the run
    the single process is compared with and the run resumed from its sharded checkpoint (launched once for
    both: each test changes the run's folder in a copy of its own, ``_own_copy``)."""
    root = tmp_path_factory.mktemp("two-ranks")
    home = _copy(lake, root / "home").home
    ranks = _torchrun(home, CONFIG, root)
    run_dir = Path(ranks[0]["summary"]["checkpoint"]).parent
    shutil.copytree(run_dir, root / "periodic", ignore=lambda folder, names: [  # (completing it keeps the last two)
        n for n in names if folder == str(run_dir) and n != sorted(n for n in names if n.startswith("step-"))[-2]])
    settings = Settings(home=home, frame_backend="pandas")
    completed = complete(settings, ranks[0]["summary"]["checkpoint"], tracker=TrainingRun(settings))
    return home, [{**r, "completed": completed.to_dict() | {"train_hours": completed.train_hours}} for r in ranks]


def _periodic(two_ranks: tuple[Path, list[dict]], run_dir: Path) -> Path:
    """The 2-rank run's last periodic checkpoint (the one before its last), put back into ``run_dir``."""
    saved = next((two_ranks[0].parent / "periodic").glob("step-*"))
    shutil.copytree(saved, run_dir / saved.name)
    return run_dir / saved.name


def _own_copy(two_ranks: tuple[Path, list[dict]], target: Path) -> list[dict]:
    """The 2-rank run's home copied to ``target``; its ranks' reports with their paths moved there."""
    home, ranks = two_ranks
    shutil.copytree(home, target)
    return json.loads(json.dumps(ranks).replace(str(home), str(target)))


def _torchrun(home: Path, config: TrainConfig, tmp_path: Path) -> list[dict]:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(CHECKOUT / p) for p in ("platform", "kernels", "")),
           "OMP_NUM_THREADS": "1"}
    out = tmp_path / "ranks"
    out.mkdir()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script), str(home), json.dumps(config.to_dict()), str(out)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(path.read_text()) for path in sorted(out.glob("rank-*.json"))]


def _rows_in_shard_files(folder: Path) -> dict[str, torch.Tensor]:
    """The ranks' rows of every table and buffer, put in place from their shard files by hand (safetensors
    slices at the offsets DCP records; not DCP's reader): what gathering the ranks' tables would give."""
    chunks: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            offsets = json.loads(f.metadata()["DCP_SHARDING_INFO"])
            for key in f.keys():  # noqa: SIM118 - a safetensors handle is not a mapping
                chunks.setdefault(key, []).append((offsets[key]["saved_offsets"][0], f.get_tensor(key)))
    whole = {}
    for key, pieces in chunks.items():
        if key == "tables.step":
            whole[key] = pieces[0][1]
            continue
        pieces.sort(key=lambda piece: piece[0])
        assert [first for first, _ in pieces] == [0, *[f + t.shape[0] for f, t in pieces][:-1]], key  # no gap
        whole[key] = torch.cat([t for _, t in pieces])
    return whole


def test_two_ranks_train_the_same_model_as_one_process(lake: Settings, two_ranks, tmp_path: Path):
    single = train(_copy(lake, tmp_path / "one"), CONFIG)
    ranks = _own_copy(two_ranks, tmp_path / "two")
    assert sorted((r["rank"], r["world"]) for r in ranks) == [(0, 2), (1, 2)]
    # The ranks trained, wrote their last checkpoint and stopped: validated by neither of them
    assert all(r["summary"]["awaits_completion"] and r["summary"]["auc"] != r["summary"]["auc"] for r in ranks)
    assert all(r["summary"]["checkpoint"] == ranks[0]["summary"]["checkpoint"] for r in ranks)
    double = TrainSummary(**{**ranks[0]["completed"], "train_hours": single.train_hours})
    assert not double.awaits_completion and double.run_id == ranks[0]["summary"]["run_id"]
    assert double.steps == single.steps > 10 and double.samples == single.samples
    assert double.auc == pytest.approx(single.auc, abs=1e-6)
    assert double.logloss == pytest.approx(single.logloss, abs=1e-6)

    one, two = (load_file(Path(s) / "model.safetensors") for s in (single.checkpoint, double.checkpoint))
    assert one.keys() == two.keys()  # the single-process layout: serving, gate and warm start cannot tell
    for name, tensor in one.items():
        assert two[name].shape == tensor.shape and two[name].dtype == tensor.dtype, name
        torch.testing.assert_close(two[name], tensor, atol=WEIGHT_TOLERANCE, rtol=0, msg=name)
    initial = RankingModel(CONFIG.model, len(checkpoint.read(single.checkpoint)["dense"]),
                           [tuple(t) for t in checkpoint.read(single.checkpoint)["tables"]], seed=CONFIG.seed)
    moved = (initial.embeddings.weights - two["sparse_arch.embeddings.weights"][:initial.embeddings.weights.numel()])
    assert moved.abs().max() > 100 * WEIGHT_TOLERANCE  # the tables did train: the agreement is not trivial
    plan = plan_sharding(checkpoint.load_model(double.checkpoint)[0].embeddings, 2, ROW_WISE_ABOVE)
    assert {s.row_wise for shards in plan.ranks for s in shards} == {True, False}

    # No rank held every table: each allocated its plan's rows and optimizer state, and only those (the whole
    # tables are what one process's model holds; their bytes split over the ranks, each holding less).
    last = Path(ranks[0]["summary"]["checkpoint"])
    held = checkpoint.read(last)["sharding"]
    whole = sum(v.numel() * v.element_size() for k, v in one.items() if k[len(TABLES):] in ("weights", "state1"))
    assert held["world"] == 2 and held["whole_bytes"] == whole
    assert sum(held["rank_bytes"]) == whole and all(0 < b < whole for b in held["rank_bytes"])
    # ... and each wrote its own rows of the last checkpoint, which keeps no table whole; the whole model was
    # put together from them by the process that completed the run: the ranks' rows, bit for bit.
    assert sorted(p.name for p in (last / checkpoint.TABLES).iterdir()) == [
        "shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"]
    assert {p.suffix for p in last.rglob("*") if p.is_file()} == {".safetensors", ".json"}
    assert not {k for k in load_file(last / "model.safetensors") if k[len(TABLES):] in checkpoint.TABLE_BUFFERS}
    assert not (Path(double.checkpoint) / checkpoint.TABLES).exists()  # the completed one is whole (it serves)
    assert Path(double.checkpoint).parent == last.parent and checkpoint.read(double.checkpoint)["completed"]
    shards = _rows_in_shard_files(last / checkpoint.TABLES)
    assembled = checkpoint.load_model(double.checkpoint)[0].embeddings
    for t, name in enumerate(c.name for c in assembled.tables):
        rows = assembled.layout.rows[t]
        for buffer, view in zip(("weight", "state1"), _state_views(assembled, t), strict=True):
            assert torch.equal(view[:rows], shards[f"tables.{name}.{buffer}"]), (name, buffer)
    assert int(assembled.step) == int(shards["tables.step"])

    registry.configure(Settings(home=tmp_path / "two"))  # one MLflow run: rank 0's while it trained, completed after
    client = MlflowClient()
    runs = client.search_runs([client.get_experiment_by_name(registry.EXPERIMENT).experiment_id])
    assert [r.data.tags["recloop.run_id"] for r in runs] == [double.run_id] and runs[0].info.status == "FINISHED"
    losses = client.get_metric_history(runs[0].info.run_id, "train_loss")
    assert [[m.step, m.value] for m in losses] == double.loss_curve and runs[0].data.metrics["auc"] == double.auc

    # The 2-rank checkpoint warm-starts one process (six newer hours: the first run held out eight).
    warm = train(_copy(lake, tmp_path / "warm"),
                 TrainConfig(mode="incremental", validation_hours=2, validation_rows=0, batch_size=256, device="cpu",
                             model=CONFIG.model),
                 warm_start=Path(double.checkpoint))
    assert warm.warm_start == double.checkpoint and warm.steps > 0 and 0.5 < warm.auc <= 1.0

    # One process resumes the 2-rank run from its sharded periodic checkpoint (2 data shards: the same global
    # batches) and ends where the 2 ranks did.
    run_dir = last.parent
    periodic = _periodic(two_ranks, run_dir)
    assert (periodic / checkpoint.TABLES).is_dir() and not checkpoint.read(periodic).get("awaits_completion")
    (run_dir / "latest.json").write_text(json.dumps({"step_dir": periodic.name, "completed": False}))
    for later in (p for p in run_dir.glob("step-*") if p.name > periodic.name):
        shutil.rmtree(later)
    resumed = train(Settings(home=tmp_path / "two", frame_backend="pandas"), CONFIG)
    assert resumed.resumed_from_step == checkpoint.read(periodic)["position"]["step"] > 0
    assert resumed.steps == double.steps
    again = load_file(Path(resumed.checkpoint) / "model.safetensors")
    for name, tensor in two.items():
        torch.testing.assert_close(again[name], tensor, atol=WEIGHT_TOLERANCE, rtol=0, msg=name)

def test_a_plan_covers_every_row_once_and_balances_the_ranks():
    model = RankingModel(ModelConfig(embedding_dim=4), 3, [("big", 1000), ("a", 30), ("b", 20), ("c", 10)])
    plan = plan_sharding(model.embeddings, 3, row_wise_above=500)
    for t, rows in enumerate((1000, 30, 20, 10)):
        covered = sorted((s.lo, s.hi) for _, s in plan.owners(t))
        assert covered[0][0] == 0 and covered[-1][1] == rows
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:], strict=False))
    assert [len(plan.owners(0)), len(plan.owners(1))] == [3, 1]  # row-wise over every rank; whole


def test_shards_and_batches_join_in_order(lake: Settings):
    files = sorted((lake.home / "features" / "training").glob("*.parquet"))
    shards = shard_row_groups(files, 2)
    pieces = [p for shard in shards for p in shard]
    assert len(pieces) == len(set(pieces)) and not set(shards[0]) & set(shards[1])
    first = Batch(torch.ones(2, 1), torch.zeros(2), torch.tensor([1, 2, 7, 8, 9]), torch.tensor([0, 1, 2, 4, 5]))
    second = Batch(torch.ones(1, 1), torch.ones(1), torch.tensor([3, 6]), torch.tensor([0, 1, 2]))
    joined = concat_batches([first, second], num_tables=2)
    # table 0: rows [1], [2], [3]; table 1: rows [7, 8], [9], [6]
    assert joined.values.tolist() == [1, 2, 3, 7, 8, 9, 6] and joined.offsets.tolist() == [0, 1, 2, 3, 5, 6, 7]


def test_the_cli_launches_torchrun_and_completes_a_warm_start_that_grew_its_tables(lake_factory, tmp_path: Path):
    """``recloop train --nproc 2`` from a single-process champion whose tables have grown since (new ids): each
    rank reads its rows of the champion's tables (slices of its file) and draws the new rows as one process
    would; the command completes the run itself and reports one JSON summary, the same model as one process's
    run on the same data shards."""
    from recloop.features.config import FeatureConfig
    from recloop.features.job import build_features
    from recloop.schema import load_spec

    settings = lake_factory(tmp_path / "lake", WorldConfig(seed=8, days=2, events_per_day=3000),
                            features_end=datetime(2026, 1, 2, 12, tzinfo=UTC))  # a day and a half
    champion = train(settings, TrainConfig(days=2, batch_size=256, validation_hours=4, device="cpu",
                                           deterministic=True, model=CONFIG.model))
    spec = load_spec("synthetic")
    build_features(settings, spec, FeatureConfig.for_spec(spec))  # the rest: vocabularies grow
    one, two = (_copy(settings, tmp_path / name) for name in ("one", "two"))
    asked = dict(mode="incremental", batch_size=256, validation_hours=2, device="cpu", deterministic=True)
    single = train(one, TrainConfig(**asked, data_shards=2), warm_start=Path(champion.checkpoint))
    assert single.grown_tables and single.steps > 5  # the test is about tables that grew

    env = {**os.environ, "RECLOOP_HOME": str(two.home), "RECLOOP_FRAME_BACKEND": "pandas", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(str(CHECKOUT / p) for p in ("platform", "kernels", ""))}
    env.pop("WORLD_SIZE", None)
    done = subprocess.run([sys.executable, "-m", "recloop.cli", "train", "--nproc", "2", "--mode", "incremental",
                           "--from", str(two.home / Path(champion.checkpoint).relative_to(settings.home)),
                           "--batch-size", "256", "--validation-hours", "2", "--device", "cpu", "--deterministic",
                           "--no-track", "--json"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == 1 and not reports[0]["awaits_completion"] and 0.5 < reports[0]["auc"] <= 1.0
    assert reports[0]["steps"] == single.steps and reports[0]["grown_tables"] == single.grown_tables
    state = checkpoint.read(reports[0]["checkpoint"])
    assert state["train"]["data_shards"] == 2 and state["completed"]
    assert not (Path(reports[0]["checkpoint"]) / checkpoint.TABLES).exists()
    expected, got = (load_file(Path(p) / "model.safetensors") for p in (single.checkpoint, reports[0]["checkpoint"]))
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        assert got[name].shape == tensor.shape, name  # the grown tables' capacities too
        torch.testing.assert_close(got[name], tensor, atol=WEIGHT_TOLERANCE, rtol=0, msg=name)
    assert reports[0]["auc"] == pytest.approx(single.auc, abs=1e-6)


def test_a_rank_allocates_only_its_shards_of_the_tables(tmp_path: Path):
    """At start-up a rank builds its model with its shards of the tables alone (``distributed.rank_model``),
    never the whole collection first: measured as the peak resident memory each of 2 ranks' processes grows by
    while it builds a model with 2 tables of 1.5M rows, against one process building the whole model."""
    script = tmp_path / "build.py"
    script.write_text("""
import json, sys
import torch
import recloop.checkpoint, recloop.model.sharded_checkpoint  # rank_model's imports: before the measurement
from recloop.distributed import Ranks, rank_model
from recloop.model import ModelConfig, RankingModel

def memory(field: str) -> int:  # this process's resident memory now (VmRSS) or at its peak (VmHWM), in bytes
    with open("/proc/self/status") as f:  # (not getrusage: its peak carries over from the process that forked it)
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

config = ModelConfig(embedding_dim=16, bottom_mlp=(8,), top_mlp=(8,), embedding_backend="reference")
tables = [("c_user", 2_000_000), ("c_item", 2_000_000), ("c_device", 50)]
torch.zeros(1).add_(1)  # torch's own start-up allocations before the measurement
before = memory("VmRSS")
assert memory("VmHWM") - before < 50e6  # the peak so far is the start-up's: the build's own will show
rank = int(sys.argv[1])
if rank < 0:
    model = RankingModel(config, 3, tables)
    held = sum(b.numel() * b.element_size() for b in (model.embeddings.weights, model.embeddings.state1))
else:
    model = rank_model(config, 3, tables, torch.device("cpu"), 0, Ranks(rank, 2), None)
    held = model.embeddings.held_bytes()
print(json.dumps({"grew": memory("VmHWM") - before, "held": held}))
""")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(str(CHECKOUT / p) for p in ("platform", "kernels", ""))}
    runs = {rank: subprocess.Popen([sys.executable, str(script), str(rank)], env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True) for rank in (-1, 0, 1)}
    figures = {}
    for rank, process in runs.items():
        out, err = process.communicate(timeout=240)
        assert process.returncode == 0, err[-4000:]
        figures[rank] = json.loads(out.splitlines()[-1])
    whole = figures[-1]
    assert whole["held"] > 150e6 and whole["grew"] >= whole["held"]  # the measurement sees the tables
    assert figures[0]["held"] + figures[1]["held"] == whole["held"]
    for rank in (0, 1):  # about half the tables each, and never the whole of them on the way (one process
        # peaks at 1.9 times the tables: a table's draw is a temporary of its size; a rank at its rows + 4 MiB)
        assert figures[rank]["held"] < 0.6 * whole["held"], figures
        assert figures[rank]["held"] <= figures[rank]["grew"] < 0.75 * whole["held"], figures


def test_a_shard_of_row_groups_from_many_files_shuffles_and_delivers_each_row_once(tmp_path: Path):
    """Files of several row groups split between shards: each shard's epoch delivers its own rows once (its
    shuffle was sized from every row group of its files, and the first group raised "a group of 180 rows got
    a permutation of 250")."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from recloop.data import FeatureSchema
    from recloop.distributed import ShardLoader

    files = []
    for f, rows in enumerate((430, 270)):
        ids = np.arange(f * 1000, f * 1000 + rows)
        files.append(tmp_path / f"part{f}.parquet")
        pq.write_table(pa.table({"label": np.zeros(rows, np.float32), "d_x": ids.astype(np.float32),
                                 "c_a": ids % 7, "row_id": ids}), files[-1], row_group_size=100)
    schema = FeatureSchema(dense=("d_x",), categorical={"c_a": 7}, multi_hot={}, extra=("row_id",))
    seen = []
    for shard in shard_row_groups(files, 2):
        loader = ShardLoader(shard, schema, 64, seed=3, device=torch.device("cpu"))
        got = [r for batch in loader.epoch(0) for r in batch.extra["row_id"].tolist()]
        assert len(got) == loader.num_rows == sum(pq.ParquetFile(p).metadata.row_group(g).num_rows for p, g in shard)
        seen += got
    assert sorted(seen) == [*range(430), *range(1000, 1270)]


def test_sharded_tables_count_ids_outside_them_and_raise(tmp_path: Path):
    """The sharded lookup drops or zeroes an id outside its table without a word (the owners' collections do
    not check); the rank holding it counts it, and the check before a checkpoint raises, as one process
    does (training files newer than the schema trained silently on zero vectors under torchrun)."""
    import torch.distributed as dist

    from recloop.model.sharded import ShardedEmbeddings

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    try:
        model = RankingModel(ModelConfig(embedding_dim=4, bottom_mlp=(8,), top_mlp=(8,)), 1, [("a", 10), ("b", 1000)])
        sharded = ShardedEmbeddings.from_collection(model.embeddings, plan_sharding(model.embeddings, 1), rank=0)
        offsets = torch.tensor([0, 1, 2, 3, 4])  # batch 2, tables a then b
        sharded(torch.tensor([3, 7, 999, 12]), offsets)
        sharded.raise_id_errors()  # all in range: nothing to say
        sharded(torch.tensor([3, 10, 5, 1000]), offsets)  # a: 10 is past its 10 rows; b: 1000 past its 1000
        with pytest.raises(IndexError, match=r"table 'a' has 10 rows; 1 ids out of range .* \[10, 10\]"):
            sharded.raise_id_errors()
        sharded.raise_id_errors()  # reset by the raise
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # a torchrun launch of 2 ranks (and the module's uninterrupted one): a minute on 2 shared cores
def test_two_ranks_resume_from_their_sharded_checkpoint(two_ranks, tmp_path: Path):
    """Killed after a periodic checkpoint (here: pointed back at it), 2 ranks read back each its own table
    shards (torch.distributed.checkpoint) and end at the uninterrupted run's weights."""
    home = tmp_path / "home"
    done = TrainSummary(**_own_copy(two_ranks, home)[0]["completed"])
    final = load_file(Path(done.checkpoint) / "model.safetensors")
    run_dir = Path(done.checkpoint).parent
    periodic = _periodic(two_ranks, run_dir)
    assert (periodic / checkpoint.TABLES).is_dir()
    periodic_step = checkpoint.read(periodic)["position"]["step"]
    (run_dir / "latest.json").write_text(json.dumps({"step_dir": periodic.name, "completed": False}))
    for later in (p for p in run_dir.glob("step-*") if p.name > periodic.name):  # the ranks' last, the completed
        shutil.rmtree(later)
    (tmp_path / "again").mkdir()
    ranks = _torchrun(home, CONFIG, tmp_path / "again")
    again = complete(Settings(home=home, frame_backend="pandas"), ranks[0]["summary"]["checkpoint"])
    assert again.resumed_from_step == periodic_step > 0
    assert again.steps == done.steps
    resumed = load_file(Path(again.checkpoint) / "model.safetensors")
    assert resumed.keys() == final.keys()
    for name, tensor in final.items():  # the same ranks and order of sums: bit for bit
        assert torch.equal(resumed[name], tensor), name
