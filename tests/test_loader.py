"""The chunked loader: every row once per epoch, valid jagged layout, deterministic order for a seed,
no value read back from a tensor while batches are assembled (no host synchronization on a GPU)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from recloop.data import ChunkLoader, FeatureSchema

SCHEMA = FeatureSchema(dense=("d_a", "d_b"), categorical={"c_x": 50, "c_y": 7}, multi_hot={"m_h": 30},
                       extra=("row_id",))


@pytest.fixture
def files(tmp_path: Path) -> list[Path]:
    """Three files, 1000 rows in all, small row groups (many chunks), lists of length 0..5."""
    rng = np.random.default_rng(0)
    paths, row = [], 0
    for i, n in enumerate([430, 270, 300]):
        lengths = rng.integers(0, 6, n)
        lists = [list(rng.integers(0, 30, k)) for k in lengths]
        ids = np.arange(row, row + n)
        table = pa.table({
            "row_id": ids, "label": (ids % 3 == 0).astype(np.float32),
            "d_a": ids.astype(np.float32), "d_b": -ids.astype(np.float32),
            "c_x": ids % 50, "c_y": ids % 7, "m_h": pa.array(lists, pa.list_(pa.int64())),
        })
        path = tmp_path / f"part{i}.parquet"
        pq.write_table(table, path, row_group_size=128)
        paths.append(path)
        row += n
    return paths


def rows_of(batch) -> list[int]:
    return batch.extra["row_id"].tolist()


def test_every_row_exactly_once_with_a_valid_jagged_layout(files):
    loader = ChunkLoader(files, SCHEMA, batch_size=97, seed=1, shuffle_chunks=3)
    seen, sizes = [], []
    lists = {int(r): list(v) for f in files
             for r, v in zip(pq.read_table(f)["row_id"].to_pylist(), pq.read_table(f)["m_h"].to_pylist(), strict=True)}
    for batch in loader.epoch(0):
        b = batch.size
        sizes.append(b)
        ids = rows_of(batch)
        seen.extend(ids)
        assert batch.offsets.shape == (3 * b + 1,) and batch.offsets[0] == 0
        assert int(batch.offsets[-1]) == batch.values.numel()
        assert (batch.offsets[1:] >= batch.offsets[:-1]).all()
        # One-hot tables first (bags of 1, table-major), then the multi-hot lists of the same rows.
        assert batch.values[:b].tolist() == [r % 50 for r in ids]
        assert batch.values[b:2 * b].tolist() == [r % 7 for r in ids]
        for k, r in enumerate(ids):
            start, end = int(batch.offsets[2 * b + k]), int(batch.offsets[2 * b + k + 1])
            assert batch.values[start:end].tolist() == lists[r]
        assert batch.dense[:, 0].tolist() == [float(r) for r in ids]  # rows stay aligned across columns
        assert batch.label.tolist() == [float(r % 3 == 0) for r in ids]
    assert sorted(seen) == list(range(1000))
    # every batch full but the last: a group of chunks' remainder (lists included) joins the next group
    assert sizes == [97] * 10 + [30]


def test_shuffling_changes_order_not_content_and_is_deterministic(files):
    def order(seed, epoch, shuffle=True):
        return [r for b in ChunkLoader(files, SCHEMA, 64, seed=seed, shuffle=shuffle).epoch(epoch) for r in rows_of(b)]

    plain = order(0, 0, shuffle=False)
    assert plain == list(range(1000))
    first = order(3, 0)
    assert first != plain and sorted(first) == plain
    assert order(3, 0) == first  # same seed and epoch: same order
    assert order(3, 1) != first and order(4, 0) != first


@pytest.mark.parametrize(("batch_size", "shuffle_chunks"), [(97, 3), (64, 1), (128, 2), (1000, 16)])
def test_permutations_are_drawn_ahead_for_the_groups_the_epoch_forms(files, batch_size, shuffle_chunks):
    """A thread draws each group's permutation ahead of the consumer, sized from the row groups' metadata
    (a size that did not match the group would raise); an epoch left early stops it."""
    import threading

    loader = ChunkLoader(files, SCHEMA, batch_size, seed=7, shuffle_chunks=shuffle_chunks)
    sizes = loader._group_sizes(0)
    assert sum(sizes) - sum(size % batch_size for size in sizes[:-1]) == 1000  # remainders counted twice
    seen = [r for b in loader.epoch(0) for r in rows_of(b)]
    assert sorted(seen) == list(range(1000)) and seen != list(range(1000))
    assert loader.stats.shuffle_s > 0
    for _ in loader.epoch(1):
        break  # left after one batch
    assert not [t for t in threading.enumerate() if t.name == "recloop-shuffle"]


def test_skipping_batches_resumes_the_same_epoch(files):
    loader = ChunkLoader(files, SCHEMA, 50, seed=2)
    full = [rows_of(b) for b in loader.epoch(0)]
    resumed = [rows_of(b) for b in loader.epoch(0, skip_batches=7)]
    assert resumed == full[7:]


def test_bad_input(tmp_path: Path, files):
    with pytest.raises(ValueError, match="no training files"):
        ChunkLoader([], SCHEMA, 10)
    empty = tmp_path / "empty.parquet"
    pq.write_table(pq.read_table(files[0]).slice(0, 0), empty)
    with pytest.raises(ValueError, match="no training rows"):
        ChunkLoader([empty], SCHEMA, 10)
    with pytest.raises(FileNotFoundError, match="recloop features"):
        FeatureSchema.load(tmp_path / "missing.json")


@contextlib.contextmanager
def no_tensor_reads():
    """Fail on any read of a tensor's value into Python (``int(t)``, ``t.item()``, slicing by a tensor...):
    on a GPU each is a host synchronization."""
    def refuse(*args, **kwargs):
        raise AssertionError("a tensor value was read on the host")

    names = ("item", "tolist", "__int__", "__index__", "__bool__", "__float__")
    saved = {name: getattr(torch.Tensor, name) for name in names}
    try:
        for name in names:
            setattr(torch.Tensor, name, refuse)
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def test_batches_are_assembled_without_reading_tensor_values(files):
    with no_tensor_reads():
        batches = list(ChunkLoader(files, SCHEMA, 97, seed=1, shuffle_chunks=3, pad_values_to=64).epoch(0))
    assert sorted(r for b in batches for r in rows_of(b)) == list(range(1000))
    reference = list(ChunkLoader(files, SCHEMA, 97, seed=1, shuffle_chunks=3).epoch(0))
    for padded, plain in zip(batches, reference, strict=True):
        nnz = int(plain.offsets[-1])
        assert padded.values.numel() % 64 == 0 and padded.values.numel() - nnz < 64
        assert torch.equal(padded.offsets, plain.offsets) and torch.equal(padded.values[:nnz], plain.values)
        assert (padded.values[nnz:] == 0).all()


@pytest.mark.parametrize("workers, arrow_threads", [(1, True), (4, True), (2, False)])
def test_decoding_threads_change_nothing(files, workers, arrow_threads):
    def batches(workers, arrow_threads=True):
        return [(rows_of(b), b.values.tolist(), b.offsets.tolist())
                for b in ChunkLoader(files, SCHEMA, 64, seed=5, workers=workers, prefetch=1,
                                     arrow_threads=arrow_threads).epoch(2)]

    assert batches(workers, arrow_threads) == batches(2)


@pytest.mark.parametrize("workers", [1, 3])
def test_staged_decoding_delivers_the_same_batches(files, workers):
    # Staging (a GPU's default): threads write chunks column by column into a ring of reused buffers that
    # is smaller than the epoch, and the chunks are transposed to rows after. Run here on the CPU, with few
    # slots reused many times over, it must deliver exactly the batches of the plain path.
    def batches(staging):
        loader = ChunkLoader(files, SCHEMA, 64, seed=5, workers=workers, prefetch=1, staging=staging,
                             shuffle_chunks=2)
        return [(b.dense.tolist(), b.label.tolist(), rows_of(b), b.values.tolist(), b.offsets.tolist())
                for b in loader.epoch(1)]

    staged = batches(True)
    assert staged == batches(False)
    assert sum(len(b[0]) for b in staged) == 1000


def test_int32_ids_are_staged_narrow_and_delivered_as_int64(files, tmp_path: Path):
    # Training files hold int32 ids (recloop.formats.id_dtype): they are staged and copied as int32 and
    # widened to the kernels' int64 after the copy. Files written before (int64 ids) still read, in the
    # same epoch as int32 ones.
    from recloop.data.loader import _Staging

    narrow = []
    for i, path in enumerate(files):
        table = pq.read_table(path)
        if i != 1:  # the middle file keeps its int64 ids
            table = table.cast(pa.schema([pa.field(f.name, pa.int32() if f.name in ("c_x", "c_y") else
                                                   pa.list_(pa.int32()) if f.name == "m_h" else f.type)
                                          for f in table.schema]))
        narrow.append(tmp_path / f"narrow{i}.parquet")
        pq.write_table(table, narrow[-1], row_group_size=128)

    loader = ChunkLoader(narrow, SCHEMA, 64, seed=5, staging=True)
    staging = _Staging(2, pinned=False)
    staged = [loader._read_staged((narrow[i], 0), staging, i) for i in (0, 1)]
    assert staged[0].tensors["categorical"].dtype == torch.int32
    assert staged[0].tensors["values:m_h"].dtype == torch.int32
    assert staged[1].tensors["categorical"].dtype == torch.int64  # the int64 file

    def batches(paths, staging):
        loader = ChunkLoader(paths, SCHEMA, 64, seed=5, workers=2, prefetch=1, staging=staging, shuffle_chunks=2)
        return [(b.values.dtype, rows_of(b), b.values.tolist(), b.offsets.tolist()) for b in loader.epoch(1)]

    expected = batches(files, False)
    assert expected[0][0] == torch.int64
    assert batches(narrow, True) == expected
    assert batches(narrow, False) == expected


def test_an_abandoned_epoch_stops_its_threads(files):
    import threading

    before = {t.name for t in threading.enumerate()}
    iterator = ChunkLoader(files, SCHEMA, 16, seed=0, shuffle_chunks=1, prefetch=1, workers=2).epoch(0)
    next(iterator)
    iterator.close()
    leftover = [t for t in threading.enumerate() if t.name.startswith("recloop") and t.name not in before]
    for thread in leftover:
        thread.join(timeout=5)
    assert not any(t.is_alive() for t in leftover)


@pytest.mark.parametrize("staging", [False, True])
def test_stage_times_name_the_slow_stage(files, monkeypatch, staging):
    import time

    loader = ChunkLoader(files, SCHEMA, 64, seed=0, shuffle_chunks=2, workers=1, staging=staging)
    assert sum(b.size for b in loader.epoch(0)) == 1000
    stats = loader.stats
    assert (stats.rows, stats.chunks) == (1000, 10) and stats.decode_s > 0 and stats.batching_s > 0
    assert 0 < stats.consumer_wait_s < stats.epoch_s

    name = "_read_staged" if staging else "_read"
    read = getattr(ChunkLoader, name)

    def slow_read(self, *args):
        time.sleep(0.1)
        return read(self, *args)

    monkeypatch.setattr(ChunkLoader, name, slow_read)  # slow decoding: the consumer waits for chunks
    list(loader.epoch(0))
    slow_decode = loader.stats
    assert slow_decode.decode_s >= 10 * 0.1 and slow_decode.consumer_wait_s > slow_decode.batching_s
    assert slow_decode.decode_wait_s > slow_decode.handover_wait_s

    monkeypatch.setattr(ChunkLoader, name, read)
    for _ in loader.epoch(0):  # a slow consumer: the producer waits to hand chunks over
        time.sleep(0.06)
    slow_consumer = loader.stats
    assert slow_consumer.handover_wait_s > slow_consumer.consumer_wait_s
    assert slow_consumer.handover_wait_s > slow_consumer.decode_wait_s


def test_on_a_gpu_a_default_loader_pads_multi_hot_ids_to_the_bucket(files):
    """Issue 39: a library user who builds a loader without ``pad_values_to`` gets padded ids on a GPU, so that a
    compiled step replays one CUDA graph per bucket instead of recording one per batch (the GPU test below runs
    it); on a CPU, and without list columns, nothing is padded. The device is not touched to decide."""
    from recloop.data import VALUES_BUCKET

    one_hot = FeatureSchema(dense=SCHEMA.dense, categorical=SCHEMA.categorical, multi_hot={})
    assert ChunkLoader(files, SCHEMA, 97, device="cuda").pad_values_to == VALUES_BUCKET
    assert ChunkLoader(files, one_hot, 97, device="cuda").pad_values_to is None
    assert ChunkLoader(files, SCHEMA, 97).pad_values_to is None
    assert ChunkLoader(files, SCHEMA, 97, device="cuda", pad_values_to=None).pad_values_to is None
    with pytest.raises(ValueError, match="pad_values_to"):
        ChunkLoader(files, SCHEMA, 97, pad_values_to=0)


@pytest.mark.gpu
def test_batches_land_on_the_gpu_without_host_synchronization(files):
    cpu = [(rows_of(b), b.values.tolist(), b.offsets.tolist(), b.dense.tolist(), b.label.tolist())
           for b in ChunkLoader(files, SCHEMA, 128, seed=0).epoch(0)]
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing call raises
    try:
        batches = list(ChunkLoader(files, SCHEMA, 128, device="cuda", seed=0, pad_values_to=256).epoch(0))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(b.values.is_cuda and b.dense.is_cuda for b in batches)
    # the same rows, ids and columns: staged column-major on the host, transposed to rows on the device
    gpu = [(rows_of(b), b.values[:int(b.offsets[-1])].tolist(), b.offsets.tolist(), b.dense.tolist(), b.label.tolist())
           for b in batches]
    assert gpu == cpu
    # in rows on the device: one group, in file order, is delivered as its chunks are (no gather after them)
    plain = next(ChunkLoader(files[:1], SCHEMA, 64, device="cuda", shuffle=False, shuffle_chunks=1).epoch(0))
    assert plain.dense.is_contiguous() and plain.values.dtype == torch.int64


def test_ids_are_written_as_int32_where_their_table_fits():
    from recloop.formats import id_dtype

    assert id_dtype(1_000_000) == np.int32 and id_dtype(2**31) == np.int32  # ids 0 .. 2**31 - 1
    assert id_dtype(2**31 + 1) == np.int64
