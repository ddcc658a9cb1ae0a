"""Id dropout: the rate measured on a training window (``recloop.data.cold_ids``) and the ids a step drops
(``recloop.model.fit.drop_ids``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from recloop.data import FeatureSchema, cold_ids
from recloop.data.cold_ids import MAX_RATE, cold_shares, dropout_rates, key_tables
from recloop.model.fit import OOV_ID, drop_ids


def _files(tmp_path: Path) -> list[Path]:
    """Ten hourly files of 100 rows: the first nine's users are ids 2-50; the newest's are 30 new ids, 10
    out-of-vocabulary rows and 60 known ones. Every item is known."""
    rng = np.random.default_rng(0)
    files = []
    for hour in range(10):
        if hour < 9:
            users = rng.integers(2, 51, 100)
        else:
            users = np.r_[np.arange(51, 81), np.full(10, OOV_ID), rng.integers(2, 51, 60)]
        path = tmp_path / f"2026-01-01T{hour:02d}.parquet"
        pq.write_table(pa.table({"c_user": users.astype(np.int32), "c_item": rng.integers(2, 6, 100).astype(np.int32)}),
                       path)
        files.append(path)
    return files


def test_the_cold_share_is_the_newest_rows_ids_that_the_rows_before_them_do_not_hold(tmp_path: Path):
    shares = cold_shares(_files(tmp_path), ["c_user", "c_item"])
    assert shares == {"c_user": 0.4, "c_item": 0.0}  # 30 new + 10 out of vocabulary of the newest 100 rows
    assert dropout_rates(shares) == {"c_user": 0.4}  # no item is new: their ids are kept
    assert dropout_rates({"c_user": 0.4, "c_item": 0.9}) == {"c_user": 0.4, "c_item": MAX_RATE}
    assert cold_shares(_files(tmp_path)[:1], ["c_user"]) == {}  # one file: nothing before the newest rows


def test_the_cold_share_reads_the_file_before_the_newest_rows_however_large_and_copes_with_null_ids(
        tmp_path: Path, monkeypatch):
    files = _files(tmp_path)
    monkeypatch.setattr(cold_ids, "MAX_EARLIER_ROWS", 50)  # smaller than one file: that file is read all the same
    assert cold_shares(files, ["c_user"])["c_user"] >= 0.4
    nulls = tmp_path / "nulls"
    nulls.mkdir()
    for hour in range(3):
        pq.write_table(pa.table({"c_user": np.zeros(10, dtype=np.int32)}), nulls / f"2026-01-01T{hour:02d}.parquet")
    assert cold_shares(sorted(nulls.glob("*.parquet")), ["c_user"]) == {"c_user": 0.0}  # null everywhere: known


def test_only_vocabulary_tables_of_the_user_and_item_keys_have_their_ids_dropped():
    raw = {"user_key": "user", "item_key": "item", "categorical": {
        "c_user": {"source": "user"}, "c_item": {"source": "item", "hashed": True},
        "c_country": {"source": "country"}, "c_user_x_country": {"source": ["user", "country"], "hashed": True},
        "c_seller": {"source": "item"}}}
    schema = FeatureSchema(dense=(), categorical={"c_user": 10, "c_item": 10, "c_country": 5, "c_user_x_country": 9,
                                                  "c_seller": 7},
                           multi_hot={}, hashed=("c_item", "c_user_x_country"), budgets=(("c_seller", 100),))
    assert key_tables(schema, raw) == ["c_user"]  # hashed, crossed, budgeted or another column's: kept


def test_a_step_drops_the_listed_tables_ids_to_the_unknown_row_at_their_rate():
    rows = 4000
    one_hot = [torch.randint(2, 50, (rows,)) for _ in range(2)]
    multi = torch.randint(2, 9, (3 * rows,))  # a list column after them: three ids a row
    values = torch.cat([*one_hot, multi])

    def dropped(rates, seed):
        return drop_ids(values, rows, rates, torch.Generator().manual_seed(seed))

    out = dropped(((1, 0.3),), 0)
    assert torch.equal(out[:rows], one_hot[0]) and torch.equal(out[2 * rows:], multi)  # other tables untouched
    lost = out[rows:2 * rows] != one_hot[1]
    assert (out[rows:2 * rows][lost] == OOV_ID).all() and abs(lost.float().mean().item() - 0.3) < 0.03
    assert torch.equal(out, dropped(((1, 0.3),), 0)) and not torch.equal(out, dropped(((1, 0.3),), 1))
    assert torch.equal(values, torch.cat([*one_hot, multi]))  # a new tensor: the batch's own ids are kept
    both = dropped(((0, 1.0), (1, 1.0)), 0)
    assert (both[:2 * rows] == OOV_ID).all()
