"""The item index: every catalog item's vector, searched for a user's nearest items by inner product.

Item vectors are unit length, so the inner product is the cosine the model was trained on. Kinds:

- ``hnsw``: FAISS ``IndexHNSWFlat`` (a graph; no training step; ``ef_search`` trades recall for time);
- ``ivf``: FAISS ``IndexIVFFlat`` (k-means lists; ``probe`` lists searched per query);
- ``flat``: FAISS ``IndexFlatIP``, exact.

On a GPU (``exact_on_gpu`` and CUDA present) the search is exact: one matrix product and ``torch.topk``
over the vectors on the device, faster there than any approximate index at catalog sizes that fit.

Saved as the index's own file format plus safetensors and JSON, never pickle::

    index.faiss          faiss.write_index
    index.safetensors    ids (N,) int64 and vectors (N, D) float32 (the exact path, and a rebuild)
    index.json           configuration, size, dimension

Example::

    index = ItemIndex.build(vectors, ids, IndexConfig(kind="ivf"))
    found, scores = index.search(user_vectors, k=500)     # (Q, 500) ids, -1 where fewer were found
    index.save(folder); ItemIndex.load(folder)
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from safetensors.torch import load_file, save_file

IndexKind = Literal["hnsw", "ivf", "flat"]
FILES = ("index.faiss", "index.safetensors", "index.json")


@dataclass(frozen=True)
class IndexConfig:
    """How the item index is built and searched.

    Args:
        kind: ``hnsw``, ``ivf`` or ``flat`` (see the module docstring). The default, IVF with sqrt(N) lists
            and 64 probed, is chosen by ``benchmarks/retrieval.py`` (recall of the exact top 500 and time
            on 100k items, next to HNSW and the exact search; figures in ``benchmarks/RESULTS.md``).
        hnsw_neighbors: M, graph neighbours per node.
        ef_construction, ef_search: HNSW candidate list sizes when building and searching (searching
            uses at least the requested k).
        ivf_lists: IVF lists (default sqrt(N): for k in the hundreds, few long lists beat many short
            ones); ``ivf_probe``: lists searched per query.
        exact_on_gpu: search exactly with torch on a GPU when CUDA is present.
        threads: FAISS threads per search (0: FAISS's default).
    """

    kind: IndexKind = "ivf"
    hnsw_neighbors: int = 32
    ef_construction: int = 80
    ef_search: int = 800
    ivf_lists: int | None = None
    ivf_probe: int = 64
    exact_on_gpu: bool = True
    threads: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> IndexConfig:
        return cls(**raw)


class ItemIndex:
    """Nearest items by inner product (see the module docstring). Build with ``ItemIndex.build``."""

    def __init__(self, ids: np.ndarray, vectors: np.ndarray, config: IndexConfig, faiss_index,
                 build_seconds: float = 0.0):
        self.ids = np.ascontiguousarray(ids, dtype=np.int64)  # (N,)
        self.vectors = np.ascontiguousarray(vectors, dtype=np.float32)  # (N, D)
        self.config = config
        self.build_seconds = build_seconds
        self._faiss = faiss_index
        self._device_vectors = None
        if config.exact_on_gpu and torch.cuda.is_available():
            self._device_vectors = torch.from_numpy(self.vectors).cuda()

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def dim(self) -> int:
        return self.vectors.shape[1]

    @classmethod
    def build(cls, vectors: np.ndarray, ids: np.ndarray, config: IndexConfig = IndexConfig()) -> ItemIndex:
        """An index over ``vectors`` (N, D) whose results are named by ``ids`` (N,)."""
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if vectors.ndim != 2 or len(vectors) != len(ids):
            raise ValueError(f"vectors must be (N, D) with one id each; got {vectors.shape} and {len(ids)} ids")
        if len(vectors) == 0:
            raise ValueError("an index needs at least one item")
        started = time.perf_counter()
        index = _new_faiss_index(vectors, config)
        return cls(ids, vectors, config, index, time.perf_counter() - started)

    def search(self, queries: np.ndarray | torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` nearest items of each query: ids (Q, k) int64 and scores (Q, k), best first.

        Fewer than ``k`` found (a catalog smaller than ``k``, or an approximate search that ran short):
        the rest are id -1 with score -inf.
        """
        queries = _as_numpy(queries)
        if self._device_vectors is not None:
            return self._exact_on_device(queries, k)
        import faiss

        if self.config.threads:
            faiss.omp_set_num_threads(self.config.threads)
        if self.config.kind == "hnsw":
            self._faiss.hnsw.efSearch = max(self.config.ef_search, k)
        elif self.config.kind == "ivf":
            self._faiss.nprobe = min(self.config.ivf_probe, self._faiss.nlist)
        scores, positions = self._faiss.search(queries, k)
        return self._named(positions, scores)

    def exact_search(self, queries: np.ndarray | torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The exact top ``k`` (a brute-force product): the reference the approximate search is measured by."""
        queries = torch.from_numpy(_as_numpy(queries))
        scores = queries @ torch.from_numpy(self.vectors).T  # (Q, N)
        top = torch.topk(scores, min(k, len(self)), dim=1)
        return self._named(top.indices.numpy(), top.values.numpy(), k)

    def _exact_on_device(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        scores = torch.from_numpy(queries).to(self._device_vectors.device) @ self._device_vectors.T  # (Q, N)
        top = torch.topk(scores, min(k, len(self)), dim=1)
        return self._named(top.indices.cpu().numpy(), top.values.float().cpu().numpy(), k)

    def _named(self, positions: np.ndarray, scores: np.ndarray, k: int | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
        if k is not None and positions.shape[1] < k:  # pad to k columns
            pad = k - positions.shape[1]
            positions = np.pad(positions, ((0, 0), (0, pad)), constant_values=-1)
            scores = np.pad(scores, ((0, 0), (0, pad)), constant_values=-np.inf)
        found = positions >= 0
        ids = np.where(found, self.ids[np.where(found, positions, 0)], -1)
        return ids, np.where(found, scores, -np.inf).astype(np.float32)

    # --- files ---------------------------------------------------------------------------------------------

    def save(self, folder: Path) -> list[Path]:
        """Write the index's files into ``folder`` (each written aside and renamed into place)."""
        import faiss

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        meta = {"config": self.config.to_dict(), "items": len(self), "dim": self.dim,
                "build_seconds": round(self.build_seconds, 4), "faiss": faiss.__version__}
        targets = [folder / name for name in FILES]
        staged = [p.with_name(f".{p.name}.tmp") for p in targets]
        faiss.write_index(self._faiss, str(staged[0]))
        save_file({"ids": torch.from_numpy(self.ids), "vectors": torch.from_numpy(self.vectors)}, staged[1])
        staged[2].write_text(json.dumps(meta, indent=2) + "\n")
        for tmp, path in zip(staged, targets, strict=True):
            os.replace(tmp, path)
        return targets

    @classmethod
    def load(cls, folder: Path, config: IndexConfig | None = None) -> ItemIndex:
        """An index saved by ``save`` (``config`` overrides search-time settings such as ``ef_search``)."""
        import faiss

        folder = Path(folder)
        missing = [name for name in FILES if not (folder / name).exists()]
        if missing:
            raise FileNotFoundError(f"{folder} is not a saved item index: {missing} missing")
        meta = json.loads((folder / "index.json").read_text())
        tensors = load_file(folder / "index.safetensors")
        stored = IndexConfig.from_dict(meta["config"])
        if config is not None and config.kind != stored.kind:
            raise ValueError(f"the saved index is {stored.kind!r}, not {config.kind!r}")
        return cls(tensors["ids"].numpy(), tensors["vectors"].numpy(), config or stored,
                   faiss.read_index(str(folder / "index.faiss")), meta.get("build_seconds", 0.0))


def _as_numpy(queries: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(queries, torch.Tensor):
        queries = queries.detach().float().cpu().numpy()
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    if queries.ndim != 2:
        raise ValueError(f"queries must be (Q, D), got shape {queries.shape}")
    return queries


def _new_faiss_index(vectors: np.ndarray, config: IndexConfig):
    import faiss

    n, dim = vectors.shape
    if config.threads:
        faiss.omp_set_num_threads(config.threads)
    if config.kind == "flat":
        index = faiss.IndexFlatIP(dim)
    elif config.kind == "hnsw":
        index = faiss.IndexHNSWFlat(dim, config.hnsw_neighbors, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = config.ef_construction
        index.hnsw.efSearch = config.ef_search
    elif config.kind == "ivf":
        lists = config.ivf_lists or max(1, min(n // 39, int(np.sqrt(n))))  # FAISS wants ≥ 39 points a list
        quantizer = faiss.IndexFlatIP(dim)
        index = faiss.IndexIVFFlat(quantizer, dim, lists, faiss.METRIC_INNER_PRODUCT)
        index.train(vectors)
        index.nprobe = min(config.ivf_probe, lists)
    else:
        raise ValueError(f"unknown index kind {config.kind!r}; choose hnsw, ivf or flat")
    index.add(vectors)
    return index
