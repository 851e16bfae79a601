"""Packed trials in a sweep: single-configuration Tune trials that train together in one pack (``peftune.core.pack``).

Ray Tune still schedules one trial per configuration: the searcher, ASHA, the equal budget, the record, the
checkpoints and the retries see nothing else. A search trial of a packable method (``resources.pack_size`` K > 1)
asks for 1/K of a trial's resources, joins a cohort at the sweep's :class:`PackHub` (trials of its node and GPU
that can share the batches; closed at K members or after ``pack_wait_s``), and is trained as a member of one pack
by a :class:`PackRunner` process, which holds the rest of a trial's share when the cohort closed short. The trial
relays its member's reports to ``tune.report`` and Tune's decisions back; the runner stops the members Tune
stopped. A runner that fails fails its members' trials, which Tune retries alone; a silent member is stopped after
``DECISION_TIMEOUT_S``. The confirmation does not pack. Why this design: docs/design.md, "Packed trials".
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import tempfile
import threading
import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch
from ray import tune
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from peftune.base import record_names
from peftune.core import pack
from peftune.core.train import TrainConfig, TrainingDiverged
from peftune.sweep.shared_data import release_freed_memory, worker_prepared

log = logging.getLogger("peftune.sweep.packing")

# a member's trial that neither went on nor stopped within this is taken as stopped (its process died): Tune
# answers a report far sooner (docs/benchmarks.md, "Packed trials")
DECISION_TIMEOUT_S = 300.0
# the least a new runner waits for its top-up CPUs (``pack_wait_s`` where longer): longer than a runner process
# takes to start, so that a short ``pack_wait_s`` does not leave every top-up unheld (docs/benchmarks.md, "Packed
# trials")
RUNNER_START_S = 10.0


@dataclass(frozen=True)
class PackSettings:
    """How a sweep's search trials pack: ``size`` members at most (1: never), a cohort waiting ``wait_s`` for them,
    at the hub named ``hub``."""

    size: int
    wait_s: float
    hub: str

    def packs(self, config: dict) -> bool:
        """Whether the trial of this Tune ``config`` joins a pack: a search trial of a packable configuration."""
        marks = config.get("peftune") or {}
        if self.size <= 1 or (marks.get("phase") or record_names.SEARCH) != record_names.SEARCH:
            return False
        method = config.get("method")
        return pack.packs(method, config.get(method) or {})


@dataclass(frozen=True)
class TrialResources:
    """Tune's resources per trial (``tune.with_resources`` takes a callable of the trial's config): a trial that
    may pack asks for 1/K of a trial's share, every other trial for the whole."""

    cpu: float
    gpu: float = 0.0
    packing: PackSettings | None = None

    def __call__(self, config: dict) -> tune.PlacementGroupFactory:
        share = 1 / self.packing.size if self.packing is not None and self.packing.packs(config) else 1.0
        bundle = {"CPU": self.cpu * share, **({"GPU": self.gpu * share} if self.gpu else {})}
        return tune.PlacementGroupFactory([bundle])


# the hubs this driver started, by name: a handle held (Ray ends an actor no handle refers to) until stop_hubs
_HUBS: dict[str, Any] = {}


def start_hub(prepared, threads: int, size: int, wait_s: float, cpus_per_trial: float) -> PackSettings:
    """The sweep's pack hub (``prepared``: the ``shared_data.SharedData`` its runners train on), started and owned by
    the driver (it ends with the driver at the latest). Returns the settings every trial gets."""
    name = f"peftune-packs-{uuid.uuid4().hex[:12]}"
    options = {"name": name, "num_cpus": 0, "max_concurrency": 1000}
    _HUBS[name] = PackHub.options(**options).remote(prepared, threads, size, wait_s, cpus_per_trial)
    return PackSettings(size, wait_s, name)


def stop_hubs() -> None:
    """End the hubs this driver started, and with them their runners (actors they own)."""
    while _HUBS:
        _, hub = _HUBS.popitem()
        ray.kill(hub)


# ----------------------------------------------------------------------------- the hub


class _Cohort:
    def __init__(self, deadline: float):
        self.deadline = deadline
        self.configs: list[TrainConfig] = []
        self.taken = threading.Event()  # a member took it to start it: it admits no more
        self.closed = threading.Event()  # it has its runner
        self.runner = None
        self.id = uuid.uuid4().hex  # the pack's: every call to its runner names it (a runner trains one after another)


@ray.remote
class PackHub:
    """Forms the cohorts (per node, GPU and ``pack_key``) and starts each on an idle runner of its node and GPU."""

    def __init__(self, prepared, threads: int, size: int, wait_s: float, cpus_per_trial: float):
        self.prepared, self.threads, self.size, self.wait_s = prepared, threads, size, wait_s
        self.cpus_per_trial = cpus_per_trial
        self.lock = threading.Lock()
        self.open: dict[tuple, _Cohort] = {}
        self.idle: dict[tuple, list] = {}  # ((node id, GPU ids), members) -> runners whose pack ended
        self.runners: list = []  # every runner it started: a handle held keeps a runner alive (Ray ends the rest)

    def join(self, key: tuple, config: TrainConfig, place: tuple) -> tuple[Any, str, int, int]:
        """Add a member; blocks until its cohort has its runner. (the runner, the pack's id, the member's index, the
        pack's size)

        ``place``: (node id, the ids of the GPUs Ray granted the trial): a pack's members share one GPU. The cohort
        closes at K members or at its deadline; the member that closes it finds its runner, outside the lock (that
        may wait for CPUs), while the others wait."""
        with self.lock:
            cohort = self.open.get((place, key))
            if cohort is None:
                cohort = self.open[(place, key)] = _Cohort(time.monotonic() + self.wait_s)
            index = len(cohort.configs)
            cohort.configs.append(config)
            closes = len(cohort.configs) >= self.size and self._take(place, key, cohort)
        if not closes:
            cohort.taken.wait(max(0.0, cohort.deadline - time.monotonic()))
            with self.lock:
                closes = self._take(place, key, cohort)
        if closes:
            try:
                runner = self._runner(place, len(cohort.configs))
                hub = ray.get_runtime_context().current_actor
                runner.start.remote(cohort.id, list(cohort.configs), hub, place, len(cohort.configs))
                cohort.runner = runner
            finally:  # its other members wait on this: released even where no runner could be had
                cohort.closed.set()
        cohort.closed.wait()
        if cohort.runner is None:  # each member's trial fails, and Tune retries it alone (a retry never packs)
            raise RuntimeError("the pack's runner could not be started (the hub's log says why)")
        return cohort.runner, cohort.id, index, len(cohort.configs)

    def _take(self, place: tuple, key: tuple, cohort: _Cohort) -> bool:  # under the lock
        """Whether the caller takes ``cohort`` to start it (False: another member already did)."""
        if cohort.taken.is_set():
            return False
        self.open.pop((place, key), None)
        cohort.taken.set()
        return True

    def _runner(self, place: tuple, members: int):
        """An idle runner of this place for a pack of ``members``, or a new one.

        A new runner holds what its members do not: a pack of k < K members holds k/K of a trial's CPUs, and trains
        on one trial's threads; without the rest, Ray would give it to other trials, and the pack would train slower
        than its members alone. Where that top-up cannot start within ``pack_wait_s`` (``RUNNER_START_S`` at least)
        it holds none: every CPU may be held by members waiting for their runners, and then no top-up ever starts
        and the search stands still. Of a GPU it holds nothing: k members take about k/K of a slot's memory, and a
        GPU's share is not a share of its time anyway. Both cases as measured: docs/benchmarks.md, "Packed trials"."""
        with self.lock:
            idle = self.idle.get((place, members))
            if idle:
                return idle.pop()
        top_up = self.cpus_per_trial * (self.size - members) / self.size
        runner = self._spawn(place, top_up)
        if top_up > 0:
            wait_s = max(self.wait_s, RUNNER_START_S)
            ready, _ = ray.wait([runner.ready.remote()], timeout=wait_s)
            if not ready:
                log.warning("a pack of %d: its runner's %.2f CPUs did not free in %.0f s; it trains on its members' "
                            "CPUs alone (oversubscribed)", members, top_up, wait_s)  # fmt: skip
                ray.kill(runner)
                runner = self._spawn(place, 0.0)
        with self.lock:
            self.runners.append(runner)
        return runner

    def _spawn(self, place: tuple, cpus: float):
        node, gpus = place
        where = NodeAffinitySchedulingStrategy(node, soft=False)  # the CPUs its members hold are there
        options = {"num_cpus": cpus, "max_concurrency": 1000, "scheduling_strategy": where}
        return PackRunner.options(**options).remote(self.prepared, self.threads, gpus)

    def release(self, place: tuple, members: int, runner) -> None:
        """A runner whose pack of ``members`` ended: the next cohort of its place and size takes it, if it holds no
        CPUs; one that holds a top-up is ended (idle, it kept the CPUs from every trial: in the SST job with packs
        of 3, the confirmation, which never packs, ran at about half its speed)."""
        with self.lock:
            if members >= self.size:
                self.idle.setdefault((place, members), []).append(runner)
                return
            self.runners = [r for r in self.runners if r != runner]
        ray.kill(runner)


# ----------------------------------------------------------------------------- the runner


@dataclass
class _Channel:
    """A member's way to its trial: what it reported, and whether Tune let it go on."""

    reports: queue.Queue
    decision: queue.Queue
    awaiting: bool = False  # it reported: the pack waits for Tune's decision before it trains on
    told: bool = False  # its trial was told it diverged


@ray.remote
class PackRunner:
    """Trains one pack at a time, in a thread of its own; members' trials fetch their reports with ``next`` and
    answer with ``decide``, each call naming its pack (a call may reach the runner before the pack's ``start``, and
    a late one of an earlier pack after it)."""

    def __init__(self, prepared, threads: int, gpus: tuple[str, ...] = ()):
        """``gpus``: the ids of the GPUs its members were granted. It asks Ray for none itself (its members hold the
        pack's share), and Ray leaves the GPUs of an actor that asks for none as the node's; so it makes those
        the ones it sees, as Ray would have, before torch starts CUDA."""
        if gpus:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        self.prepared, self.threads = prepared, threads
        self.packs: dict[str, list[_Channel]] = {}  # pack id -> its members' channels
        self.started = threading.Condition()

    def ready(self) -> bool:
        """Answers once the runner has started (its process, with the CPUs it asked for)."""
        return True

    def start(self, pack_id: str, configs: list[TrainConfig], hub, place: tuple, members: int) -> None:
        channels = [_Channel(queue.Queue(), queue.Queue()) for _ in configs]
        with self.started:
            self.packs = {pack_id: channels}  # an earlier pack's calls find nothing now
            self.started.notify_all()
        me = ray.get_runtime_context().current_actor
        release = functools.partial(hub.release.remote, place, members, me)
        threading.Thread(target=self._train, args=(configs, channels, release), daemon=True).start()

    def _channel(self, pack_id: str, index: int, wait: bool) -> _Channel | None:
        with self.started:
            if wait:
                self.started.wait_for(lambda: pack_id in self.packs, timeout=DECISION_TIMEOUT_S)
            channels = self.packs.get(pack_id)
        return None if channels is None else channels[index]

    def next(self, pack_id: str, index: int) -> tuple[str, Any]:
        """The member's next item: ("report", (metrics, {file: bytes} | None)), ("divergence", reason), ("end", None)
        or ("error", the pack's traceback)."""
        channel = self._channel(pack_id, index, wait=True)
        return ("error", "the pack never started on its runner") if channel is None else channel.reports.get()

    def decide(self, pack_id: str, index: int, go_on: bool) -> None:
        channel = self._channel(pack_id, index, wait=False)
        if channel is not None:
            channel.decision.put(go_on)

    def _train(self, configs: list[TrainConfig], channels: list[_Channel], release) -> None:
        torch.set_num_threads(self.threads)
        try:
            prepared = worker_prepared(self.prepared)
            reports = [_reporter(channel, len(configs)) for channel in channels]
            packed = pack.run_pack(configs, prepared, reports, decide=lambda p: _decide(p, channels))
            _tell_diverged(packed, channels)
            for channel in channels:
                if not channel.told:
                    channel.reports.put(("end", None))
        except Exception:  # every member's trial fails with it; Tune retries each from its checkpoint, alone
            error = traceback.format_exc()
            log.error("a pack failed: %s", error)
            for channel in channels:
                channel.reports.put(("error", error))
        finally:
            release_freed_memory()
            release()


def _reporter(channel: _Channel, size: int):
    """A member's report function (``train.ReportFn``): its metrics, and the checkpoint it writes, as file bytes."""

    def report(metrics: dict, save) -> None:
        files = None
        if save is not None:
            with tempfile.TemporaryDirectory(prefix="peftune-pack-") as directory:
                root = Path(directory)
                save(root)
                files = {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}
        channel.awaiting = True
        channel.reports.put(("report", ({**metrics, record_names.PACK_SIZE_RESULT: size}, files)))

    return report


def _decide(packed: pack.Pack, channels: list[_Channel]) -> None:
    """Wait for Tune's decision on every report the members just made; stop those it stopped. A member that just
    diverged is told at once (its trial ends, and its share goes back to Tune)."""
    _tell_diverged(packed, channels)
    for member in list(packed.active):
        channel = channels[member.index]
        if not channel.awaiting:
            continue
        channel.awaiting = False
        try:
            go_on = channel.decision.get(timeout=DECISION_TIMEOUT_S)
        except queue.Empty:
            log.warning("member %d's trial gave no decision in %.0f s: stopped", member.index, DECISION_TIMEOUT_S)
            go_on = False
        if not go_on:
            packed.stop(member, "stopped by the scheduler")


def _tell_diverged(packed: pack.Pack, channels: list[_Channel]) -> None:
    for member in packed.members:
        channel = channels[member.index]
        if member.divergence is not None and not channel.told:
            channel.told = True
            channel.reports.put(("divergence", member.divergence))


# ----------------------------------------------------------------------------- the trial's side


def packed_trial(train_config: TrainConfig, settings: PackSettings, report) -> None:
    """Run a search trial as a member of a pack: join a cohort, then relay the member's reports to Tune through
    ``report`` (the worker's: metrics, and ``save(directory)`` writing the checkpoint) and Tune's decisions back.
    Raises ``TrainingDiverged`` as ``run_trial`` would."""
    hub = ray.get_actor(settings.hub)
    place = (ray.get_runtime_context().get_node_id(), tuple(str(i) for i in ray.get_gpu_ids()))
    runner, pack_id, index, size = ray.get(hub.join.remote(pack.pack_key(train_config), train_config, place))
    log.info("training in a pack of %d (member %d)", size, index)
    try:
        while True:
            kind, payload = ray.get(runner.next.remote(pack_id, index))
            if kind == "end":
                return
            if kind == "divergence":
                raise TrainingDiverged(payload)
            if kind == "error":
                raise RuntimeError(f"the pack this trial trained in failed:\n{payload}")
            metrics, files = payload
            report(metrics, None if files is None else _writer(files))  # SystemExit when Tune stopped the trial
            runner.decide.remote(pack_id, index, True)  # it returned: Tune lets the trial go on
    except BaseException:  # stopped, failed or ended: the pack goes on without this member
        runner.decide.remote(pack_id, index, False)
        raise


def _writer(files: dict[str, bytes]):
    def save(directory: Path) -> None:
        for name, data in files.items():
            path = directory / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)

    return save
