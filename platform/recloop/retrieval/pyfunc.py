"""The retriever as an MLflow pyfunc: a custom flavor whose loader reads safetensors, JSON and the FAISS
file, never pickle.

MLflow logs this module's name as the model's ``loader_module``, the retriever's folder (towers, catalog,
index) as its ``data`` and recloop with its kernels as its ``code`` (``recloop.model_code``);
``mlflow.pyfunc.load_model("models:/recloop-retriever@champion")`` runs it with or without recloop
installed. Input: a DataFrame of user rows as ``recloop features`` writes them (the user tower's ``c_*``
indices and ``m_*`` lists); output: a DataFrame with each row's top ``k`` raw item ids
(``params={"k": 500}``).
"""

from __future__ import annotations

import numpy as np
import pandas as pd


class RecloopRetriever:
    """The retriever's towers and index, answering DataFrames of user rows."""

    def __init__(self, folder: str):
        from recloop.retrieval.retriever import Retriever

        self.retriever = Retriever.load(folder)

    def predict(self, model_input: pd.DataFrame, params=None) -> pd.DataFrame:
        from recloop.retrieval.data import Rows

        features = self.retriever.features
        columns = {c: model_input[c].to_numpy(dtype=np.int64) for c in (features.user_id, *features.context)}
        lists = {}
        for name in features.history:
            values = [np.asarray(v if v is not None else [], dtype=np.int64) for v in model_input[name]]
            offsets = np.concatenate([[0], np.cumsum([len(v) for v in values])]).astype(np.int64)
            lists[name] = (offsets, np.concatenate(values) if values else np.zeros(0, np.int64))
        k = int((params or {}).get("k", 500))
        ids, scores = self.retriever.retrieve(Rows(columns, lists), k)
        return pd.DataFrame({"item_ids": list(ids), "scores": list(scores)})


def _load_pyfunc(data_path: str) -> RecloopRetriever:
    """MLflow's entry point for a custom flavor: ``data_path`` is the retriever's folder."""
    return RecloopRetriever(data_path)
