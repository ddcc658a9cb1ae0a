"""Loading a registered model where recloop is not installed: what `mlflow models serve` with a virtualenv
or uv environment, `mlflow models build-docker` and a managed endpoint do.

``load_and_predict`` runs a fresh interpreter with ``-I -S``: no site module (so no ``.pth`` file, and with
it no editable finder pointing at this checkout), no user site, no ``PYTHON*`` variables, no script or
working folder on the path; its path is the standard library plus this environment's site-packages (the
third-party libraries the model's requirements name). recloop and recloop_kernels can come only from the
model itself. It reports the predictions, where recloop was imported from and the distributions recloop's own modules
imported while loading and scoring (to hold against the model's requirements; what those import in turn
their own requirements bring).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

CHECKOUT = Path(__file__).resolve().parents[1]
# The folders an import of recloop could come from: the checkout and its two package roots (the editable
# install's finder maps them; this environment's own site-packages may sit inside the checkout, .venv/).
SOURCES = [str(CHECKOUT), str(CHECKOUT / "platform"), str(CHECKOUT / "kernels")]

_SCRIPT = r"""
import builtins, importlib.metadata, importlib.util, json, sys
site_packages, sources, uri, rows, params, hidden = sys.argv[1:]
sys.path.extend(json.loads(site_packages))


class Hidden:  # installed here for the test suite, not there: as if absent
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in json.loads(hidden):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


sys.meta_path.insert(0, Hidden())
found = [name for name in ("recloop", "recloop_kernels") if importlib.util.find_spec(name) is not None]
assert not found, f"importable before the model is loaded: {found}"
assert not [p for p in sys.path if p.rstrip("/") in json.loads(sources)], sys.path
direct, plain_import = set(), builtins.__import__

def traced(name, globals=None, locals=None, fromlist=(), level=0):
    # what recloop's own modules import (an import statement, cached or not): what its requirements must bring
    module = plain_import(name, globals, locals, fromlist, level)
    where = (globals or {}).get("__file__") or ""
    if level == 0 and ("/code/recloop/" in where or "/code/recloop_kernels/" in where):
        direct.add(name.split(".")[0])
    return module

builtins.__import__ = traced
import mlflow.pyfunc, pandas as pd
model = mlflow.pyfunc.load_model(uri)
answer = model.predict(pd.read_parquet(rows), params=json.loads(params) or None)
if isinstance(answer, pd.DataFrame):
    answer = {c: [v.tolist() if hasattr(v, "tolist") else v for v in answer[c]] for c in answer.columns}
else:
    answer = answer.tolist()
import recloop, recloop_kernels
owners = importlib.metadata.packages_distributions()
third_party = {d for name in direct - set(sys.stdlib_module_names) for d in owners.get(name, [name])}
print(json.dumps({"answer": answer, "recloop": recloop.__file__, "recloop_kernels": recloop_kernels.__file__,
                  "distributions": sorted(third_party - {"recloop", "recloop_kernels"})}))
"""


def site_packages() -> list[str]:
    return sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})


# Installed for the tests (the Triton interpreter), not among the model's requirements: a CPU machine built
# from those has no triton, and the kernels fall back to their PyTorch reference there.
NOT_REQUIRED = ("triton",)


def load_and_predict(model_uri: str, rows: Path, tracking_uri: str, cwd: Path, params: dict | None = None,
                     hidden: tuple[str, ...] = NOT_REQUIRED) -> dict:
    """Load ``model_uri`` and score the parquet ``rows`` in a fresh interpreter without recloop (see above),
    where the modules ``hidden`` cannot be imported."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "MLFLOW_", "RECLOOP_"))}
    env.update(MLFLOW_TRACKING_URI=tracking_uri, MLFLOW_REGISTRY_URI=tracking_uri, MLFLOW_DISABLE_TELEMETRY="true",
               MLFLOW_LOGGING_LEVEL="WARNING", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-I", "-S", "-c", _SCRIPT, json.dumps(site_packages()), json.dumps(SOURCES),
                           model_uri, str(rows), json.dumps(params or {}), json.dumps(hidden)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", Requirement(requirement).name).lower()


def covered(requirements: list[str]) -> set[str]:
    """The distributions ``requirements`` install: the named ones and what they require, recursively (as
    installed here; extras and environment markers evaluated as pip would for a plain install)."""
    seen: set[str] = set()
    pending = [_name(r) for r in requirements if r.strip() and not r.startswith("-")]
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for line in requires:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                pending.append(_name(line))
    return seen


def uncovered(used: list[str], requirements: list[str]) -> list[str]:
    """The distributions in ``used`` that installing ``requirements`` would not bring (recloop itself comes
    with the model)."""
    have = covered(requirements)
    return sorted(n for n in {re.sub(r"[-_.]+", "-", u).lower() for u in used} - have if n != "recloop")


def _strings(value) -> list[str]:
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return [value] if isinstance(value, str) else []


def shipped_model(uri: str, tracking_uri: str, target: Path, places: list[Path]) -> tuple[dict, list[str]]:
    """The logged model at ``uri``, downloaded: its MLmodel and requirements, checked to name no absolute path
    (none of ``places``) and to carry recloop and recloop_kernels as code, sources and package data only."""
    import mlflow
    import yaml

    folder = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(target), tracking_uri=tracking_uri,
                                                      registry_uri=tracking_uri))
    mlmodel = yaml.safe_load((folder / "MLmodel").read_text())
    # MLflow 3 records where the logged model lives in the artifact store (a store URI, s3://... on MinIO); it
    # reads it from the tracking server, not from a copy of the model. Everything else is module names and paths
    # relative to the model.
    store = {k: v for k, v in mlmodel.items() if k != "artifact_path"}
    assert mlmodel["artifact_path"].endswith(f"/models/{mlmodel['model_id']}/artifacts"), mlmodel["artifact_path"]
    absolute = [s for s in _strings(store) if s.startswith("/") or any(str(p) in s for p in places)]
    assert not absolute, absolute
    assert mlmodel["signature"]["inputs"] and mlmodel["signature"]["outputs"]  # served inputs are checked and cast
    flavor = mlmodel["flavors"]["python_function"]
    code = folder / flavor["code"]
    assert sorted(p.name for p in code.iterdir()) == ["recloop", "recloop_kernels"]
    files = [p.relative_to(code) for p in code.rglob("*") if p.is_file()]
    assert {p.suffix for p in files} <= {".py", ".yaml"}, sorted({p.suffix for p in files})
    assert not [p for p in files if "__pycache__" in p.parts or p.name.startswith(".")]
    assert Path("recloop/model/ranking.py") in files and Path("recloop_kernels/collection.py") in files
    assert not [p for p in files if "tests" in p.parts]
    return mlmodel, (folder / "requirements.txt").read_text().split()

