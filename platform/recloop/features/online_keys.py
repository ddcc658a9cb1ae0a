"""The online store's key layout: Feast's Redis hashes, as ``recloop.features.online_writer`` writes them and
serving's reader (``recloop.features.online``) reads them, one definition for both.

- key: Feast's entity key serialization (version 3) for one int64 join key, followed by the project name.
  The constant head of the serialization is taken from Feast itself; a test checks the whole key against
  ``feast.infra.key_encoding_utils.serialize_entity_key`` for many ids.
- fields: ``murmur3("<view>:<feature>")`` → a serialized ``ValueProto``; ``_ts:<view>`` → a serialized
  ``Timestamp``, exactly as Feast's Redis store writes them.
- ``generation_key``: changes after every write of the project's online state (recloop's own, not Feast's).
"""

from __future__ import annotations

import struct

import numpy as np

from recloop.features.feast_import import import_feast


def entity_key_head(join_key: str) -> bytes:
    """Feast's serialized entity key for ``{join_key: int64}``, minus the trailing 8 value bytes."""
    import_feast()
    from feast.infra.key_encoding_utils import serialize_entity_key
    from feast.protos.feast.types.EntityKey_pb2 import EntityKey
    from feast.protos.feast.types.Value_pb2 import Value

    serialized = serialize_entity_key(EntityKey(join_keys=[join_key], entity_values=[Value(int64_val=0)]), 3)
    if serialized[-8:] != struct.pack("<q", 0):
        raise RuntimeError("unexpected Feast entity key layout; use Feast's own materialization")
    return serialized[:-8]


def redis_keys(join_key: str, project: str, ids: np.ndarray) -> list[bytes]:
    head, tail = entity_key_head(join_key), project.encode("utf-8")
    packed = np.asarray(ids, dtype="<i8").tobytes()
    return [head + packed[i:i + 8] + tail for i in range(0, len(packed), 8)]


def generation_key(project: str) -> bytes:
    """The key whose value changes after every write of the project's online state (not one of Feast's)."""
    return f"recloop:{project}:online_generation".encode()


def field_key(view: str, feature: str) -> bytes:
    """The Redis hash field of one feature of a view: Feast's ``murmur3("<view>:<feature>")``."""
    import_feast()
    from feast.infra.online_stores.helpers import _mmh3

    return _mmh3(f"{view}:{feature}")
