"""The GPU dataloader: training parquet in big chunks to the device, shuffled, in the kernels' layout."""

from recloop.data.loader import (
    BATCH_PLAN,
    VALUES_BUCKET,
    Batch,
    ChunkLoader,
    FeatureSchema,
    LoaderStats,
    training_files,
)

__all__ = ["BATCH_PLAN", "VALUES_BUCKET", "Batch", "ChunkLoader", "FeatureSchema", "LoaderStats", "training_files"]
