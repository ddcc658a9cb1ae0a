"""What a logged model carries so that it loads where recloop is not installed.

A registered version is served by whatever MLflow serves with: ``mlflow models serve`` in a virtualenv or
uv environment built from the model's requirements, ``mlflow models build-docker``, a managed endpoint.
None of them has recloop. So each model is logged as an MLflow *custom flavor*: its ``loader_module``
(``recloop.ranker_pyfunc``, ``recloop.retrieval.pyfunc``) and the packages it imports, ``recloop`` and
``recloop_kernels``, travel in the model's ``code`` folder (MLflow puts that folder on ``sys.path`` before
importing the loader), the checkpoint is its ``data``, and its ``requirements.txt`` names the third-party
libraries. The MLmodel file then holds module names and paths relative to the model, never a path on the
machine that logged it (a model logged *from code* records its script's absolute path, and the
artifacts' source paths).

Only sources and package data are shipped: caches, compiled files and hidden files are left out.

Example::

    with code_paths() as code:
        mlflow.pyfunc.log_model(name="model", loader_module="recloop.ranker_pyfunc", data_path=folder,
                                code_paths=code, signature=signature(RecloopRanker(folder), example),
                                input_example=example, pip_requirements=requirements(RANKER))
"""

from __future__ import annotations

import importlib
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PACKAGES = ("recloop", "recloop_kernels")

# What the loaders import, outside recloop (ranker: checkpoint, model, data.loader; retriever: its towers
# and FAISS index): checked against what a load and a prediction import, in a process without recloop.
RANKER = ("mlflow", "torch", "safetensors", "numpy", "pandas", "pyarrow")
RETRIEVER = (*RANKER, "faiss-cpu")

# Lower bounds as pyproject.toml states them: the model's environment resolves like recloop's own.
_MINIMUM = {"mlflow": ">=3,<4", "torch": ">=2.5", "safetensors": ">=0.4", "numpy": ">=1.26",
            "pandas": ">=2.2,<3", "pyarrow": ">=17", "faiss-cpu": ">=1.8,<2"}

_LEFT_OUT = shutil.ignore_patterns("__pycache__", "*.pyc", "*.pyo", ".*")


@contextmanager
def code_paths() -> Iterator[list[str]]:
    """Copies of the ``recloop`` and ``recloop_kernels`` package folders (sources and package data), in a
    temporary folder for as long as the model is being logged: MLflow's ``code_paths``."""
    with tempfile.TemporaryDirectory(prefix="recloop-model-code-") as folder:
        paths = []
        for name in PACKAGES:
            source = Path(importlib.import_module(name).__file__).parent
            target = Path(folder) / name
            shutil.copytree(source, target, ignore=_LEFT_OUT)
            paths.append(str(target))
        yield paths


def requirements(names: tuple[str, ...]) -> list[str]:
    """The model's pip requirements: ``names`` with the version ranges recloop itself needs."""
    return [f"{name}{_MINIMUM.get(name, '')}" for name in names]


def signature(model, example, params: dict | None = None):
    """The model's MLflow signature from a prediction on ``example`` (with ``params``: their schema too).
    MLflow infers none for a custom flavor, and without one a served model takes no ``params``."""
    from mlflow.models import infer_signature

    return infer_signature(example, model.predict(example, params), params)
