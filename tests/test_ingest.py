"""Ingestion: every bad input has a known outcome, every row is accounted for, nothing lands twice."""

from __future__ import annotations

import gzip
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from recloop.ingest import ingest
from recloop.ingest.lake import read_events
from recloop.ingest.ledger import Ledger
from recloop.ingest.run import replay_quarantine
from recloop.schema import DatasetSpec, load_spec
from recloop.settings import Settings

SYNTHETIC = load_spec("synthetic")
CRITEO = load_spec("criteo")


def lake_rows(settings: Settings) -> pa.Table:
    """The lake as any pyarrow reader sees it (hidden temporaries are skipped by pyarrow itself)."""
    if not settings.lake_events_dir.exists():
        return pa.table({})
    return ds.dataset(settings.lake_events_dir, format="parquet", partitioning="hive").to_table()


def quarantine_rows(settings: Settings) -> pa.Table:
    files = sorted(settings.quarantine_dir.rglob("*.parquet")) if settings.quarantine_dir.exists() else []
    return pa.concat_tables([pq.read_table(f) for f in files], promote_options="permissive") if files else pa.table({})


def with_column(table: pa.Table, name: str, values) -> pa.Table:
    array = values if isinstance(values, pa.Array) else pa.array(values)
    return table.set_column(table.column_names.index(name), name, array)


def to_csv(table: pa.Table) -> str:
    frame = table.to_pandas()
    frame["history"] = frame["history"].map(lambda h: "|".join(str(int(v)) for v in h))
    frame["ts"] = frame["ts"].map(lambda t: t.isoformat())
    return frame.to_csv(index=False)


# --- the bad-input table -----------------------------------------------------------------------------------

@dataclass
class Case:
    """A landing file built from good events, and what ingesting it must give."""

    make: Callable[[pa.Table, Path, datetime], Path]
    status: str  # ingested | rejected
    quarantined: int | str  # a count, or "all"
    reason: str | None = None  # a reason code every quarantined row carries
    error: str | None = None  # part of the rejection message


def _parquet(name: str, change: Callable[[pa.Table, datetime], pa.Table]):
    def make(events: pa.Table, folder: Path, now: datetime) -> Path:
        path = folder / name
        pq.write_table(change(events, now), path)
        return path

    return make


def _text(name: str, render: Callable[[pa.Table], bytes]):
    def make(events: pa.Table, folder: Path, now: datetime) -> Path:
        path = folder / name
        path.write_bytes(render(events))
        return path

    return make


def _replace_first(column: str, value, type_=None):
    def change(events: pa.Table, now: datetime) -> pa.Table:
        values = events[column].to_pylist()
        values[0] = value
        return with_column(events, column, pa.array(values, type_ or events.schema.field(column).type))

    return change


def _price_as_text(events: pa.Table, now: datetime) -> pa.Table:
    prices = [str(p) for p in events["price"].to_pylist()]
    prices[1] = "abc"
    prices[2] = "12,5"
    return with_column(events, "price", pa.array(prices))


def _fractional_user(events: pa.Table, now: datetime) -> pa.Table:
    users = events["user_id"].cast(pa.float64()).to_pylist()
    users[3] = 7.5
    return with_column(events, "user_id", pa.array(users, pa.float64()))


def _integer_prices(events: pa.Table, now: datetime) -> pa.Table:
    prices = [None if p is None else round(p) for p in events["price"].to_pylist()]
    prices[0] = 2**53 + 1  # no float64 of its own: it rounds (and is above the spec's max)
    return with_column(events, "price", pa.array(prices, pa.int64()))


def _far_future(events: pa.Table, now: datetime) -> pa.Table:
    stamps = events["ts"].to_pylist()
    stamps[0] = now + timedelta(days=3)
    return with_column(events, "ts", pa.array(stamps, pa.timestamp("us", tz="UTC")))


def _millisecond_beyond_microseconds(events: pa.Table, now: datetime) -> pa.Table:
    millis = events["ts"].cast(pa.timestamp("ms", tz="UTC"), safe=False).cast(pa.int64()).to_pylist()
    millis[0] = 2**62  # a valid millisecond count that int64 microseconds cannot hold
    return with_column(events, "ts", pa.array(millis, pa.int64()).cast(pa.timestamp("ms", tz="UTC")))


def _duplicate_within(events: pa.Table, now: datetime) -> pa.Table:
    ids = events["event_id"].to_pylist()
    ids[5] = ids[4]
    ids[6] = ids[4]
    return with_column(events, "event_id", pa.array(ids))


def _csv_non_finite_prices(events: pa.Table) -> bytes:
    lines = to_csv(events).splitlines()
    price = lines[0].split(",").index("price")
    for row, text in enumerate(("Infinity", "1e999", "-inf", "NaN"), start=1):
        cells = lines[row].split(",")
        cells[price] = text
        lines[row] = ",".join(cells)
    return ("\n".join(lines) + "\n").encode()


def _csv_bad_timestamp(events: pa.Table) -> bytes:
    lines = to_csv(events).splitlines()
    cells = lines[1].split(",")
    cells[1] = "yesterday"
    lines[1] = ",".join(cells)
    return ("\n".join(lines) + "\n").encode()


def _csv_latin1(events: pa.Table) -> bytes:
    return to_csv(events).replace("US", "Ü").encode("latin-1")


def _csv_short_line(events: pa.Table) -> bytes:
    lines = to_csv(events).splitlines()
    lines[2] = ",".join(lines[2].split(",")[:5])
    return ("\n".join(lines) + "\n").encode()


def _csv_bad_history(events: pa.Table) -> bytes:
    lines = to_csv(events).splitlines()
    head = lines[1].rsplit(",", 2)
    lines[1] = f"{head[0]},1|x,{head[2]}"
    return ("\n".join(lines) + "\n").encode()


def _truncated_parquet(events: pa.Table, folder: Path, now: datetime) -> Path:
    path = folder / "truncated.parquet"
    pq.write_table(events, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


CASES = {
    "wrong-dtype-text-in-numeric": Case(_parquet("price_text.parquet", _price_as_text), "ingested", 2,
                                        "invalid_type:price"),
    "wrong-dtype-fractional-id": Case(_parquet("fractional.parquet", _fractional_user), "ingested", 1,
                                      "invalid_type:user_id"),
    "missing-column": Case(_parquet("no_price.parquet", lambda e, now: e.drop_columns(["price"])), "ingested",
                           "all", "missing_column:price"),
    "extra-column": Case(_parquet("extra.parquet", lambda e, now: e.append_column("coupon", pa.array(["x"] * len(e)))),
                         "ingested", "all", "unexpected_column:coupon"),
    "uint64-id-beyond-int64": Case(_parquet("uint64.parquet", _replace_first("user_id", 2**63, pa.uint64())),
                                   "ingested", 1, "invalid_type:user_id"),
    "float-id-of-2-pow-63": Case(_parquet("float_id.parquet", _replace_first("user_id", 2.0**63, pa.float64())),
                                 "ingested", 1, "invalid_type:user_id"),
    "int64-label-beyond-int8": Case(_parquet("wide_label.parquet", _replace_first("label", 2**60 + 1, pa.int64())),
                                    "ingested", 1, "invalid_type:label"),
    "uint64-history-beyond-int64": Case(
        _parquet("uint64_history.parquet", _replace_first("history", [1, 2**63], pa.list_(pa.uint64()))),
        "ingested", 1, "invalid_type:history"),
    "int64-price-beyond-2-pow-53": Case(_parquet("int_price.parquet", _integer_prices), "ingested", 1,
                                        "out_of_range:price"),
    "null-label": Case(_parquet("null_label.parquet", _replace_first("label", None)), "ingested", 1, "null:label"),
    "label-outside-0-1": Case(_parquet("label2.parquet", _replace_first("label", 2)), "ingested", 1,
                              "not_allowed:label"),
    "negative-position": Case(_parquet("position.parquet", _replace_first("position", 0)), "ingested", 1,
                              "out_of_range:position"),
    "country-pattern": Case(_parquet("country.parquet", _replace_first("country", "usa")), "ingested", 1,
                            "pattern_mismatch:country"),
    "price-plus-infinity": Case(_parquet("inf.parquet", _replace_first("price", float("inf"))), "ingested", 1,
                                "non_finite:price"),
    "price-nan": Case(_parquet("nan.parquet", _replace_first("price", float("nan"))), "ingested", 1,
                      "non_finite:price"),
    "csv-non-finite-prices": Case(_text("inf.csv", _csv_non_finite_prices), "ingested", 4, "non_finite:price"),
    "unparsable-timestamp": Case(_text("bad_ts.csv", _csv_bad_timestamp), "ingested", 1, "invalid_type:ts"),
    "timestamp-beyond-microseconds": Case(_parquet("millis.parquet", _millisecond_beyond_microseconds), "ingested", 1,
                                          "invalid_type:ts"),
    "far-future-timestamp": Case(_parquet("future.parquet", _far_future), "ingested", 1, "future_timestamp:ts"),
    "duplicate-ids-within-file": Case(_parquet("dups.parquet", _duplicate_within), "ingested", 2,
                                      "duplicate_event_id"),
    "csv-wrong-field-count": Case(_text("short.csv", _csv_short_line), "ingested", 1, "wrong_field_count:5/12"),
    "csv-bad-multi-hot": Case(_text("history.csv", _csv_bad_history), "ingested", 1, "invalid_type:history"),
    "truncated-parquet": Case(_truncated_parquet, "rejected", 0, error="not a readable parquet file"),
    "not-parquet": Case(_text("fake.parquet", lambda e: b"hello, I am text"), "rejected", 0,
                        error="not a readable parquet file"),
    "empty-file": Case(_text("empty.parquet", lambda e: b""), "rejected", 0, error="empty file"),
    "non-utf8-csv": Case(_text("latin1.csv", _csv_latin1), "rejected", 0, error="not UTF-8"),
    "unsupported-type": Case(_text("events.json", lambda e: b"{}"), "rejected", 0, error="unsupported file type"),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_bad_input(case: Case, small_events: pa.Table, settings: Settings, now: datetime, tmp_path: Path):
    landing = tmp_path / "landing"
    landing.mkdir()
    path = case.make(small_events, landing, now)
    summary = ingest(landing, SYNTHETIC, settings, now=now)

    [result] = summary.results
    assert result.status == case.status, result
    assert result.rows_in == result.rows_landed + result.rows_quarantined
    if case.status == "rejected":
        assert case.error in result.error
        assert summary.files_rejected == 1 and not lake_rows(settings).num_rows
        with Ledger.open(settings.ledger_path) as ledger:
            assert ledger.get(result.ledger_key).status == "rejected"
        return
    expected = result.rows_in if case.quarantined == "all" else case.quarantined
    assert result.rows_quarantined == expected
    assert lake_rows(settings).num_rows == result.rows_landed == result.rows_in - expected
    quarantined = quarantine_rows(settings)
    assert quarantined.num_rows == expected
    assert all(case.reason in r for r in quarantined["_reason"].to_pylist()), quarantined["_reason"].to_pylist()
    assert set(quarantined["_source_file"].to_pylist()) == {str(path)}
    assert result.reasons.get(case.reason) == expected


def test_quarantine_keeps_the_original_values_and_row_numbers(small_events, settings, now, tmp_path):
    landing = tmp_path / "landing"
    landing.mkdir()
    (landing / "bad_ts.csv").write_bytes(_csv_bad_timestamp(small_events))
    pq.write_table(_price_as_text(small_events, now), landing / "price.parquet")
    ingest(landing, SYNTHETIC, settings, now=now)
    rows = {(Path(r["_source_file"]).name, r["_source_row"]): r for r in quarantine_rows(settings).to_pylist()}
    assert rows[("bad_ts.csv", 0)]["ts"] == "yesterday"
    assert rows[("bad_ts.csv", 0)]["event_id"] == small_events["event_id"][0].as_py()
    assert rows[("price.parquet", 1)]["price"] == "abc" and rows[("price.parquet", 2)]["price"] == "12,5"
    assert rows[("price.parquet", 1)]["_reason"] == "invalid_type:price"


def test_a_bool_from_parquet_lands_when_its_quarantined_row_is_replayed(small_events, settings, now, tmp_path):
    events = with_column(small_events.slice(0, 3), "label", pa.array([True, False, True]))
    events = with_column(events, "device", pa.array([True, None, False]))  # a string column takes "true"
    events = with_column(events, "price", pa.array([-1.0, 1.0, 2.0]))
    pq.write_table(events, tmp_path / "bools.parquet")
    first = ingest(tmp_path / "bools.parquet", SYNTHETIC, settings, now=now)
    assert (first.rows_landed, first.results[0].reasons) == (2, {"out_of_range:price": 1})
    assert quarantine_rows(settings)["label"].to_pylist() == ["true"]  # shown as the file wrote it

    again = replay_quarantine(settings, SYNTHETIC, now=now)  # nothing fixed yet: quarantined again, still a bool
    assert again.results[0].reasons == {"out_of_range:price": 1}
    columns = [c.model_copy(update={"min": -10.0}) if c.name == "price" else c for c in SYNTHETIC.columns]
    fixed = SYNTHETIC.model_copy(update={"columns": tuple(columns)})
    replayed = replay_quarantine(settings, fixed, now=now)
    assert (replayed.rows_landed, replayed.rows_quarantined) == (1, 0), replayed.results
    lake = lake_rows(settings)
    row = lake.filter(pc.equal(lake["event_id"], events["event_id"][0])).to_pylist()
    assert [(r["label"], r["device"], r["price"]) for r in row] == [(1, "true", -1.0)]


def test_csv_lands_the_same_events_as_parquet(small_events, settings, now, tmp_path):
    landing = tmp_path / "landing"
    landing.mkdir()
    (landing / "events.csv").write_text(to_csv(small_events))
    summary = ingest(landing, SYNTHETIC, settings, now=now)
    assert summary.rows_landed == small_events.num_rows and summary.rows_quarantined == 0
    landed = lake_rows(settings).drop_columns(["date"]).sort_by("event_id")
    expected = small_events.sort_by("event_id")
    for name in expected.column_names:
        if name in ("price", "p_click"):
            np.testing.assert_allclose(landed[name].to_numpy(), expected[name].to_numpy(), rtol=1e-12)
        else:
            assert landed[name].to_pylist() == expected[name].to_pylist(), name


def test_nanosecond_timestamps_from_pandas_land_truncated_to_the_microsecond(small_events, settings, now, tmp_path):
    frame = small_events.to_pandas()
    frame["ts"] = frame["ts"].astype("datetime64[ns, UTC]") + pd.to_timedelta(789, unit="ns")
    frame.to_parquet(tmp_path / "pandas.parquet")  # pandas writes timestamp[ns]
    assert pq.read_schema(tmp_path / "pandas.parquet").field("ts").type.unit == "ns"
    [result] = ingest(tmp_path / "pandas.parquet", SYNTHETIC, settings, now=now).results
    assert (result.status, result.rows_landed) == ("ingested", small_events.num_rows), result
    landed = lake_rows(settings).sort_by("event_id")["ts"]
    assert landed.to_pylist() == small_events.sort_by("event_id")["ts"].to_pylist()  # the 789 ns dropped


def test_integers_beyond_float_precision_land_exactly(small_events, settings, now, tmp_path):
    users = small_events["user_id"].to_pylist()
    users[0], users[1] = 2**60 + 1, 2**64 - 1  # exact in int64 | beyond it: only that row is quarantined
    pq.write_table(with_column(small_events, "user_id", pa.array(users, pa.uint64())), tmp_path / "ids.parquet")
    [result] = ingest(tmp_path / "ids.parquet", SYNTHETIC, settings, now=now).results
    assert (result.rows_landed, result.reasons) == (small_events.num_rows - 1, {"invalid_type:user_id": 1})
    landed = lake_rows(settings).filter(pc.equal(lake_rows(settings)["event_id"], small_events["event_id"][0]))
    assert landed["user_id"].to_pylist() == [2**60 + 1]
    assert quarantine_rows(settings)["user_id"].to_pylist() == [str(2**64 - 1)]


@pytest.mark.parametrize("name", ["excel.csv", "excel.csv.gz"])
def test_a_csv_starting_with_a_byte_order_mark_lands(name, small_events, settings, now, tmp_path):
    data = b"\xef\xbb\xbf" + to_csv(small_events).encode()  # Excel's "CSV UTF-8"
    (tmp_path / name).write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    [result] = ingest(tmp_path / name, SYNTHETIC, settings, now=now).results
    assert (result.rows_landed, result.reasons) == (small_events.num_rows, {}), result
    assert sorted(lake_rows(settings)["event_id"].to_pylist()) == sorted(small_events["event_id"].to_pylist())


def test_duplicates_across_files_and_reingestion_are_noops(small_events, settings, now, tmp_path):
    landing = tmp_path / "landing"
    landing.mkdir()
    pq.write_table(small_events, landing / "a.parquet")
    first = ingest(landing, SYNTHETIC, settings, now=now)
    assert first.rows_landed == small_events.num_rows

    again = ingest(landing, SYNTHETIC, settings, now=now)  # same file: skipped by the ledger
    assert (again.files_skipped, again.rows_in) == (1, 0)
    assert [r.error for r in again.results] == [
        "already ingested under this version of spec 'synthetic': `recloop ingest FILE --reingest` reads it again"]
    shutil.copy(landing / "a.parquet", landing / "a-copy.parquet")  # same bytes, new name: skipped too
    copied = ingest(landing, SYNTHETIC, settings, now=now)
    assert copied.files_skipped == 2
    assert {Path(r.path).name: r.error for r in copied.results}["a-copy.parquet"].startswith(
        f"already ingested under this version of spec 'synthetic' as {landing / 'a.parquet'}")

    # Same events written again (different bytes): every row is a duplicate of the lake.
    overlap = pa.concat_tables([small_events.slice(0, 10), small_events.slice(0, 10)])
    pq.write_table(overlap, landing / "b.parquet", compression="gzip")
    third = ingest(landing, SYNTHETIC, settings, now=now)
    [b] = [r for r in third.results if r.path.endswith("b.parquet")]
    assert (b.rows_in, b.rows_landed, b.rows_quarantined) == (20, 0, 20)
    assert b.reasons == {"duplicate_event_id": 20}
    assert lake_rows(settings).num_rows == small_events.num_rows
    assert pc.count_distinct(lake_rows(settings)["event_id"]).as_py() == small_events.num_rows


def test_a_file_read_again_leaves_its_first_rows_in_the_lake(small_events, settings, now, tmp_path):
    """``--reingest`` deleted the file's ledger record, and with it the first read's outputs from the lake's
    committed files: its rows left every reader (features: 2,928 rows of 3,000) while their ids made the second
    read's rows duplicates, so they were lost for good, and a whole day read again emptied the lake."""
    from recloop.ingest.lake import read_window

    landing = tmp_path / "landing"
    landing.mkdir()
    pq.write_table(small_events, landing / "a.parquet")
    ingest(landing, SYNTHETIC, settings, now=now)
    again = ingest(landing / "a.parquet", SYNTHETIC, settings, now=now, reingest=True)
    assert (again.rows_landed, again.rows_quarantined) == (0, small_events.num_rows)  # duplicates, as documented
    assert read_window(settings, SYNTHETIC, None, None).num_rows == small_events.num_rows
    assert ingest(landing, SYNTHETIC, settings, now=now).files_skipped == 1  # and known to the ledger again


def test_a_bad_file_does_not_stop_the_run(small_events, settings, now, tmp_path):
    landing = tmp_path / "landing"
    (landing / "2026-01-01").mkdir(parents=True)
    (landing / "2026-01-01" / "a_broken.parquet").write_bytes(b"PAR1 garbage")
    pq.write_table(small_events, landing / "2026-01-01" / "b_good.parquet")
    (landing / "_world.json").write_text("{}")  # metadata: not an event file
    (landing / ".partial.parquet.tmp").write_bytes(b"being written")  # hidden: someone is still writing
    summary = ingest(landing, SYNTHETIC, settings, now=now)
    # every entry found is counted (ignored ones were left out of ``files``)
    assert (summary.files, summary.files_rejected, summary.files_ingested, summary.files_ignored) == (4, 1, 1, 2)
    assert summary.files == len(summary.results) and all(r.error for r in summary.results if r.status != "ingested")
    assert summary.rows_landed == small_events.num_rows
    ignored = {Path(r.path).name: r.error for r in summary.results if r.status == "ignored"}
    assert ignored == {"_world.json": "metadata name ('_'): file", ".partial.parquet.tmp": "hidden name ('.'): file"}


def test_lake_is_partitioned_by_event_date_and_reads_as_one_dataset(settings, now, tmp_path):
    from recloop.simulate import WorldConfig, simulate

    simulate(WorldConfig(seed=1, days=2, events_per_day=1000), tmp_path / "landing")
    summary = ingest(tmp_path / "landing", SYNTHETIC, settings, now=now)
    assert summary.files == 49 and summary.files_ignored == 1 and summary.rows_landed == 2000  # + _world.json
    dates = sorted(p.name for p in settings.lake_events_dir.iterdir())
    assert dates == ["date=2026-01-01", "date=2026-01-02"]
    table = lake_rows(settings)
    assert table.num_rows == 2000
    by_date = table.group_by("date").aggregate([("event_id", "count")]).to_pydict()
    assert sorted(zip(by_date["date"], by_date["event_id_count"], strict=True)) == [("2026-01-01", 1000), ("2026-01-02", 1000)]
    with Ledger.open(settings.ledger_path) as ledger:
        assert read_events(ledger, settings.home, settings.lake_events_dir).num_rows == 2000
        assert all(e.status == "done" and e.rows_in == e.rows_landed for e in ledger.entries())


# --- Criteo ------------------------------------------------------------------------------------------------

def criteo_lines(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        ints = ["" if rng.random() < 0.2 else str(int(rng.integers(-2, 500))) for _ in range(13)]
        cats = ["" if rng.random() < 0.1 else f"{int(rng.integers(0, 2**32)):08x}" for _ in range(26)]
        lines.append("\t".join([str(int(rng.random() < 0.25)), *ints, *cats]))
    return lines


def test_criteo_ids_and_times_are_derived_and_stable(settings, now, tmp_path):
    landing = tmp_path / "landing"
    landing.mkdir()
    lines = criteo_lines(50)
    lines[7] = "\t".join(lines[7].split("\t")[:30])  # a line with the wrong number of fields
    lines[8] = lines[8].replace("\t", "\t0x", 1).replace("0x", "zz", 1)  # I1 not an integer
    (landing / "day_3").write_text("\n".join(lines) + "\n")
    summary = ingest(landing, CRITEO, settings, now=now)
    [result] = summary.results
    assert (result.rows_in, result.rows_landed, result.rows_quarantined) == (50, 48, 2)
    assert result.reasons == {"invalid_type:I1": 1, "wrong_field_count:30/40": 1}
    quarantined = {r["_source_row"]: r for r in quarantine_rows(settings).to_pylist()}
    assert quarantined[7]["_raw_line"] == lines[7]
    landed = lake_rows(settings).sort_by("ts")
    day_three = datetime(2014, 1, 4, tzinfo=UTC)
    assert landed["ts"][0].as_py() == day_three and landed["ts"][-1].as_py() < day_three + timedelta(days=1)
    assert landed["C1"].null_count < 50 and landed["I1"].type == pa.int64()

    # Another lake reading the same bytes under another name gets the same ids.
    other = Settings(home=tmp_path / "other")
    (tmp_path / "again").mkdir()
    shutil.copy(landing / "day_3", tmp_path / "again" / "day_3.tsv")
    ingest(tmp_path / "again", CRITEO, other, now=now)
    assert sorted(lake_rows(other)["event_id"].to_pylist()) == sorted(landed["event_id"].to_pylist())


def test_a_criteo_tsv_starting_with_a_byte_order_mark_lands_the_same_ids(settings, now, tmp_path):
    text = "\n".join(criteo_lines(20)) + "\n"
    for folder, data in (("plain", text.encode()), ("bom", b"\xef\xbb\xbf" + text.encode())):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "day_0").write_bytes(data)
    plain = Settings(home=tmp_path / "home-plain")
    ingest(tmp_path / "plain", CRITEO, plain, now=now)
    [result] = ingest(tmp_path / "bom", CRITEO, settings, now=now).results
    assert (result.rows_landed, result.reasons) == (20, {}), result
    assert sorted(lake_rows(settings)["event_id"].to_pylist()) == sorted(lake_rows(plain)["event_id"].to_pylist())


def test_extra_columns_can_be_ignored_by_the_spec(small_events, settings, now, tmp_path):
    lenient = DatasetSpec.model_validate({**SYNTHETIC.model_dump(), "on_extra_columns": "ignore"})
    landing = tmp_path / "landing"
    landing.mkdir()
    pq.write_table(small_events.append_column("coupon", pa.array(["x"] * len(small_events))), landing / "e.parquet")
    summary = ingest(landing, lenient, settings, now=now)
    assert summary.rows_landed == small_events.num_rows and "coupon" not in lake_rows(settings).column_names


@pytest.mark.parametrize("pattern", ["[A-Z]{2}", "US|FR", "^US|FR$", "(?!XX)[A-Z]{2}"],
                         ids=["unanchored", "alternatives", "anchors-inside-alternatives", "lookahead-python-re"])
def test_a_pattern_must_match_the_whole_value(pattern, small_events, settings, now, tmp_path):
    columns = [c.model_copy(update={"pattern": pattern}) if c.name == "country" else c for c in SYNTHETIC.columns]
    spec = SYNTHETIC.model_copy(update={"columns": tuple(columns)})
    countries = ["US", "FR", "USA", "xUS", "FRx", "US\n"] + [None] * (small_events.num_rows - 6)
    pq.write_table(with_column(small_events, "country", pa.array(countries, pa.string())), tmp_path / "c.parquet")
    [result] = ingest(tmp_path / "c.parquet", spec, settings, now=now).results
    assert result.reasons == {"pattern_mismatch:country": 4}, result  # as serving's re.fullmatch judges them
    assert sorted(quarantine_rows(settings)["country"].to_pylist()) == ["FRx", "US\n", "USA", "xUS"]


def test_a_spec_can_let_non_finite_values_of_a_column_land(small_events, settings, now, tmp_path):
    columns = [c.model_copy(update={"allow_non_finite": True}) if c.name == "price" else c for c in SYNTHETIC.columns]
    lenient = SYNTHETIC.model_copy(update={"columns": tuple(columns)})
    landing = tmp_path / "landing"
    landing.mkdir()
    (landing / "inf.csv").write_bytes(_csv_non_finite_prices(small_events))
    summary = ingest(landing, lenient, settings, now=now)
    assert summary.rows_landed == small_events.num_rows
    prices = lake_rows(settings).sort_by("event_id")["price"].to_numpy(zero_copy_only=False)
    assert np.isposinf(prices).sum() == 2 and np.isneginf(prices).sum() == 1 and np.isnan(prices).sum() >= 1


def test_missing_source_is_a_clear_error(settings):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ingest(Path("/nonexistent/landing"), SYNTHETIC, settings)


def test_summary_json_has_the_documented_keys(small_events, settings, now, tmp_path):
    pq.write_table(small_events, tmp_path / "e.parquet")
    payload = json.loads(json.dumps(ingest(tmp_path / "e.parquet", SYNTHETIC, settings, now=now).to_dict()))
    for key in ("files", "files_skipped", "files_rejected", "rows_in", "rows_landed", "rows_quarantined"):
        assert key in payload
    for detail in payload["files_detail"]:
        assert detail["rows_in"] == detail["rows_landed"] + detail["rows_quarantined"]


def test_only_zero_and_one_are_booleans():
    """A typed 2 (or 0.5) for a bool column is invalid, that row alone, as the text "2" is (Arrow's cast
    read any non-zero number as true); nulls stay nulls."""
    from recloop.ingest.validate import coerce_column
    from recloop.schema import ColumnSpec

    flag = ColumnSpec(name="clicked", role="label", dtype="bool")
    for values in (pa.array([0, 1, 2, None], pa.int64()), pa.array([0.0, 1.0, 0.5, None])):
        typed, bad = coerce_column(flag, values)
        assert typed.to_pylist() == [False, True, None, None] and bad.tolist() == [False, False, True, False]


@pytest.mark.parametrize("pattern", [r"\d{2}", r"(?!00)\d{2}"], ids=["re2", "python-re"])
def test_ingestion_and_serving_judge_other_scripts_digits_alike(pattern, small_events, settings, now, tmp_path):
    """``\\d`` is ASCII in both places: RE2 (ingestion) and Python's ``re`` (serving, and ingestion's
    fallback for what RE2 cannot run) used to disagree on Arabic-Indic digits, so serving accepted a
    context value whose rows ingestion quarantined."""
    from recloop.features.online import RequestError, _check_categorical

    columns = [c.model_copy(update={"pattern": pattern}) if c.name == "country" else c for c in SYNTHETIC.columns]
    spec = SYNTHETIC.model_copy(update={"columns": tuple(columns)})
    countries = ["12", "\u0661\u0662", "\uff11\uff12"] + [None] * (small_events.num_rows - 3)  # ASCII, Arabic, fullwidth
    pq.write_table(with_column(small_events, "country", pa.array(countries, pa.string())), tmp_path / "c.parquet")
    [result] = ingest(tmp_path / "c.parquet", spec, settings, now=now).results
    assert result.reasons == {"pattern_mismatch:country": 2}, result
    country = next(c for c in spec.columns if c.name == "country")
    _check_categorical(country, pa.array(["12"]))
    for refused in countries[1:3]:
        with pytest.raises(RequestError, match="does not match"):
            _check_categorical(country, pa.array([refused]))
