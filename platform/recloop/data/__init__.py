"""The GPU dataloader: training parquet in big chunks to the device, shuffled, in the kernels' layout."""

from recloop.data.loader import Batch, ChunkLoader, FeatureSchema, LoaderStats, training_files

__all__ = ["Batch", "ChunkLoader", "FeatureSchema", "LoaderStats", "training_files"]
