"""On-disk formats that a writer and a reader in different modules must agree on (constants, numpy and
pyarrow only: any module can import this, on any machine: the feature job without torch, the GPU machine
without the service packages)."""

import numpy as np
import pyarrow as pa

# How training rows are written (the feature job, recloop.data.synthetic, benchmarks/loader.py) for
# recloop.data.ChunkLoader: LZ4 (parquet's LZ4_RAW codec, not the deprecated Hadoop-framed one), no
# dictionary pages. Decoding is the loader's host work. One thread decoding Criteo-shaped row groups (13
# dense, 26 id columns, 131k rows) on a 2-core AMD EPYC, best of 6, three runs: pyarrow's default (snappy,
# dictionary) 1.6-2.4M rows/s at 200 bytes a row on disk; LZ4 without dictionary 3.3-4.0M at 162 bytes
# (no compression 5.2-6.6M at 264 bytes; zstd 1.3-1.4M at 171). Ids spread over millions of rows gain
# nothing from a dictionary.
# The Arrow type of each dtype a dataset spec names (recloop.schema): how ingestion lands a column, how the
# journal writes feedback back as events, how serving builds a request's columns.
ARROW_TYPES: dict[str, pa.DataType] = {
    "string": pa.string(),
    "int8": pa.int8(),
    "int32": pa.int32(),
    "int64": pa.int64(),
    "float32": pa.float32(),
    "float64": pa.float64(),
    "bool": pa.bool_(),
    "timestamp": pa.timestamp("us", tz="UTC"),
    "list<int64>": pa.list_(pa.int64()),
}

TRAINING_PARQUET = {"compression": "lz4_raw", "use_dictionary": False}


def id_dtype(capacity: int) -> np.dtype:
    """How training files store a table's ids (rows ``0 .. capacity - 1``): int32 where they fit, else int64.

    Ids are most of a training row (26 of a Criteo row's 40 columns): int32 halves the bytes the loader
    decodes and copies to the device (it widens them there). One thread decoding a Criteo-shaped row group
    (LZ4, 131k rows) on a 2-core AMD EPYC: int64 ids 7.7-10.8M rows/s at 162 bytes a row on disk, int32
    16.7-17.0M at 146 bytes. Readers take either: a table that outgrows int32 gets int64 files from then on."""
    return np.dtype(np.int32) if capacity <= np.iinfo(np.int32).max + 1 else np.dtype(np.int64)
