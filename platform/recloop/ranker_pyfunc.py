"""The ranking model as an MLflow pyfunc, logged from code: it loads safetensors and JSON, never pickle.

MLflow logs this file as the model's code (models-from-code) together with the checkpoint folder as an
artifact; ``mlflow.pyfunc.load_model("models:/recloop-ranker@champion")`` runs it in the loading
process. Input: a DataFrame of feature rows as ``recloop features`` writes them (``d_*`` floats, ``c_*``
indices, ``m_*`` lists); output: click probabilities.
"""

from __future__ import annotations

import mlflow
import numpy as np
import pandas as pd
import torch

from recloop.data.loader import Batch


def frame_to_batch(frame: pd.DataFrame, dense: list[str], tables: list[str]) -> Batch:
    """Feature rows → a batch in the kernels' layout (one-hot ``c_*`` tables, then ``m_*`` lists)."""
    size = len(frame)
    dense_values = torch.tensor(frame[dense].to_numpy(dtype=np.float32)) if dense else torch.zeros(size, 0)
    parts, lengths = [], []
    for name in tables:
        if name.startswith("m_"):
            lists = [np.asarray(v if v is not None else [], dtype=np.int64) for v in frame[name]]
            parts.append(torch.tensor(np.concatenate(lists) if lists else np.zeros(0, np.int64)))
            lengths.append(torch.tensor([len(v) for v in lists], dtype=torch.int64))
        else:
            parts.append(torch.tensor(frame[name].to_numpy(dtype=np.int64)))
            lengths.append(torch.ones(size, dtype=torch.int64))
    all_lengths = torch.cat(lengths) if lengths else torch.zeros(0, dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), all_lengths.cumsum(0)])
    return Batch(dense_values, torch.zeros(size), torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64),
                 offsets)


class RecloopRanker(mlflow.pyfunc.PythonModel):
    def load_context(self, context) -> None:
        from recloop.train import load_model

        self.model, state = load_model(context.artifacts["checkpoint"], device="cpu")
        self.dense = list(state["dense"])
        self.tables = [name for name, _ in state["tables"]]

    def predict(self, context, model_input: pd.DataFrame, params=None) -> np.ndarray:
        batch = frame_to_batch(model_input, self.dense, self.tables)
        with torch.no_grad():
            return torch.sigmoid(self.model(batch.dense, batch.values, batch.offsets)).numpy()


mlflow.models.set_model(RecloopRanker())
