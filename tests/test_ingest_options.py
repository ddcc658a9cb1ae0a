"""Ingestion options a spec declares: timestamp formats, whole floats in integer columns, the ledger keyed on
content + spec version, --reingest, quarantine replay, and Criteo as TSV, CSV with a header or parquet."""

from __future__ import annotations

import json
import shutil
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
from test_ingest import criteo_lines
from typer.testing import CliRunner

from recloop.cli import app
from recloop.ingest import ingest, lake
from recloop.schema import DatasetSpec, load_spec

NOW = datetime(2026, 2, 1, tzinfo=UTC)


def ratings_spec(ts_format: str | None = None, integral_floats: bool = False) -> DatasetSpec:
    ts = {
        "name": "ts",
        "role": "timestamp",
        "dtype": "timestamp",
        **({"format": ts_format} if ts_format else {}),
    }
    return DatasetSpec.model_validate(
        {
            "name": "ratings",
            "integral_floats": integral_floats,
            "columns": [
                {"name": "rating_id", "role": "event_id", "dtype": "string"},
                ts,
                {"name": "customer", "role": "user_key", "dtype": "int64", "min": 0},
                {"name": "product", "role": "item_key", "dtype": "int64", "min": 0},
                {"name": "liked", "role": "label", "dtype": "int8", "allowed": [0, 1]},
                {"name": "year", "role": "numeric", "dtype": "int64", "min": 1900, "max": 2100},
            ],
        }
    )


def read_window(settings, spec):
    return lake.read_window(settings, spec, None, None)


def write_csv(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    header = list(rows[0])
    path.write_text(
        ",".join(header) + "\n" + "".join(",".join(str(r[h]) for h in header) + "\n" for r in rows)
    )
    return path


def rows_with(ts_values: list, years: list) -> list[dict]:
    return [
        {"rating_id": f"r{i}", "ts": ts, "customer": i % 3, "product": i % 5, "liked": i % 2, "year": year}
        for i, (ts, year) in enumerate(zip(ts_values, years, strict=True))
    ]


@pytest.mark.parametrize(
    ("ts_format", "values"),
    [
        ("epoch_s", [1420070400, 1420070401]),
        ("epoch_ms", [1420070400000, 1420070401000]),
        ("epoch_us", [1420070400000000, 1420070401000000]),
        (None, ["2015-01-01T00:00:00Z", "2015-01-01 00:00:01+00:00"]),
    ],
)
def test_timestamp_formats_declared_in_the_spec(settings, tmp_path, ts_format, values):
    spec = ratings_spec(ts_format)
    landing = write_csv(tmp_path / "in" / "r.csv", rows_with(values, [2015, 2016])).parent
    assert ingest(landing, spec, settings, now=NOW).rows_landed == 2
    landed = read_window(settings, spec).sort_by("ts")["ts"].to_pylist()
    assert landed == [datetime(2015, 1, 1, tzinfo=UTC), datetime(2015, 1, 1, 0, 0, 1, tzinfo=UTC)]


def test_epoch_seconds_without_a_format_are_quarantined_with_a_hint(settings, tmp_path):
    landing = write_csv(tmp_path / "in" / "r.csv", rows_with([1420070400, 1420070401], [2015, 2016])).parent
    [result] = ingest(landing, ratings_spec(), settings, now=NOW).results
    assert result.rows_quarantined == 2 and result.reasons == {"invalid_type:ts": 2}
    assert any("format: epoch_s" in hint for hint in result.hints), result.hints


def test_whole_floats_in_an_integer_column_are_accepted_when_the_spec_says_so(settings, tmp_path):
    landing = write_csv(
        tmp_path / "in" / "r.csv", rows_with([1420070400] * 3, ["2015.0", "2015.5", "2016"])
    ).parent
    strict = ingest(landing, ratings_spec("epoch_s"), settings, now=NOW).results[0]
    assert strict.reasons == {"invalid_type:year": 2} and any("integral_floats" in h for h in strict.hints)

    lenient = ratings_spec("epoch_s", integral_floats=True)
    [result] = ingest(
        landing, lenient, settings, now=NOW
    ).results  # a new spec version: the file is read again
    # 2015.5 is not lossless; 2016 landed the first time, so it is a duplicate now.
    assert result.status == "ingested" and result.reasons == {"invalid_type:year": 1, "duplicate_event_id": 1}
    assert sorted(read_window(settings, lenient)["year"].to_pylist()) == [2015, 2016]


def test_reingest_and_quarantine_replay_from_the_cli(tmp_path, monkeypatch):
    monkeypatch.setenv("RECLOOP_HOME", str(tmp_path / "home"))
    runner = CliRunner()
    bad_spec, good_spec = (
        tmp_path / "strict.yaml",
        tmp_path / "fixed_spec.yaml",
    )  # file names ≠ the spec's name
    bad_spec.write_text(json.dumps(ratings_spec().model_dump(mode="json")))
    good_spec.write_text(json.dumps(ratings_spec("epoch_s").model_dump(mode="json")))
    landing = write_csv(tmp_path / "in" / "r.csv", rows_with([1420070400, 1420070401], [2015, 2016])).parent

    first = runner.invoke(app, ["ingest", str(landing), "--spec", str(bad_spec)])
    assert first.exit_code == 0 and "format: epoch_s" in first.output and "quarantine replay" in first.output
    again = json.loads(runner.invoke(app, ["ingest", str(landing), "--spec", str(bad_spec), "--json"]).stdout)
    assert again["files_skipped"] == 1
    forced = json.loads(
        runner.invoke(app, ["ingest", str(landing), "--spec", str(bad_spec), "--reingest", "--json"]).stdout
    )
    assert forced["files_ingested"] == 1 and forced["rows_quarantined"] == 2

    replayed = runner.invoke(app, ["quarantine", "replay", "--spec", str(good_spec), "--json"])
    assert replayed.exit_code == 0, replayed.output
    summary = json.loads(replayed.stdout)
    # Two quarantine files (first ingest, --reingest) hold the same two rows: they land once, then duplicates.
    assert (summary["rows_in"], summary["rows_landed"], summary["rows_quarantined"]) == (4, 2, 2)
    home = tmp_path / "home"
    assert sorted(p.name for p in (home / "quarantine" / "replayed").rglob("*.parquet")) and not [
        p
        for p in (home / "quarantine").glob("date=*/*.parquet")
        if pq.read_table(p)["_reason"].to_pylist() != ["duplicate_event_id"] * 2
    ]
    assert "epoch_s" in (home / "spec.yaml").read_text()  # the home now works with the fixed spec

    # `features --spec FILE` with a file named unlike its spec (once: "unknown spec 'ratings'").
    built = runner.invoke(app, ["features", "--spec", str(good_spec), "--no-materialize", "--json"])
    assert built.exit_code == 0, built.output
    assert json.loads(built.stdout)["rows"] == 2
    again = runner.invoke(app, ["features", "--json", "--no-materialize"])  # no --spec: the home's
    assert again.exit_code == 0 and json.loads(again.stdout)["rows"] == 0, again.output


def test_criteo_as_tsv_csv_with_header_and_parquet_with_ids_from_row_content(settings, tmp_path):
    criteo = load_spec("criteo")
    lines = criteo_lines(30, seed=3)
    fields = criteo.file_fields
    table = pacsv.read_csv(
        pa.py_buffer(("\n".join(lines) + "\n").encode()),
        read_options=pacsv.ReadOptions(column_names=fields),
        parse_options=pacsv.ParseOptions(delimiter="\t"),
        convert_options=pacsv.ConvertOptions(
            column_types={f: pa.string() for f in fields}, strings_can_be_null=True, null_values=[""]
        ),
    )
    (tmp_path / "tsv").mkdir()
    (tmp_path / "tsv" / "day_0").write_text("\n".join(lines) + "\n")
    (tmp_path / "csv").mkdir()
    numbers = {f"I{i}" for i in range(1, 14)}  # pandas-style export: integers written as 260.0
    csv_rows = [",".join(fields)] + [
        ",".join(
            (f"{v}.0" if f in numbers and v else v) for f, v in zip(fields, line.split("\t"), strict=True)
        )
        for line in lines
    ]
    (tmp_path / "csv" / "day_0.csv").write_text("\n".join(csv_rows) + "\n")
    (tmp_path / "pq").mkdir()
    pq.write_table(table, tmp_path / "pq" / "day_0.parquet")

    landed = {}
    for folder in ("tsv", "csv", "pq"):
        home = settings.model_copy(update={"home": tmp_path / f"home-{folder}"})
        spec = criteo.model_copy(update={"integral_floats": True}) if folder == "csv" else criteo
        summary = ingest(tmp_path / folder, spec, home, now=NOW)
        assert (summary.rows_in, summary.rows_landed) == (30, 30), summary.results
        landed[folder] = sorted(read_window(home, spec)["event_id"].to_pylist())
    assert landed["tsv"] == landed["pq"]  # the same rows: the same ids, whatever the file format
    assert len(set(landed["tsv"])) == 30

    # The same rows sent again in another file land nothing twice.
    shutil.copy(tmp_path / "tsv" / "day_0", tmp_path / "tsv" / "day_0.resent.tsv")
    with_line = "\n".join([*lines, criteo_lines(1, seed=9)[0]]) + "\n"
    (tmp_path / "tsv" / "day_0.more.tsv").write_text(with_line)
    home = settings.model_copy(update={"home": tmp_path / "home-tsv"})
    again = ingest(tmp_path / "tsv", criteo, home, now=NOW)
    # The identical copy is known by its bytes; the longer file lands only its new row.
    assert again.files_skipped == 2 and again.rows_landed == 1 and again.rows_quarantined == 30


def test_an_unsigned_epoch_beyond_int64_quarantines_its_row_not_the_file(settings, tmp_path):
    """Epoch seconds in a uint64 parquet column: a value past int64 is one bad row (it used to fail the
    cast of the whole column, and the file was rejected)."""
    seconds = [1420070400, 2**64 - 1, 1420070401]
    table = pa.Table.from_pylist(rows_with([0, 0, 0], [2015, 2016, 2017]))
    table = table.set_column(1, "ts", pa.array(seconds, pa.uint64()))
    landing = tmp_path / "in"
    landing.mkdir()
    pq.write_table(table, landing / "r.parquet")
    [result] = ingest(landing, ratings_spec("epoch_s"), settings, now=NOW).results
    assert result.rows_landed == 2 and result.reasons == {"invalid_type:ts": 1}, result
    assert sorted(read_window(settings, ratings_spec("epoch_s"))["rating_id"].to_pylist()) == ["r0", "r2"]


def _published_criteo_sample(path: Path, lines: list[str], fields: list[str]) -> Path:
    """The published Criteo sample's shape: a CSV with a header, in a file named ``.txt``, counts as ``260.0``."""
    numbers = {f"I{i}" for i in range(1, 14)}
    rows = [",".join(fields)] + [
        ",".join((f"{v}.0" if f in numbers and v else v) for f, v in zip(fields, line.split("\t"), strict=True))
        for line in lines
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(rows) + "\n")
    return path


def test_the_shipped_criteo_spec_ingests_the_published_sample_read_by_content(settings, tmp_path):
    """A CSV with a header named ``dac_sample.txt`` was read as headerless TSV (every row quarantined, no hint),
    and its ``260.0`` counts needed a spec edit; by content, with the shipped spec as it is, every row lands,
    the same ids as the TSV, and a hint says the name disagreed with the content."""
    criteo = load_spec("criteo")
    lines = criteo_lines(40, seed=5)
    sample = _published_criteo_sample(tmp_path / "in" / "dac_sample.txt", lines, criteo.file_fields)
    summary = ingest(sample.parent, criteo, settings, now=NOW)
    assert (summary.rows_in, summary.rows_landed, summary.rows_quarantined) == (40, 40, 0), summary.results
    [result] = summary.results
    assert any("dac_sample.txt: read as CSV with a header by its content" in h for h in result.hints), result.hints
    (tmp_path / "tsv").mkdir()
    (tmp_path / "tsv" / "day_0").write_text("\n".join(lines) + "\n")
    home = settings.model_copy(update={"home": tmp_path / "home-tsv"})
    (tmp_path / "tsv" / "day_1.tsv").write_text("\n".join(criteo_lines(5, seed=6)) + "\n")
    tsv = ingest(tmp_path / "tsv", criteo, home, now=NOW)
    assert tsv.rows_landed == 45 and not any(r.hints for r in tsv.results)  # headerless TSV: what the names say
    assert len(set(read_window(settings, criteo)["event_id"].to_pylist())) == 40


def test_a_table_log_named_txt_is_read_by_its_header_and_a_skipped_file_says_why(settings, tmp_path):
    landing = write_csv(tmp_path / "in" / "r.csv", rows_with([1420070400, 1420070401], [2015, 2016])).parent
    (landing / "r.csv").rename(landing / "ratings export.txt")
    spec = ratings_spec("epoch_s")
    first = ingest(landing, spec, settings, now=NOW)
    assert first.rows_landed == 2 and first.files_rejected == 0, first.results
    assert "read as CSV with a header by its content" in first.results[0].hints[0]
    shutil.copy(landing / "ratings export.txt", landing / "renamed.csv")
    again = ingest(landing, spec, settings, now=NOW)
    reasons = {Path(r.path).name: r.error for r in again.results}
    assert again.files_skipped == 2 and all(reasons.values()), reasons
    assert "already ingested under this version of spec 'ratings' as" in reasons["renamed.csv"]
    assert "--reingest" in reasons["ratings export.txt"]


def test_spec_criteo_is_the_shipped_spec_beside_a_folder_named_criteo(tmp_path, monkeypatch):
    """`--spec criteo` in a directory holding the data folder `criteo/` said "spec file criteo does not exist"."""
    from recloop.datasets import normalized

    (tmp_path / "criteo").mkdir()
    monkeypatch.chdir(tmp_path)
    assert load_spec("criteo").name == "criteo" and normalized("criteo") == "criteo"
    with pytest.raises(Exception, match="is a folder, not a YAML file"):
        load_spec("./criteo")


def test_criteo_rows_written_back_from_a_lake_keep_their_ids_and_times(settings, tmp_path):
    """``recloop replay`` lands a period of the source lake as parquet in the spec's columns: for the Criteo spec
    its event id and timestamp are already there. They are kept (deriving them again named each column twice,
    and the replay stopped with "no training rows")."""
    from recloop.settings import Settings

    criteo = load_spec("criteo")
    (tmp_path / "log").mkdir()
    (tmp_path / "log" / "day_2").write_text("\n".join(criteo_lines(40, seed=5)) + "\n")
    ingest(tmp_path / "log", criteo, settings, now=NOW)
    rows = lake.read_window(settings, criteo, None, None).sort_by(criteo.timestamp)
    (tmp_path / "again").mkdir()
    pq.write_table(rows.select(criteo.names), tmp_path / "again" / "bootstrap.parquet")
    other = Settings(home=tmp_path / "other", frame_backend="pandas")
    summary = ingest(tmp_path / "again", criteo, other, now=NOW)
    assert (summary.rows_landed, summary.rows_quarantined, summary.files_rejected) == (40, 0, 0)
    back = lake.read_window(other, criteo, None, None).sort_by(criteo.timestamp)
    for column in (criteo.event_id, criteo.timestamp):
        assert back[column].to_pylist() == rows[column].to_pylist(), column
