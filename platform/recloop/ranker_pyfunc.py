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
import pyarrow as pa
import torch

from recloop.data.loader import Batch, rows_to_batch


def frame_to_batch(frame: pd.DataFrame, dense: list[str], tables: list[str]) -> Batch:
    """Feature rows → a batch in the kernels' layout (the serving API's conversion, from pandas)."""
    return rows_to_batch(pa.Table.from_pandas(frame[[*dense, *tables]], preserve_index=False), dense, tables)


class RecloopRanker(mlflow.pyfunc.PythonModel):
    def load_context(self, context) -> None:
        from recloop import checkpoint

        self.model, state = checkpoint.load_model(context.artifacts["checkpoint"], device="cpu")
        inputs = checkpoint.trained_inputs(state)
        self.dense, self.tables = list(inputs.dense), list(inputs.table_names)

    def predict(self, context, model_input: pd.DataFrame, params=None) -> np.ndarray:
        batch = frame_to_batch(model_input, self.dense, self.tables)
        with torch.no_grad():
            return torch.sigmoid(self.model(batch.dense, batch.values, batch.offsets)).numpy()


mlflow.models.set_model(RecloopRanker())
