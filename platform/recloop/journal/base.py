"""The journal's interface (``Journal``) and all that does not depend on the store: batching request rows,
accepting feedback exactly once, landing it as events, and the figures decisions read (``stats``,
``interleaving_credits``, ``served_predictions``, ...). The stores: ``recloop.journal.sqlite`` and
``recloop.journal.postgres``; what the journal is for: ``recloop.journal``."""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import uuid
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from recloop.evaluate import auc
from recloop.evidence.variants import VariantStats, p99_bounds
from recloop.formats import ARROW_TYPES
from recloop.schema import DatasetSpec

log = logging.getLogger("recloop.journal")

if TYPE_CHECKING:
    pass


class FeedbackError(ValueError):
    """Feedback that does not match its request (unknown request, items that were not candidates)."""


class UnknownRequest(FeedbackError):
    pass


class JournalBusy(RuntimeError):
    """Feedback that cannot be judged now, and may be accepted on a retry: the store refused the queued
    request rows it might name, or every wait for a request another replica has not written is taken."""


class JournalUnavailable(JournalBusy):
    """The journal's store cannot be reached (a serving replica started while its database was down, or one
    gone since): requests are kept in memory and written once it answers; feedback is refused until then, so
    the client keeps it and sends it again (nothing is accepted that could not be recorded).

    Args:
        retry_after: seconds until the store is tried again (what a client should wait).
    """

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class Journal(ABC):
    """The journal's interface and everything that does not depend on the store (see the module docstring).

    A store implements five primitives: ``_write_requests`` (a batch of request and evaluation rows,
    repeats ignored), ``_request`` (a request's payload and served version), ``_insert_new_feedback``
    (insert the rows whose event id is new, atomically; return those), ``_unlanded`` (claim events not
    landed yet and mark them once written), ``_query`` (rows of a read-only SQL query in ``?`` style) and
    ``_close_store``.

    Args:
        spec: the dataset feedback lands as (only ``land_feedback`` needs it).
        request_wait_seconds: how long feedback waits for an unknown request to appear. Another replica
            writes its requests in batches (every ~50 ms): feedback that reaches this one first waits.
    """

    def __init__(self, spec: DatasetSpec | None = None, request_wait_seconds: float = 0.0):
        self.spec = spec
        self.request_wait_seconds = request_wait_seconds
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._unwritten: list[tuple] = []  # a batch whose write failed: first in the next one
        self._flushing = threading.Lock()
        # feedback calls that may wait for a request another replica has not written yet: few at once, so
        # that calls naming requests that never were cannot hold every serving thread
        self._waiting = threading.BoundedSemaphore(2)
        self._stop = threading.Event()
        self._writer = threading.Thread(target=self._write_loop, name="recloop-journal", daemon=True)
        self.write_error: str | None = None  # the last failed write of requests, until one succeeds
        self._recovered: list[Path] = []  # files of rows an earlier process could not write, queued again
        # While the store fails, rows past ``spill_rows`` go to a file in ``spill_folder`` (``keep_unwritten``)
        # instead of memory, and are queued again once it answers: an outage of hours neither grows the process
        # nor loses what a crash would have taken with it. None: kept in memory (and written out at ``close``).
        self.spill_folder: Path | None = None
        self.spill_rows = 5_000

    def _start_writer(self) -> None:
        self._writer.start()

    # --- what a store implements --------------------------------------------------------------------------

    @abstractmethod
    def _write_requests(self, requests: list[tuple], evaluations: list[tuple]) -> None:
        ...

    @abstractmethod
    def _request(self, request_id: str) -> tuple[str, str] | None:
        ...

    @abstractmethod
    def _insert_new_feedback(self, rows: list[tuple]) -> list[tuple]:
        ...

    @abstractmethod
    def _unlanded(self, limit: int):
        """A context manager yielding ``(rows, mark)``: feedback rows joined with their request
        (``event_id, item_id, label, ts_us, user_id, payload``), and ``mark(file_name)`` to call once they
        are written. Rows claimed here are not handed to another caller until the block ends."""
        ...

    @abstractmethod
    def _query(self, sql: str, params: list) -> list[tuple]:
        ...

    @abstractmethod
    def _close_store(self) -> None:
        ...

    def _wait_for_request(self, request_id: str, seconds: float) -> None:
        """Block until ``request_id`` may have been written by another replica, at most ``seconds``: a short
        poll here; a store that can announce its writes waits for the announcement."""
        time.sleep(max(0.0, min(0.02, seconds)))

    # --- how the store is doing -------------------------------------------------------------------------

    @property
    def unwritten_requests(self) -> int:
        """Request rows served but not in the store yet (queued for the writer, or kept after a failed write)."""
        return len(self._unwritten) + self._queue.qsize()

    @property
    def degraded(self) -> str | None:
        """Why the journal cannot record right now (None: it can): serving goes on, requests kept in memory."""
        if self.write_error is None:
            return None
        return (f"{self.unwritten_requests} request rows kept in memory until the journal's store answers "
                f"(feedback refused meanwhile): {self.write_error}")

    # --- requests -------------------------------------------------------------------------------------

    def record(self, request: tuple, evaluations: list[tuple]) -> None:
        """Queue a request row and its evaluations (written within ~50 ms, or at the next ``flush``)."""
        self._queue.put((request, evaluations))

    def flush(self) -> None:
        """Write every queued request now. If the store refuses (a database gone for a moment), the batch is
        kept, first in the next write, and the error raised: a request row is never dropped."""
        with self._flushing:
            batch = self._drain()
            # files kept by an earlier process: their rows were queued before the file was listed, so they are in
            # this batch or in an earlier one that was written
            files, self._recovered = self._recovered, []
            if batch:
                try:
                    self._write_requests([r for r, _ in batch], [e for _, es in batch for e in es])
                except BaseException:
                    self._unwritten, self._recovered = batch, files + self._recovered
                    raise
        for path in files:  # written: what an earlier process kept for this store is in it now
            path.unlink(missing_ok=True)

    def _drain(self) -> list[tuple]:
        """The rows kept after a failed write, then every queued one, taken out (the caller holds ``_flushing``)."""
        batch, self._unwritten = self._unwritten, []
        while True:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                return batch

    def keep_unwritten(self, folder: Path) -> Path | None:
        """Write the request rows the store has not taken (it is down while the process stops) to a JSON file in
        ``folder``; a later process queues them again (``queue_kept``). Returns the file (None: nothing kept)."""
        with self._flushing:
            batch = self._drain()
            if not batch:
                return None
            Path(folder).mkdir(parents=True, exist_ok=True)
            path = Path(folder) / f"requests-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:8]}.json"
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(json.dumps([[list(r), [list(e) for e in es]] for r, es in batch]))
            tmp.rename(path)  # atomic: a later process reads all of it or nothing
            return path

    def queue_kept(self, folder: Path) -> int:
        """Queue again the request rows earlier processes kept in ``folder`` (``keep_unwritten``); each file is
        removed once its rows are written. Returns the rows queued."""
        rows = 0
        for path in sorted(Path(folder).glob("requests-*.json")) if Path(folder).is_dir() else ():
            if path in self._recovered:  # queued already, not written yet
                continue
            for request, evaluations in json.loads(path.read_text()):
                self._queue.put((tuple(request), [tuple(e) for e in evaluations]))
                rows += 1
            with self._flushing:
                self._recovered.append(path)
        return rows

    def _write_loop(self) -> None:
        failures = 0
        while not self._stop.wait(min(0.05 * 2 ** failures, 5.0)):  # backs off while the store fails
            try:
                self.flush()
                if self.write_error is not None:
                    log.warning("journal: the store answers again; the request rows kept meanwhile are written")
                    if self.spill_folder is not None and self.queue_kept(self.spill_folder):
                        self.flush()  # the rows spilled to disk during the outage
                failures, self.write_error = 0, None
            except Exception as err:  # noqa: BLE001 - the rows are kept; the thread must live on
                failures = min(failures + 1, 7)
                self.write_error = f"{type(err).__name__}: {str(err).strip()}"
                log.warning("journal: writing %d request rows failed (kept, retried): %s",
                            len(self._unwritten), err)
                if self.spill_folder is not None and self.unwritten_requests >= self.spill_rows:
                    try:
                        self.keep_unwritten(self.spill_folder)
                    except OSError as spill_error:  # a full disk: they stay in memory
                        log.error("journal: could not spill the kept request rows to disk: %s", spill_error)

    def close(self) -> None:
        self._stop.set()
        if self._writer.is_alive():
            self._writer.join(timeout=5)
        try:
            self.flush()
        except Exception:
            log.error("journal: %d request rows could not be written before closing", len(self._unwritten))
            raise
        finally:
            self._close_store()

    # --- feedback -------------------------------------------------------------------------------------

    def add_feedback(self, request_id: str, impressions: list[int], clicks: list[int]) -> dict[str, int]:
        """Record one event per impression (label 1 if clicked); returns counts of new and repeated events."""
        try:
            self.flush()  # the request may still be queued
        except JournalUnavailable:
            raise
        except Exception as err:  # noqa: BLE001 - kept and retried by the writer; the request may be among them
            raise JournalBusy(f"the journal's store refused the queued requests ({type(err).__name__}): "
                              "retry") from err
        row = self._request(request_id)
        if row is None and self.request_wait_seconds > 0:
            if not self._waiting.acquire(blocking=False):  # no serving thread held: the client retries
                raise JournalBusy(f"request {request_id!r} is not written yet and every wait for one is taken: "
                                  "retry")
            try:
                deadline = time.monotonic() + self.request_wait_seconds
                while row is None and time.monotonic() < deadline:  # served by another replica, not written yet
                    self._wait_for_request(request_id, deadline - time.monotonic())
                    row = self._request(request_id)
            finally:
                self._waiting.release()
        if row is None:
            raise UnknownRequest(f"unknown request id {request_id!r}")
        payload, served_version = json.loads(row[0]), row[1]
        candidates = {item: i for i, item in enumerate(payload["item_ids"])}
        shown = set(payload.get("ranked", payload["item_ids"]))  # what the answer listed (top_k may cut it)
        strangers = sorted({i for i in impressions if i not in shown})
        if strangers:
            raise FeedbackError(f"items {strangers[:10]} were not shown in the answer to request {request_id}")
        unshown = sorted(set(clicks) - set(impressions))
        if unshown:
            raise FeedbackError(f"clicks on items {unshown[:10]} that are not among the impressions")
        clicked, now = set(clicks), time.time()
        rows = []
        for item in dict.fromkeys(impressions):  # an item shown twice in one list is one event
            index = candidates[item]
            scores = {version: values[index] for version, values in payload["scores"].items()}
            rows.append((f"{request_id}-{item}", request_id, item, int(item in clicked), now, served_version,
                         json.dumps(scores), None))
        new = self._insert_new_feedback(rows)
        return {"accepted": len(new), "duplicates": len(rows) - len(new), "clicks": sum(r[3] for r in new),
                "served_version": served_version}

    def land_feedback(self, landing_dir: Path, limit: int = 200_000) -> tuple[Path | None, int]:
        """Write events not landed yet as one parquet file in the landing zone; returns it and its rows."""
        with self._unlanded(limit) as (rows, mark):
            if not rows:
                return None, 0
            table = self._events(rows)
            folder = Path(landing_dir) / "serving"
            folder.mkdir(parents=True, exist_ok=True)
            name = f"feedback-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:8]}.parquet"
            tmp = folder / f".{name}.tmp"
            pq.write_table(table, tmp)
            tmp.rename(folder / name)  # atomic: the ingester never sees half a file
            mark(name)
        return folder / name, len(rows)

    def _events(self, rows: list[tuple]) -> pa.Table:
        """Feedback rows as events in the dataset spec's columns (context per candidate, served position)."""
        spec = self.spec
        if spec is None:
            raise ValueError("this journal was opened without a dataset spec: it cannot land feedback")
        payloads: dict[str, dict] = {}
        columns: dict[str, list] = {c.name: [] for c in spec.columns}
        for event_id, item, label, ts_us, user_id, raw in rows:
            payload = payloads.setdefault(raw, json.loads(raw))
            index = payload["item_ids"].index(item)
            values = {spec.event_id: event_id, spec.timestamp: ts_us, spec.label: label}
            if spec.user_key:
                values[spec.user_key] = user_id
            if spec.item_key:
                values[spec.item_key] = item
            for name, value in payload["context"].items():
                values[name] = value[index] if payload["per_candidate"].get(name) else value
            if "position" in columns and "position" not in payload["context"]:
                ranked = payload.get("ranked", ())  # an item it does not list (a journal from before feedback
                # was checked against it) lands with no position: ingestion quarantines it, with its reason
                values["position"] = ranked.index(item) + 1 if item in ranked else None
            for name, column in columns.items():
                column.append(values.get(name))
        arrays = {}
        for column in spec.columns:
            values = columns[column.name]
            if column.dtype == "timestamp":
                arrays[column.name] = pa.array(np.asarray(values, dtype=np.int64), pa.timestamp("us", tz="UTC"))
            else:
                arrays[column.name] = pa.array(values, ARROW_TYPES[column.dtype])
        return pa.table(arrays)

    # --- what the canary controller and the monitor read ------------------------------------------------

    def stats(self, version: str, since: float | None = None, event_window: tuple[int, int] | None = None
              ) -> VariantStats:
        """What ``version`` did: requests, errors, NaNs and p99 of its evaluations; impressions and clicks of
        the requests it served; its online AUC over every impression it scored (shadow included). Over
        every process writing to this journal (all replicas, with PostgreSQL).

        Args:
            since: only what was served at or after this wall-clock time (the canary's steps).
            event_window: only requests whose event time is in ``[start_us, end_us)`` (the monitor's
                windows, which are in event time).
        """
        self.flush()
        where, params = _request_window(since, event_window=event_window)
        condition = " AND ".join(["1 = 1", *where])
        # A champion's ``paired`` evaluations (it scores an A/B challenger's requests too, for the paired online
        # AUC: ``paired_scores``) are not requests it served: they stay out of its counts and latencies.
        evaluations = self._query(
            f"SELECT e.status, e.latency_ms FROM evaluations e JOIN requests r USING (request_id) "
            f"WHERE e.version = ? AND e.role <> 'paired' AND {condition}", [version, *params])
        feedback = self._query(
            f"SELECT f.label, f.served_version, f.scores FROM feedback f JOIN requests r USING (request_id) "
            f"WHERE {condition}", params)
        latencies = np.array([ms for _, ms in evaluations], dtype=np.float64)
        served = [label for label, served_by, _ in feedback if served_by == version]
        labels, scores = [], []
        for label, _, raw in feedback:
            score = json.loads(raw).get(version)
            if score is not None:
                labels.append(label)
                scores.append(score)
        online_auc = auc(np.array(labels), np.array(scores, dtype=np.float64)) if len(labels) >= 2 else float("nan")
        return VariantStats(
            requests=len(evaluations), errors=sum(s == "error" for s, _ in evaluations),
            nan_responses=sum(s == "nan" for s, _ in evaluations),
            p99_ms=float(np.percentile(latencies, 99)) if len(latencies) else 0.0,
            **dict(zip(("p99_low_ms", "p99_high_ms"), p99_bounds(latencies), strict=True)),
            impressions=len(served), clicks=int(sum(served)),
            online_auc=None if online_auc != online_auc else float(online_auc),
        )

    def interleaving_credits(self, challenger: str, since: float | None = None
                             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per interleaved request of ``challenger`` with feedback: the user, the clicks credited to the
        champion's team and to the challenger's (the team that placed each clicked item)."""
        self.flush()
        rows = self._query(
            "SELECT r.request_id, r.user_id, r.payload, f.item_id, f.label FROM feedback f "
            "JOIN requests r USING (request_id) WHERE r.variant = 'interleave' AND r.served_version = ? "
            "AND r.at >= ?", [challenger, since or 0.0])
        requests: dict[str, list] = {}
        teams_of: dict[str, dict[int, int]] = {}
        for request_id, user_id, raw, item, label in rows:
            if request_id not in teams_of:
                payload = json.loads(raw)
                teams = payload.get("interleaving", {}).get("teams", [])
                teams_of[request_id] = dict(zip(payload["ranked"], teams, strict=False))
                requests[request_id] = [user_id, 0, 0]
            team = teams_of[request_id].get(item)
            if label and team is not None:
                requests[request_id][1 + int(team)] += 1
        table = np.array(list(requests.values()), dtype=np.int64).reshape(-1, 3)
        return table[:, 0], table[:, 1], table[:, 2]

    def paired_scores(self, champion: str, challenger: str, since: float | None = None
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per impression since ``since`` that *both* versions scored (interleaved requests, shadowed ones, and
        an A/B challenger's requests, which the champion scores too): the label, the champion's score, the
        challenger's and the user. The canary's paired online AUC rests on these: the same impressions for
        both models, whatever the mix of users each served."""
        self.flush()
        where, params = _request_window(since)
        rows = self._query(
            "SELECT f.label, f.scores, r.user_id FROM feedback f JOIN requests r USING (request_id) "
            f"WHERE f.scores LIKE ? {''.join(f'AND {c} ' for c in where)}",
            [f'%"{challenger}":%', *params])
        labels, first, second, users = [], [], [], []
        for label, raw, user_id in rows:
            scores = json.loads(raw)
            a, b = scores.get(champion), scores.get(challenger)
            if a is None or b is None:
                continue
            labels.append(label)
            first.append(a)
            second.append(b)
            users.append(user_id)
        return (np.asarray(labels, dtype=np.int64), np.asarray(first, dtype=np.float64),
                np.asarray(second, dtype=np.float64), np.asarray(users, dtype=np.int64))

    def served_predictions(self, version: str | None, event_window: tuple[int, int] | None = None,
                           segments: tuple[str, ...] = ("device",)) -> dict[str, np.ndarray]:
        """Per impression ``version`` served (interleaved requests left out), with event time in the window:
        the label, the version's own predicted probability, the user and each segment column's value (from
        the request's context). ``version=None``: every version's, each impression with the prediction of the
        version that served it (the model line's served history, across champions)."""
        self.flush()
        window, params = _request_window(event_window=event_window)
        by_version = ["r.served_version = ?"] if version is not None else []
        where = ["r.variant <> 'interleave'", *by_version, *window]
        params = [version, *params] if version is not None else params
        rows = self._query(
            f"SELECT f.label, f.scores, r.user_id, r.request_id, r.payload, f.item_id, r.served_version FROM feedback f "
            f"JOIN requests r USING (request_id) WHERE {' AND '.join(where)}", params)
        out: dict[str, list] = {"labels": [], "predictions": [], "users": [], **{c: [] for c in segments}}
        payloads: dict[str, dict] = {}
        for label, scores, user_id, request_id, raw, item, served_by in rows:
            score = json.loads(scores).get(version if version is not None else served_by)
            if score is None:
                continue
            payload = payloads.setdefault(request_id, json.loads(raw))
            out["labels"].append(label)
            out["predictions"].append(score)
            out["users"].append(user_id)
            for column in segments:
                value = payload["context"].get(column)
                if payload.get("per_candidate", {}).get(column):
                    value = value[payload["item_ids"].index(item)]
                out[column].append("" if value is None else str(value))
        return {k: np.asarray(v) for k, v in out.items()}

    def served_event_ids(self, event_window: tuple[int, int]) -> set[str]:
        """The event ids of the impressions served (every version's) with event time in ``[start_us, end_us)``:
        the lake's rows that serving landed as feedback (``land_feedback``), chosen by a ranker, not the world."""
        self.flush()
        where, params = _request_window(event_window=event_window)
        rows = self._query(f"SELECT f.event_id FROM feedback f JOIN requests r USING (request_id) "
                           f"WHERE {' AND '.join(where)}", params)
        return {str(event_id) for (event_id,) in rows}

    def first_served_us(self, version: str) -> int | None:
        """Event time (µs) of the first request ``version`` served alone (not interleaved) that got feedback."""
        self.flush()
        rows = self._query("SELECT MIN(r.ts_us) FROM feedback f JOIN requests r USING (request_id) "
                           "WHERE r.variant <> 'interleave' AND r.served_version = ?", [version])
        return int(rows[0][0]) if rows and rows[0][0] is not None else None

    def exploration_requests(self, event_window: tuple[int, int] | None = None, limit: int = 20_000) -> list[dict]:
        """Explored requests (served by a Plackett-Luce draw, propensities logged) with feedback on their top
        slot: user, event time, candidates, context, the shown top item, its propensity and whether it was
        clicked (the off-policy estimators' logs)."""
        self.flush()
        window, params = _request_window(event_window=event_window)
        where, params = ["r.payload LIKE ?", *window], ['%"exploration"%', *params]
        rows = self._query(
            f"SELECT r.request_id, r.user_id, r.ts_us, r.payload, f.item_id, f.label FROM feedback f "
            f"JOIN requests r USING (request_id) WHERE {' AND '.join(where)} LIMIT {int(limit) * 10}", params)
        out: dict[str, dict] = {}
        for request_id, user_id, ts_us, raw, item, label in rows:
            payload = json.loads(raw)
            explored = payload.get("exploration")  # the text matched; a context value may say "exploration" too
            if not isinstance(explored, dict) or not explored.get("propensities"):
                continue
            if not payload.get("ranked") or item != payload["ranked"][0] or request_id in out:
                continue
            out[request_id] = {"user_id": user_id, "ts_us": ts_us, "item_ids": payload["item_ids"],
                               "context": payload["context"], "top": item, "label": int(label),
                               "propensity": float(payload["exploration"]["propensities"][0])}
            if len(out) >= limit:
                break
        return list(out.values())

    def user_clicks(self, version: str | None, since: float | None = None, until: float | None = None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per user: clicks and impressions of the requests ``version`` served (any version: None) with
        wall-clock time in ``[since, until)`` (interleaved requests left out)."""
        self.flush()
        window, params = _request_window(since, until)
        where = ["r.variant <> 'interleave'", *(["r.served_version = ?"] if version is not None else []), *window]
        return self._per_user("", where, ([version] if version is not None else []) + params)

    def _per_user(self, join: str, where: list[str], params: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(users, clicks, impressions) of the feedback on the requests matching ``where`` (after ``join``)."""
        rows = self._query(
            f"SELECT r.user_id, SUM(f.label), COUNT(*) FROM feedback f JOIN requests r USING (request_id) {join} "
            f"WHERE {' AND '.join(where)} GROUP BY r.user_id", params)
        table = np.array(rows, dtype=np.float64).reshape(-1, 3)
        return table[:, 0].astype(np.int64), table[:, 1], table[:, 2]


    # --- what the recommendation path reads ------------------------------------------------------------

    def recent_items(self, user_id: int, since_us: int) -> dict[int, tuple[float, bool]]:
        """Items shown to ``user_id`` in requests whose event time is at or after ``since_us``, with feedback
        recorded: item → (last event time in seconds, clicked?). Over every replica (with PostgreSQL)."""
        rows = self._query(
            "SELECT f.item_id, MAX(r.ts_us), MAX(f.label) FROM feedback f JOIN requests r USING (request_id) "
            "WHERE r.user_id = ? AND r.ts_us >= ? GROUP BY f.item_id", [int(user_id), int(since_us)])
        return {int(item): (ts_us / 1e6, bool(clicked)) for item, ts_us, clicked in rows}

    def retriever_stats(self, version: str, since: float | None = None) -> VariantStats:
        """What retriever ``version`` did (its journal name, ``retriever_key``): requests, errors and p99 of
        its retrievals (served and shadow), and the impressions and clicks of the requests it served (its
        retrieval succeeded: a failed one fell back to the champion's).
        The ranker's scores say nothing about a retriever, so there is no online AUC."""
        self.flush()
        key = retriever_key(version)
        window, params = _request_window(since)
        since_sql = "".join(f"AND {condition} " for condition in window)
        evaluations = self._query(
            f"SELECT e.status, e.latency_ms FROM evaluations e JOIN requests r USING (request_id) "
            f"WHERE e.version = ? {since_sql}", [key, *params])
        feedback = self._query(
            f"SELECT f.label FROM feedback f JOIN requests r USING (request_id) JOIN evaluations e "
            f"ON e.request_id = f.request_id WHERE e.version = ? AND e.role = 'served' AND e.status = 'ok' "
            f"{since_sql}", [key, *params])
        latencies = np.array([ms for _, ms in evaluations], dtype=np.float64)
        return VariantStats(
            requests=len(evaluations), errors=sum(s == "error" for s, _ in evaluations),
            nan_responses=sum(s == "nan" for s, _ in evaluations),
            p99_ms=float(np.percentile(latencies, 99)) if len(latencies) else 0.0,
            **dict(zip(("p99_low_ms", "p99_high_ms"), p99_bounds(latencies), strict=True)),
            impressions=len(feedback), clicks=int(sum(label for (label,) in feedback)), online_auc=None)

    def retriever_user_clicks(self, version: str, since: float | None = None
                              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per user: clicks and impressions of the requests retriever ``version`` served (its A/B arm) with
        wall-clock time at or after ``since``. A retrieval that failed served nothing: the champion's, which
        answered instead, holds the request (both were journaled as served, so both arms counted it)."""
        self.flush()
        window, params = _request_window(since)
        return self._per_user("JOIN evaluations e ON e.request_id = f.request_id",
                              ["e.version = ?", "e.role = 'served'", "e.status = 'ok'", *window],
                              [retriever_key(version), *params])


def _request_window(since: float | None = None, until: float | None = None,
                    event_window: tuple[int, int] | None = None) -> tuple[list[str], list]:
    """SQL conditions on the requests (``r``) and their parameters: wall-clock time in ``[since, until)``,
    event time in ``event_window`` (``[start_us, end_us)``); each bound only when given."""
    where, params = [], []
    if since is not None:
        where.append("r.at >= ?")
        params.append(since)
    if until is not None:
        where.append("r.at < ?")
        params.append(until)
    if event_window is not None:
        where.append("r.ts_us >= ? AND r.ts_us < ?")
        params += list(event_window)
    return where, params


def retriever_key(version: str) -> str:
    """How a retriever version is named in the journal's evaluations (ranker versions are bare numbers)."""
    return f"retriever:{version}"
