"""The host-memory tier (recloop_kernels.host_tier): a small device cache over tables in host memory trains
exactly as the whole table on the device does, and moves only the rows it misses."""

from __future__ import annotations

import os

import pytest
import torch

from recloop_kernels import EmbeddingBagCollection, TableConfig
from recloop_kernels.host_tier import HostCachedEmbeddingBagCollection

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
TRITON = pytest.mark.skipif(not (INTERPRETER or torch.cuda.is_available()), reason="needs CUDA or TRITON_INTERPRET=1")
TABLES = [TableConfig("item", 400, 8), TableConfig("user", 300, 5, pooling="mean"), TableConfig("ctx", 20, 8)]


def zipf_batches(steps: int, batch_size: int, seed: int):
    """Table-major bags of Zipf ids (a hot head, a long tail), empty bags included."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        lengths = torch.randint(0, 4, (len(TABLES) * batch_size,), generator=g)
        values = []
        for t, table in enumerate(TABLES):
            n = int(lengths[t * batch_size:(t + 1) * batch_size].sum())
            p = torch.arange(1, table.num_embeddings + 1, dtype=torch.float64) ** -1.1
            ranks = torch.multinomial(p, n, replacement=True, generator=g) if n else torch.zeros(0, dtype=torch.int64)
            values.append(torch.randperm(table.num_embeddings, generator=torch.Generator().manual_seed(t))[ranks])
        yield torch.cat(values), torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adam"])
@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=TRITON)])
def test_the_cached_table_trains_exactly_as_the_whole_table_on_the_device(optimizer, backend):
    kwargs = dict(optimizer=optimizer, lr=0.2, seed=4, backend=backend)
    whole = EmbeddingBagCollection(TABLES, **kwargs)
    tiered = HostCachedEmbeddingBagCollection(TABLES, cache_rows=[60, 50, 20], **kwargs)
    batches = list(zipf_batches(25 if backend == "reference" else 8, 16, seed=1))
    head = torch.randn(16, whole.embedding_dim, generator=torch.Generator().manual_seed(2))
    for step, (values, offsets) in enumerate(batches):
        out_whole, out_tiered = whole(values, offsets), tiered(values, offsets)
        assert torch.equal(out_tiered, out_whole), f"forward, step {step}"
        (out_whole * head).sum().backward()
        if step % 2 and step + 1 < len(batches):  # every other batch prefetched while this one is in flight
            tiered.prefetch(*batches[step + 1])
        (out_tiered * head).sum().backward()
    tiered.flush()
    assert torch.equal(tiered.store.weights, whole.weights)
    assert torch.equal(tiered.store.state1, whole.state1)
    assert torch.equal(tiered.store.state2, whole.state2)
    assert 0.3 < tiered.hit_rate < 1.0  # the Zipf head stays cached, the tail comes and goes
    assert tiered.rows_copied_in == tiered.lookups - tiered.hits  # only missing rows moved
    assert tiered.rows_written_back > 0
    print(f"{backend}/{optimizer}: hit rate {tiered.hit_rate:.2f} over {tiered.lookups} distinct-row lookups")


def test_a_cache_smaller_than_a_batch_says_so():
    tiered = HostCachedEmbeddingBagCollection(TABLES, cache_rows=4, optimizer="sgd")
    values, offsets = next(zipf_batches(1, 32, seed=3))
    with pytest.raises(ValueError, match="cache_rows"):
        tiered(values, offsets)


def test_bad_ids_stay_errors_and_padding_is_ignored():
    tiered = HostCachedEmbeddingBagCollection(TABLES, cache_rows=50, optimizer="sgd", check_ids="sync")
    values = torch.tensor([3, 5, 7, 1000, 1])  # item: 3, 5; user: 7; ctx: 1000 (bad); 1: padding
    offsets = torch.tensor([0, 2, 3, 4])
    with pytest.raises(IndexError):
        tiered(values, offsets)


@pytest.mark.gpu
def test_on_cuda_a_pinned_store_with_prefetch_trains_as_the_whole_table():
    """The CUDA path: pinned host store, copies on a side stream, prefetch while a batch is in flight."""
    kwargs = dict(optimizer="rowwise_adagrad", lr=0.2, seed=4)
    tiered = HostCachedEmbeddingBagCollection(TABLES, cache_rows=[60, 50, 20], device="cuda", **kwargs)
    assert tiered.store.weights.is_pinned()
    whole = EmbeddingBagCollection(TABLES, device="cuda", **kwargs)
    with torch.no_grad():  # the store's rows were drawn on the host: start the whole table from the same ones
        whole.weights.copy_(tiered.store.weights)
    batches = [(v.cuda(), o.cuda()) for v, o in zipf_batches(30, 16, seed=1)]
    head = torch.randn(16, whole.embedding_dim, device="cuda")
    for step, (values, offsets) in enumerate(batches):
        out_whole, out_tiered = whole(values, offsets), tiered(values, offsets)
        torch.testing.assert_close(out_tiered, out_whole, rtol=1e-6, atol=1e-7)
        (out_whole * head).sum().backward()
        if step + 1 < len(batches):
            tiered.prefetch(*batches[step + 1])
        (out_tiered * head).sum().backward()
    tiered.flush()
    torch.testing.assert_close(tiered.store.weights.cuda(), whole.weights, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(tiered.store.state1.cuda(), whole.state1, rtol=1e-6, atol=1e-7)
    assert 0.3 < tiered.hit_rate < 1.0
