"""Training under torchrun: 2 real gloo processes with sharded tables and DDP train the same model as one
process on the same data shards, and their checkpoint warm-starts a single-process run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient
from safetensors.torch import load_file

from recloop import checkpoint, registry
from recloop.data.loader import Batch
from recloop.distributed import concat_batches, shard_row_groups
from recloop.model import ModelConfig, RankingModel
from recloop.model.sharded import plan_sharding
from recloop.settings import Settings
from recloop.simulate import WorldConfig
from recloop.train import TrainConfig, TrainSummary, train

CHECKOUT = Path(__file__).resolve().parents[1]
ROW_WISE_ABOVE = 200  # the user table (~260 rows) and the crosses go row-wise, the small ones table-wise
CONFIG = TrainConfig(days=2, epochs=1, batch_size=256, validation_hours=8, device="cpu", deterministic=True,
                     checkpoint_every=7, data_shards=2, row_wise_above=ROW_WISE_ABOVE,
                     model=ModelConfig(embedding_dim=8, bottom_mlp=(16,), top_mlp=(32,)))
# Two processes sum their gradients in another order than one: fp32 rounding, ~1e-7 after 19 steps here.
WEIGHT_TOLERANCE = 1e-5

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
    """One 2-rank run of ``CONFIG`` on a copy of the lake, and what its ranks reported: the run the single
    process is compared with and the run resumed from its sharded checkpoint (launched once for both: each
    test changes the run's folder in a copy of its own, ``_own_copy``)."""
    root = tmp_path_factory.mktemp("two-ranks")
    home = _copy(lake, root / "home").home
    return home, _torchrun(home, CONFIG, root)


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


def test_two_ranks_train_the_same_model_as_one_process(lake: Settings, two_ranks, tmp_path: Path):
    single = train(_copy(lake, tmp_path / "one"), CONFIG)
    ranks = _own_copy(two_ranks, tmp_path / "two")
    assert sorted((r["rank"], r["world"]) for r in ranks) == [(0, 2), (1, 2)]
    double = TrainSummary(**{**ranks[0]["summary"], "train_hours": single.train_hours})
    assert all(r["summary"]["checkpoint"] == ranks[0]["summary"]["checkpoint"] for r in ranks)
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

    registry.configure(Settings(home=tmp_path / "two"))  # one MLflow run, kept by rank 0 while the ranks trained
    client = MlflowClient()
    runs = client.search_runs([client.get_experiment_by_name(registry.EXPERIMENT).experiment_id])
    assert [r.data.tags["recloop.run_id"] for r in runs] == [double.run_id] and runs[0].info.status == "FINISHED"
    losses = client.get_metric_history(runs[0].info.run_id, "train_loss")
    assert [[m.step, m.value] for m in losses] == double.loss_curve and runs[0].data.metrics["auc"] == double.auc

    # The periodic checkpoints under 2 ranks kept the tables sharded: each rank wrote its own shards through
    # torch.distributed.checkpoint (safetensors with their offsets, no pickle), none gathered every table.
    run_dir = Path(double.checkpoint).parent
    periodic = [p for p in sorted(run_dir.glob("step-*")) if p != Path(double.checkpoint)][-1]
    assert sorted(p.name for p in (periodic / checkpoint.TABLES).iterdir()) == [
        "shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"]
    assert {p.suffix for p in periodic.rglob("*") if p.is_file()} == {".safetensors", ".json"}
    assert "sparse_arch.embeddings.weights" not in load_file(periodic / "model.safetensors")
    assert not (Path(double.checkpoint) / checkpoint.TABLES).exists()  # the completed one is whole (it serves)
    # One process resumes the 2-rank run from its sharded checkpoint (2 data shards: the same global batches)
    # and ends where the 2 ranks did.
    (run_dir / "latest.json").write_text(json.dumps({"step_dir": periodic.name, "completed": False}))
    for later in (p for p in run_dir.glob("step-*") if p.name > periodic.name):
        shutil.rmtree(later)
    resumed = train(Settings(home=tmp_path / "two", frame_backend="pandas"), CONFIG)
    assert resumed.resumed_from_step == checkpoint.read(periodic)["position"]["step"] > 0
    assert resumed.steps == double.steps
    again = load_file(Path(resumed.checkpoint) / "model.safetensors")
    for name, tensor in two.items():
        torch.testing.assert_close(again[name], tensor, atol=WEIGHT_TOLERANCE, rtol=0, msg=name)

    # The 2-rank checkpoint warm-starts one process (six newer hours: the first run held out eight).
    warm = train(_copy(lake, tmp_path / "warm"),
                 TrainConfig(mode="incremental", validation_hours=2, validation_rows=0, batch_size=256, device="cpu",
                             model=CONFIG.model),
                 warm_start=Path(double.checkpoint))
    assert warm.warm_start == double.checkpoint and warm.steps > 0 and 0.5 < warm.auc <= 1.0


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


def test_the_cli_launches_torchrun(lake: Settings, tmp_path: Path):
    """``recloop train --nproc 2``: rank 0 reports one JSON summary; the checkpoint is the usual one."""
    home = _copy(lake, tmp_path / "cli").home
    env = {**os.environ, "RECLOOP_HOME": str(home), "RECLOOP_FRAME_BACKEND": "pandas", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(str(CHECKOUT / p) for p in ("platform", "kernels", ""))}
    env.pop("WORLD_SIZE", None)
    done = subprocess.run([sys.executable, "-m", "recloop.cli", "train", "--nproc", "2", "--days", "2",
                           "--batch-size", "512", "--validation-hours", "8", "--device", "cpu", "--no-track",
                           "--json"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == 1 and reports[0]["steps"] > 0 and 0.5 < reports[0]["auc"] <= 1.0
    assert checkpoint.read(reports[0]["checkpoint"])["train"]["data_shards"] == 2


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
        sharded = ShardedEmbeddings(model.embeddings, plan_sharding(model.embeddings, 1), rank=0)
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
    done = TrainSummary(**_own_copy(two_ranks, home)[0]["summary"])
    final = load_file(Path(done.checkpoint) / "model.safetensors")
    run_dir = Path(done.checkpoint).parent
    periodic = [p for p in sorted(run_dir.glob("step-*")) if p != Path(done.checkpoint)][-1]
    assert (periodic / checkpoint.TABLES).is_dir()
    (run_dir / "latest.json").write_text(json.dumps({"step_dir": periodic.name, "completed": False}))
    shutil.rmtree(done.checkpoint)
    (tmp_path / "again").mkdir()
    again = TrainSummary(**_torchrun(home, CONFIG, tmp_path / "again")[0]["summary"])
    assert again.resumed_from_step == checkpoint.read(periodic)["position"]["step"] > 0
    assert again.steps == done.steps
    resumed = load_file(Path(again.checkpoint) / "model.safetensors")
    assert resumed.keys() == final.keys()
    for name, tensor in final.items():  # the same ranks and order of sums: bit for bit
        assert torch.equal(resumed[name], tensor), name
