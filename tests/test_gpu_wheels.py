"""``benchmarks/gpu_wheels.py``: wheels split into parts, stashed part by part, reassembled and sha256-checked."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_wheels", ROOT / "benchmarks" / "gpu_wheels.py")
gw = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gw)

MIB = 1 << 20


@pytest.fixture
def wheels(tmp_path: Path) -> list[Path]:
    src = tmp_path / "src"
    src.mkdir()
    sizes = {"big-1.0-py3-none-any.whl": int(2.5 * MIB), "small-1.0-py3-none-any.whl": 1000,
             "mid-1.0-py3-none-any.whl": MIB // 2, "empty-1.0-py3-none-any.whl": 0}
    out = []
    for name, size in sizes.items():
        (src / name).write_bytes(os.urandom(size))
        out.append(src / name)
    return out


def carry_all(parts: list[Path], stash_dir: Path) -> None:
    for part in parts:
        gw.stash(part, stash_dir)


def test_pack_stash_reassemble(tmp_path: Path, wheels: list[Path]) -> None:
    parts = gw.pack(wheels, tmp_path / "whl", part_mib=1)
    assert [p.name for p in parts] == [f"p{i}" for i in range(1, len(parts) + 1)] == [
        p.name for p in gw.parts_of(tmp_path / "whl")]
    total = sum(w.stat().st_size for w in wheels)
    assert len(parts) == -(-total // MIB)  # parts are filled: ceil(total / limit)
    for part in parts:
        pieces = [f for f in part.iterdir() if f.name != gw.MANIFEST]
        assert sum(f.stat().st_size for f in pieces) <= MIB
        assert json.loads((part / gw.MANIFEST).read_text())["parts"] == len(parts)
    manifest = json.loads((parts[0] / gw.MANIFEST).read_text())
    big = next(e for e in manifest["wheels"] if e["name"].startswith("big"))
    assert big["pieces"][0].endswith(".whl.000") and len(big["pieces"]) >= 3
    carry_all(parts, tmp_path / "stash")
    whole = gw.reassemble(tmp_path / "stash", tmp_path / "whole")
    assert sorted(w.name for w in whole) == sorted(w.name for w in wheels)
    for wheel in wheels:
        assert (tmp_path / "whole" / wheel.name).read_bytes() == wheel.read_bytes()


def test_missing_piece_is_named(tmp_path: Path, wheels: list[Path]) -> None:
    parts = gw.pack(wheels, tmp_path / "whl", part_mib=1)
    carry_all(parts[:-1], tmp_path / "stash")  # the last call's part never arrived
    with pytest.raises(SystemExit, match=r"missing \d+ piece\(s\).*\.whl\.\d{3}"):
        gw.reassemble(tmp_path / "stash", tmp_path / "whole")
    with pytest.raises(SystemExit, match="no manifest.json"):
        gw.reassemble(tmp_path / "empty", tmp_path / "whole")


def test_corrupt_piece_fails_sha(tmp_path: Path, wheels: list[Path]) -> None:
    parts = gw.pack(wheels, tmp_path / "whl", part_mib=1)
    carry_all(parts, tmp_path / "stash")
    piece = tmp_path / "stash" / "big-1.0-py3-none-any.whl.001"
    data = bytearray(piece.read_bytes())
    data[10] ^= 0xFF
    piece.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="sha256 mismatch for big-1.0-py3-none-any.whl"):
        gw.reassemble(tmp_path / "stash", tmp_path / "whole")


def test_stash_refuses_a_folder_without_manifest(tmp_path: Path) -> None:
    (tmp_path / "p1").mkdir()
    with pytest.raises(SystemExit, match="no manifest.json"):
        gw.stash(tmp_path / "p1", tmp_path / "stash")


def test_commands_fit_the_device_tool(tmp_path: Path, wheels: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gw, "ROOT", tmp_path)
    gw.pack(wheels, tmp_path / ".whl-cudf", part_mib=1)
    calls = gw.commands(".whl-cudf")
    assert len(calls) == len(gw.parts_of(tmp_path / ".whl-cudf"))
    for i, (cmd, carry) in enumerate(calls, 1):
        assert carry[0] == f".whl-cudf/p{i}" and len(cmd) <= 2000 and f"stash .whl-cudf/p{i}" in cmd
    # the last call also carries the suite's JSON so far and writes the merged one where the tool returns it
    assert calls[-1][1][1:] == ["gpu-in"] and all(len(carry) == 1 for _, carry in calls[:-1])
    assert "install" in calls[-1][0] and "gpu_suite.py --only cudf --out $OUT/gpu_suite.json" in calls[-1][0]
    assert all("install" not in cmd for cmd, _ in calls[:-1])


def test_numpys_row_stack_is_restored_only_where_it_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    # the device image's numpy 2.4 lacks row_stack, which its numba-cuda needs for ``import cudf``
    old, new = types.ModuleType("numpy"), types.ModuleType("numpy")
    old.vstack = new.vstack = object()
    old.row_stack = object()
    for fake in (old, new):
        monkeypatch.setitem(sys.modules, "numpy", fake)
        gw.restore_numpy_row_stack()
    assert new.row_stack is new.vstack and old.row_stack is not old.vstack
    monkeypatch.setitem(sys.modules, "numpy", types.ModuleType("numpy"))
    sys.modules["numpy"].vstack = marker = object()
    exec(gw.NUMPY_ALIAS, {})  # the install's check, in its own process
    assert sys.modules["numpy"].row_stack is marker
