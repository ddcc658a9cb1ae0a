"""Atomicity and exactly-once under crashes and concurrency: real processes, really killed midway."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from recloop.ingest import ingest
from recloop.ingest.ledger import Ledger
from recloop.schema import load_spec
from recloop.settings import Settings

NOW = datetime(2026, 2, 1, tzinfo=UTC)

# Runs an ingest in a child process that dies abruptly (os._exit: no cleanup, no finally blocks) at a
# chosen point of the commit: while writing an output, or between two renames after the commit point.
CRASHING_INGEST = textwrap.dedent(
    """
    import os, sys
    from datetime import datetime, timezone
    from pathlib import Path
    import recloop.ingest.lake as lake
    from recloop.ingest import ingest
    from recloop.schema import load_spec
    from recloop.settings import Settings

    source, home, crash_at = sys.argv[1], sys.argv[2], sys.argv[3]
    if crash_at == "staging":
        real_write = lake.StagedParquet.write
        def write_half_then_die(self, table):
            real_write(self, table.slice(0, table.num_rows // 2))
            os._exit(9)
        lake.StagedParquet.write = write_half_then_die
    elif crash_at == "publishing":
        real_replace, renames = lake.os.replace, []
        def die_on_second_rename(src, dst):
            renames.append(src)
            if len(renames) == 2:
                os._exit(9)
            real_replace(src, dst)
        lake.os.replace = die_on_second_rename
    ingest(Path(source), load_spec("synthetic"), Settings(home=Path(home)),
           now=datetime(2026, 2, 1, tzinfo=timezone.utc))
    """
)


def run_child(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CRASHING_INGEST, *args], capture_output=True, text=True, timeout=120)


def visible_lake_rows(settings: Settings) -> int:
    if not settings.lake_events_dir.exists():
        return 0
    return ds.dataset(settings.lake_events_dir, format="parquet", partitioning="hive").count_rows()


@pytest.fixture
def two_day_file(small_events: pa.Table, tmp_path: Path) -> Path:
    """One source file whose rows span two dates, plus one bad row: three outputs to commit."""
    shifted = pc.add(small_events["ts"].slice(100), pa.scalar(timedelta(days=1), pa.duration("us")))
    stamps = pa.concat_arrays([small_events["ts"].slice(0, 100).combine_chunks(), shifted.combine_chunks()])
    table = small_events.set_column(1, "ts", stamps)
    labels = table["label"].to_pylist()
    labels[0] = 5
    table = table.set_column(table.column_names.index("label"), "label", pa.array(labels, pa.int8()))
    landing = tmp_path / "landing"
    landing.mkdir()
    path = landing / "span.parquet"
    pq.write_table(table, path)
    return path


@pytest.mark.parametrize("crash_at", ["staging", "publishing"])
def test_a_killed_ingest_leaves_nothing_half_visible_and_the_next_run_finishes(
    crash_at: str, two_day_file: Path, settings: Settings
):
    total = pq.read_metadata(two_day_file).num_rows
    child = run_child(str(two_day_file.parent), str(settings.home), crash_at)
    assert child.returncode == 9, child.stderr

    with Ledger.open(settings.ledger_path) as ledger:
        states = [e.status for e in ledger.entries()]
    if crash_at == "staging":
        # Died writing the first output: nothing visible to any reader, nothing in the ledger.
        assert visible_lake_rows(settings) == 0 and states == []
        assert list(settings.home.rglob(".*.tmp")), "the half-written output exists, hidden"
    else:
        # Died after the commit point, between renames: the ledger knows the commit is in flight.
        assert states == ["committing"]

    summary = ingest(two_day_file.parent, load_spec("synthetic"), settings, now=NOW)
    if crash_at == "publishing":
        assert summary.recovered == [str(two_day_file)] and summary.files_skipped == 1
    else:
        assert summary.files_ingested == 1 and summary.rows_landed == total - 1
    assert visible_lake_rows(settings) == total - 1
    assert not list(settings.home.rglob(".*.tmp")), "temporaries are cleaned up"
    with Ledger.open(settings.ledger_path) as ledger:
        [entry] = ledger.entries()
    assert (entry.status, entry.rows_in, entry.rows_landed, entry.rows_quarantined) == ("done", total, total - 1, 1)
    # And once more: nothing changes.
    assert ingest(two_day_file.parent, load_spec("synthetic"), settings, now=NOW).rows_in == 0
    assert visible_lake_rows(settings) == total - 1


def test_two_ingests_at_once_land_every_event_exactly_once(tmp_path: Path, settings: Settings):
    from recloop.simulate import WorldConfig, simulate

    simulate(WorldConfig(seed=9, days=1, events_per_day=3000), tmp_path / "landing")
    children = [
        subprocess.Popen([sys.executable, "-c", CRASHING_INGEST, str(tmp_path / "landing"), str(settings.home), "never"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    for child in children:
        assert child.wait(timeout=120) == 0, child.stderr.read()
    lake = ds.dataset(settings.lake_events_dir, format="parquet", partitioning="hive").to_table(columns=["event_id"])
    assert lake.num_rows == 3000 and pc.count_distinct(lake["event_id"]).as_py() == 3000
    with Ledger.open(settings.ledger_path) as ledger:
        assert len(ledger.entries(status="done")) == 24
