"""Feast objects of recloop: entities, the entity statistics views and the ``ranking_v1`` service.

Side-effect free: importing it defines objects and nothing else. The sources are the tables that
``recloop features`` writes under ``$RECLOOP_HOME/features``; each row is an entity's state after its
events at ``event_timestamp`` (see recloop.features.ops for the meaning of each statistic).
"""

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


user = Entity(name="user", join_keys=["user_id"], value_type=ValueType.INT64, description="a user of the service")
item = Entity(name="item", join_keys=["item_id"], value_type=ValueType.INT64, description="an item of the catalog")

# One parquet file per hour in each folder; the DuckDB offline store reads them through the glob.
user_stats_source = FileSource(
    name="user_stats_source", path=os.path.join(FEATURES_DIR, "user_stats", "*.parquet"),
    file_format=ParquetFormat(), timestamp_field="event_timestamp",
)
item_stats_source = FileSource(
    name="item_stats_source", path=os.path.join(FEATURES_DIR, "item_stats", "*.parquet"),
    file_format=ParquetFormat(), timestamp_field="event_timestamp",
)

user_stats = FeatureView(
    name="user_stats", entities=[user], ttl=TTL, schema=_stats_fields("user"), source=user_stats_source, online=True,
    description="user activity: events and clicks over 1 h / 24 h / all time, last seen",
)
item_stats = FeatureView(
    name="item_stats", entities=[item], ttl=TTL, schema=_stats_fields("item"), source=item_stats_source, online=True,
    description="item traffic: impressions and clicks over 1 h / 24 h / all time, last seen",
)

ranking_v1 = FeatureService(name="ranking_v1", features=[user_stats, item_stats],
                            description="what the ranking model reads at serving time")
