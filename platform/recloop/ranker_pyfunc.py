"""The ranking model as an MLflow pyfunc: a custom flavor whose loader reads safetensors and JSON, never pickle.

MLflow logs this module's name as the model's ``loader_module``, the checkpoint's step folder as its
``data`` and recloop with its kernels as its ``code`` (``recloop.model_code``), so
``mlflow.pyfunc.load_model("models:/recloop-ranker@champion")`` works in any process with the model's
requirements, recloop installed or not: MLflow puts the model's code folder on the path and calls
``_load_pyfunc`` with the checkpoint. Input: a DataFrame of feature rows as ``recloop features`` writes
them (``d_*`` floats, ``c_*`` indices, ``m_*`` lists); output: click probabilities.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import torch

from recloop.data.loader import Batch, rows_to_batch


def frame_to_batch(frame: pd.DataFrame, dense: list[str], tables: list[str]) -> Batch:
    """Feature rows → a batch in the kernels' layout (the serving API's conversion, from pandas)."""
    return rows_to_batch(pa.Table.from_pandas(frame[[*dense, *tables]], preserve_index=False), dense, tables)


class RecloopRanker:
    """The checkpoint's model on the CPU, scoring DataFrames of feature rows."""

    def __init__(self, checkpoint_dir: str):
        from recloop import checkpoint

        self.model, state = checkpoint.load_model(checkpoint_dir, device="cpu")
        inputs = checkpoint.trained_inputs(state)
        self.dense, self.tables = list(inputs.dense), list(inputs.table_names)

    def predict(self, model_input: pd.DataFrame, params=None) -> np.ndarray:
        batch = frame_to_batch(model_input, self.dense, self.tables)
        with torch.no_grad():
            return torch.sigmoid(self.model(batch.dense, batch.values, batch.offsets)).numpy()


def _load_pyfunc(data_path: str) -> RecloopRanker:
    """MLflow's entry point for a custom flavor: ``data_path`` is the model's checkpoint folder."""
    return RecloopRanker(data_path)
