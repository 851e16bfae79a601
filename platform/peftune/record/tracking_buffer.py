"""A durable, ordered write-ahead buffer for the trials' MLflow writes, drained by a background thread.

The Tune callback (``peftune.record.trial_logger.TrialLogger``) only appends operations here, so a slow or unreachable
tracking server never holds up the trials or kills the driver; one thread applies them in order, retrying each
with backoff. What an operation does is a subclass's ``_op_<name>`` method (``writer.TrialWrites``, the
MLflow writes, each idempotent: that is what makes a replay exactly once); this module imports no MLflow. Durable:
each operation is appended to ``<storage>/<sweep>.tracking-pending.jsonl`` before it is queued, with the last
applied sequence number beside it; operations still pending when a sweep ends are replayed, in order, before the
next run of the sweep logs anything.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from peftune.base.errors import DiskFullError, disk_full, no_space
from peftune.record.stores import sqlite_path

log = logging.getLogger("peftune.tracking")

MIN_BACKOFF_S, MAX_BACKOFF_S = 0.5, 15.0


def pending_path(storage: str, sweep: str) -> Path:
    """Beside Tune's state when it is a local directory, else in the working directory."""
    base = Path(storage) if "://" not in storage else Path(".peftune-tracking")
    return base / f"{sweep}.tracking-pending.jsonl"


def set_aside_stale(path: Path) -> None:
    """A new sweep (no Tune state) under a name whose pending writes remain: they belong to trials Tune
    no longer knows, so they must not enter the new record; they are kept aside, not deleted."""
    if not path.is_file():
        return
    aside = path.with_name(f"{path.name}.stale-{int(time.time())}")
    path.replace(aside)
    path.with_name(path.name + ".applied").unlink(missing_ok=True)
    log.warning("MLflow writes pending for an earlier sweep of this name, whose Ray state is gone, moved to %s", aside)


class WriteBuffer:
    """Ordered MLflow operations of one sweep: ``put`` appends (on disk too); a thread applies each with the
    subclass's ``_op_<name>``."""

    def __init__(self, record, path: Path | str | None):
        self.record = record
        self.path = Path(path) if path is not None else None
        self._queue: deque[dict] = deque()
        self._lock = threading.Condition()
        self._seq = 0
        self._applied = 0
        self._thread: threading.Thread | None = None
        self._stop = False
        self._stopping = threading.Event()  # cuts a retry's backoff short (a new write does not)
        self.failures = 0  # failed attempts (an outage's retries), for the record of an outage
        # the first write this buffer could not make for lack of space (its own files, or the store's), for the
        # driver to stop the sweep on; the buffer itself goes on in memory, so the record can still be closed
        self.full: DiskFullError | None = None
        self.store_full = False  # the operation at the head was refused by the store for space: flush stops waiting
        # a measurement's wrapper of each write (``peftune.benchmarks.driver`` times them): called in the buffer's
        # thread with the operation (its ``op`` names it) and a function that applies it; None: applied as it is
        self.around_apply: Callable[[dict, Callable[[], None]], None] | None = None
        self._load()

    # -- the queue

    def put(self, op: str, **args) -> None:
        with self._lock:
            self._seq += 1
            item = {"seq": self._seq, "op": op, **args}
            if self.path is not None:
                self._append(json.dumps(item) + "\n")
            self._queue.append(item)
            self._lock.notify_all()

    def pending(self) -> int:
        with self._lock:
            return len(self._queue)

    def start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stop = False
            self._stopping.clear()
            self._thread = threading.Thread(target=self._drain, name="peftune-tracking", daemon=True)
            self._thread.start()

    def flush(self, timeout: float, progress_every: float = 10.0) -> bool:
        """Wait (at most ``timeout`` s) until every operation is applied; True when none is pending."""
        self.start()
        deadline, shown = time.monotonic() + timeout, time.monotonic()
        with self._lock:
            while self._queue:
                now = time.monotonic()
                if now >= deadline or self.store_full:  # no retry takes a write while the store has no space
                    return False
                if now - shown >= progress_every:
                    log.info("waiting for %d MLflow write(s) to reach %s", len(self._queue), self.record.tracking_uri)
                    shown = now
                self._lock.wait(min(1.0, deadline - now))
        self._forget()
        return True

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._stopping.set()
            self._lock.notify_all()

    # -- on disk

    def _load(self) -> None:
        """Queue the operations a former run left pending (their order and numbers kept)."""
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        applied = self._marker().read_text().strip() if self._marker().is_file() else "0"
        self._applied = int(applied or 0)
        if not self.path.is_file():
            return
        for line in self.path.read_text().splitlines():
            try:
                item = json.loads(line)
            except json.JSONDecodeError:
                continue  # the last line of a write the driver did not finish: it was never queued
            self._seq = max(self._seq, int(item["seq"]))
            if item["seq"] > self._applied:
                self._queue.append(item)
        if self._queue:
            log.warning("replaying %d MLflow write(s) left pending by an earlier run (%s)", len(self._queue), self.path)

    def _marker(self) -> Path:
        return self.path.with_name(self.path.name + ".applied")

    def _append(self, line: str) -> None:
        """``line`` at the end of the pending file; a line cut short for lack of space is taken back (a later line
        would otherwise join it and both be lost to ``_load``) and the operation stays queued in memory only.

        Unbuffered (``os.write`` on a descriptor): a buffered file refused for space fails again when it is
        truncated or closed (each flushes what it still holds), and that second error named no file."""
        data = memoryview(line.encode())
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as error:
            if no_space(error) is None:
                raise
            self._noted_full(DiskFullError(self.path, len(data)))
            return
        try:
            size = os.fstat(fd).st_size
            try:
                written = 0
                while written < len(data):  # a write that ran out of space part way returns what it wrote
                    written += os.write(fd, data[written:])
                os.fsync(fd)
            except OSError as error:
                if no_space(error) is None:
                    raise
                os.ftruncate(fd, size)  # frees, needs no space
                self._noted_full(DiskFullError(self.path, len(data)))
        finally:
            os.close(fd)

    def _note_applied(self, seq: int) -> None:
        self._applied = seq
        if self.path is not None:
            temporary = self._marker().with_name(self._marker().name + ".tmp")
            try:
                temporary.write_text(str(seq))
                temporary.replace(self._marker())
            except OSError as error:
                temporary.unlink(missing_ok=True)
                if no_space(error) is None:
                    raise
                # the number is kept in memory: an operation applied but not noted is applied again by the
                # next run, which changes nothing (each is idempotent)
                self._noted_full(DiskFullError(self._marker(), len(str(seq))))

    def _noted_full(self, error: DiskFullError) -> None:
        if self.full is None:
            log.error("%s", error)
            self.full = error

    def _forget(self) -> None:
        """Everything is applied: the files go (a new run starts numbering again)."""
        if self.path is None:
            return
        with self._lock:
            if self._queue:
                return
            for path in (self.path, self._marker()):
                path.unlink(missing_ok=True)

    # -- the thread

    def _drain(self) -> None:
        backoff = MIN_BACKOFF_S
        while True:
            with self._lock:
                while not self._queue and not self._stop:
                    self._lock.wait()
                if self._stop:
                    return
                item = self._queue[0]
            started = time.monotonic()
            try:
                if self.around_apply is None:
                    self._apply(item)
                else:
                    self.around_apply(item, functools.partial(self._apply, item))
            except Exception as error:  # noqa: BLE001  any failure of the server or the link: retry
                # how long MLflow's client held the attempt (its own retries, bounded by the driver's
                # MLFLOW_HTTP_REQUEST_* settings) before this buffer took the write back
                took = time.monotonic() - started
                self.failures += 1
                if no_space(error) is not None:  # the store's disk is full: retried, but nobody need wait for it
                    with self._lock:
                        self.store_full = True
                        # an artifact's copy names its file; the database's refusal names none: its file, then
                        store = sqlite_path(self.record.tracking_uri) or self.record.tracking_uri
                        self._noted_full(disk_full(error, path=store))
                        self._lock.notify_all()
                log.warning(
                    "MLflow write %s failed after %.1fs (%s); %d pending, retrying in %.1fs",
                    item["op"],
                    took,
                    str(error).splitlines()[0][:200] if str(error) else type(error).__name__,
                    self.pending(),
                    backoff,
                    extra={"attempt_s": took},
                )
                self._stopping.wait(backoff)
                backoff = min(MAX_BACKOFF_S, backoff * 2)
                continue
            backoff = MIN_BACKOFF_S
            with self._lock:
                self.store_full = False
                self._queue.popleft()
                self._note_applied(item["seq"])
                self._lock.notify_all()

    def _apply(self, item: dict) -> None:
        getattr(self, f"_op_{item['op']}")(**{k: v for k, v in item.items() if k not in ("seq", "op")})
