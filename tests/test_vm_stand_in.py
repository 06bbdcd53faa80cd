"""A whole worker VM (local/vm_stand_in.py): real SDK processes sharing one runtime through MultiProcessShared,
around the real generate step, engine and vLLM. One process paused while another polls; the runtime's host
killed mid-stream."""

from __future__ import annotations

import time
from collections import defaultdict

import pytest

from local.vm_stand_in import VmStandIn
from pipeline.contract.chunking import ChunkPolicy
from pipeline.contract.messages import InferenceRequest
from pipeline.engines.engine import EngineSettings
from pipeline.serving.vllm_server import server_metrics
from tests.conftest import SERVED_NAME, wait_until

pytestmark = pytest.mark.engine
LEASE_S = 2.0


def vm_settings(base_url: str) -> EngineSettings:
    return EngineSettings(server=None, server_url=base_url, served_model_name=SERVED_NAME, max_in_flight=8,
                          request_timeout_s=120, stream_lease_s=LEASE_S,
                          chunk_policy=ChunkPolicy(chunk_tokens=4, interval_ms=100))


def requests(prefix: str, count: int, tokens: int) -> list[InferenceRequest]:
    return [InferenceRequest(id=f"{prefix}-{i}", prompt=f"Count from {i} upwards, in words.", max_tokens=tokens,
                             min_tokens=tokens, temperature=0, received_at=time.time()) for i in range(count)]


def assert_each_answered_once_and_whole(vm: VmStandIn, sent: list[InferenceRequest]) -> dict[str, dict]:
    """One completion per request, none lettered; its stream's chunks gapless and adding up to its text."""
    completions = {c["id"]: c for c in vm.committed.completions}
    assert sorted(c["id"] for c in vm.committed.completions) == sorted(r.id for r in sent)
    assert not vm.committed.dead_letters, vm.committed.dead_letters
    streams: dict[str, dict[int, str]] = defaultdict(dict)
    for chunk in vm.committed.chunks:
        assert streams[chunk["stream"]].setdefault(chunk["seq"], chunk["text"]) == chunk["text"]
    for completion in completions.values():
        chunks = streams[completion["stream"]]
        assert sorted(chunks) == list(range(len(chunks))), completion["id"]
        assert "".join(chunks[seq] for seq in sorted(chunks)) == completion["text"], completion["id"]
    return completions


def test_one_sdk_process_paused_longer_than_the_lease_while_another_polls_keeps_its_streams(vllm_server):
    """Process 1 stops (SIGSTOP) for three leases while process 0, the runtime's host, polls its own streams the
    whole time. Each stream's lease runs on the clocks of the process that polls it: process 1's are kept, and
    collected when it resumes, not generated again (attempt 1)."""
    with VmStandIn(vm_settings(vllm_server.base_url), processes=2) as vm:
        busy, paused = requests("busy", 2, 160), requests("paused", 2, 160)  # all still running after the pause
        for n, request in enumerate(busy):
            vm.assign(f"a{n}", 0)
            vm.deliver(f"a{n}", [request])
        for n, request in enumerate(paused):
            vm.assign(f"b{n}", 1)
            vm.deliver(f"b{n}", [request])
        vm.run_for(0.5)
        vm.pause(1)
        vm.run_for(3 * LEASE_S)  # process 0 polls throughout: to a VM-wide lease, process 1's keys moved away
        assert vm.busy(), "process 0's streams still run: it polled for the whole pause"
        vm.resume(1)
        vm.run_until_idle()
        completions = assert_each_answered_once_and_whole(vm, busy + paused)
        assert {r.id: completions[r.id]["attempt"] for r in paused} == {r.id: 1 for r in paused}


def test_the_runtimes_host_killed_mid_stream_is_rebuilt_once_and_every_request_ends_once(vllm_server):
    """SIGKILL of the process that hosts the runtime: its streams die with it (vLLM aborts them as their
    connections close). The other process's next call finds the host gone, reconnects (MultiProcessShared builds
    the runtime anew in it) and sends each lost stream once again; the dead process's keys move to it with their
    committed state. Every request ends once, resent at most once."""
    with VmStandIn(vm_settings(vllm_server.base_url), processes=2) as vm:
        sent = requests("host", 4, 96)
        for n, request in enumerate(sent):
            vm.assign(f"k{n}", n % 2)
            vm.deliver(f"k{n}", [request])
        vm.run_for(1.0)
        vm.kill(0)
        vm.run_until_idle()
        completions = assert_each_answered_once_and_whole(vm, sent)
        attempts = {i: c["attempt"] for i, c in completions.items()}
        assert set(attempts.values()) == {2}, f"each stream cut by the kill, and sent again once: {attempts}"
    assert wait_until(lambda: server_metrics(vllm_server.base_url)["vllm:num_requests_running"] == 0, 30)
