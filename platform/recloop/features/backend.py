"""The frame backend: cuDF on a GPU, pandas on a CPU, behind one small interface.

Feature code is written once against the common subset of the two libraries (sorting, group-by
aggregations, merges, column arithmetic) plus an array module (``numpy`` or ``cupy``) for the
vectorized parts such as binary searches. Code that must behave identically on both sorts explicitly:
cuDF's group-by does not sort by default and its group order differs from pandas'.

Example::

    backend = get_backend("auto")        # cuDF when CUDA and cuDF are importable, else pandas
    frame = backend.from_arrow(table)
    ...
    table = backend.to_arrow(frame)
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import numpy as np
import pandas as pd
import pyarrow as pa

BackendName = Literal["auto", "cudf", "pandas"]


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run here (for example cuDF without a GPU)."""


@dataclass(frozen=True)
class FrameBackend:
    """A data-frame library (``frames``) and its array module (``arrays``)."""

    name: str
    frames: ModuleType  # pandas or cudf
    arrays: ModuleType  # numpy or cupy

    def from_arrow(self, table: pa.Table) -> Any:
        if self.name == "cudf":
            return self.frames.DataFrame.from_arrow(table)
        return table.to_pandas(types_mapper={pa.string(): pd.StringDtype("pyarrow")}.get)

    def to_arrow(self, frame: Any) -> pa.Table:
        if self.name == "cudf":
            return frame.to_arrow()
        return pa.Table.from_pandas(frame, preserve_index=False)

    def values(self, series: Any) -> Any:
        """A column as an array of this backend's array module (numpy or cupy)."""
        return series.values if self.name == "cudf" else series.to_numpy()

    def series(self, values: Any, index: Any = None) -> Any:
        return self.frames.Series(values, index=index)

    def to_numpy(self, values: Any) -> np.ndarray:
        return values.get() if self.name == "cudf" else np.asarray(values)


def _cudf_usable() -> bool:
    try:
        cupy = importlib.import_module("cupy")
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return False
        importlib.import_module("cudf")
    except Exception:  # noqa: BLE001 - no GPU, no driver, no cuDF: all mean "not usable here"
        return False
    return True


def get_backend(name: BackendName = "auto") -> FrameBackend:
    """The backend for a setting: ``auto`` never fails; ``cudf`` fails clearly where it cannot run."""
    if name == "pandas" or (name == "auto" and not _cudf_usable()):
        return FrameBackend("pandas", pd, np)
    if name not in ("auto", "cudf"):
        raise ValueError(f"unknown frame backend {name!r}: choose auto, cudf or pandas")
    if not _cudf_usable():
        raise BackendUnavailable("frame backend 'cudf' needs a CUDA GPU with cupy and cudf installed "
                                 "(pip install -e '.[gpu]'); use 'auto' or 'pandas' here")
    return FrameBackend("cudf", importlib.import_module("cudf"), importlib.import_module("cupy"))
