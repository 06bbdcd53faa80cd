"""A stand-in for Dataflow's commit semantics around the real generate DoFn, and nothing else.

No local runner retries a bundle, moves a key or updates a job, so this driver
does what the runner would, around the real ``StreamingGenerateFn`` (its
``process`` and timer callbacks, called with in-memory state and timers) and
real engines against the real vLLM server. The rules it reproduces:

* **A work item commits whole or not at all.** A bundle of elements, or one
  timer firing, for one key: its outputs, state writes and timer settings are
  committed together, and a failed commit discards them all and the runner
  retries the work item ("Bundling and persistence" in Beam's programming
  model: "the entire bundle fails ... outputs ... discarded"; Dataflow
  retries failed work items in streaming mode indefinitely). :meth:`Driver.deliver`
  and :meth:`Driver.fire` take ``commit=False`` to make one fail.
* **One key at a time.** State and timers are per key and window, and a key's
  work items run one after another (Beam's "State and timers" guide).
* **Keys move.** Streaming Engine keeps state in the service, so a key can be
  processed by another worker at any work item; the old worker's in-memory
  objects (its engine and streams) stay behind ("Streaming Engine" and
  autoscaling pages of Dataflow's docs). :meth:`Driver.move`.
* **Drain fires watermark timers.** A drain stops reading input and moves the
  watermark to infinity (``gcloud dataflow jobs drain``), so every
  event-time timer fires, here the DRAIN timer at the global window's end.
  :meth:`Driver.drain`.
* **Update reads old state.** A replacement job gets the old job's state
  as the old code wrote it (Dataflow's "Update an existing pipeline").
  :meth:`Driver.load` starts a key from given state.

What it does not reproduce: the runner's timing (a due poll timer fires when
the test says, never early, so a test makes timers late by firing them late),
bundle sizes, and parallelism across keys (``tests/test_admission.py`` runs
work items on a small pool of threads, as a worker's harness threads).
Each worker's runtime is built in-process and handed to its DoFns by an
:class:`InProcessRuntime`, as ``SharedRuntime.acquire`` would on a worker of its own.
"""

from __future__ import annotations

import copy
import inspect
import json
import time
from dataclasses import dataclass, field
from typing import Any

from apache_beam import pvalue
from apache_beam.transforms.window import GlobalWindow

from pipeline.engines.engine import Engine
from pipeline.generation.generate import StreamingGenerateFn
from pipeline.generation.generate_settings import GenerateSettings
from pipeline.generation.step_outputs import TAG_COMPLETIONS, TAG_DEAD_LETTERS
from pipeline.worker.runtime import WorkerRuntime
from pipeline.worker.runtime_settings import AdmissionSettings, RuntimeSettings

BAGS = ("waiting", "inflight")
VALUES = ("progress", "seen", "poll_at_ms", "wait_ms")
# A DoFn parameter name -> (kind, state name).
PARAMETERS = {"waiting": ("bag", "waiting"), "inflight": ("bag", "inflight"),
              "progress_state": ("value", "progress"), "seen_state": ("value", "seen"),
              "poll_at_ms": ("value", "poll_at_ms"), "wait_ms": ("value", "wait_ms"),
              "poll": ("timer", "poll"), "drain": ("timer", "drain")}


@dataclass
class KeyState:
    """What the runner keeps for one key: state cells, and the timers set."""

    bags: dict[str, list[str]] = field(default_factory=lambda: {name: [] for name in BAGS})
    values: dict[str, Any] = field(default_factory=lambda: dict.fromkeys(VALUES))
    timers: dict[str, float | None] = field(default_factory=lambda: {"poll": None, "drain": None})
    bytes_written: int = 0  # state bytes this work item wrote (for the cost figures)
    writes: int = 0  # state writes (adds, writes, clears) and timer settings this work item made

    def is_empty(self) -> bool:
        return not any(self.bags.values()) and all(v is None for v in self.values.values())


class _Bag:
    def __init__(self, state: KeyState, name: str) -> None:
        self._state, self._name = state, name

    def read(self) -> list[str]:
        return list(self._state.bags[self._name])

    def add(self, value: str) -> None:
        self._state.bags[self._name].append(value)
        self._state.bytes_written += len(value.encode())
        self._state.writes += 1

    def clear(self) -> None:
        self._state.bags[self._name] = []
        self._state.writes += 1


class _Value:
    def __init__(self, state: KeyState, name: str) -> None:
        self._state, self._name = state, name

    def read(self) -> Any:
        return self._state.values[self._name]

    def write(self, value: Any) -> None:
        self._state.values[self._name] = value
        self._state.bytes_written += len(value.encode()) if isinstance(value, str) else 8
        self._state.writes += 1

    def clear(self) -> None:
        self._state.values[self._name] = None
        self._state.writes += 1


class _Timer:
    def __init__(self, state: KeyState, name: str) -> None:
        self._state, self._name = state, name

    def set(self, timestamp: Any) -> None:
        self._state.timers[self._name] = float(timestamp)
        self._state.writes += 1

    def clear(self) -> None:
        self._state.timers[self._name] = None
        self._state.writes += 1


@dataclass(frozen=True)
class InProcessRuntime:
    """A runtime source (:class:`~pipeline.worker.runtime.RuntimeSource`) for a runtime built in this process: every
    step given the same one shares its engine and admission ledger, as the steps of one worker VM do."""

    runtime: WorkerRuntime
    tag: str

    @property
    def settings(self) -> RuntimeSettings:
        return self.runtime.settings

    def acquire(self, *, fresh: bool = False) -> WorkerRuntime:
        return self.runtime


def in_process(engine: Engine, tag: str, admission: AdmissionSettings = AdmissionSettings()) -> InProcessRuntime:
    """A runtime around ``engine`` for the steps of one stand-in worker."""
    return InProcessRuntime(WorkerRuntime(engine, admission), tag)


def generate_fn(source: InProcessRuntime, poll_interval_ms: float, **options: Any) -> StreamingGenerateFn:
    """The generate step's DoFn on ``source``'s runtime, set up as a runner would; ``options``: its
    :class:`~pipeline.generation.generate_settings.GenerateSettings`."""
    settings = GenerateSettings(**options, engine=source.settings.engine.engine)
    dofn = StreamingGenerateFn(source, poll_interval_ms, settings)
    dofn.setup()
    return dofn


@dataclass
class Worker:
    name: str
    dofn: StreamingGenerateFn
    engine: Engine


@dataclass
class Outputs:
    """A work item's outputs, by tag."""

    chunks: list[dict] = field(default_factory=list)
    completions: list[dict] = field(default_factory=list)
    dead_letters: list[dict] = field(default_factory=list)

    def extend(self, other: Outputs) -> None:
        self.chunks += other.chunks
        self.completions += other.completions
        self.dead_letters += other.dead_letters


class Driver:
    """Runs the DoFn's work items for keys under the rules in the module docstring."""

    def __init__(self, workers: list[Worker]) -> None:
        self.workers = workers
        self.state: dict[Any, KeyState] = {}
        self.owner: dict[Any, Worker] = {}
        self.committed = Outputs()
        self.discarded = Outputs()
        self.last: KeyState | None = None

    def load(self, key: Any, state: KeyState, worker: Worker | None = None) -> None:
        """Starts a key from state written elsewhere (an update from older code)."""
        self.state[key] = state
        self.owner[key] = worker or self.workers[0]

    def move(self, key: Any, worker: Worker) -> None:
        """The key's next work items run on ``worker``, from the committed state."""
        self.owner[key] = worker

    def deliver(self, key: Any, requests: list, *, commit: bool = True) -> Outputs:
        return self.run(key, "process", (key, list(requests)), commit=commit)

    def busy_keys(self) -> dict[Any, float]:
        """Keys that hold requests (or a stream to release) and have a poll timer set: when each is due."""
        # A copy: tests/test_worker_rig.py runs work items for new keys on other threads meanwhile.
        return {key: state.timers["poll"] for key, state in list(self.state.items())
                if state.timers["poll"] is not None
                and (state.bags["inflight"] or state.bags["waiting"] or state.values["progress"])}

    def fire(self, key: Any, *, commit: bool = True, max_wait_s: float = 5.0) -> Outputs | None:
        """Fires the key's poll timer when it is due, waiting up to ``max_wait_s``; None when none is that near."""
        timer = self.state.get(key, KeyState()).timers["poll"]
        if timer is None or timer - time.time() > max_wait_s:
            return None
        time.sleep(max(timer - time.time(), 0.0))
        return self.run(key, "on_poll", None, commit=commit, timer="poll")

    def drain(self, key: Any, *, commit: bool = True) -> Outputs | None:
        if self.state.get(key, KeyState()).timers["drain"] is None:
            return None
        return self.run(key, "on_drain", None, commit=commit, timer="drain")

    def run(self, key: Any, method: str, element: Any, *, commit: bool = True, timer: str | None = None) -> Outputs:
        """One work item of the key: ``method`` of the DoFn (``timer``: the timer fired), on its committed state."""
        worker = self.owner.setdefault(key, self.workers[0])
        committed = self.state.setdefault(key, KeyState())
        work = copy.deepcopy(committed)
        work.bytes_written = work.writes = 0
        if timer is not None:
            work.timers[timer] = None  # a timer that fires is cleared unless the callback sets it again
        callback = getattr(worker.dofn, method)
        kwargs: dict[str, Any] = {}
        for name in inspect.signature(callback).parameters:
            if name == "window":
                kwargs[name] = GlobalWindow()
            elif name == "key":
                kwargs[name] = key
            elif name in PARAMETERS:
                kind, state_name = PARAMETERS[name]
                kwargs[name] = {"bag": _Bag, "value": _Value, "timer": _Timer}[kind](work, state_name)
        args = (element,) if element is not None else ()
        outputs = Outputs()
        for item in callback(*args, **kwargs) or ():
            if isinstance(item, pvalue.TaggedOutput):
                {TAG_COMPLETIONS: outputs.completions, TAG_DEAD_LETTERS: outputs.dead_letters}[item.tag].append(
                    item.value)
            else:
                outputs.chunks.append(item)
        self.last = work  # what the work item wrote, committed or not
        if commit:
            self.state[key] = work
            self.committed.extend(outputs)
        else:
            self.discarded.extend(outputs)
        return outputs


def entry_v1(request_json: str, fingerprint: str, key: str | None, *, attempt: int = 1,
             deadline_at: float | None = None, batch: str | None = None) -> str:
    """A waiting or in-flight entry exactly as commit 41b0859 (state version 1, no "v") wrote it."""
    return json.dumps({"request": request_json, "fp": fingerprint, "attempt": attempt, "key": key,
                       "deadline_at": deadline_at, "batch": batch})
