"""How many of the rows a model will score carry ids it never trained: the rate of its id dropout.

A ranker meets, after it is trained, users and items its tables never saw: on MovieLens 1M, 77 % of a week's
ratings come from users who rated nothing before that week. Trained on rows that all carry a known id, it learns
each user's past through the id's row and scores the unknown ones from an out-of-vocabulary row it rarely
trained. Its training rows lose their key ids at the rate it will meet unknown ones (``recloop.model.fit.drop_ids``),
and that rate is measured on the training window itself: the share of the newest rows whose id the rows before
them do not hold (``cold_shares``), capped at ``MAX_RATE`` so a returning user's row still learns from most of
its rows, and none below ``MIN_SHARE``.

Example::

    tables = key_tables(FeatureSchema.load(layout.schema), json.loads(layout.schema.read_text()))
    cold_shares(training_files, tables)  # {"c_userId": 0.77, "c_movieId": 0.0}
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from recloop.data.loader import FeatureSchema
from recloop.model.fit import OOV_ID

NEWEST_SHARE = 0.1  # the newest rows of the window: the ones most like what the model scores next
MAX_EARLIER_ROWS = 2_000_000  # the rows before them read for the ids they hold (the newest of them)
MAX_RATE = 0.5  # on MovieLens 1M, 0.4 / 0.75 / 1.0 held out alike (AUC 0.7793 / 0.7791 / 0.7792)
# Below this share a model meets next to no unknown ids, and its rows keep theirs: the synthetic world's newest rows
# hold 0.8 % new users, and dropping them there moved a full run's held-out AUC by -0.001 (noise; 3 seeds).
MIN_SHARE = 0.05


def key_tables(schema: FeatureSchema, raw_schema: dict) -> list[str]:
    """The one-hot tables of the dataset's user and item keys that are vocabularies (not hash buckets, not
    under a row budget: a dynamic table keys rows by the raw id and has no single unknown row)."""
    keys = {raw_schema.get("user_key"), raw_schema.get("item_key")} - {None}
    budgeted = {name for name, _ in schema.budgets}
    return [name for name, spec in raw_schema.get("categorical", {}).items()
            if isinstance(spec.get("source"), str) and spec["source"] in keys and name in schema.categorical
            and name not in schema.hashed and name not in budgeted]


def cold_shares(files: Sequence[Path], tables: Sequence[str]) -> dict[str, float]:
    """Per table, the share of the newest ``NEWEST_SHARE`` of the rows of ``files`` (in time order) whose id
    is out of vocabulary or absent from up to ``MAX_EARLIER_ROWS`` rows before them; {} with fewer than two
    files or no tables."""
    files = list(files)
    if len(files) < 2 or not tables:
        return {}
    rows = np.array([pq.ParquetFile(f).metadata.num_rows for f in files])
    newest_rows = np.cumsum(rows[::-1])
    cut = len(files) - min(int(np.searchsorted(newest_rows, NEWEST_SHARE * rows.sum())) + 1, len(files) - 1)
    earlier = cut - 1  # the file before them at least, then back while the rows stay within MAX_EARLIER_ROWS
    while earlier > 0 and rows[earlier - 1:cut].sum() <= MAX_EARLIER_ROWS:
        earlier -= 1

    def ids(part: Sequence[Path], table: str) -> np.ndarray:
        return np.concatenate([pq.read_table(f, columns=[table])[table].to_numpy() for f in part]).astype(np.int64)

    shares = {}
    for table in tables:
        newest, before = ids(files[cut:], table), ids(files[earlier:cut], table)
        if not len(newest) or not len(before):
            continue
        known = np.zeros(max(int(newest.max()), int(before.max()), OOV_ID) + 1, dtype=bool)
        known[before] = True
        known[OOV_ID] = False  # already unknown to any model
        shares[table] = float(np.mean(~known[newest]))
    return shares


def dropout_rates(shares: dict[str, float]) -> dict[str, float]:
    """The id-dropout rate per table from its cold share (capped at ``MAX_RATE``; tables whose share is below
    ``MIN_SHARE`` left out), rounded to what is said."""
    return {table: round(min(share, MAX_RATE), 3) for table, share in shares.items() if share >= MIN_SHARE}
