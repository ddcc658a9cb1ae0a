"""The ranker's MLflow input example (``pipeline.example_rows``): rows whose list columns hold ids, so MLflow
can infer the signature's list types (an example of empty lists made it warn and fail its own check)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from recloop.pipeline import example_rows


def _write(path: Path, genres: list[list[int]]) -> Path:
    pq.write_table(pa.table({"d_year": [0.5] * len(genres), "c_userId": list(range(2, 2 + len(genres))),
                             "m_genres": pa.array(genres, pa.list_(pa.int32()))}), path)
    return path


def test_the_input_example_is_taken_from_rows_whose_lists_hold_ids(tmp_path: Path):
    older = _write(tmp_path / "2026-01-01T00.parquet", [[3, 4], [], [5], [6], [7, 8], [9]])
    newest = _write(tmp_path / "2026-01-01T01.parquet", [[], [], [2], []])  # movies without genres, mostly
    example = example_rows([older, newest])
    assert len(example) == 5 and all(len(ids) > 0 for ids in example["m_genres"])
    assert example["c_userId"].tolist() == [4, 2, 4, 5, 6]  # the newest file's first, then the older file's
    empty = _write(tmp_path / "2026-01-01T02.parquet", [[], []])
    assert len(example_rows([empty])) == 2  # no row with ids anywhere: the newest rows, as before
