"""A durable, ordered write-ahead buffer for the trials' MLflow writes, drained by a background thread.

The Tune callback (``peftune.tracking.TrialLogger``) only appends operations here, so a slow or unreachable
tracking server never holds up the trials or kills the driver; one thread applies them in order, retrying each
with backoff. Exactly once: every operation is idempotent (a trial's run is found by its Ray trial id before one
is created; metrics carry the timestamp of their first sending, which MLflow's SQL store de-duplicates; params and
tags are set to the same values). Write-only but for that one search. Durable: each operation is appended to
``<storage>/<sweep>.tracking-pending.jsonl`` before it is queued, with the last applied sequence number beside it;
operations still pending when a sweep ends are replayed, in order, before the next run of the sweep logs anything.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable
from pathlib import Path

from peftune.errors import DiskFullError, disk_full, no_space
from peftune.record import (
    ERROR,
    FAILED,
    METHOD,
    PARENT_TAG,
    RETRIES,
    ROLE,
    STATUS,
    SWEEP,
    TRIAL_ID,
    TRIAL_ROLE,
    sqlite_path,
)

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
    """Ordered MLflow operations of one sweep: ``put`` appends (on disk too); a thread applies them."""

    def __init__(self, record, path: Path | str | None):
        self.record = record
        self.path = Path(path) if path is not None else None
        self._queue: deque[dict] = deque()
        self._lock = threading.Condition()
        self._seq = 0
        self._applied = 0
        self._runs: dict[str, str] = {}  # trial id -> run id, found or created by this buffer
        self._started: dict[str, int] = {}  # trial id -> its run's start time (ms), as the server set it
        self._client = None
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

    @property
    def client(self):
        if self._client is None:
            import mlflow

            self._client = mlflow.MlflowClient(tracking_uri=self.record.tracking_uri)
        return self._client

    def _apply(self, item: dict) -> None:
        getattr(self, f"_op_{item['op']}")(**{k: v for k, v in item.items() if k not in ("seq", "op")})

    # -- the operations (each idempotent)

    def created(self, trial_id: str) -> tuple[str, int] | None:
        """The run id and start time (ms) of the trial's run, once this buffer created or found it."""
        run_id = self._runs.get(trial_id)
        return (run_id, self._started.get(trial_id, 0)) if run_id is not None else None

    def known_run_id(self, trial_id: str) -> str | None:
        """The trial's run id if this buffer has created or found its run already (no call to the store)."""
        return self._runs.get(trial_id)

    def run_id(self, trial_id: str) -> str | None:
        if trial_id not in self._runs:
            runs = self.client.search_runs(
                [self.record.experiment_id],
                filter_string=f"tags.`{PARENT_TAG}` = '{self.record.parent_run_id}' "
                f"and tags.`{TRIAL_ID}` = '{trial_id}'",
                max_results=1,
            )
            if runs:
                self._runs[trial_id] = runs[0].info.run_id
                self._started[trial_id] = runs[0].info.start_time
        return self._runs.get(trial_id)

    def _op_trial_run(
        self, trial_id: str, run_name: str, method: str, sweep: str, params: dict, tags: dict | None = None,
        datasets: list | None = None,
    ) -> None:  # fmt: skip
        """Create the trial's run (found again by trial id), its params and ``datasets`` (tracking.data_inputs)."""
        from mlflow.entities import Param

        run_id = self.run_id(trial_id)
        if run_id is None:
            base = {PARENT_TAG: self.record.parent_run_id, ROLE: TRIAL_ROLE, SWEEP: sweep, TRIAL_ID: trial_id}
            run = self.client.create_run(
                self.record.experiment_id, run_name=run_name, tags={**base, METHOD: method, **(tags or {})}
            )
            run_id = self._runs[trial_id] = run.info.run_id
            self._started[trial_id] = run.info.start_time
        self.client.log_batch(run_id, params=[Param(k, v) for k, v in params.items()])
        log_datasets(self.client, run_id, datasets)

    def _op_metrics(self, trial_id: str, metrics: list) -> None:
        from mlflow.entities import Metric

        self.client.log_batch(self._need(trial_id), metrics=[Metric(*m) for m in metrics])

    def _op_tags(self, trial_id: str, tags: dict) -> None:
        run_id = self._need(trial_id)
        for key, value in tags.items():
            self.client.set_tag(run_id, key, value)

    def _op_delete_tags(self, trial_id: str, keys: list) -> None:
        from mlflow.exceptions import MlflowException

        run_id = self._need(trial_id)
        for key in keys:
            try:
                self.client.delete_tag(run_id, key)
            except MlflowException as error:  # the run has no such tag (never set, or deleted by an earlier try)
                if error.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise

    def _op_run_status(self, trial_id: str, status: str) -> None:
        run_id = self._need(trial_id)
        if status == "RUNNING":
            self.client.update_run(run_id, status="RUNNING")
        else:
            self.client.set_terminated(run_id, status=status)

    def _op_finish(
        self, trial_id: str, status: str, error: str | None, retries: int, best: list | None = None,
        task_metrics: list | None = None,
    ) -> None:  # fmt: skip
        """The trial's end: its ``best`` metrics (best_epoch, best_<metric>, as the driver kept them), its status,
        error and retries. ``task_metrics``: an operation queued by a peftune that read the best epoch back from the
        record here; now ignored (without best_* the analysis finds the best epoch in the run's history)."""
        from mlflow.entities import Metric

        run_id = self._need(trial_id)
        if best:
            self.client.log_batch(run_id, metrics=[Metric(*m) for m in best])
        tags = {STATUS: status, **({ERROR: error} if error is not None else {})}
        if retries > 0:
            tags[RETRIES] = str(retries)
        for key, value in tags.items():
            self.client.set_tag(run_id, key, value)
        self.client.set_terminated(run_id, status="FAILED" if status == FAILED else "FINISHED")

    def _op_artifact(self, trial_id: str, path: str, text: str) -> None:
        """A text file as the run's artifact ``path`` (gzip-compressed when it ends in ``.gz``); replaces it."""
        import gzip
        import tempfile

        run_id = self._need(trial_id)
        directory, name = os.path.split(path)
        with tempfile.TemporaryDirectory(prefix="peftune-artifact-") as tmp:
            local = Path(tmp) / name
            data = text.encode()
            local.write_bytes(gzip.compress(data, mtime=0) if name.endswith(".gz") else data)
            self.client.log_artifact(run_id, str(local), artifact_path=directory or None)

    def _need(self, trial_id: str) -> str:
        run_id = self.run_id(trial_id)
        if run_id is None:  # its trial_run operation comes first in the order: this is not an outage
            raise LookupError(f"no MLflow run for trial {trial_id} under parent run {self.record.parent_run_id}")
        return run_id


def log_datasets(client, run_id: str, datasets) -> None:
    """``datasets`` (``peftune.tracking.data_inputs``) as the run's MLflow dataset inputs (the UI's Dataset column
    and filter); logging one again changes nothing (MLflow keeps one input per dataset name and digest)."""
    if not datasets:
        return
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import Dataset, DatasetInput, InputTag

    inputs = []
    for item in datasets:
        with warnings.catch_warnings():  # MLflow registers its local-file source twice ("" and file:): either fits
            warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted")
            source = resolve_dataset_source(item["source"])
        meta = MetaDataset(source, name=item["name"], digest=item["digest"]).to_dict()
        entity = Dataset(meta["name"], meta["digest"], meta["source_type"], meta["source"],
                         profile=json.dumps({"sha256": item["sha256"]}))  # fmt: skip
        inputs.append(DatasetInput(entity, tags=[InputTag("mlflow.data.context", item["context"])]))
    client.log_inputs(run_id, datasets=inputs)
