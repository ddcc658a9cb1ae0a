"""Ingestion under hostile landing folders: files that vanish, cannot be read, lead elsewhere, repeat
events under another date, or are bigger than one batch. Each file gets a named outcome; the run goes on."""

from __future__ import annotations

import os
import sqlite3
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from recloop.ingest import ingest
from recloop.ingest.ledger import Ledger
from recloop.ingest.readers import open_landing_file, read_batches
from recloop.schema import load_spec
from recloop.settings import Settings

SYNTHETIC = load_spec("synthetic")
CRITEO = load_spec("criteo")


def lake_table(settings: Settings) -> pa.Table:
    if not settings.lake_events_dir.exists():
        return pa.table({})
    return ds.dataset(settings.lake_events_dir, format="parquet", partitioning="hive").to_table()


def quarantine_table(settings: Settings) -> pa.Table:
    files = sorted(settings.quarantine_dir.rglob("*.parquet")) if settings.quarantine_dir.exists() else []
    return pa.concat_tables([pq.read_table(f) for f in files]) if files else pa.table({})


def thirds(events: pa.Table, landing: Path) -> list[Path]:
    landing.mkdir(parents=True, exist_ok=True)
    step = events.num_rows // 3
    paths = []
    for i, name in enumerate(("a.parquet", "b.parquet", "c.parquet")):
        pq.write_table(events.slice(i * step, step), landing / name)
        paths.append(landing / name)
    return paths


def by_name(summary) -> dict[str, object]:
    return {Path(r.path).name: r for r in summary.results}


# --- files that cannot be read --------------------------------------------------------------------------


def test_a_file_that_vanishes_mid_run_is_rejected_and_the_run_goes_on(small_events, settings, now, tmp_path):
    a, b, c = thirds(small_events, tmp_path / "landing")

    def remove_b(result) -> None:
        if result.path == str(a):
            b.unlink()  # gone between discovery and reading, as a producer's cleanup might do

    summary = ingest(tmp_path / "landing", SYNTHETIC, settings, now=now, on_file=remove_b)
    results = by_name(summary)
    assert results["b.parquet"].status == "rejected" and "vanished" in results["b.parquet"].error
    assert results["a.parquet"].status == results["c.parquet"].status == "ingested"
    assert lake_table(settings).num_rows == 2 * (small_events.num_rows // 3)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_an_unreadable_file_is_rejected_each_run_until_it_can_be_read(small_events, settings, now, tmp_path):
    _, b, _ = thirds(small_events, tmp_path / "landing")
    b.chmod(0)
    try:
        first = ingest(tmp_path / "landing", SYNTHETIC, settings, now=now)
        assert by_name(first)["b.parquet"].status == "rejected" and first.files_ingested == 2
        assert "Permission denied" in by_name(first)["b.parquet"].error
    finally:
        b.chmod(0o644)
    again = ingest(tmp_path / "landing", SYNTHETIC, settings, now=now)  # not remembered as bad: read now
    assert by_name(again)["b.parquet"].status == "ingested"


@pytest.mark.timeout(60)
def test_a_pipe_named_like_a_landing_file_is_refused_without_blocking(small_events, settings, now, tmp_path):
    thirds(small_events, tmp_path / "landing")
    os.mkfifo(tmp_path / "landing" / "stream.csv")  # opening it for reading would wait for a writer forever
    summary = ingest(tmp_path / "landing", SYNTHETIC, settings, now=now)
    assert by_name(summary)["stream.csv"].status == "rejected"
    assert "not a regular file" in by_name(summary)["stream.csv"].error
    assert summary.files_ingested == 3


def test_a_file_broken_halfway_is_rejected_whole_and_leaves_nothing(small_events, settings, now, tmp_path):
    landing = tmp_path / "landing"
    landing.mkdir()
    frame = small_events.to_pandas()
    frame["history"] = frame["history"].map(lambda h: "|".join(str(int(v)) for v in h))
    text = frame.to_csv(index=False).encode()
    (landing / "late.csv").write_bytes(text + b"e-bad,2026-01-01T18:00:00Z,1,2,0,ios,\xfcS,3,1.0,1,,0.5\n")
    summary = ingest(landing, SYNTHETIC, settings, now=now, batch_rows=16)  # many batches before the bad one
    [result] = summary.results
    assert result.status == "rejected" and "UTF-8" in result.error, result
    assert lake_table(settings).num_rows == 0 and quarantine_table(settings).num_rows == 0
    assert not list(settings.home.rglob(".*.tmp"))
    with Ledger.open(settings.ledger_path) as ledger:
        assert ledger.event_id_count() == 0 and ledger.get(result.ledger_key).status == "rejected"


# --- links, odd names: every file accounted for ------------------------------------------------------------


def test_links_are_refused_and_hidden_names_are_listed(small_events, settings, now, tmp_path):
    landing = tmp_path / "landing"
    thirds(small_events, landing)
    outside = tmp_path / "outside"
    outside.mkdir()
    pq.write_table(small_events.slice(0, 5), outside / "other.parquet")
    (landing / "passwd.csv").symlink_to("/etc/passwd")
    (landing / "elsewhere").symlink_to(outside, target_is_directory=True)
    (landing / "dangling.parquet").symlink_to(tmp_path / "nothing-here")
    pq.write_table(small_events.slice(0, 5), landing / "..%2f..%2fescape.parquet")
    (landing / ".git").mkdir()
    (landing / ".git" / "config").write_text("[core]")

    summary = ingest(landing, SYNTHETIC, settings, now=now)
    results = by_name(summary)
    assert set(results) == {"a.parquet", "b.parquet", "c.parquet", "passwd.csv", "elsewhere", "dangling.parquet",
                            "..%2f..%2fescape.parquet", ".git"}
    for link in ("passwd.csv", "elsewhere", "dangling.parquet"):
        assert results[link].status == "rejected" and "symbolic link" in results[link].error
    assert results["..%2f..%2fescape.parquet"].status == "ignored"
    assert "hidden name" in results["..%2f..%2fescape.parquet"].error
    assert "not searched" in results[".git"].error
    assert (summary.files_ingested, summary.files_rejected, summary.files_ignored) == (3, 3, 2)
    assert quarantine_table(settings).num_rows == 0  # /etc/passwd never read
    assert lake_table(settings).num_rows == 3 * (small_events.num_rows // 3)


# --- duplicates across the whole lake --------------------------------------------------------------------


def _shifted(events: pa.Table, days: int) -> pa.Table:
    later = pc.add(events["ts"], pa.scalar(timedelta(days=days), pa.duration("us")))
    return events.set_column(events.column_names.index("ts"), "ts", later)


def test_an_event_replayed_under_another_date_is_a_duplicate(small_events, settings, now, tmp_path):
    first = tmp_path / "first"
    first.mkdir()
    pq.write_table(small_events, first / "day1.parquet")
    ingest(first, SYNTHETIC, settings, now=now)

    replay = tmp_path / "replay"
    replay.mkdir()
    pq.write_table(_shifted(small_events.slice(0, 7), days=2), replay / "day3.parquet")
    summary = ingest(replay, SYNTHETIC, settings, now=now)
    [result] = summary.results
    assert (result.rows_landed, result.rows_quarantined) == (0, 7)
    assert result.reasons == {"duplicate_event_id": 7}
    assert lake_table(settings).num_rows == small_events.num_rows


def test_a_ledger_from_before_the_id_set_is_filled_from_the_lake(small_events, settings, now, tmp_path):
    first = tmp_path / "first"
    first.mkdir()
    pq.write_table(small_events, first / "day1.parquet")
    ingest(first, SYNTHETIC, settings, now=now)
    with sqlite3.connect(settings.ledger_path) as db:  # as an older recloop left it: no ids, no marker
        db.execute("DELETE FROM event_ids")
        db.execute("DELETE FROM meta")

    replay = tmp_path / "replay"
    replay.mkdir()
    pq.write_table(_shifted(small_events.slice(0, 7), days=2), replay / "day3.parquet")
    [result] = ingest(replay, SYNTHETIC, settings, now=now).results
    assert result.reasons == {"duplicate_event_id": 7}
    with Ledger.open(settings.ledger_path) as ledger:
        assert ledger.event_id_count() == small_events.num_rows


# --- batch by batch --------------------------------------------------------------------------------------


def _csv_with_bad_lines(events: pa.Table) -> bytes:
    frame = events.to_pandas()
    frame["history"] = frame["history"].map(lambda h: "|".join(str(int(v)) for v in h))
    lines = frame.to_csv(index=False).splitlines()
    for row in (3, 40, 41, 150, len(lines) - 1):  # wrong field counts spread over many blocks, one at the end
        lines[row] = ",".join(lines[row].split(",")[:4])
    return ("\n".join(lines) + "\n").encode()


def _criteo_text(n: int) -> str:
    rng = np.random.default_rng(1)
    lines = []
    for i in range(n):
        ints = ["" if rng.random() < 0.2 else str(int(rng.integers(-2, 500))) for _ in range(13)]
        cats = [f"{int(rng.integers(0, 2**32)):08x}" for _ in range(26)]
        line = "\t".join([str(int(rng.random() < 0.25)), *ints, *cats])
        lines.append(line if i % 37 else line[: line.rfind("\t")])  # every 37th line is short a field
    return "\n".join(lines)  # no final newline: the last line still counts (in a file that is not changing)


def _written_a_while_ago(path: Path, text: str) -> None:
    """``text`` at ``path``, last changed two minutes ago: a text file whose last line has no line end is read
    only once it has not changed for ``readers.UNSETTLED_SECONDS``."""
    path.write_text(text)
    os.utime(path, (time.time() - 120, time.time() - 120))


@pytest.mark.parametrize("kind", ["parquet", "csv", "criteo"])
def test_small_batches_land_exactly_what_one_batch_lands(kind, small_events, now, tmp_path):
    landing = tmp_path / "landing"
    landing.mkdir()
    spec = CRITEO if kind == "criteo" else SYNTHETIC
    events = pa.concat_tables([small_events, small_events.slice(0, 9)])  # in-file duplicates across batches
    if kind == "parquet":
        pq.write_table(events, landing / "e.parquet", row_group_size=37)
    elif kind == "csv":
        (landing / "e.csv").write_bytes(_csv_with_bad_lines(events))
    else:
        _written_a_while_ago(landing / "day_2", _criteo_text(300))

    outcomes = []
    for batch_rows in (1_000_000, 16):
        settings = Settings(home=tmp_path / f"home-{batch_rows}")
        [result] = ingest(landing, spec, settings, now=now, batch_rows=batch_rows).results
        lake = lake_table(settings).sort_by(spec.event_id)
        quarantined = quarantine_table(settings).select(["_source_row", "_reason"]).sort_by("_source_row")
        outcomes.append((result.rows_in, result.rows_landed, result.rows_quarantined, result.reasons,
                         lake.to_pylist(), quarantined.to_pylist()))
    assert outcomes[0][2] > 0 and outcomes[0][1] > 0  # both kinds of row were exercised
    assert outcomes[1] == outcomes[0]


def test_a_reader_never_holds_more_than_a_batch(small_events, tmp_path):
    pq.write_table(small_events, tmp_path / "e.parquet", row_group_size=100)
    _written_a_while_ago(tmp_path / "day_0", _criteo_text(120))
    for name, spec, rows in (("e.parquet", SYNTHETIC, small_events.num_rows), ("day_0", CRITEO, 120)):
        with open_landing_file(tmp_path / name) as handle:
            sizes = [b.rows_in for b in read_batches(handle, name, spec, "0" * 64, batch_rows=16)]
        assert max(sizes) <= 16 and sum(sizes) == rows, (name, sizes)


# --- what an adversarial review of ingestion found (2026-11-29) -------------------------------------------------


def test_a_timestamp_no_python_datetime_holds_quarantines_its_row_not_the_file(small_events, now, tmp_path):
    """Two bad stamps in one file, one before year 1: pandera's report of the failures turned them into Python
    datetimes and crashed (OverflowError), so the whole file was rejected and its good rows never landed."""
    micros = small_events["ts"].cast(pa.int64()).to_pylist()
    micros[0] = -62_200_000_000 * 10**6  # before year 1
    micros[1] = 4_000_000_000 * 10**6  # 2096: in the future
    stamps = pa.array(micros, pa.int64()).cast(pa.timestamp("us", tz="UTC"))
    landing = tmp_path / "landing"
    landing.mkdir()
    pq.write_table(small_events.set_column(small_events.schema.get_field_index("ts"), "ts", stamps), landing / "e.parquet")
    settings = Settings(home=tmp_path / "home")
    [result] = ingest(landing, SYNTHETIC, settings, now=now).results
    assert result.status == "ingested", result.error
    assert (result.rows_landed, result.rows_quarantined) == (small_events.num_rows - 2, 2)
    reasons = dict(zip(*(quarantine_table(settings)[c].to_pylist() for c in ("_source_row", "_reason")), strict=True))
    assert reasons == {0: "out_of_range:ts", 1: "future_timestamp:ts"}


def test_a_header_without_a_line_end_is_an_empty_csv_not_a_bad_one(now, tmp_path):
    """``event_id,ts,…`` with no newline after it was rejected for good ("Could not skip initial 1 rows"), while
    the same header with a newline was a file of no rows."""
    landing = tmp_path / "landing"
    landing.mkdir()
    _written_a_while_ago(landing / "header.csv", ",".join(SYNTHETIC.names))
    [result] = ingest(landing, SYNTHETIC, Settings(home=tmp_path / "home"), now=now).results
    assert (result.status, result.rows_in, result.error) == ("ingested", 0, None)


def test_blank_lines_of_a_criteo_file_are_no_rows(now, tmp_path):
    """Trailing blank lines were rows with one field each, quarantined as ``wrong_field_count:1/40``."""
    landing = tmp_path / "landing"
    landing.mkdir()
    (landing / "day_0").write_text(_criteo_text(36) + "\n\n\n")  # (its first line is short a field)
    [result] = ingest(landing, CRITEO, Settings(home=tmp_path / "home"), now=now).results
    assert (result.rows_in, result.rows_landed, result.reasons) == (36, 35, {"wrong_field_count:39/40": 1})


def test_a_text_file_still_being_written_waits_for_the_next_run(now, tmp_path):
    """A CSV read while its writer was inside the last line landed that line cut short (``0.`` of ``0.75`` as
    0.0); the finished line was then refused as a duplicate id and the wrong value stayed. A text file whose
    last line has no line end and that changed within ``UNSETTLED_SECONDS`` is left for the next run."""
    landing = tmp_path / "landing"
    landing.mkdir()
    header = ",".join(SYNTHETIC.names)
    first = "e1,2026-01-01T00:00:00Z,1,2,0,ios,GB,3,10.5,1,,0.25"
    second = "e2,2026-01-01T00:01:00Z,1,3,1,ios,GB,3,10.5,2,,0.75"
    (landing / "events.csv").write_text(f"{header}\n{first}\n{second[:-2]}")  # the writer is at "0."
    settings = Settings(home=tmp_path / "home")
    [waiting] = ingest(landing, SYNTHETIC, settings, now=now).results
    assert waiting.status == "rejected" and "may still be being written" in waiting.error
    assert not lake_table(settings).num_rows
    (landing / "events.csv").write_text(f"{header}\n{first}\n{second}\n")  # finished: read at once
    [landed] = ingest(landing, SYNTHETIC, settings, now=now).results
    assert (landed.status, landed.rows_landed) == ("ingested", 2)
    assert sorted(lake_table(settings).select(["event_id", "p_click"]).to_pylist(), key=str) == [
        {"event_id": "e1", "p_click": 0.25}, {"event_id": "e2", "p_click": 0.75}]


def test_a_file_named_or_a_replayed_log_is_read_at_once_without_a_last_line_end(now, tmp_path):
    """The wait is for files found in the landing zone: a file named as the source (the user chose it) and a
    finished log (``recloop replay``, ``wait_for_writers=False``) are read at once, last line included."""
    header = ",".join(SYNTHETIC.names)
    text = f"{header}\ne1,2026-01-01T00:00:00Z,1,2,0,ios,GB,3,10.5,1,,0.25"  # just written, no line end
    for name, where, options in (("named", "events.csv", {}), ("replayed", "", {"wait_for_writers": False})):
        landing = tmp_path / name
        landing.mkdir()
        (landing / "events.csv").write_text(text)
        [result] = ingest(landing / where, SYNTHETIC, Settings(home=tmp_path / f"home-{name}"), now=now,
                          **options).results
        assert (result.status, result.rows_landed) == ("ingested", 1), (name, result.error)
