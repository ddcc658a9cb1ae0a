"""Registered versions loaded for scoring: a ranker version as a model that scores feature rows, a
retriever version as the served retriever, each downloaded and verified first (``checkpoint.resolve``).

Serving's model pools (``recloop.serve.models``) hold these; the gate's off-policy check and the demo's
reference runs load and score versions the same way, so every figure about a version comes from the
model serving would run.

Example::

    loaded = load_version(settings, "7")
    probabilities = score(loaded, rows)   # rows: the request's d_*, c_*, m_* columns
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import torch

from recloop.data.loader import rows_to_batch
from recloop.endpoints import ServiceUnavailable
from recloop.model import RankingModel
from recloop.settings import Settings

if TYPE_CHECKING:
    from recloop.retrieval.retriever import Retriever

log = logging.getLogger("recloop.serve")


@dataclass(frozen=True)
class LoadedModel:
    version: str
    model: RankingModel
    dense: tuple[str, ...]
    tables: tuple[str, ...]

    @property
    def columns(self) -> tuple[str, ...]:
        return self.dense + self.tables


def load_version(settings: Settings, version: str) -> LoadedModel:
    """A registered version, downloaded and verified (``checkpoint.resolve``) and loaded on the CPU.

    A copy that passed verification and still fails to load is fetched once more before giving up
    (a version registered before checksums were recorded can only be checked that way).
    """
    from recloop import checkpoint

    try:
        model, state = checkpoint.load_model(checkpoint.resolve(settings, version), device="cpu")
    except (checkpoint.CheckpointError, ServiceUnavailable):
        raise
    except Exception as err:  # noqa: BLE001 - e.g. SafetensorError: the bytes are bad, not the caller
        log.warning("model v%s does not load (%s): fetching it again", version, err)
        model, state = checkpoint.load_model(checkpoint.resolve(settings, version, refetch=True), device="cpu")
    inputs = checkpoint.trained_inputs(state)
    return LoadedModel(version, model, inputs.dense, inputs.table_names)


def load_checkpoint(path: str | Path, name: str) -> LoadedModel:
    """A checkpoint file that was never registered (a benchmark's or the demo's reference run), on the CPU."""
    from recloop import checkpoint

    model, state = checkpoint.load_model(path, device="cpu")
    inputs = checkpoint.trained_inputs(state)
    return LoadedModel(name, model, inputs.dense, inputs.table_names)


@dataclass(frozen=True)
class LoadedRetriever:
    """A registered retriever version: towers, catalog with its raw attributes, and the item index."""

    version: str
    retriever: Retriever


def load_retriever(settings: Settings, version: str) -> LoadedRetriever:
    """A registered ``recloop-retriever`` version, downloaded and verified (``checkpoint.resolve``), on the CPU;
    fetched once more when a verified copy still does not load (as ``load_version``)."""
    from recloop import checkpoint
    from recloop.registry import RETRIEVER_NAME
    from recloop.retrieval.retriever import Retriever

    try:
        return LoadedRetriever(version, Retriever.load(checkpoint.resolve(settings, version, RETRIEVER_NAME)))
    except (checkpoint.CheckpointError, ServiceUnavailable):
        raise
    except Exception as err:  # noqa: BLE001 - the bytes are bad, not the caller
        log.warning("retriever v%s does not load (%s): fetching it again", version, err)
        folder = checkpoint.resolve(settings, version, RETRIEVER_NAME, refetch=True)
        return LoadedRetriever(version, Retriever.load(folder))


@torch.no_grad()
def score(loaded: LoadedModel, rows: pa.Table) -> torch.Tensor:
    """Click probabilities for feature rows (the request's ``d_*``, ``c_*``, ``m_*`` columns)."""
    batch = rows_to_batch(rows, loaded.dense, loaded.tables)
    return torch.sigmoid(loaded.model(batch.dense, batch.values, batch.offsets).float())
