"""One driver per sweep: a lease on the sweep's storage path, renewed while the driver lives.

``run_sweep`` holds this lease from start to end; a second driver is refused at once (``LeaseHeld``: one line
naming the holder's host, pid and start). A holder that died on this host is replaced at once (its pid is gone or
another process's); one on another host once its lease lapsed (no renewal for ``ttl`` seconds,
``PEFTUNE_LEASE_S``). A lease is a generation file ``<sweep>.driver.<n>.lease`` beside Tune's state, taken by
``os.link`` of a complete temporary file (a link to an existing name fails on local file systems and NFS alike, so
only one driver gets a generation) and renewed by replacing the holder's own file; a holder that finds its
generation superseded gives up the sweep. With object storage the lease lives in ``PEFTUNE_LEASE_DIR`` (default
``~/.peftune/leases``), which guards the drivers of one machine.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlparse

import psutil

from peftune.base.errors import UserError

log = logging.getLogger("peftune.sweep.lease")

DEFAULT_TTL_S = 60.0  # long enough for a loaded driver to renew (every ttl/6); what a resume after a crash waits
TTL_ENV, DIR_ENV = "PEFTUNE_LEASE_S", "PEFTUNE_LEASE_DIR"
LOST_EXIT = 3  # a driver whose lease was taken over stops at once, as if interrupted: the new driver goes on


class LeaseHeld(UserError):
    """Another driver holds the sweep's lease (exit 2: nothing started)."""


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    since: float  # wall-clock time the driver took the lease
    renewed: float  # wall-clock time of its last renewal
    ttl: float
    token: str  # this holder's own mark: a renewal checks the file is still its own
    started: float | None = None  # the holder process's start time (psutil): a reused pid is another process

    def lapsed(self, now: float) -> bool:
        return now - self.renewed > self.ttl

    def holds(self, now: float) -> bool:
        """Whether the holder still holds the lease: not lapsed, and not a process of this host that has ended."""
        return not self.lapsed(now) and not self.gone()

    def gone(self) -> bool:
        """Whether the holder is a process of this host that has ended (or whose pid another process now has).

        A driver killed with SIGKILL cannot release its lease; on its own host that is seen at once, so running
        the command again resumes the sweep without waiting ``ttl``. A holder on another host cannot be seen:
        only its lease's lapse tells."""
        if self.host != socket.gethostname():
            return False
        try:
            process = psutil.Process(self.pid)
            if process.status() == psutil.STATUS_ZOMBIE:  # ended, not yet reaped by its parent
                return True
            # psutil gives the start time to the hundredth of a second; 1 s apart is another process
            return self.started is not None and abs(process.create_time() - self.started) > 1.0
        except psutil.NoSuchProcess:
            return True
        except psutil.AccessDenied:  # another user's live process
            return False

    def describe(self, now: float) -> str:
        since = datetime.datetime.fromtimestamp(self.since, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        return (
            f"host {self.host}, pid {self.pid}, since {since}, lease renewed {max(0.0, now - self.renewed):.0f} s ago"
        )


def ttl_from_env() -> float:
    raw = os.environ.get(TTL_ENV)
    if raw is None:
        return DEFAULT_TTL_S
    try:
        ttl = float(raw)
    except ValueError:
        ttl = -1.0
    if not ttl > 0:
        raise UserError(f"{TTL_ENV}={raw!r}: expected a positive number of seconds")
    return ttl


def lease_dir(storage: str) -> Path:
    """Where the leases of sweeps under ``storage`` live: the storage path itself when it is a file system."""
    parsed = urlparse(storage)
    if "://" not in storage:
        return Path(storage)
    if parsed.scheme == "file":
        return Path(parsed.path)
    digest = hashlib.sha256(storage.encode()).hexdigest()[:16]
    return Path(os.environ.get(DIR_ENV) or Path.home() / ".peftune" / "leases") / digest


class Lease:
    """The lease of sweep ``name`` in ``directory``: ``acquire`` (or ``LeaseHeld``), then ``release``."""

    def __init__(self, directory: Path, name: str, ttl: float | None = None, on_lost: Callable[[], None] | None = None):
        """``on_lost``: what the renewing thread does when another driver took the lease over (default: stop
        this process at once, since writing on would corrupt the sweep the other driver now runs)."""
        self.directory, self.name = Path(directory), name
        self.ttl = ttl_from_env() if ttl is None else ttl
        self.on_lost = on_lost or _stop_driver
        self.generation: int | None = None
        self.holder: Holder | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _path(self, generation: int) -> Path:
        return self.directory / f"{self.name}.driver.{generation}.lease"

    def generations(self) -> list[int]:
        pattern = re.compile(rf"{re.escape(self.name)}\.driver\.(\d+)\.lease")
        found = (pattern.fullmatch(p.name) for p in self.directory.glob(f"{glob_escape(self.name)}.driver.*.lease"))
        return sorted(int(m.group(1)) for m in found if m)

    def read(self, generation: int) -> Holder | None:
        path = self._path(generation)
        try:
            return Holder(**json.loads(path.read_text()))
        except FileNotFoundError:
            return None  # released meanwhile
        except (ValueError, TypeError) as error:
            raise UserError(f"{path}: not a driver lease of peftune ({error}); expected one written by it") from None

    def current(self) -> tuple[int | None, Holder | None]:
        """The newest generation and its holder (None, None: nobody ever held it, or it was released)."""
        for generation in reversed(self.generations()):
            holder = self.read(generation)
            if holder is not None:
                return generation, holder
        return None, None

    def check_free(self) -> None:
        """Raise ``LeaseHeld`` when a live driver holds the lease; nothing is written. A second driver is refused
        so before it reads the data or loads Ray (seconds); ``acquire`` decides, later, who takes the lease."""
        _, holder = self.current()
        now = time.time()
        if holder is not None and holder.holds(now):
            raise LeaseHeld(self.held_message(holder, now))

    def acquire(self) -> None:
        """Take the lease, or raise ``LeaseHeld`` naming the driver that holds it; start renewing it."""
        self.directory.mkdir(parents=True, exist_ok=True)
        now = time.time()
        generation, holder = self.current()
        if holder is not None and holder.holds(now):
            raise LeaseHeld(self.held_message(holder, now))
        gone = holder is not None and holder.gone()
        if holder is not None:
            why = "whose process has ended" if gone else "whose lease lapsed"
            log.warning("taking over sweep %s from a driver %s: %s", self.name, why, holder.describe(now))
        mine = Holder(socket.gethostname(), os.getpid(), now, now, self.ttl, uuid.uuid4().hex, _started(os.getpid()))
        target = 0 if generation is None else generation + 1
        temporary = self.directory / f".{self.name}.driver.{mine.token}.tmp"
        temporary.write_text(json.dumps(asdict(mine)))
        try:
            os.link(temporary, self._path(target))  # atomic: fails if another driver took this generation
        except FileExistsError:
            winner = self.read(target)
            raise LeaseHeld(self.held_message(winner, time.time()) if winner else f"sweep {self.name!r}: "
                            "another driver took its lease at the same moment") from None  # fmt: skip
        finally:
            temporary.unlink(missing_ok=True)
        # the lapsed generations below stay: deleting them would let a driver that listed the directory before
        # this link, and then finds those files gone, take generation 0 beside this one
        self.generation, self.holder = target, mine
        self._thread = threading.Thread(target=self._renew_loop, name="peftune-lease", daemon=True)
        self._thread.start()

    def held_message(self, holder: Holder, now: float) -> str:
        lapse = datetime.datetime.fromtimestamp(holder.renewed + holder.ttl, datetime.timezone.utc)
        return (
            f"sweep {self.name!r} is being run by another driver: {holder.describe(now)}; wait for it to end or "
            f"stop it (if it died, its lease in {self.directory} lapses at {lapse:%H:%M:%S} UTC: run this again "
            f"then to resume the sweep)"
        )

    def renew(self) -> bool:
        """Renew the lease; False when it is no longer ours (a later generation, or our file gone)."""
        if self.generation is None or self.holder is None:
            return False
        newer = [g for g in self.generations() if g > self.generation]
        current = self.read(self.generation)
        if newer or current is None or current.token != self.holder.token:
            return False
        self.holder = Holder(**{**asdict(self.holder), "renewed": time.time()})
        temporary = self.directory / f".{self.name}.driver.{self.holder.token}.tmp"
        try:
            temporary.write_text(json.dumps(asdict(self.holder)))
            os.replace(temporary, self._path(self.generation))
        except OSError:
            temporary.unlink(missing_ok=True)  # a disk full left it empty: the lease file itself is untouched
            raise
        return True

    def _renew_loop(self) -> None:
        interval = max(0.1, self.ttl / 6)
        while not self._stop.wait(interval):
            try:
                ours = self.renew()
            except OSError as error:  # a file-server hiccup: try again; the lease lapses only after ttl
                log.warning("could not renew the lease of sweep %s: %s", self.name, error)
                continue
            if not ours:  # another driver took over after this one went unrenewed for a whole ttl (a stalled machine)
                log.critical("the lease of sweep %s was taken over by another driver; stopping", self.name)
                self.on_lost()
                return

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.generation is not None and self.holder is not None:
            current = self.read(self.generation)
            if current is not None and current.token == self.holder.token:
                self._path(self.generation).unlink(missing_ok=True)
        self.generation = None


def _started(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def _stop_driver() -> None:
    os._exit(LOST_EXIT)  # no cleanup: closing the record's runs would end the new driver's trials


def glob_escape(text: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", text)


@contextlib.contextmanager
def held(storage: str, name: str) -> Iterator[Lease]:
    """Hold the lease of sweep ``name`` under ``storage`` for the block (``LeaseHeld`` when another driver has it).

    A user error in the block means nothing started: the storage directory, if this created it, goes again.
    """
    directory = lease_dir(storage)
    created = [d for d in (directory, *directory.parents) if not d.exists()]  # what acquire's mkdir makes
    lease = Lease(directory, name)
    lease.acquire()
    nothing_started = False
    try:
        yield lease
    except UserError:
        nothing_started = True
        raise
    finally:
        lease.release()
        for made in created if nothing_started else ():
            with contextlib.suppress(OSError):
                made.rmdir()  # only when empty: whatever else was written there stays
