"""A stand-in for a whole Dataflow worker VM: several real SDK processes sharing one engine host.

:mod:`local.runner_semantics` stands in for the runner's commit rules around the generate step in the test's
own process. A worker VM is more than that, and this adds what it is made of:

* **Several SDK processes.** A Dataflow worker hands its work items to Apache Beam SDK processes, by default
  one per vCPU ("Troubleshoot Dataflow out of memory errors":
  https://cloud.google.com/dataflow/docs/guides/troubleshoot-oom; the job's SDK container image "recommends
  using more than one core per SDK container instance", ``SdkHarnessContainerImage`` in Dataflow's API). Each is
  a real process here (``multiprocessing``, spawned), running the real ``StreamingGenerateFn``.
* **One runtime per VM.** The steps reach the worker's runtime through Beam's ``MultiProcessShared``, which
  "will be instantiated once per VM and methods will be invoked on it via rpc" (its module's documentation): the
  first process to acquire it hosts it, the others call it through a proxy, exactly as the template's
  ``SharedRuntime`` does on a worker.
* **State lives in the service.** With Streaming Engine a key's state is kept by the service, not in the SDK
  process, and each work item commits whole (the rules and their sources: :mod:`local.runner_semantics`). So
  this stand-in keeps every key's committed state and ships each work item (the key's state with it) to the
  process that runs the key; a process that dies loses no committed state, and its keys' work items run in
  another process.
* **Processes pause and die.** One process can be paused (``SIGSTOP``: a long GC, memory pressure) while the
  others run, and any can be killed (``SIGKILL``), the runtime's host among them.

Not reproduced yet: each process's bounded pool of harness threads (a process runs one work item at a time
here), the read bundles of the admission step, and an update.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from local.runner_semantics import Driver, KeyState, Outputs, Worker
from pipeline.engines.engine import EngineSettings
from pipeline.generation.generate import StreamingGenerateFn
from pipeline.worker.runtime import SharedRuntime, new_runtime_tag

WORK_ITEM_TIMEOUT_S = 120.0


def _serve(name: str, source: SharedRuntime, poll_interval_ms: float, drain_timeout_s: float, conn: Any) -> None:
    """An SDK process: sets up the generate step (acquiring the VM's runtime) and runs the work items it is sent."""
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")
    dofn = StreamingGenerateFn(source, poll_interval_ms, dedupe_window_s=600, drain_timeout_s=drain_timeout_s)
    dofn.setup()
    driver = Driver([Worker(name, dofn, None)])
    conn.send(("ready", os.getpid()))
    while True:
        message = conn.recv()
        if message[0] == "stop":
            return
        _, key, method, element, timer, state = message
        driver.state[key] = state
        outputs = driver.run(key, method, element, timer=timer)
        conn.send((outputs, driver.state[key]))


@dataclass
class SdkProcess:
    name: str
    process: Any
    conn: Any
    pid: int
    paused: bool = False
    dead: bool = False


@dataclass
class VmStandIn:
    """A worker VM of ``processes`` SDK processes; the first hosts the runtime. Use as a context manager."""

    settings: EngineSettings
    processes: int = 2
    poll_interval_ms: float = 50.0
    drain_timeout_s: float = 20.0
    tag: str = ""
    sdk: list[SdkProcess] = field(default_factory=list)
    state: dict[Any, KeyState] = field(default_factory=dict)
    owner: dict[Any, int] = field(default_factory=dict)
    committed: Outputs = field(default_factory=Outputs)
    retried: int = 0  # work items that a process died in, run again elsewhere

    def __enter__(self) -> VmStandIn:
        self.tag = self.tag or new_runtime_tag(self.settings)
        context = multiprocessing.get_context("spawn")
        for n in range(self.processes):  # one at a time: the first to acquire the runtime hosts it
            parent, child = context.Pipe()
            name = f"sdk-{n}"
            process = context.Process(target=_serve, name=name, daemon=True, args=(
                name, SharedRuntime(self.settings, self.tag), self.poll_interval_ms, self.drain_timeout_s, child))
            process.start()
            if not parent.poll(WORK_ITEM_TIMEOUT_S):
                raise RuntimeError(f"{name} did not start")
            _, pid = parent.recv()
            self.sdk.append(SdkProcess(name, process, parent, pid))
        return self

    def __exit__(self, *exc: object) -> None:
        for sdk in self.sdk:
            if sdk.paused:
                os.kill(sdk.pid, signal.SIGCONT)
            if not sdk.dead:
                try:
                    sdk.conn.send(("stop",))
                except OSError:
                    pass
        for sdk in self.sdk:
            sdk.process.join(timeout=10)
            if sdk.process.is_alive():
                sdk.process.kill()
                sdk.process.join(timeout=5)

    # The runner's side ------------------------------------------------------------------------

    def assign(self, key: Any, process: int) -> None:
        """The key's work items run in SDK process ``process`` from now on."""
        self.owner[key] = process

    def deliver(self, key: Any, requests: list) -> Outputs:
        return self.run(key, "process", (key, list(requests)))

    def run(self, key: Any, method: str, element: Any = None, timer: str | None = None) -> Outputs:
        """One work item of the key, in the process that runs it; retried in another if that process dies."""
        while True:
            sdk = self._live_owner(key)
            try:
                sdk.conn.send(("run", key, method, element, timer, self.state.setdefault(key, KeyState())))
                if not sdk.conn.poll(WORK_ITEM_TIMEOUT_S):
                    raise RuntimeError(f"{sdk.name} took more than {WORK_ITEM_TIMEOUT_S:g} s for one work item")
                outputs, state = sdk.conn.recv()
            except (EOFError, OSError):  # the process died in the work item: it failed, and runs again elsewhere
                sdk.dead = True
                self.retried += 1
                continue
            self.state[key] = state
            self.committed.extend(outputs)
            return outputs

    def due(self) -> list[Any]:
        """Keys whose poll timer is due and whose process is not paused."""
        now = time.time()
        return [key for key, state in list(self.state.items())
                if state.timers["poll"] is not None and state.timers["poll"] <= now
                and (state.bags["inflight"] or state.bags["waiting"] or state.values["progress"])
                and not self._live_owner(key).paused]

    def busy(self) -> list[Any]:
        return [key for key, state in self.state.items() if state.timers["poll"] is not None
                and (state.bags["inflight"] or state.bags["waiting"] or state.values["progress"])]

    def fire_due(self) -> int:
        keys = self.due()
        for key in keys:
            self.run(key, "on_poll", timer="poll")
        return len(keys)

    def run_for(self, seconds: float) -> None:
        """Fires due timers (of processes not paused) for ``seconds``."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if not self.fire_due():
                time.sleep(0.01)

    def run_until_idle(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.busy():
            if time.monotonic() > deadline:
                raise AssertionError(f"keys still busy after {timeout_s:g} s: {self.busy()}")
            if not self.fire_due():
                time.sleep(0.01)

    # What happens to processes ------------------------------------------------------------------

    def pause(self, process: int) -> None:
        os.kill(self.sdk[process].pid, signal.SIGSTOP)
        self.sdk[process].paused = True

    def resume(self, process: int) -> None:
        os.kill(self.sdk[process].pid, signal.SIGCONT)
        self.sdk[process].paused = False

    def kill(self, process: int) -> None:
        os.kill(self.sdk[process].pid, signal.SIGKILL)
        self.sdk[process].process.join(timeout=10)
        self.sdk[process].dead = True

    def _live_owner(self, key: Any) -> SdkProcess:
        """The process that runs the key; a key whose process died moves to the next live one."""
        n = self.owner.setdefault(key, 0)
        if self.sdk[n].dead:
            live = [i for i, sdk in enumerate(self.sdk) if not sdk.dead]
            if not live:
                raise RuntimeError("every SDK process of the VM is dead")
            n = self.owner[key] = live[0]
        return self.sdk[n]
