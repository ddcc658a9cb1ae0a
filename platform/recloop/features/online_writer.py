"""Pipelined materialization into Feast's Redis online store, in Feast's own layout.

Feast's materialization converts every row through pandas and protobuf objects in Python and runs at
about 11k entities/s on a 2-core machine (``benchmarks/materialize.py``). This writer produces the
same Redis hashes (so ``FeatureStore.get_online_features`` reads them unchanged) from columns:

- key (``recloop.features.online_keys``, shared with serving's reader): Feast's entity key serialization (version 3) for one int64 join key, followed by the project
  name. The constant head of the serialization is taken from Feast itself; a test checks the whole
  key against ``feast.infra.key_encoding_utils.serialize_entity_key`` for many ids.
- fields: ``murmur3("<view>:<feature>")`` → a serialized ``ValueProto``; ``_ts:<view>`` → a
  serialized ``Timestamp``, exactly as Feast's Redis store writes them.

Rows go to Redis in pipelines of ``batch`` commands without transactions; only the latest row per
entity is written. After the last row, the project's generation key (``generation_key``) gets a new
random value: a reader that keeps entity state in memory (serving's item state) keeps it only while
that value is the one it read before the state.
"""

from __future__ import annotations

import uuid

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recloop.features.feast_import import import_feast
from recloop.features.online_keys import field_key, generation_key, redis_keys


def latest_per_entity(table: pa.Table, join_key: str) -> pa.Table:
    """The newest row of each entity (by ``event_timestamp``)."""
    ordered = table.sort_by([(join_key, "ascending"), ("event_timestamp", "ascending")])
    keys = ordered[join_key].to_numpy()
    last = np.ones(len(keys), dtype=bool)
    last[:-1] = keys[1:] != keys[:-1]
    return ordered.filter(pa.array(last))


def _serialized_values(column: pa.ChunkedArray, value_proto) -> list[bytes]:
    """Each value as a serialized ``ValueProto`` (b"" for null); each distinct value serialized once."""
    integer = pa.types.is_integer(column.type)
    filled = column.fill_null(0) if integer else column.cast(pa.float64()).fill_null(0.0)
    distinct, inverse = np.unique(filled.to_numpy(), return_inverse=True)
    encode = (lambda v: value_proto(int64_val=int(v))) if integer else (lambda v: value_proto(double_val=float(v)))
    encoded = [encode(v).SerializeToString() for v in distinct]
    out = [encoded[i] for i in inverse]
    for i in np.flatnonzero(~np.asarray(pc.is_valid(column))):
        out[i] = b""
    return out


def write_to_redis(client, *, project: str, view: str, join_key: str, table: pa.Table, features: list[str],
                   batch: int = 20_000) -> int:
    """Write each entity's latest row of ``table`` (join key, ``event_timestamp``, features) to Redis.

    Returns the number of entities written.
    """
    import_feast()
    from feast.protos.feast.types.Value_pb2 import Value
    from google.protobuf.timestamp_pb2 import Timestamp

    rows = latest_per_entity(table, join_key)
    keys = redis_keys(join_key, project, rows[join_key].to_numpy())
    micros = rows["event_timestamp"].cast(pa.int64()).to_numpy()
    stamps = [Timestamp(seconds=int(s), nanos=int(n)).SerializeToString()
              for s, n in zip(micros // 1_000_000, (micros % 1_000_000) * 1000, strict=True)]
    ts_field = f"_ts:{view}".encode()
    columns = []
    for feature in features:
        columns.append((field_key(view, feature), _serialized_values(rows[feature], Value)))
    written = 0
    for start in range(0, len(keys), batch):
        with client.pipeline(transaction=False) as pipe:
            for i in range(start, min(start + batch, len(keys))):
                mapping = {ts_field: stamps[i]}
                for field, values in columns:
                    mapping[field] = values[i]
                pipe.hset(keys[i], mapping=mapping)
            written += len(pipe.execute())
    # A new value rather than a counter: a flushed and rewritten store can never repeat one a reader holds.
    client.set(generation_key(project), uuid.uuid4().hex)
    return written
