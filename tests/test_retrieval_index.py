"""Item index: the same answers after a save/load round trip, ANN recall against exact search, padding."""

from __future__ import annotations

import numpy as np
import pytest

from recloop.retrieval.index import IndexConfig, ItemIndex


def clustered(n: int, dim: int, seed: int) -> np.ndarray:
    """Unit vectors around a few centres, as trained item vectors are (categories)."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(20, dim))
    vectors = centres[rng.integers(0, 20, n)] + 0.7 * rng.normal(size=(n, dim))
    return (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float32)


@pytest.mark.parametrize("kind", ["ivf", "hnsw", "flat"])
def test_round_trip_gives_the_same_answers(tmp_path, kind):
    vectors, queries = clustered(3000, 16, 0), clustered(20, 16, 1)
    ids = np.arange(3000, dtype=np.int64) * 7 + 100  # raw ids, not positions
    index = ItemIndex.build(vectors, ids, IndexConfig(kind=kind))
    found, scores = index.search(queries, 50)
    assert found.shape == scores.shape == (20, 50)
    assert np.isin(found, ids).all() and (np.diff(scores, axis=1) <= 1e-6).all()  # best first
    written = index.save(tmp_path / "index")
    assert {p.name for p in written} == {"index.faiss", "index.safetensors", "index.json"}
    assert not list((tmp_path / "index").glob("*.tmp"))
    loaded = ItemIndex.load(tmp_path / "index")
    again, again_scores = loaded.search(queries, 50)
    np.testing.assert_array_equal(again, found)
    np.testing.assert_allclose(again_scores, scores, rtol=1e-6)
    assert loaded.config == index.config and len(loaded) == 3000


def test_the_default_ann_finds_most_of_the_exact_top_k():
    vectors, queries = clustered(20_000, 32, 2), clustered(50, 32, 3)
    index = ItemIndex.build(vectors, np.arange(20_000), IndexConfig())
    approximate, _ = index.search(queries, 200)
    exact, exact_scores = index.exact_search(queries, 200)
    brute = np.argsort(-(queries @ vectors.T), axis=1)[:, :200]
    assert np.array_equal(np.sort(exact, axis=1), np.sort(brute, axis=1))  # the reference is exact
    recall = np.mean([len(np.intersect1d(a, e)) / 200 for a, e in zip(approximate, exact, strict=True)])
    assert recall >= 0.95, recall
    assert (np.diff(exact_scores, axis=1) <= 1e-6).all()


def test_a_catalog_smaller_than_k_is_padded_and_bad_input_refused(tmp_path):
    vectors = clustered(30, 8, 4)
    index = ItemIndex.build(vectors, np.arange(30), IndexConfig(kind="flat"))
    found, scores = index.search(vectors[:2], 50)
    assert (found[:, :30] >= 0).all() and (found[:, 30:] == -1).all() and np.isneginf(scores[:, 30:]).all()
    assert found[0, 0] == 0 and found[1, 0] == 1  # each vector's nearest item is itself
    with pytest.raises(ValueError):
        ItemIndex.build(vectors, np.arange(29))
    with pytest.raises(ValueError):
        index.search(vectors[0], 5)  # a single vector must be (1, D)
    with pytest.raises(FileNotFoundError):
        ItemIndex.load(tmp_path)
