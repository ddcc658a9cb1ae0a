"""Versioned feature state: vocabularies, stored statistics and each entity's latest state, as of a time.

Each feature run that moves time forward writes a new version; a model records the version it was
trained on, and because vocabularies are append-only every later version maps its ids the same way.

::

    $RECLOOP_HOME/features/state/v000003/
        manifest.json              version, as_of, statistics, file names and SHA-256 checksums
        vocab-<column>.parquet     one per categorical column with a vocabulary
        snapshot-<entity>.parquet  latest state row per entity before as_of (what the online store holds)
        snapshot-<entity>/part-00003.parquet   the same in parts, when Dask workers wrote it (one part per
                                   hash partition of the keys; read back as one table sorted by key)

A version is written into a hidden folder and renamed into place, so it appears whole or not at all. A
missing or corrupt file is an error that names it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from recloop.features.vocab import Vocabulary


class FeatureStateError(RuntimeError):
    """A state version is missing, incomplete or corrupt."""


@dataclass(frozen=True)
class FeatureState:
    """Everything a feature run carries over to the next one.

    Args:
        as_of_us: the state covers events strictly before this time (UTC microseconds).
        vocabularies: per categorical column.
        stats: stored statistics (``prior_ctr``, ``numeric: {column: {mean, std}}``).
        snapshots: per entity prefix (``user``, ``item``), the latest state row of each entity.
        version: assigned when saved (0 = not saved yet).
    """

    as_of_us: int
    vocabularies: dict[str, Vocabulary]
    stats: dict
    snapshots: dict[str, pa.Table] = field(default_factory=dict)
    version: int = 0

    @property
    def as_of(self) -> datetime:
        return datetime.fromtimestamp(self.as_of_us / 1_000_000, tz=UTC)


class StateStore:
    """The versions under one folder. Example: ``StateStore(home / "features" / "state").latest()``."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._manifests: dict[int, dict] = {}  # a version's manifest never changes once written

    MARKER = "LATEST"  # the newest version's number, rewritten (atomically) each time one is published

    @property
    def marker(self) -> Path:
        return self.root / self.MARKER

    def publish(self, version: int) -> None:
        """Announce ``version`` as the newest: readers (serving) check the marker's change cheaply per request."""
        tmp = self.root / f".{self.MARKER}.tmp"
        tmp.write_text(f"{version}\n")
        os.replace(tmp, self.marker)

    def marker_stamp(self) -> tuple[int, int] | None:
        """A cheap fingerprint of the newest published version (one ``stat``): changes when one is published."""
        try:
            found = os.stat(self.marker)
        except FileNotFoundError:
            try:  # a state written before the marker existed: the folder changes when a version lands
                found = os.stat(self.root)
            except FileNotFoundError:
                return None
        return found.st_mtime_ns, found.st_ino

    def versions(self) -> list[int]:
        if not self.root.exists():
            return []
        return sorted(int(p.name[1:]) for p in self.root.iterdir() if p.is_dir() and p.name.startswith("v"))

    def _manifest(self, version: int) -> dict:
        if version in self._manifests:
            return self._manifests[version]
        path = self.root / f"v{version:06d}" / "manifest.json"
        try:
            self._manifests[version] = manifest = json.loads(path.read_text())
            return manifest
        except FileNotFoundError as err:
            raise FeatureStateError(f"feature state manifest {path} is missing") from err
        except json.JSONDecodeError as err:
            raise FeatureStateError(f"feature state manifest {path} is corrupt: {err}") from err

    def _as_of(self, version: int) -> int:
        return int(self._manifest(version)["as_of_us"])

    def as_of_us(self, version: int) -> int:
        """The time a version is as of (its manifest alone is read)."""
        return self._as_of(version)

    def _current(self) -> list[int]:
        """The versions still valid. A rebuild for late events (``recloop.features.job``) writes corrected
        states for the times from their period to the latest state's; every state written before it for a
        time in that span missed the late events, and is left out from then on. (The latest state itself
        stays the latest until the rebuild's last corrected state, for the same time, supersedes it.)"""
        versions = self.versions()
        rebuilds = [m["rebuild"] for v in versions if (m := self._manifest(v)).get("rebuild")]
        return [v for v in versions if not any(
            v < r["first_version"] and r["from_us"] < self._as_of(v) < r["until_us"] for r in rebuilds)]

    def latest_version(self) -> int | None:
        """The newest state: the latest ``as_of``, and of equal ones the last written."""
        versions = self._current()
        return max(versions, key=lambda v: (self._as_of(v), v)) if versions else None

    def latest(self, snapshots: bool = True) -> FeatureState | None:
        version = self.latest_version()
        return self.load(version, snapshots) if version is not None else None

    def at_or_before(self, t_us: int, counted: bool = False, snapshots: bool = True) -> FeatureState | None:
        """The newest valid state whose ``as_of`` is not after ``t_us`` (of equal ones, the last written).
        ``counted``: only one whose vocabulary counts are as of its own time (a rebuild's corrected states
        before its end carry the latest counts). ``snapshots``: False leaves them unread (``snapshot_files``)."""
        found = [(as_of, v) for v in self._current() if (as_of := self._as_of(v)) <= t_us and not (
            counted and (r := self._manifest(v).get("rebuild")) and as_of < r["until_us"])]
        return self.load(max(found)[1], snapshots) if found else None

    def next_version(self) -> int:
        return (self.versions() or [0])[-1] + 1

    def load(self, version: int, snapshots: bool = True) -> FeatureState:
        """A version, with its snapshots unless ``snapshots`` is False (a driver that leaves them to workers)."""
        manifest = self._manifest(version)
        folder = self.root / f"v{version:06d}"
        vocabularies = {
            column: Vocabulary(column, entry["min_count"], _read_checked(folder / entry["file"], entry["sha256"]))
            for column, entry in manifest["vocabularies"].items()
        }
        tables = {prefix: _read_snapshot(files) for prefix, files in self.snapshot_files(version).items()} \
            if snapshots else {}
        return FeatureState(manifest["as_of_us"], vocabularies, manifest["stats"], tables, version)

    def snapshot_files(self, version: int) -> dict[str, list[tuple[str, str]]]:
        """Each snapshot's files (path, SHA-256): one, or a Dask job's parts."""
        folder = self.root / f"v{version:06d}"
        return {prefix: [(str(folder / part["file"]), part["sha256"]) for part in entry.get("parts", [entry])]
                for prefix, entry in self._manifest(version)["snapshots"].items()}

    def stage(self) -> Path:
        """The next version's staging folder, empty: Dask workers write snapshot parts into it
        (``write_snapshot_part``) before ``save(..., staged=...)`` adds the rest and renames it in."""
        staging = self.root / f".v{self.next_version():06d}.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        return staging

    def unstage(self, staging: Path | None) -> None:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)

    def save(self, state: FeatureState, publish: bool = True, rebuild: dict | None = None,
             staged: Path | None = None, snapshot_parts: dict[str, list[dict]] | None = None) -> FeatureState:
        """Write ``state`` as the next version (announced to readers unless ``publish`` is False: a corrected
        earlier state); returns it with its version number. ``rebuild``: a corrected state's rebuild
        (``from_us``, ``until_us``, ``first_version``: the first version it wrote), see ``_current``.
        ``staged``, ``snapshot_parts``: the folder of ``stage`` and, per entity, the parts written into it."""
        version = self.next_version()
        final = self.root / f"v{version:06d}"
        staging = staged if staged is not None else self.stage()
        manifest = {
            "version": version, "as_of_us": state.as_of_us, "as_of": state.as_of.isoformat(),
            "created_at": datetime.now(UTC).isoformat(), "stats": state.stats,
            "vocabularies": {}, "snapshots": {},
        }
        if rebuild is not None:
            manifest["rebuild"] = rebuild
        for column, vocab in state.vocabularies.items():
            name = f"vocab-{column}.parquet"
            manifest["vocabularies"][column] = {"file": name, "min_count": vocab.min_count, "size": vocab.size,
                                                "sha256": _write(vocab.table, staging / name)}
        for prefix, table in state.snapshots.items():
            name = f"snapshot-{prefix}.parquet"
            manifest["snapshots"][prefix] = {"file": name, "rows": table.num_rows,
                                             "sha256": _write(table, staging / name)}
        for prefix, parts in (snapshot_parts or {}).items():
            parts = sorted(parts, key=lambda p: p["file"])
            manifest["snapshots"][prefix] = {"parts": parts, "rows": sum(p["rows"] for p in parts)}
        (staging / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        os.replace(staging, final)
        if publish:
            self.publish(version)
        return FeatureState(state.as_of_us, state.vocabularies, state.stats, state.snapshots, version)


def write_snapshot_part(table: pa.Table, staging: Path, prefix: str, number: int) -> dict:
    """One hash partition's snapshot rows, written by a Dask worker into a staged version; its manifest entry."""
    name = f"snapshot-{prefix}/part-{number:05d}.parquet"
    (staging / name).parent.mkdir(exist_ok=True)
    return {"file": name, "rows": table.num_rows, "sha256": _write(table, staging / name)}


def read_snapshot_part(path: str, sha256: str) -> pa.Table:
    return _read_checked(Path(path), sha256)


def _read_snapshot(files: list[tuple[str, str]]) -> pa.Table:
    """A snapshot's table: its one file, or its parts in one table sorted by key (as one process writes it)."""
    tables = [_read_checked(Path(path), sha256) for path, sha256 in files]
    if len(tables) == 1:
        return tables[0]
    table = pa.concat_tables(tables)
    return table.take(pc.sort_indices(table["key"]))


def _write(table: pa.Table, path: Path) -> str:
    pq.write_table(table, path)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _read_checked(path: Path, sha256: str) -> pa.Table:
    try:
        data = path.read_bytes()
    except FileNotFoundError as err:
        raise FeatureStateError(f"feature state file {path} is missing") from err
    if hashlib.sha256(data).hexdigest() != sha256:
        raise FeatureStateError(f"feature state file {path} is corrupt (checksum mismatch)")
    try:
        return pq.read_table(pa.BufferReader(data))
    except pa.ArrowException as err:
        raise FeatureStateError(f"feature state file {path} is corrupt: {err}") from err
