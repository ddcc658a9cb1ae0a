"""Synthetic training rows in the loader's layout, with a planted click model (benchmarks, tests, a GPU box).

The feature job builds training rows from the simulated world through the lake, which needs recloop's
services; this writes rows of the same layout directly, so that the loader, the model and the trainer
can be measured on a machine that has only torch, numpy and pyarrow. Each id has a hidden effect and
each dense column a weight; a row's click probability is ``sigmoid(bias + Σ effects + dense · weights)``,
so a model that learns gets an AUC well above 0.5 (``oracle`` holds the true probability)::

    files, schema = write_training_rows(folder, rows=1_000_000, files=4, categorical={"c_0": 1000, ...},
                                        multi_hot={"m_0": 500})
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from recloop.data.loader import FeatureSchema
from recloop.formats import TRAINING_PARQUET, id_dtype


def write_training_rows(folder: Path, rows: int, files: int, categorical: dict[str, int],
                        multi_hot: dict[str, int] | None = None, dense: int = 13, hotness: int = 5,
                        zipf: float = 1.05, seed: int = 0, part: str = "part", row_group_size: int = 1 << 17
                        ) -> tuple[list[Path], FeatureSchema]:
    """Write ``rows`` rows over ``files`` parquet files; returns the files and their ``FeatureSchema``.

    The click model is a function of ``seed`` alone; the rows also of ``part`` (the files' name prefix),
    so that training and validation rows can be drawn separately from the same model.

    Ids follow a Zipf law (exponent ``zipf``) over each table's rows (shuffled, so the hot rows are not
    the first ones); multi-hot lists have 0..2·hotness ids. Columns: ``d_*`` dense, categorical and
    multi-hot by the given names, ``label``, and ``p_click`` (the planted probability).
    """
    multi_hot = multi_hot or {}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = np.random.default_rng(seed)
    tables = {**categorical, **multi_hot}
    effects = {name: model.normal(0.0, 0.6, size) for name, size in tables.items()}
    ranks = {name: model.permutation(size) for name, size in tables.items()}
    dense_weights = model.normal(0.0, 0.3, dense)
    rng = np.random.default_rng([seed, *part.encode()])
    paths = []
    for f, count in enumerate(np.diff(np.linspace(0, rows, files + 1).astype(np.int64))):
        columns: dict[str, pa.Array | np.ndarray] = {}
        dense_values = rng.standard_normal((count, dense)).astype(np.float32)
        logit = np.full(count, -1.2) + dense_values @ dense_weights
        for i in range(dense):
            columns[f"d_{i}"] = dense_values[:, i]
        for name, size in categorical.items():
            ids = ranks[name][_zipf(rng, size, count, zipf)]
            columns[name] = ids.astype(id_dtype(size))
            logit += effects[name][ids]
        for name, size in multi_hot.items():
            lengths = rng.integers(0, 2 * hotness + 1, count)
            flat = ranks[name][_zipf(rng, size, int(lengths.sum()), zipf)]
            starts = np.concatenate([[0], np.cumsum(lengths)])
            running = np.concatenate([[0.0], np.cumsum(effects[name][flat])])
            sums = running[starts[1:]] - running[starts[:-1]]
            logit += np.where(lengths > 0, sums / np.maximum(lengths, 1), 0.0)
            columns[name] = pa.ListArray.from_arrays(pa.array(starts, pa.int32()), pa.array(flat.astype(id_dtype(size))))
        probability = 1 / (1 + np.exp(-logit))
        columns["p_click"] = probability
        columns["label"] = (rng.random(count) < probability).astype(np.float32)
        path = folder / f"{part}-{f:04d}.parquet"
        pq.write_table(pa.table(columns), path, row_group_size=row_group_size, **TRAINING_PARQUET)
        paths.append(path)
    schema = FeatureSchema(dense=tuple(f"d_{i}" for i in range(dense)), categorical=dict(categorical),
                           multi_hot=dict(multi_hot))
    return paths, schema


def _zipf(rng: np.random.Generator, size: int, count: int, exponent: float) -> np.ndarray:
    """``count`` ranks in [0, size) with P(k) ∝ (k + 1)^-exponent (inverse-CDF sampling)."""
    cdf = np.cumsum(np.arange(1, size + 1, dtype=np.float64) ** -exponent)
    return np.minimum(np.searchsorted(cdf, rng.random(count) * cdf[-1]), size - 1)
