"""What features to build from a dataset: typed, frozen configuration, with defaults from the spec.

Example::

    config = FeatureConfig.for_spec(load_spec("synthetic"))
    [c.column for c in config.categorical]   # ['user_id', 'item_id', 'device', 'country', 'category']
"""

from __future__ import annotations

from dataclasses import dataclass, field

from recloop.schema import DatasetSpec


@dataclass(frozen=True)
class CategoricalFeature:
    """A categorical column turned into embedding-row indices.

    Args:
        column: the spec column.
        min_count: ids seen fewer times than this (over all windows so far) map to the OOV index.
        hash_buckets: hash into this many buckets instead of keeping a vocabulary (unbounded ids).
        max_rows: a row budget: the model keys this column's table by its ids (vocabulary indices, or the
            hashes when ``hash_buckets`` is set, as large as 2**62) and holds at most this many rows,
            admitting and evicting ids as they come and go (``recloop_kernels.dynamic``; the model's
            ``ModelConfig.max_rows`` says the same per table). None: a row per id, growing with the vocabulary.
    """

    column: str
    min_count: int = 1
    hash_buckets: int | None = None
    max_rows: int | None = None


@dataclass(frozen=True)
class CrossFeature:
    """Two categoricals hashed together into ``buckets`` (e.g. device × item category)."""

    columns: tuple[str, str]
    buckets: int = 1 << 14

    @property
    def name(self) -> str:
        return f"{self.columns[0]}_x_{self.columns[1]}"


@dataclass(frozen=True)
class NumericFeature:
    """A numeric column: optional clip, then optional log1p, then standardization with stored stats."""

    column: str
    clip_min: float | None = None
    clip_max: float | None = None
    log1p: bool = False
    standardize: bool = True


@dataclass(frozen=True)
class MultiHotFeature:
    """A list column whose ids are mapped through a vocabulary: another categorical's (history → item_id), or
    its own (``vocabulary == column``: genres)."""

    column: str
    vocabulary: str
    max_length: int = 20


@dataclass(frozen=True)
class FeatureConfig:
    """All features of one dataset.

    Args:
        categorical, crosses, numeric, multi_hot: the per-column features.
        cyclic_time: add hour-of-day and day-of-week as sin/cos.
        smoothing: pseudo-count of the prior in target encodings and click-through rates.
        ttl_seconds: entity features older than this count as missing (also the Feast views' TTL).
        recency_cap_seconds: "time since previous event" for an entity never seen (or beyond the cap).
    """

    categorical: tuple[CategoricalFeature, ...]
    crosses: tuple[CrossFeature, ...] = ()
    numeric: tuple[NumericFeature, ...] = ()
    multi_hot: tuple[MultiHotFeature, ...] = ()
    cyclic_time: bool = True
    smoothing: float = 20.0
    ttl_seconds: int = 30 * 86400
    recency_cap_seconds: float = 30 * 86400.0
    windows_seconds: tuple[int, ...] = field(default=(3600, 86400))

    def __post_init__(self) -> None:
        names = [c.column for c in self.categorical]
        for multi in self.multi_hot:
            if multi.vocabulary not in names and multi.vocabulary != multi.column:
                raise ValueError(f"multi-hot {multi.column!r} maps through {multi.vocabulary!r}, "
                                 "which is not a categorical feature")
        for cross in self.crosses:
            missing = [c for c in cross.columns if c not in names]
            if missing:
                raise ValueError(f"cross {cross.name!r} uses {missing}, which are not categorical features")

    def categorical_feature(self, column: str) -> CategoricalFeature:
        for feature in self.categorical:
            if feature.column == column:
                return feature
        raise KeyError(column)

    @classmethod
    def for_spec(cls, spec: DatasetSpec) -> FeatureConfig:
        """Sensible defaults: every categorical gets a vocabulary (entity keys need two sightings),
        the first two non-key categoricals are each crossed with the last one, non-negative numerics
        (and those whose spec says ``scale: log``) are log-transformed, and each multi-hot list maps through the vocabulary its spec column names, else its
        own."""
        keys = [k for k in (spec.user_key, spec.item_key) if k]
        categorical = [CategoricalFeature(k, min_count=2) for k in keys]
        others = [c.name for c in spec.by_role("categorical")]
        categorical += [CategoricalFeature(name) for name in others]
        crosses = tuple(CrossFeature((a, others[-1])) for a in others[:2] if a != others[-1]) if others else ()
        numeric = tuple(
            NumericFeature(c.name, log1p=c.log_scale, clip_min=0.0 if c.non_negative and c.log_scale else None)
            for c in spec.by_role("numeric")
        )
        multi_hot = tuple(MultiHotFeature(c.name, vocabulary=c.vocabulary or c.name) for c in spec.by_role("multi_hot"))
        if spec.history is not None:  # derived from the lake (``DatasetSpec.history``), as long as it is written
            multi_hot += (MultiHotFeature(spec.history.name, vocabulary=spec.item_key, max_length=spec.history.items),)
        return cls(categorical=tuple(categorical), crosses=crosses, numeric=numeric, multi_hot=multi_hot)
