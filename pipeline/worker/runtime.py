"""The worker's runtime: one engine and one admission ledger per worker VM, shared by every SDK process.

vLLM's continuous batching works best with every request of the worker in flight against one server, and
admission must count what the whole VM holds, so all DoFn instances and SDK processes on a VM share one
:class:`WorkerRuntime` through Beam's ``MultiProcessShared``: the first process to ask starts its host, a process
of its own that builds it (and with it the model manager's server), and every process calls it through a proxy.
A proxy reaches an object's methods, not the objects it holds, so the runtime forwards each call to its part:
generation to the engine (:mod:`pipeline.engines.engine`), admission to the ledger
(:mod:`pipeline.worker.admission_ledger`). A step reaches it through a :class:`SharedRuntime` (picklable:
settings and the pipeline's tag).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from apache_beam.utils.multi_process_shared import MultiProcessShared

from pipeline.engines import lane_governor
from pipeline.engines.engine import Engine
from pipeline.engines.engine_settings import EngineSettings
from pipeline.engines.vllm_engine import vllm_engine
from pipeline.worker.admission_ledger import AdmissionLedger
from pipeline.worker.runtime_settings import AdmissionSettings, CallSettings, RuntimeSettings

LOGGER = logging.getLogger(__name__)

# Runners may set up and tear down DoFn instances per bundle (the DirectRunner does), so the reference is held for
# the life of the process rather than released in teardown, which would stop the server; the engine closes itself
# (and its server) at exit. Per process: the runtimes it has acquired (proxies), by tag.
_ACQUIRED: dict[str, WorkerRuntime] = {}
_ACQUIRE_LOCK = threading.Lock()


@dataclass
class ProcessRecord:
    """What this process's steps have told one runtime, or counted of it: the client side of the per-process cache
    above. It cannot live in a DoFn instance, which a runner may build anew for each bundle; keep it here only."""

    reported_waiting: dict[str, tuple[int, float]] = field(default_factory=dict)  # key -> (count, monotonic when)
    gauges_at: dict[str, float] = field(default_factory=dict)  # step -> when it last set the load gauges
    uncounted_logged_at: float = float("-inf")  # when the admission step last logged that it could not count
    full_logged_at: float = float("-inf")  # when a reader last logged that the worker was full
    lock: threading.Lock = field(default_factory=threading.Lock)


# Per process: its record of each runtime, by tag.
_RECORDS: dict[str, ProcessRecord] = {}


def process_record(tag: str) -> ProcessRecord:
    """This process's record of the runtime named ``tag``."""
    with _ACQUIRE_LOCK:
        return _RECORDS.setdefault(tag, ProcessRecord())


# Per process: its name as a client of the runtimes (pid and a random part: SDK containers may reuse pids).
_CLIENT: dict[int, str] = {}


def client_id() -> str:
    """This process's name as a client of a runtime: its streams' leases run on its clocks."""
    pid = os.getpid()
    return _CLIENT.setdefault(pid, f"{pid}-{uuid.uuid4().hex[:8]}")


class WorkerRuntime:
    """One VM's engine and admission ledger; every public method is a call a step may make through the proxy."""

    def __init__(self, engine: Engine, admission: AdmissionSettings = AdmissionSettings(),
                 calls: CallSettings = CallSettings()) -> None:
        self.engine = engine
        self.settings = RuntimeSettings(engine.settings, admission, calls)
        self.admission = AdmissionLedger(self.settings, engine.in_flight, bulk_unfinished=engine.bulk_in_flight,
                                        bulk_cap=engine.bulk_cap)
        self._counted: dict[str, int] = {}  # the engine's totals handed out as counts so far (load_and_counts)
        self._counted_lock = threading.Lock()

    # Generation (the generate step) -----------------------------------------------------

    def submit_batch(self, request_jsons: list[str], attempts: list[int], client: str = "") -> list[str | None]:
        return self.engine.submit_batch(request_jsons, attempts, client)

    def poll(self, positions: dict[str, int], client: str = "") -> dict[str, list[tuple[str, str]]]:
        return self.engine.poll(positions, client)

    def heartbeat(self, client: str) -> None:
        self.engine.heartbeat(client)

    def cancel(self, keys: list[str]) -> None:
        self.engine.cancel(keys)

    def in_flight(self) -> int:
        return self.engine.in_flight()

    def hold_leases(self, for_s: float) -> None:
        self.engine.hold_leases(for_s)

    def server_restarts(self) -> int:
        return self.engine.server_restarts()

    def load_and_counts(self) -> tuple[dict[str, int | None], dict[str, int]]:
        """:meth:`load`, and what the engine's totals (its server's restarts, the lane governor's counts) grew by
        since any step of any SDK process last took them: each is counted as a Beam counter once for the whole VM,
        not once per process that asks. One call, the engine's stats read once for both."""
        load = self.load()
        return load, self._take_counts(load)

    def _take_counts(self, stats: dict[str, int | None]) -> dict[str, int]:
        totals = {"server_restarts": self.engine.server_restarts(),
                  **{name: int(stats.get(name) or 0) for name in lane_governor.TOTALS}}
        with self._counted_lock:
            grown = {name: max(total - self._counted.get(name, 0), 0) for name, total in totals.items()}
            self._counted.update(totals)
        return grown

    # Admission (the admission step; the generate step reports what waits) ------------------

    def admit(self, ids: list[str], in_place_of: Sequence[str] = (), bulk: bool = False,
              keys: dict[str, str] | None = None) -> int:
        return self.admission.admit(ids, in_place_of, bulk, keys)

    def withdraw(self, ids: list[str]) -> None:
        self.admission.withdraw(ids)

    def settled(self, filled: list[str], unfilled: list[str]) -> None:
        self.admission.settled(filled, unfilled)

    def renew(self, ids: list[str]) -> list[str]:
        return self.admission.renew(ids)

    def dispatched(self, ids: list[str]) -> None:
        self.admission.dispatched(ids)

    def report_waiting(self, holder: str, count: int, arrived: Sequence[str] = ()) -> None:
        self.admission.report_waiting(holder, count, arrived)

    def full(self, bulk: bool = False) -> bool:
        return self.admission.full(bulk)

    # Both ---------------------------------------------------------------------------------

    def load(self) -> dict[str, int | None]:
        """The worker's load: what its generate step holds (in flight and waiting) against the bound, what
        was admitted and is on its way (counted against the bound too), and the engine's stats."""
        unfinished, waiting, on_the_way = self.admission.counts()
        return {"held": unfinished + waiting, "on_the_way": on_the_way, "max_held": self.admission.bound,
                "in_flight": unfinished, "waiting": waiting, **self.engine.stats()}

    def close(self) -> None:
        self.engine.close()


class RuntimeSource(Protocol):
    """How a step reaches its worker's runtime: the settings it was built for, a tag that names the runtime among
    others in the process, and the runtime itself."""

    @property
    def settings(self) -> RuntimeSettings: ...

    @property
    def tag(self) -> str: ...

    def acquire(self, *, fresh: bool = False) -> WorkerRuntime: ...


@dataclass(frozen=True)
class SharedRuntime:
    """The runtime one pipeline's steps share on a worker, named by the pipeline's tag (:func:`new_runtime_tag`)."""

    settings: RuntimeSettings
    tag: str

    def acquire(self, *, fresh: bool = False) -> WorkerRuntime:
        """The worker-wide runtime; ``fresh`` drops this process's handle first (its hosting process died)."""
        return acquire_runtime(self.settings, self.tag, fresh=fresh)


def new_runtime_tag(settings: RuntimeSettings) -> str:
    """A tag for one pipeline's runtime: shared by its steps on a worker, never with another job's."""
    return "streaming-llm-" + hashlib.sha1((repr(settings) + uuid.uuid4().hex).encode()).hexdigest()[:16]


def build_engine(settings: EngineSettings) -> Engine:
    """The engine the settings name; transformers is imported only by workers that use it."""
    if not logging.getLogger().handlers:  # its own process (see acquire_runtime): log where the worker does
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.engine == "transformers":
        from pipeline.engines.transformers_engine import transformers_engine
        return transformers_engine(settings)
    return vllm_engine(settings)


def build_runtime(settings: RuntimeSettings) -> WorkerRuntime:
    return WorkerRuntime(build_engine(settings.engine), settings.admission, settings.calls)


def acquire_runtime(settings: RuntimeSettings, tag: str, *, fresh: bool = False) -> WorkerRuntime:
    """The worker-wide runtime: the first process to ask builds it, the others proxy to it.

    ``fresh``: this process's handle no longer answers (its hosting process died), so it is acquired anew, which
    builds the runtime in this process if no other has yet; the old handle stays cached until the new one is
    ready. Nothing of this process waits on it meanwhile: the build (a vLLM start, minutes) runs outside the
    process's lock. Beam's ``MultiProcessShared`` builds the object under its cross-process file lock
    (``initialize_eagerly``), so the other processes' :func:`reconnect` threads wait on that lock while it
    starts; their timers and reads do not: their calls fail fast on the old handle (a timer commits and fires
    again, a read pulls nothing and asks again a second later).

    The runtime lives in a process of its own (``spawn_process``), a child of the SDK process that asked first,
    never inside an SDK process: there its event loop, chunk publishing and lease clocks shared that process's
    interpreter lock with its harness threads, so a pause of that one process (a garbage collection, memory
    pressure) stopped every process's calls, and the static engine's decoding loop, Python between many small
    torch calls, waited for the lock at every call. Its host dies with the SDK process that started it (Beam's
    life line), as its streams then do; every call to it is bounded in time (:mod:`.runtime_client`).
    """
    with _ACQUIRE_LOCK:
        if not fresh and tag in _ACQUIRED:
            return _ACQUIRED[tag]
    shared = MultiProcessShared(functools.partial(build_runtime, settings), tag=tag, spawn_process=True)
    runtime = shared.acquire()
    with _ACQUIRE_LOCK:
        if fresh or tag not in _ACQUIRED:
            _ACQUIRED[tag] = runtime
        return _ACQUIRED[tag]


# Per process: the threads acquiring a runtime anew after its host died, by tag.
_RECONNECTING: dict[str, threading.Thread] = {}
# Per process: how many times each runtime was acquired anew, by tag (runtime_generation).
_GENERATIONS: dict[str, int] = {}


def runtime_generation(tag: str) -> int:
    """How many reconnects to the runtime ``tag`` names this process has completed: a call that read it before it
    took its handle, and whose handle then failed, starts no reconnect when one completed since (its handle was the
    dead host's; the runtime is back already)."""
    with _ACQUIRE_LOCK:
        return _GENERATIONS.get(tag, 0)
RECONNECT_BACKOFF_S = (1.0, 60.0)  # first and longest wait between failed attempts


def reconnect(source: RuntimeSource, cause: BaseException, seen: int | None = None) -> None:
    """Acquires ``source``'s runtime anew in a thread of its own, once at a time per process, retrying with
    backoff until it succeeds: a step that found the runtime's host gone (``cause``: what its call raised) goes
    on meanwhile (its calls fail fast on the old handle), so no timer waits for a rebuild and no failed rebuild
    wedges a key. A start is logged with its cause; while one runs, a further call does nothing, and so does a
    call made on a handle from before the last reconnect (``seen``: :func:`runtime_generation` when it began): a
    second rebuild would lose every stream the first one's runtime runs."""

    def again() -> None:
        wait_s = RECONNECT_BACKOFF_S[0]
        while True:
            try:
                source.acquire(fresh=True)
                with _ACQUIRE_LOCK:
                    _GENERATIONS[source.tag] = _GENERATIONS.get(source.tag, 0) + 1
                LOGGER.warning("Reconnected to the worker's runtime (%s)", source.tag)
                return
            except Exception:
                LOGGER.exception("Reconnecting to the worker's runtime failed; trying again in %.0f s", wait_s)
                time.sleep(wait_s)
                wait_s = min(2 * wait_s, RECONNECT_BACKOFF_S[1])

    with _ACQUIRE_LOCK:
        running = _RECONNECTING.get(source.tag)
        if running is not None and running.is_alive():
            return
        if seen is not None and _GENERATIONS.get(source.tag, 0) > seen:
            return  # the call's handle was the dead host's: the runtime was acquired anew since
        _RECONNECTING[source.tag] = threading.Thread(target=again, name=f"reconnect-{source.tag}", daemon=True)
        _RECONNECTING[source.tag].start()
    LOGGER.warning("The worker's runtime is unreachable (%s); acquiring it anew in the background", cause)
