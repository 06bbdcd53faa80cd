"""The one call policy's recovery (pipeline/worker/runtime_client.py): a host that died is acquired anew once.

The runtime's handle is staged here (a host that dies and is rebuilt, calls held on the dead host's handle); the
real runtime behind the same policy, its host killed mid-stream, is tests/test_runner_semantics.py's and
tests/test_vm_stand_in.py's."""

from __future__ import annotations

import logging
import threading
import time

from pipeline.engines.engine_settings import EngineSettings
from pipeline.worker.runtime import runtime_generation
from pipeline.worker.runtime_client import RuntimeClient, start_heartbeat
from pipeline.worker.runtime_settings import AdmissionSettings, CallSettings, RuntimeSettings
from tests.conftest import wait_until


class StagedHost:
    """A runtime source whose host can die; each fresh acquire builds a new one, and a handle works only while the
    host it was taken from lives."""

    def __init__(self) -> None:
        self.settings = RuntimeSettings(EngineSettings(server=None, server_url="http://unused"), AdmissionSettings(),
                                        CallSettings(bound_s=10.0))
        self.tag = f"staged-{time.monotonic_ns()}"
        self.builds, self.alive = 0, True
        self.beats: list[tuple[int, str]] = []  # (build, client) of each heartbeat the host heard
        self.failing = False  # its engine raises on a heartbeat

    def acquire(self, *, fresh: bool = False) -> Handle:
        if fresh:
            self.builds, self.alive = self.builds + 1, True
        return Handle(self, self.builds)


class Handle:
    def __init__(self, host: StagedHost, build: int) -> None:
        self.host, self.build = host, build

    def ping(self) -> str:
        if not self.host.alive or self.build != self.host.builds:
            raise ConnectionError("the runtime's host is gone")  # as a MultiProcessShared proxy's call does
        return "pong"

    def heartbeat(self, client: str) -> None:
        self.ping()
        if self.host.failing:
            raise RuntimeError("the engine failed")
        self.host.beats.append((self.build, client))


def test_a_call_on_the_dead_hosts_handle_that_fails_after_the_reconnect_starts_no_second_rebuild():
    """Reproduces what a fresh clone's make test saw on a loaded 2-core machine: after 'Reconnected to the worker's
    runtime', a call that had taken the dead host's handle before failed, started a second rebuild, and every
    stream was sent a third time. Such a call now finds the runtime acquired anew since it began and leaves it."""
    host = StagedHost()
    client = RuntimeClient(host, "test")
    host.alive = False  # the host dies
    taken, release, outcomes = threading.Event(), threading.Event(), []

    def held(runtime: Handle) -> str:
        taken.set()
        release.wait(timeout=30)
        return runtime.ping()

    late = threading.Thread(target=lambda: outcomes.append(client.call("report", held)))
    late.start()
    assert taken.wait(10), "the late call holds the dead host's handle"  # before anything reconnects
    assert client.call("poll", lambda runtime: runtime.ping())[1] is None  # fails: starts the one reconnect
    assert wait_until(lambda: runtime_generation(host.tag) == 1, 10), "the reconnect completes"
    assert client.call("poll", lambda runtime: runtime.ping())[1] == "pong"
    release.set()
    late.join(timeout=30)
    assert outcomes and outcomes[0][1] is None, "the late call failed on the dead host's handle"
    time.sleep(1.0)  # a second reconnect, were one started, builds at once
    assert host.builds == 1, "one rebuild for the host's death, not one per call that saw it"


def test_the_heartbeat_under_the_one_policy_leaves_a_dead_host_to_the_steps_and_then_beats_the_new_one(caplog):
    """The heartbeat is a runtime call like the steps', bounded by the call bound; but it outlives the pipeline that
    started it, so a dead host it finds is left to the steps' next call: an ended pipeline's beat starts no
    runtime. Once a step has reconnected, the beats reach the new host; a beat the engine fails is logged once a
    minute, not at every beat."""
    host = StagedHost()
    host.alive = False
    start_heartbeat(host)
    start_heartbeat(host)  # once per process and runtime, however many steps start it
    time.sleep(1.5)  # three beats or more on the dead host
    assert host.builds == 0 and runtime_generation(host.tag) == 0, "a beat rebuilt a runtime"
    RuntimeClient(host, "test").call("poll", lambda runtime: runtime.ping())  # a step finds the host gone
    assert wait_until(lambda: runtime_generation(host.tag) == 1, 10)
    assert wait_until(lambda: len(host.beats) >= 3, 10), "the new host hears the beats"
    assert {build for build, _ in host.beats} == {1} and len({client for _, client in host.beats}) == 1
    host.failing = True
    with caplog.at_level(logging.ERROR, logger="pipeline.worker.runtime_client"):
        time.sleep(1.5)
    assert len([r for r in caplog.records if "failed to hear the heartbeat" in r.getMessage()]) == 1
    host.failing = False
