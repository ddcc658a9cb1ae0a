"""The package's layers as import-linter contracts (``[tool.importlinter]`` in pyproject.toml): a new import
cycle or an import that runs up a layer fails the suite, and so CI. ARCHITECTURE.md draws the same layers."""

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONTRACTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


LINT_IMPORTS = shutil.which("lint-imports", path=str(Path(sys.executable).parent))


def test_every_contract_is_kept():
    result = subprocess.run([LINT_IMPORTS, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert f"Contracts: {len(CONTRACTS)} kept, 0 broken." in result.stdout


def test_the_contracts_cover_every_module_and_keep_their_rules():
    """Reviewed contracts, not loosened ones: every top-level module of recloop sits in exactly one layer, the
    layers run faces → serving → decisions → stages → adapters → core → kernels, and the acyclic and
    kernel-isolation contracts are there."""
    layers = next(c for c in CONTRACTS if c["type"] == "layers")["layers"]
    placed = [m.strip() for layer in layers for m in layer.split(":")]
    assert len(placed) == len(set(placed)), "a module is in two layers"
    package = ROOT / "platform" / "recloop"
    modules = {f"recloop.{p.stem}" for p in package.glob("*.py") if p.stem != "__init__"}
    modules |= {f"recloop.{p.name}" for p in package.iterdir() if (p / "__init__.py").exists()}
    assert modules <= set(placed), f"modules in no layer: {sorted(modules - set(placed))}"
    order = [next(i for i, layer in enumerate(layers) if name in layer)
             for name in ("recloop.cli", "recloop.serve", "recloop.gate", "recloop.train", "recloop.registry",
                          "recloop.schema", "recloop_kernels")]
    assert order == sorted(order) and len(set(order)) == len(order)
    kinds = {c["type"] for c in CONTRACTS}
    assert {"layers", "acyclic_siblings", "forbidden"} <= kinds
    kernels = next(c for c in CONTRACTS if c["type"] == "forbidden" and c["source_modules"] == ["recloop_kernels"])
    assert "recloop" in kernels["forbidden_modules"]


def test_an_upward_import_breaks_the_contract(tmp_path: Path):
    """The contracts can fail: the same configuration over a copy of the package with one core module importing
    the registry (an adapter above it) is broken, and says which import."""
    copy = tmp_path / "tree"
    shutil.copytree(ROOT / "platform" / "recloop", copy / "recloop", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "kernels" / "recloop_kernels", copy / "recloop_kernels",
                ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "flows", copy / "flows", ignore=shutil.ignore_patterns("__pycache__"))
    with (copy / "recloop" / "evaluate.py").open("a") as f:
        f.write("\nfrom recloop import registry  # noqa: E402,F401 - the upward import under test\n")
    config = tmp_path / "importlinter.toml"
    config.write_text((ROOT / "pyproject.toml").read_text())
    result = subprocess.run([LINT_IMPORTS, "--no-cache", "--config", str(config)], cwd=copy, capture_output=True,
                            text=True, timeout=240, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(copy)})
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-2000:]
    assert "recloop.evaluate -> recloop.registry" in result.stdout
