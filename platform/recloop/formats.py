"""On-disk formats that a writer and a reader in different modules must agree on (constants only: any
module can import this, on any machine: the feature job without torch, the GPU machine without the
service packages)."""

# How training rows are written (the feature job, recloop.data.synthetic, benchmarks/loader.py) for
# recloop.data.ChunkLoader: LZ4 (parquet's LZ4_RAW codec, not the deprecated Hadoop-framed one), no
# dictionary pages. Decoding is the loader's host work. One thread decoding Criteo-shaped row groups (13
# dense, 26 id columns, 131k rows) on a 2-core AMD EPYC, best of 6, three runs: pyarrow's default (snappy,
# dictionary) 1.6-2.4M rows/s at 200 bytes a row on disk; LZ4 without dictionary 3.3-4.0M at 162 bytes
# (no compression 5.2-6.6M at 264 bytes; zstd 1.3-1.4M at 171). Ids spread over millions of rows gain
# nothing from a dictionary.
TRAINING_PARQUET = {"compression": "lz4_raw", "use_dictionary": False}
