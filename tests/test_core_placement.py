"""Keeping the pipeline's threads off the model's cores, on real processes and sockets of this machine."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

import pytest

from local import core_placement
from tests.conftest import thread_cores, thread_cores_restored, wait_until

# Core affinity is Linux's (os.sched_getaffinity): elsewhere the placement has nothing to place on.
pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="core affinity is Linux's")
CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
needs_two_cores = pytest.mark.skipif(len(CORES) < 2, reason="needs at least 2 cores")


def test_listening_pid_finds_the_process_that_listens_on_a_port():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        assert core_placement.listening_pid(port) is None  # bound, not yet listening
        listener.listen()
        assert core_placement.listening_pid(port) == os.getpid()
    assert core_placement.listening_pid(port) is None


@needs_two_cores
def test_bound_cores_finds_the_threads_a_child_binds_and_nothing_in_an_unbound_one():
    # A child that binds one of its threads, as vLLM's worker binds its compute threads.
    code = ("import os, threading, time\n"
            f"def bound():\n    os.sched_setaffinity(0, {{{CORES[0]}}}); time.sleep(60)\n"
            "threading.Thread(target=bound, daemon=True).start(); print('ready', flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert child.stdout.readline().strip() == "ready"
        assert wait_until(lambda: core_placement.bound_cores(child.pid) == {CORES[0]}, 10)
        assert core_placement.bound_cores(idle.pid) == frozenset()
    finally:
        for process in (child, idle):
            process.kill()
            process.wait()
    assert core_placement.bound_cores(child.pid) == frozenset()  # ended


@needs_two_cores
def test_keep_off_moves_every_thread_of_this_process_and_the_threads_it_starts():
    model = frozenset(CORES[:1])
    # A child in this session, as the worker's runtime host is; one in a session of its own, as vLLM is.
    host = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        with thread_cores_restored():
            found = core_placement.pipeline_processes()
            assert os.getpid() in found and host.pid in found and server.pid not in found
            assert core_placement.keep_off(model) == frozenset(CORES) - model
            assert all(not cores & model for cores in thread_cores().values())
            assert os.sched_getaffinity(host.pid) == frozenset(CORES) - model
            assert os.sched_getaffinity(server.pid) == frozenset(CORES)
    finally:
        for process in (host, server):
            process.kill()
            process.wait()
    with thread_cores_restored():
        assert core_placement.keep_off(model) == frozenset(CORES) - model
        assert all(not cores & model for cores in thread_cores().values())
        seen: list[frozenset[int]] = []
        later = threading.Thread(target=lambda: seen.append(frozenset(os.sched_getaffinity(0))))
        later.start()
        later.join()
        assert seen and not seen[0] & model
        assert core_placement.keep_off(model) is None  # already off
    assert core_placement.keep_off(frozenset()) is None
    assert core_placement.keep_off(frozenset(CORES)) is None  # no core would be left


@pytest.mark.engine
@needs_two_cores
def test_the_local_launcher_finds_the_cores_vllm_computes_on_and_moves_the_pipeline_off_them(vllm_server):
    allowed = frozenset(CORES)
    # vLLM's CPU build binds its compute to all but the last core (one NUMA node here).
    expected = allowed - {max(allowed)}
    assert core_placement.model_cores(vllm_server.base_url) == expected  # a server on loopback, found by its port
    assert core_placement.model_cores() == expected  # the session's server is a child of this process
    assert core_placement.model_cores("http://vllm.internal:8000") == frozenset()  # a server elsewhere
    with thread_cores_restored():
        watcher = core_placement.keep_pipeline_off_local_model(vllm_server.base_url, interval_s=0.1)
        watcher.join(timeout=10)
        assert not watcher.is_alive()
        assert all(not cores & expected for cores in thread_cores().values())
