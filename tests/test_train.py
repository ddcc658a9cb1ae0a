"""Trainer: it learns, warm starts and grows, resumes after a crash to the same weights, refuses bad input."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow.dataset as ds
import pytest
import torch
from safetensors.torch import load_file

from recloop.checkpoint import read as read_checkpoint
from recloop.data.cold_ids import cold_shares, dropout_rates
from recloop.features.config import FeatureConfig
from recloop.features.definition import FeatureLayout
from recloop.features.job import build_features
from recloop.model import ModelConfig, RankingModel
from recloop.schema import load_spec
from recloop.settings import Settings
from recloop.simulate import WorldConfig
from recloop.train import TrainConfig, TrainError, train

SPEC = load_spec("synthetic")
SMALL = ModelConfig(embedding_dim=8, bottom_mlp=(16,), top_mlp=(32,))


@pytest.fixture(scope="module")
def world(tmp_path_factory, lake_factory) -> Path:
    """Four simulated days (a new catalog wave on the fourth), ingested; features for the first three."""
    world = WorldConfig(seed=8, days=4, events_per_day=6000, drift="sudden", drift_day=3)
    return lake_factory(tmp_path_factory.mktemp("train"), world, features_end=datetime(2026, 1, 4, tzinfo=UTC)).home


@pytest.fixture
def home(world: Path, tmp_path: Path) -> Settings:
    shutil.copytree(world, tmp_path / "home")
    return Settings(home=tmp_path / "home", frame_backend="pandas")


def config(**changes) -> TrainConfig:
    base = dict(mode="full", days=3, epochs=2, batch_size=512, validation_hours=12, checkpoint_every=10,
                device="cpu", model=SMALL)
    return TrainConfig(**{**base, **changes})


def test_a_small_full_run_learns(home: Settings):
    summary = train(home, config())
    assert summary.samples > 20_000 and summary.steps > 40
    assert summary.auc > 0.56, summary.to_dict()  # the oracle is near 0.79 here
    assert summary.oracle_auc is not None and summary.oracle_auc > summary.auc
    assert 0.7 < summary.calibration < 1.3 and summary.validation_rows > 2000
    assert Path(summary.checkpoint, "model.safetensors").exists()
    assert {"user=new", "user=returning", "device=mobile", "device=desktop"} <= set(summary.slices)
    assert sum(v["rows"] for k, v in summary.slices.items() if k.startswith("user=")) == summary.validation_rows
    assert read_checkpoint(Path(summary.checkpoint))["completed"] is True
    again = train(home, config())  # the same run again: already done, nothing retrained
    assert again.run_id == summary.run_id and again.checkpoint == summary.checkpoint


def test_incremental_warm_start_grows_tables_and_keeps_untouched_rows(home: Settings):
    base = train(home, config())
    penalized = train(home, config(embedding_l2=0.5, id_dropout=0.3))  # a chain given its penalty (or choosing it)
    build_features(home, SPEC, FeatureConfig.for_spec(SPEC))  # day four: new users and a new catalog wave
    incremental = train(home, config(mode="incremental"), warm_start=Path(base.checkpoint))
    assert incremental.warm_start == base.checkpoint
    assert incremental.id_dropout == base.id_dropout == {}  # the chain's id dropout (TrainConfig.id_dropout)
    # the embedding penalty: the mode's default (0) after a base at its own, the chain's after one given it
    assert read_checkpoint(Path(incremental.checkpoint))["train"]["embedding_l2"] is None
    assert not any(o.startswith("embedding_l2") for o in incremental.overrides)
    continued = train(home, config(mode="incremental"), warm_start=Path(penalized.checkpoint))
    assert read_checkpoint(Path(continued.checkpoint))["train"]["embedding_l2"] == 0.5
    assert any(o.startswith("embedding_l2 0.5: the penalty its chain") for o in continued.overrides)
    assert continued.id_dropout == {"c_user_id": 0.3, "c_item_id": 0.3}
    own = train(home, config(mode="incremental", embedding_l2=0.0), warm_start=Path(penalized.checkpoint))
    assert read_checkpoint(Path(own.checkpoint))["train"]["embedding_l2"] == 0.0 and own.run_id != continued.run_id
    # the chain's origin: a full run's own end, inherited by the incremental runs that follow it
    assert base.full_trained_until == base.trained_until < incremental.trained_until
    assert incremental.full_trained_until == base.trained_until
    assert read_checkpoint(Path(incremental.checkpoint))["full_trained_until"] == base.trained_until
    assert incremental.grown_tables["c_item_id"][1] > incremental.grown_tables["c_item_id"][0]
    assert incremental.train_hours[0] >= base.trained_until
    old = load_file(Path(base.checkpoint) / "model.safetensors")["sparse_arch.embeddings.weights"]
    new = load_file(Path(incremental.checkpoint) / "model.safetensors")["sparse_arch.embeddings.weights"]
    info = read_checkpoint(Path(base.checkpoint))
    rows = dict((n, r) for n, r in info["tables"])
    # Rows of c_country that the new hours never used keep their values (indices never move).
    training = ds.dataset(FeatureLayout.for_settings(home).training, format="parquet").to_table(
        columns=["c_country", "ts"]).to_pandas()
    used = set(training[training["ts"] >= datetime(2026, 1, 3, 12, tzinfo=UTC)]["c_country"].tolist())
    layout_old = _layout(info)
    layout_new = _layout(read_checkpoint(Path(incremental.checkpoint)))
    for row in range(rows["c_country"]):
        if row not in used:
            assert torch.equal(_row(old, layout_old, "c_country", row), _row(new, layout_new, "c_country", row))
    with pytest.raises(TrainError, match="nothing new"):
        train(home, config(mode="incremental", seed=1), warm_start=Path(incremental.checkpoint))


def test_training_rows_lose_their_key_ids_at_the_rate_the_newest_rows_meet_unknown_ones(home: Settings):
    """``TrainConfig.id_dropout``: measured on the window by default, continued by an incremental run, as
    configured otherwise; at 1.0 no key id but the unknown one is ever trained."""
    measured = train(home, config())
    files = [FeatureLayout.for_settings(home).training / f"{hour}.parquet" for hour in measured.train_hours]
    shares = cold_shares(files, ["c_user_id", "c_item_id"])
    assert 0 < shares["c_user_id"] < 0.05 and measured.id_dropout == dropout_rates(shares) == {}  # few new users
    assert read_checkpoint(Path(measured.checkpoint))["id_dropout"] == measured.id_dropout
    assert train(home, config(id_dropout=0.0)).id_dropout == {}
    with pytest.raises(TrainError, match="id_dropout: ids are dropped in one data shard"):
        train(home, config(id_dropout=0.3, data_shards=2))  # said, not silently skipped
    everything = train(home, config(id_dropout=1.0, epochs=1))
    assert everything.id_dropout == {"c_user_id": 1.0, "c_item_id": 1.0}
    info = read_checkpoint(Path(everything.checkpoint))
    trained = load_file(Path(everything.checkpoint) / "model.safetensors")["sparse_arch.embeddings.weights"]
    initial = RankingModel(ModelConfig.from_dict(info["model"]), len(info["dense"]), [tuple(t) for t in info["tables"]],
                           seed=0).state_dict()["sparse_arch.embeddings.weights"]
    layout = _layout(info)
    rows = dict((n, r) for n, r in info["tables"])
    for table in ("c_user_id", "c_item_id"):
        assert not torch.equal(_row(trained, layout, table, 1), _row(initial, layout, table, 1))  # the unknown row
        assert all(torch.equal(_row(trained, layout, table, row), _row(initial, layout, table, row))
                   for row in range(2, rows[table]))
    assert not torch.equal(_row(trained, layout, "c_country", 2), _row(initial, layout, "c_country", 2))


def _layout(info: dict) -> dict[str, tuple[int, int]]:
    """(element offset, dim) per table; capacities equal rows for tables that never grew in place."""
    dim = info["model"]["embedding_dim"]
    state = load_file(Path(info["path"]) / "model.safetensors")
    capacities = state["sparse_arch.embeddings.capacities"].tolist()
    offsets, total = {}, 0
    for (name, _), capacity in zip(info["tables"], capacities, strict=True):
        offsets[name] = (total, dim)
        total += capacity * dim
    return offsets


def _row(flat: torch.Tensor, layout: dict, name: str, row: int) -> torch.Tensor:
    start, dim = layout[name]
    return flat[start + row * dim:start + (row + 1) * dim]


def test_a_progress_callback_does_not_change_what_is_trained(home: Settings, tmp_path: Path):
    """``recloop train`` shows a progress bar through ``on_progress``; its samples-per-second figure overwrote the
    learning rate every tenth step (the CLI's runs diverged: held-out log loss 1.8-6.7 against 0.30)."""
    other = Settings(home=tmp_path / "other", frame_backend="pandas")
    shutil.copytree(home.home, other.home)
    told: list[tuple[int, int, float]] = []
    shown = train(other, config(deterministic=True), on_progress=lambda *figures: told.append(figures))
    quiet = train(home, config(deterministic=True))
    assert told and shown.run_id == quiet.run_id
    assert shown.loss_curve == quiet.loss_curve and shown.auc == quiet.auc, (shown.auc, quiet.auc)


def test_a_crashed_run_resumes_to_the_same_weights(home: Settings, tmp_path: Path):
    other = Settings(home=tmp_path / "other", frame_backend="pandas")
    shutil.copytree(home.home, other.home)
    deterministic = config(deterministic=True, checkpoint_every=6)
    uninterrupted = train(home, deterministic)

    def crash(step: int) -> None:
        if step == 15:
            raise KeyboardInterrupt("simulated crash")

    with pytest.raises(KeyboardInterrupt):
        train(other, deterministic, on_step=crash)
    resumed = train(other, deterministic)
    assert resumed.resumed_from_step == 12 and resumed.steps == uninterrupted.steps and not resumed.resume_note
    a = load_file(Path(uninterrupted.checkpoint) / "model.safetensors")
    b = load_file(Path(resumed.checkpoint) / "model.safetensors")
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert resumed.auc == pytest.approx(uninterrupted.auc)

    # The same crash under a loader that batched rows differently (a checkpoint written before the batch plan
    # was recorded): its 12 batches name other rows now, so the epoch restarts and trains them again. (Without
    # early stopping: it would end such a run at another step, which is not what is counted here.)
    deterministic = config(deterministic=True, checkpoint_every=6, early_stopping_share=0)
    uninterrupted = train(home, deterministic)
    older = Settings(home=tmp_path / "older", frame_backend="pandas")
    shutil.copytree(home.home, older.home, ignore=shutil.ignore_patterns("checkpoints"))  # the run not done yet
    with pytest.raises(KeyboardInterrupt):
        train(older, deterministic, on_step=crash)
    state_file = Path(read_checkpoint(next((older.home / "checkpoints").iterdir()))["path"]) / "state.json"
    state = json.loads(state_file.read_text())
    assert state["position"].pop("batch_plan") == 2 and state["position"]["batch"] == 12
    state_file.write_text(json.dumps(state))
    replayed = train(older, deterministic)
    assert replayed.resumed_from_step == 12 and replayed.steps == uninterrupted.steps + 12
    assert "epoch 0 restarts from its first batch" in replayed.resume_note
    assert "batch plan 1, now 2" in replayed.resume_note


def test_early_stopping_keeps_the_best_weights_and_calibrates_on_rows_it_never_trained_on(home: Settings):
    """Every tenth training file is held aside: scored four times an epoch, the run ends with the weights of
    the check with the lowest log loss there (not the last epoch's), and Platt's slope and intercept are
    fitted on those rows and kept in the checkpoint's JSON."""
    from recloop.checkpoint import load_model
    from recloop.data import ChunkLoader, FeatureSchema
    from recloop.evaluate import metrics, predict

    # at the rates shipped until 2026-11-28 (tables 0.2, layers 2.1e-3 at these 512-row steps, a 20-step warm-up)
    # the tables memorize their rows within six epochs, so the last weights lose on the held-aside rows beyond
    # noise and the best check's come back (at today's defaults the run overfits less and keeps its last weights)
    summary = train(home, config(epochs=6, lr=2.12e-3, warmup_share=1.0, model=replace(SMALL, embedding_lr=0.2),
                                 average_checks=False))  # the last weights against the best check's
    record = summary.early_stopping
    assert record["rows"] >= 1000 and len(record["checks"]) >= 4 and record["files"]
    assert record["best_logloss"] == min(value for _, value in record["checks"])
    # the first check ends the first epoch (a run keeps at least one pass over its rows); four an epoch after it
    every = record["checks"][1][0] - record["checks"][0][0]  # (ceil of a quarter epoch)
    assert every > 1 and record["checks"][0][0] > 4 * (every - 1)
    # the best weights replaced the last ones because the last were worse beyond noise on those rows
    assert record["restored_step"] == record["best_step"] and record["restore_z"] >= 2.0
    assert not set(record["files"]) & set(summary.train_hours) and not set(record["files"]) & set(
        summary.validation_hours)
    model, state = load_model(summary.checkpoint)
    slope, intercept = state["calibration"]
    assert slope != 1.0 and state["summary"]["early_stopping"]["best_step"] == record["best_step"]
    model.calibration = None  # the weights kept score the held-aside rows as the best check did
    layout = FeatureLayout.for_settings(home)
    files = [layout.training / f"{stem}.parquet" for stem in record["files"]]
    labels, scores, _ = predict(model, ChunkLoader(files, FeatureSchema.load(layout.schema), 8192,
                                                   shuffle=False).epoch(0))
    assert metrics(labels, scores)["logloss"] == pytest.approx(record["best_logloss"], abs=1e-5)


def test_weights_averaged_over_the_checks_are_their_mean_and_a_grown_table_stops_the_average():
    from recloop.train import _WeightAverage

    model = torch.nn.Linear(3, 2)
    assert _WeightAverage(model, max_bytes=8).why_not  # larger than its cap: no second copy of the weights
    average = _WeightAverage(model)
    seen = []
    for value in (1.0, 2.0, 6.0):
        with torch.no_grad():
            model.weight.fill_(value)
        seen.append(model.weight.detach().clone())
        average.add(model)
    average.load_into(model)
    assert average.count == 3 and torch.allclose(model.weight, torch.stack(seen).mean(dim=0))
    grown = torch.nn.Linear(4, 2)  # a table that grew mid-run (ids admitted): no average of unlike shapes
    average.add(grown)
    assert average.count == 0 and "changed shape" in average.why_not


def test_a_run_can_end_on_the_mean_of_its_checks_weights(home: Settings):
    """``average_checks`` (the default): the weights at every early-stopping check after the first, averaged
    (stochastic weight averaging along the run); the same run without it ends on its last weights. A run that
    crashed after the averaging began resumes to the same average."""
    never_restore = dict(epochs=3, restore_z=float("inf"))  # each run ends on what it computed, not the best check
    plain = train(home, config(**never_restore, average_checks=False))
    averaged = train(home, config(**never_restore))
    record = averaged.early_stopping
    assert record["averaged_checks"] == len(record["checks"]) - 1 >= 2, record
    assert "averaged_checks" not in plain.early_stopping
    assert [c[0] for c in record["checks"]] == [c[0] for c in plain.early_stopping["checks"]]  # the same run
    mine = load_file(Path(averaged.checkpoint) / "model.safetensors")
    theirs = load_file(Path(plain.checkpoint) / "model.safetensors")
    assert any(not torch.equal(mine[k], theirs[k]) for k in mine if mine[k].is_floating_point())


def test_a_run_that_crashed_while_averaging_resumes_to_the_same_average(home: Settings, tmp_path: Path):
    other = Settings(home=tmp_path / "other", frame_backend="pandas")
    shutil.copytree(home.home, other.home)
    deterministic = config(epochs=3, deterministic=True, checkpoint_every=6, restore_z=float("inf"))
    uninterrupted = train(home, deterministic)
    checks = [at for at, _ in uninterrupted.early_stopping["checks"]]
    crash_at = checks[2] + 1  # two checks averaged by then; the checkpoint before it holds one or two

    def crash(step: int) -> None:
        if step == crash_at:
            raise KeyboardInterrupt("simulated crash")

    with pytest.raises(KeyboardInterrupt):
        train(other, deterministic, on_step=crash)
    resumed = train(other, deterministic)
    assert resumed.resumed_from_step > checks[1], (resumed.resumed_from_step, checks)
    assert resumed.early_stopping["averaged_checks"] == uninterrupted.early_stopping["averaged_checks"] >= 2
    a = load_file(Path(uninterrupted.checkpoint) / "model.safetensors")
    b = load_file(Path(resumed.checkpoint) / "model.safetensors")
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_a_feature_constant_over_the_training_rows_is_centred_not_stretched():
    """A two-day window's day-of-week cosine is one value (Thursday and Friday): scaled by 1 / its spread, the
    next day's value reached the model as hundreds and its held-out log loss tripled."""
    from recloop.model.ranking import DenseArch

    torch.manual_seed(0)
    varying = torch.randn(500, 2) * torch.tensor([3.0, 0.5]) + torch.tensor([1.0, -2.0])  # (N, 2)
    weekday = torch.full((500, 1), -0.901)
    arch = DenseArch(3, (8,), 4)
    arch.standardize_from(torch.cat([varying, weekday], dim=1))
    torch.testing.assert_close(arch.scale[:2], 1 / varying.std(dim=0))
    assert arch.scale[2] == 1.0 and arch.shift[2] == pytest.approx(-0.901)
    saturday = torch.tensor([[1.0, -2.0, -0.223]])
    assert ((saturday - arch.shift) * arch.scale).abs().max() < 1  # not (0.678 / 1e-3)


def test_dense_inputs_are_standardized_by_the_training_rows_and_old_checkpoints_still_load(home: Settings):
    from recloop.checkpoint import load_model
    from recloop.model import RankingModel

    summary = train(home, config(epochs=1, early_stopping_share=0))
    model, state = load_model(summary.checkpoint)
    shift, scale = model.dense_arch.shift, model.dense_arch.scale
    assert shift.abs().max() > 0.1 and not torch.allclose(scale, torch.ones_like(scale))
    # a checkpoint written before the shift and scale existed loads as it was trained: unstandardized
    weights = {k: v for k, v in load_file(Path(summary.checkpoint) / "model.safetensors").items()
               if not k.startswith("dense_arch.s")}
    old = RankingModel(model.config, len(state["dense"]), [tuple(t) for t in state["tables"]])
    old.load_state_dict(weights)
    assert torch.equal(old.dense_arch.shift, torch.zeros_like(shift)) and torch.equal(old.dense_arch.scale,
                                                                                        torch.ones_like(scale))


def test_training_compiles_around_the_embedding_kernels(home: Settings):
    compiled = train(home, config(epochs=1, compile="aot_eager"))
    eager = train(home, config(epochs=1, compile="off", checkpoint_every=11))  # same run, another folder
    assert compiled.auc > 0.55 and compiled.samples == eager.samples
    assert compiled.auc == pytest.approx(eager.auc, abs=0.01)


def test_bad_input_is_a_clear_error(home: Settings, tmp_path: Path):
    with pytest.raises(TrainError, match="recloop features"):
        train(Settings(home=tmp_path / "empty"), config())
    with pytest.raises(TrainError, match="needs a checkpoint to start from"):
        train(home, config(mode="incremental"))
    with pytest.raises(TrainError, match="is not a checkpoint"):
        train(home, config(mode="incremental"), warm_start=home.home)
    with pytest.raises(TrainError, match="held out"):
        train(home, config(validation_hours=10_000))
    base = train(home, config(epochs=1))
    build_features(home, SPEC, FeatureConfig.for_spec(SPEC))  # new hours to train on
    state = json.loads((Path(base.checkpoint) / "state.json").read_text())
    state["state_version"] = 99
    (Path(base.checkpoint) / "state.json").write_text(json.dumps(state))
    with pytest.raises(TrainError, match="vocabulary version 99"):
        train(home, config(mode="incremental"), warm_start=Path(base.checkpoint))
    state["state_version"] = 1
    hashed = json.loads((home.home / "features" / "schema.json").read_text())["categorical"]
    cross = next(name for name, table in hashed.items() if table.get("hashed"))
    position = [name for name, _ in state["tables"]].index(cross)
    state["tables"][position][1] -= 1  # fewer buckets then: every hashed id's row moved, though it looks like growth
    (Path(base.checkpoint) / "state.json").write_text(json.dumps(state))
    with pytest.raises(TrainError, match=f"hashed \\['{cross}'\\] into other bucket counts"):
        train(home, config(mode="incremental"), warm_start=Path(base.checkpoint))
    state["tables"][position][1] += 1
    state["tables"][0][1] = 10**7  # a table larger than the features know: not this lake's checkpoint
    (Path(base.checkpoint) / "state.json").write_text(json.dumps(state))
    with pytest.raises(TrainError, match="does not match the features"):
        train(home, config(mode="incremental"), warm_start=Path(base.checkpoint))


def test_metrics_are_computed_correctly():
    from recloop.evaluate import auc, metrics

    labels = np.array([0, 0, 1, 1, 0, 1])
    assert auc(labels, np.array([0.1, 0.2, 0.8, 0.9, 0.3, 0.7])) == 1.0
    assert auc(labels, np.array([0.5] * 6)) == 0.5  # ties count half
    assert auc(labels, np.array([0.9, 0.8, 0.1, 0.2, 0.7, 0.3])) == 0.0
    out = metrics(labels, np.array([0.5, np.nan, 0.5, 0.5, 0.5, 0.5]))
    assert out["nan_predictions"] == 1 and np.isnan(out["auc"])
    assert metrics(labels, np.full(6, 0.25))["calibration"] == pytest.approx(0.5)


def test_an_incremental_window_is_its_new_hours_plus_a_replay_sample_of_a_full_runs_days(tmp_path: Path):
    """Replay draws older hours at random, ``replay_fraction`` of the new ones, from the ``days`` a full run
    would train on (never from before them), and ``epochs`` counts passes in both modes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from recloop.train import choose_windows

    files = []
    for hour in range(5 * 24):  # five days of hourly files, 100 rows each
        path = tmp_path / f"2026-01-{1 + hour // 24:02d}T{hour % 24:02d}.parquet"
        pq.write_table(pa.table({"label": [0] * 100}), path)
        files.append(path)
    base = {"trained_until": "2026-01-05T00"}  # seen days 1..4; day 5's hours are new
    settings = dict(validation_hours=6, validation_rows=100, days=2, epochs=3, train_rows=100)
    plain = choose_windows(files, TrainConfig(mode="incremental", **settings), base)
    assert [f.stem for f in plain.train] == [f.stem for f in files[96:114]] and plain.epochs == 3
    replayed = choose_windows(files, TrainConfig(mode="incremental", replay_fraction=0.5, **settings), base)
    older = [f for f in replayed.train if f.stem < base["trained_until"]]
    assert replayed.train[len(older):] == plain.train and len(older) == 9  # half of 18 new hours
    assert all(f.stem >= "2026-01-03T18" for f in older)  # within the 2 days before the held-out hours
    assert len({f.stem for f in older}) == 9
    full = choose_windows(files, TrainConfig(mode="full", **settings), None)
    assert full.train[0].stem == "2026-01-03T18" and full.epochs == 3
    # a sparse log: 2,000 held-out rows reach back past every new hour; an incremental run's held-out hours
    # take at most half of its new rows (a full run's grow as before)
    sparse = dict(validation_hours=1, validation_rows=2000, min_validation_rows=100)
    grown = choose_windows(files, TrainConfig(mode="incremental", **sparse), base)
    assert sum(len(pq.read_table(f)) for f in grown.validation) <= 24 * 100 / 2 and grown.train
    assert [f.stem for f in grown.train] == [f.stem for f in files[96:108]]
    assert len(choose_windows(files, TrainConfig(mode="full", **sparse), None).validation) == 20


def test_a_periodic_full_retrain_is_due_once_the_chain_is_long_and_tried_once_per_period(tmp_path: Path):
    """``pipeline.periodic_full_due`` over the champion's chain: not due below ``every_hours``, due at it (or
    when the chain's beginning is unknown), and after a recorded one not due again until ``every_hours`` more."""
    from recloop.pipeline import Pending, periodic_full_due, record_periodic_full
    from recloop.train import chain_origin

    settings = Settings(home=tmp_path / "home")
    day = [f"2026-01-05T{h:02d}" for h in range(24)]  # pending: a whole day; the chain began 2 days before
    pending = Pending("4", "2026-01-05T00", day, "2026-01-03T00")
    assert pending.chain_hours == 72.0  # 48 hours trained since the full run, + these 24
    assert periodic_full_due(settings, pending, 96) is None
    assert periodic_full_due(settings, pending, None) is None
    why = periodic_full_due(settings, pending, 72)
    assert why is not None and "v4" in why and "spans 72 hours" in why
    assert periodic_full_due(settings, pending, 72) == why  # asking does not count as an attempt
    record_periodic_full(settings, pending)  # the periodic retrain trained
    assert json.loads((settings.home / "loop" / "periodic_full.json").read_text())["until"] == "2026-01-06T00"
    # refused by the gate, say: the champion's chain is longer still the next hour, but the attempt is recent
    later = Pending("4", "2026-01-05T00", [*day, "2026-01-06T00"], "2026-01-03T00")
    assert periodic_full_due(settings, later, 72) is None
    three_days = [f"2026-01-{d:02d}T{h:02d}" for d in (5, 6, 7, 8) for h in range(24)]
    much_later = Pending("4", "2026-01-05T00", three_days, "2026-01-03T00")
    assert periodic_full_due(settings, much_later, 72) is not None  # 72 hours of data after the attempt
    unknown = Pending("4", "2026-01-05T00", day, "")  # an incremental checkpoint from before the origin was kept
    assert unknown.chain_hours is None and "not recorded" in periodic_full_due(
        Settings(home=tmp_path / "other"), unknown, 72)
    assert periodic_full_due(settings, Pending(None, None, [], None), 1) is None  # no champion: nothing to restart
    assert chain_origin({"trained_until": "2026-01-02T00", "train": {"mode": "full"}}) == "2026-01-02T00"
    assert chain_origin({"trained_until": "2026-01-02T00", "train": {"mode": "incremental"}}) == ""


def test_saving_a_step_again_never_removes_the_checkpoint_latest_points_at(tmp_path: Path, monkeypatch):
    """A run's completed save at the step of its last periodic one writes a new folder and only then moves
    ``latest.json``: a crash in between leaves the periodic checkpoint readable (the folder was removed
    first, and the run could never resume)."""
    import os

    import torch

    from recloop import checkpoint

    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 3)).sum().backward()
    optimizer.step()
    first = checkpoint.save(tmp_path, 150, model, optimizer, {"note": "periodic"}, completed=False)
    real_replace = os.replace

    def crash_at_the_pointer(src, dst):
        if str(dst).endswith("latest.json"):
            raise OSError("killed")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_at_the_pointer)
    with pytest.raises(OSError, match="killed"):
        checkpoint.save(tmp_path, 150, model, optimizer, {"note": "completed"}, completed=True)
    monkeypatch.setattr(os, "replace", real_replace)
    assert checkpoint.read(tmp_path)["note"] == "periodic" and checkpoint.read(tmp_path)["path"] == str(first)
    again = checkpoint.save(tmp_path, 150, model, optimizer, {"note": "completed"}, completed=True)
    assert again != first and checkpoint.read(tmp_path)["note"] == "completed"


def test_calibration_is_fitted_on_the_newest_training_rows(tmp_path: Path):
    """The base-rate correction learns the level the model will serve at: the newest rows of the window (it
    read the oldest of its last 24 files first and stopped at calibration_rows; an incremental run's
    files start with its replayed hours)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from recloop.data import FeatureSchema
    from recloop.model import ModelConfig, RankingModel
    from recloop.train import TrainConfig, _fit_calibration

    rng = np.random.default_rng(0)
    files = []
    for hour, rate in ((0, 0.05), (1, 0.05), (2, 0.6)):  # the newest hour clicks far more
        n = 3000
        table = pa.table({"label": (rng.random(n) < rate).astype(np.float32),
                          "d_x": rng.standard_normal(n).astype(np.float32), "c_a": rng.integers(0, 5, n)})
        files.append(tmp_path / f"2026-01-01T{hour:02d}.parquet")
        pq.write_table(table, files[-1], row_group_size=1000)
    schema = FeatureSchema(dense=("d_x",), categorical={"c_a": 5}, multi_hot={})
    model = RankingModel(ModelConfig(embedding_dim=4, bottom_mlp=(8,), top_mlp=(8,)), 1, [("c_a", 5)])
    config = TrainConfig(calibration_rows=2000, batch_size=500, calibration_slope=False)
    _, intercept = _fit_calibration(model, files, schema, config, torch.device("cpu"))
    model.calibration = None
    with torch.no_grad():
        newest = pq.read_table(files[-1])
        raw = torch.sigmoid(model(torch.from_numpy(newest["d_x"].to_numpy()[:, None]),
                                  torch.from_numpy(newest["c_a"].to_numpy()),
                                  torch.arange(newest.num_rows + 1))).mean().item()
    calibrated = 1 / (1 + np.exp(-(np.log(raw / (1 - raw)) + intercept)))  # about the newest hour's rate
    assert abs(calibrated - 0.6) < 0.1, (raw, intercept, calibrated)


KILLED_CONFIG = ("TrainConfig(mode='full', days=3, epochs=1, batch_size=64, validation_hours=12, checkpoint_every=25, "
                 "device='cpu', deterministic=True, model=ModelConfig(embedding_dim=8, bottom_mlp=(16,), top_mlp=(32,)))")


@pytest.mark.timeout(600)
def test_a_training_killed_mid_epoch_resumes_to_the_same_weights(home: Settings, tmp_path: Path):
    """SIGKILL in the middle of an epoch (a run made long on purpose: batches of 64, one epoch of ~300 steps,
    killed once a checkpoint inside the epoch exists): the rerun takes up from that checkpoint, within the
    epoch, and ends with the weights of a run never interrupted."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from recloop.model import ModelConfig

    config = eval(KILLED_CONFIG, {"TrainConfig": TrainConfig, "ModelConfig": ModelConfig})  # noqa: S307 - ours
    other = Settings(home=tmp_path / "other", frame_backend="pandas")
    shutil.copytree(home.home, other.home)
    code = ("from recloop.model import ModelConfig\nfrom recloop.settings import Settings\n"
            "from recloop.train import TrainConfig, train\n"
            f"train(Settings(home={str(other.home)!r}, frame_backend='pandas'), {KILLED_CONFIG})\n")
    child = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "RECLOOP_HOME": str(other.home)},
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    killed_at = None
    try:
        deadline = time.time() + 400
        while killed_at is None and child.poll() is None and time.time() < deadline:
            for pointer in (other.home / "checkpoints").glob("*/latest.json"):
                try:
                    state = read_checkpoint(pointer.parent)
                except Exception:  # noqa: BLE001 - being written: look again
                    continue
                if not state["completed"] and state["position"]["batch"] >= 50:
                    child.send_signal(signal.SIGKILL)
                    killed_at = state["position"]
            time.sleep(0.05)
    finally:
        child.kill()
        stderr = child.communicate(timeout=30)[1]
    assert killed_at is not None, f"the run ended (or never checkpointed) before it could be killed: {stderr[-2000:]}"
    assert child.returncode == -signal.SIGKILL and killed_at["epoch"] == 0  # killed inside its only epoch
    resumed = train(other, config)
    assert resumed.resumed_from_step >= killed_at["step"] > 0 and not resumed.resume_note
    uninterrupted = train(home, config)
    assert resumed.steps == uninterrupted.steps > resumed.resumed_from_step
    a = load_file(Path(uninterrupted.checkpoint) / "model.safetensors")
    b = load_file(Path(resumed.checkpoint) / "model.safetensors")
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_a_resumed_incremental_run_still_says_which_tables_grew(home: Settings):
    """A crashed incremental run resumes from its own checkpoint, whose tables grew already: its summary
    still names the growth from the base (it came out empty, and the CLI's "tables grown" line with it)."""
    base = train(home, config())
    build_features(home, SPEC, FeatureConfig.for_spec(SPEC))  # day four: new ids in several tables

    def crash(step: int) -> None:
        if step == 12:
            raise KeyboardInterrupt("simulated crash")

    with pytest.raises(KeyboardInterrupt):
        train(home, config(mode="incremental"), warm_start=Path(base.checkpoint), on_step=crash)
    resumed = train(home, config(mode="incremental"), warm_start=Path(base.checkpoint))
    assert resumed.resumed_from_step == 10
    rows = dict((n, r) for n, r in read_checkpoint(Path(base.checkpoint))["tables"])
    now = dict((n, r) for n, r in read_checkpoint(Path(resumed.checkpoint))["tables"])
    assert resumed.grown_tables and resumed.grown_tables["c_item_id"] == [rows["c_item_id"], now["c_item_id"]]


def test_small_batches_keep_the_dense_rate_and_the_warm_up_is_a_share_of_the_run():
    from recloop.train import dense_rate, warmup_factor

    config = TrainConfig(lr=5e-3, reference_batch=1024, warmup_steps=20, warmup_share=0.05)
    # a small log's 256-row steps train the layers at the configured rate, not half of it; large batches scale up
    assert dense_rate(config, 256) == pytest.approx(5e-3)
    assert dense_rate(config, 4096) == pytest.approx(1e-2)
    # 114 planned steps (Criteo's 3,600-row window, 6 epochs of 19): a 6-step warm-up, not 20 (of a run that
    # early stopping ends at 38); a long run keeps at most warmup_steps; a warm start none
    short, long_run = warmup_factor(config, 114, warm=False), warmup_factor(config, 10_000, warm=False)
    assert [round(short(s), 3) for s in (0, 4, 5, 30)] == [0.167, 0.833, 1.0, 1.0]
    assert long_run(9) == pytest.approx(0.5) and long_run(19) == 1.0
    assert warmup_factor(config, 114, warm=True)(0) == 1.0
    # unset, by mode: a run from scratch at 0.02 (with the wide part, level or ahead on every log measured),
    # a warm-started one at 0.005; the model has its wide part unless told otherwise
    from recloop.train import FULL_LR, INCREMENTAL_LR

    assert dense_rate(TrainConfig(mode="full"), 256) == FULL_LR == 2e-2
    assert dense_rate(TrainConfig(mode="incremental"), 256) == INCREMENTAL_LR == 5e-3
    assert TrainConfig(mode="incremental", lr=1e-3).dense_lr == 1e-3 and ModelConfig().wide


def test_a_tiny_window_without_early_stopping_rows_is_not_raised_to_a_hundred_epochs(tmp_path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from recloop.train import UNCHECKED_EPOCHS, Windows, fit_to_data

    hour = tmp_path / "2014-01-01T00.parquet"
    pq.write_table(pa.table({"label": np.zeros(150, np.float32)}), hour)  # Criteo's 200-row sample, 150 to train
    full = TrainConfig(mode="full", device="cpu")
    _, unchecked = fit_to_data(full, Windows(train=[hour], validation=[], epochs=1), torch.device("cpu"))
    assert unchecked.epochs == UNCHECKED_EPOCHS == 3
    assert "up to 3 epochs without early-stopping rows" in unchecked.overrides[-1]
    # with rows to stop it, min_steps (100 steps of one 256-row batch) still raises it
    _, checked = fit_to_data(full, Windows(train=[hour], validation=[], epochs=1, tuning=(hour,)), torch.device("cpu"))
    assert checked.epochs == 100


def test_the_embedding_penalty_is_chosen_on_the_newest_rows_only_when_it_beats_the_configured_one(home: Settings):
    """``embedding_l2_choices``: a trial per penalty holds the newest rows aside (forward in time, unlike the
    spread early-stopping rows); the run itself trains with a choice only when its trial beat the configured
    penalty's on those rows by ``selection_z`` standard errors of the paired per-row difference, else with the
    configured one."""
    asked = config(embedding_l2=1000.0, embedding_l2_choices=(0.01,))  # configured: the ids held near zero
    first = train(home, asked)
    figures = first.selection["embedding_l2"]
    z = figures["0.01"]["z"]
    assert figures["0.01"]["logloss"] < figures["1000"]["logloss"] and z > 0  # the ids help on the newest rows
    assert first.selection["kept"] == (0.01 if z >= 2.0 else 1000.0)
    assert any(o.startswith(f"embedding_l2 {first.selection['kept']:g} ") for o in first.overrides), first.overrides
    # a lower bar on the same trials (found completed, not retrained): the choice now clears it
    chosen = train(home, replace(asked, selection_z=z / 2))
    assert chosen.selection["kept"] == 0.01 and chosen.selection["embedding_l2"]["0.01"]["z"] == z
    assert any(o.startswith("embedding_l2 0.01 chosen") for o in chosen.overrides), chosen.overrides
    assert chosen.run_id == train(home, config(embedding_l2=0.01)).run_id  # the run itself, as if configured so
    # its early-stopping rows are spread over its window; its trial's were the newest files
    assert min(chosen.early_stopping["files"]) < max(chosen.train_hours)
    trial = train(home, config(embedding_l2=0.01, early_stopping_rows="newest", baselines=False))  # found done
    assert trial.early_stopping["files"] and max(trial.train_hours) < min(trial.early_stopping["files"])
    # the default kept by default stays unset: the run no choosing would have made (the same trials, found done)
    unset = train(home, config(embedding_l2_choices=(1000.0,)))
    assert unset.selection["kept"] == 0.01 and any(o.startswith("embedding_l2 0.01 kept") for o in unset.overrides)
    assert read_checkpoint(Path(unset.checkpoint))["train"]["embedding_l2"] is None
    assert unset.run_id == train(home, config()).run_id
