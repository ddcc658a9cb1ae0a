"""The retriever as an MLflow pyfunc, logged from code: it loads safetensors, JSON and the FAISS file, never pickle.

MLflow logs this file as the model's code together with the retriever's folder (towers, catalog, index)
as an artifact; ``mlflow.pyfunc.load_model("models:/recloop-retriever@champion")`` runs it. Input: a
DataFrame of user rows as ``recloop features`` writes them (the user tower's ``c_*`` indices and ``m_*``
lists); output: a DataFrame with each row's top ``k`` raw item ids (``params={"k": 500}``).
"""

from __future__ import annotations

import mlflow
import numpy as np
import pandas as pd


class RecloopRetriever(mlflow.pyfunc.PythonModel):
    def load_context(self, context) -> None:
        from recloop.retrieval.retriever import Retriever

        self.retriever = Retriever.load(context.artifacts["retriever"])

    def predict(self, context, model_input: pd.DataFrame, params=None) -> pd.DataFrame:
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


mlflow.models.set_model(RecloopRetriever())
