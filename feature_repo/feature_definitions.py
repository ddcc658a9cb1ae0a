"""Feast objects of recloop: entities, the entity statistics views and the ``ranking_v1`` service.

Side-effect free: importing it defines objects and nothing else. The sources are the tables that
``recloop features`` writes under ``$RECLOOP_HOME/features``; each row is an entity's state after its
events at ``event_timestamp`` (see recloop.features.ops for the meaning of each statistic).
"""

import json
import os
from datetime import timedelta

from feast import Entity, FeatureService, FeatureView, Field, FileSource, ValueType
from feast.data_format import ParquetFormat
from feast.types import Float64, Int64

FEATURES_DIR = os.path.join(os.path.abspath(os.environ.get("RECLOOP_HOME", ".recloop")), "features")
TTL = timedelta(days=30)  # recloop.features.config.FeatureConfig.ttl_seconds


def _stats_fields(prefix: str) -> list[Field]:
    counts = ["events_1h", "events_24h", "clicks_24h", "events_total", "clicks_total"]
    return [Field(name=f"{prefix}_{name}", dtype=Int64) for name in counts] + [
        Field(name=f"{prefix}_last_seen", dtype=Float64)
    ]


# The entities follow the dataset spec: recloop writes each kind's join key and value type to
# $RECLOOP_HOME/feast/entities.json before applying (recloop.features.store.write_entities). Without that
# file (the feast CLI on a fresh home), the synthetic spec's keys.
ENTITIES_FILE = os.path.join(os.path.abspath(os.environ.get("RECLOOP_HOME", ".recloop")), "feast", "entities.json")
DEFAULT_ENTITIES = {"user": {"join_key": "user_id", "value_type": "INT64"},
                    "item": {"join_key": "item_id", "value_type": "INT64"}}
DESCRIPTIONS = {
    "user": ("a user of the service", "user activity: events and clicks over 1 h / 24 h / all time, last seen"),
    "item": ("an item of the catalog", "item traffic: impressions and clicks over 1 h / 24 h / all time, last seen"),
}


def _entities() -> dict:
    if os.path.exists(ENTITIES_FILE):
        with open(ENTITIES_FILE, encoding="utf-8") as handle:
            return json.load(handle)
    return DEFAULT_ENTITIES


def _view(entity: Entity, kind: str) -> FeatureView:
    # One parquet file per period with events in each folder; the DuckDB offline store reads them through the glob.
    source = FileSource(name=f"{kind}_stats_source", path=os.path.join(FEATURES_DIR, f"{kind}_stats", "*.parquet"),
                        file_format=ParquetFormat(), timestamp_field="event_timestamp")
    return FeatureView(name=f"{kind}_stats", entities=[entity], ttl=TTL, schema=_stats_fields(kind), source=source,
                       online=True, description=DESCRIPTIONS[kind][1])


# Feast collects the module's globals: each kind present in the spec gets an entity and a view here.
_kinds = _entities()
user = Entity(name="user", join_keys=[_kinds["user"]["join_key"]], value_type=ValueType[_kinds["user"]["value_type"]],
              description=DESCRIPTIONS["user"][0]) if "user" in _kinds else None
item = Entity(name="item", join_keys=[_kinds["item"]["join_key"]], value_type=ValueType[_kinds["item"]["value_type"]],
              description=DESCRIPTIONS["item"][0]) if "item" in _kinds else None
user_stats = _view(user, "user") if user is not None else None
item_stats = _view(item, "item") if item is not None else None

ranking_v1 = FeatureService(name="ranking_v1", features=[v for v in (user_stats, item_stats) if v is not None],
                            description="what the ranking model reads at serving time")
