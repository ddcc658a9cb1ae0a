"""``benchmarks/public_logs.py``: a public log written as a landing folder + spec that ingests whole (seconds).

The real files are not in the repository (their licences and sizes): each test writes a few lines in the
published format, byte for byte as GroupLens ships it (``::``-separated, the movies in Latin-1)."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
from benchmark_scripts import benchmark_script

from recloop.schema import load_spec
from recloop.settings import Settings


@pytest.fixture(scope="module")
def public_logs():
    return benchmark_script("public_logs")


def _movielens_1m(folder: Path) -> Path:
    folder.mkdir()
    (folder / "movies.dat").write_bytes(
        "1::Toy Story (1995)::Animation|Children's|Comedy\n"
        "2::Jumanji (1995)::Adventure|Children's|Fantasy\n"
        "3::Misérables, Les (1995)::Drama|Musical\n".encode("latin-1"))
    (folder / "users.dat").write_text("1::F::1::10::48067\n2::M::56::16::70072\n")
    (folder / "ratings.dat").write_text(
        "1::1::5::978300760\n"   # 2000-12-31T22:12:40Z
        "1::3::3::978302109\n"   # 2000-12-31T22:35:09Z
        "2::2::4::978298413\n"   # 2000-12-31T21:33:33Z
        "2::3::2::978387000\n")  # 2001-01-01T22:10:00Z: after --until 2001-01-01
    return folder


def test_movielens_1m_lands_every_rating_before_the_cut_with_its_movie_and_rater(public_logs, tmp_path):
    from recloop.ingest.run import ingest

    out = public_logs.movielens_1m(_movielens_1m(tmp_path / "ml-1m"), tmp_path / "out", until="2001-01-01")
    spec = load_spec(out / "movielens_1m.yaml")
    assert (spec.user_key, spec.item_key) == ("userId", "movieId")
    assert "rows:4 kept:3 until:2001-01-01" in (out / "SOURCE").read_text()

    settings = Settings(home=tmp_path / "home")
    summary = ingest(out / "log", spec, settings, wait_for_writers=False)
    assert (summary.rows_in, summary.rows_landed, summary.rows_quarantined) == (3, 3, 0)
    landed = pq.read_table(sorted(settings.lake_events_dir.rglob("*.parquet"))).to_pandas()
    rows = {r.rating_id: r for r in landed.itertuples()}
    assert sorted(rows) == ["1-1", "1-3", "2-2"]
    assert (rows["1-1"].liked, rows["1-3"].liked, rows["2-2"].liked) == (1, 0, 1)  # 4 stars or more
    genres = public_logs.GENRES_1M
    assert [genres[g] for g in rows["1-1"].genres] == ["Animation", "Children's", "Comedy"]
    assert [genres[g] for g in rows["1-3"].genres] == ["Drama", "Musical"]  # a Latin-1 title read whole
    assert (rows["1-1"].year, rows["1-1"].gender, rows["1-1"].age, rows["1-1"].occupation) == (1995, "F", 1, 10)
    assert (rows["2-2"].gender, rows["2-2"].age, rows["2-2"].occupation) == ("M", 56, 16)
