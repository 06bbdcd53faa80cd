"""A whole worker VM (local/vm_stand_in.py): real SDK processes, each with a bounded pool of harness threads,
sharing one runtime through MultiProcessShared, around the real admission and generate steps, engine and vLLM.

The backlog is published to the Pub/Sub emulator and read by the job's real reader on every free thread,
through the fault proxy (tests/pubsub_fault_proxy.py). Hypothesis draws the schedules: how often Pub/Sub
misbehaves (short pulls, refused calls, lost answers), failed commits, engine calls that raise, and one event
(none, a paused SDK process, the runtime's host killed, an update), with or without a drain at the end. Three
written-out schedules run by default, the ones whose point is real processes: a backlog through a misbehaving
Pub/Sub with failed commits, the host killed, an update with a drain; the key machine's
side of every event (failing engines, drains, moves, host deaths: tests/test_worker_sim.py) and the worker's
bound under each way threads are handed out (tests/test_vm_sim.py) are proved by the simulators, thousands of
schedules a run. ``VM_STAND_IN_EXAMPLES`` adds that many drawn ones (default 0; each takes about 25 s on 2
cores)."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import defaultdict

import pytest
from google.cloud import pubsub_v1
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from local.vm_stand_in import READ_ACK_DEADLINE_S, Schedule, VmStandIn
from pipeline.contract.chunking import ChunkPolicy
from pipeline.contract.messages import STAGE_DRAIN, STAGE_INFERENCE, STAGE_PARSE, InferenceRequest
from pipeline.engines.engine_settings import EngineSettings
from pipeline.serving.vllm_server import is_healthy, server_metrics
from pipeline.worker.runtime_settings import AdmissionSettings, CallSettings, RuntimeSettings
from tests.conftest import SERVED_NAME, local_server_spec, wait_until
from tests.pubsub_fault_proxy import FaultProxy, Faults

pytestmark = pytest.mark.engine
LEASE_S = 6.0  # a key polls nothing while its work item runs: seen to take 4 s on a loaded machine (docs/testing.md)
PROCESSES, THREADS = 2, 2
EXAMPLES = int(os.environ.get("VM_STAND_IN_EXAMPLES", "0"))
RUNS = iter(range(10**6))


def vm_settings(base_url: str, call_bound_s: float = 5.0, **engine) -> RuntimeSettings:
    values = dict(server=None, server_url=base_url, served_model_name=SERVED_NAME, max_in_flight=4,
                  request_timeout_s=120, stream_lease_s=LEASE_S,
                  chunk_policy=ChunkPolicy(chunk_tokens=4, interval_ms=100))
    return RuntimeSettings(EngineSettings(**{**values, **engine}), AdmissionSettings(worker_queue=2, transit_s=60.0),
                           CallSettings(harness_threads=THREADS, bound_s=call_bound_s))


def requests(prefix: str, count: int, tokens: int) -> list[InferenceRequest]:
    return [InferenceRequest(id=f"{prefix}-{i}", prompt=f"Count from {i} upwards, in words.", max_tokens=tokens,
                             min_tokens=tokens, temperature=0, received_at=time.time()) for i in range(count)]


def generated_tokens(base_url: str) -> float:
    return server_metrics(base_url, ("vllm:generation_tokens_total",))["vllm:generation_tokens_total"]


def assert_each_ends_once_and_whole(vm: VmStandIn, sent: list[InferenceRequest], *,
                                    letters: bool = False) -> dict[str, dict]:
    """Each request ends as exactly one completion or (where allowed) one dead letter; each completion's stream
    is gapless and adds up to its text. (What was published as no request is the parse step's: not counted.)"""
    ended = [c["id"] for c in vm.committed.completions] + [d["id"] for d in requests_letters(vm)]
    assert sorted(ended) == sorted(r.id for r in sent), (len(ended), len(sent))
    if not letters:
        assert not requests_letters(vm), requests_letters(vm)
    streams: dict[str, dict[int, str]] = defaultdict(dict)
    for chunk in vm.committed.chunks:
        assert streams[chunk["stream"]].setdefault(chunk["seq"], chunk["text"]) == chunk["text"]
    completions = {c["id"]: c for c in vm.committed.completions}
    for completion in completions.values():
        chunks = streams[completion["stream"]]
        assert sorted(chunks) == list(range(len(chunks))), completion["id"]
        assert "".join(chunks[seq] for seq in sorted(chunks)) == completion["text"], completion["id"]
    return completions


def requests_letters(vm: VmStandIn) -> list[dict]:
    return [d for d in vm.committed.dead_letters if d["stage"] != STAGE_PARSE]


def acknowledged_ids(proxy: FaultProxy) -> set[str]:
    """What the emulator acknowledged, by request id (or, for a message that is no request, its text)."""
    found = set()
    for data in proxy.acknowledged():
        try:
            found.add(json.loads(data)["id"])
        except (ValueError, KeyError, TypeError):
            found.add(data.decode(errors="replace"))
    return found


def streams_on_each_process(vm: VmStandIn, prefix: str, tokens: int) -> tuple[int, list[InferenceRequest]]:
    """Four requests on keys ``<prefix><n>``, alternately on the runtime's host and the other process, left running
    for a second: the host, and what was sent (every stream still running: the premise of what comes next)."""
    host = vm.host()
    sent = requests(prefix, 4, tokens)
    for n, request in enumerate(sent):
        vm.assign(f"{prefix}{n}", (host + n) % 2)
        vm.deliver(f"{prefix}{n}", [request])
    vm.run_for(1.0)
    assert not vm.ended & {r.id for r in sent}, "the premise: every stream still runs"
    return host, sent


@pytest.fixture(scope="module")
def proxy(emulator):
    """The fault proxy the VM's readers reach Pub/Sub through; each schedule sets its faults."""
    made = FaultProxy(os.environ["PUBSUB_EMULATOR_HOST"], seed=7)
    yield made
    made.close()


@pytest.fixture(scope="module")
def vm(vllm_server, proxy):
    with VmStandIn(vm_settings(vllm_server.base_url), processes=PROCESSES, threads=THREADS,
                   pubsub_host=proxy.host) as stand_in:
        yield stand_in


def new_schedule(vm: VmStandIn, emulator, proxy: FaultProxy, run: int, schedule: Schedule,
                 pubsub_faults: float = 0.0) -> None:
    """The VM on a schedule of its own, reading a topic of its own through a Pub/Sub that misbehaves that often:
    short pulls at ``pubsub_faults``, refused calls and lost answers at a third of it each."""
    name = f"vm-stand-in-{run}"
    topic, subscription = emulator.create_topic(name), emulator.subscription(f"{name}-sub")
    subscriber = pubsub_v1.SubscriberClient()  # what a lost answer leased comes back within seconds
    subscriber.create_subscription(request={"name": subscription, "topic": topic,
                                            "ack_deadline_seconds": READ_ACK_DEADLINE_S})
    subscriber.close()
    proxy.faults = Faults(short=pubsub_faults, error=pubsub_faults / 3, lost=pubsub_faults / 3,
                          ack_error=pubsub_faults / 3, only=frozenset({"Pull", "ModifyAckDeadline", "Acknowledge"}))
    vm.reset(schedule, topic, subscription)


@settings(max_examples=max(EXAMPLES, 1), phases=tuple(Phase) if EXAMPLES else (Phase.explicit,), deadline=None,
          derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
# What real processes add: failed commits across SDK processes, the host's death, an update and its drain. A
# paused process is the next test's (its streams still run through the pause: the stronger premise).
@example(pubsub_faults=0.3, commit_failures=0.2, engine_failures=0.0, event="none", drain=False)
@example(pubsub_faults=0.0, commit_failures=0.2, engine_failures=0.0, event="kill", drain=False)
@example(pubsub_faults=0.3, commit_failures=0.0, engine_failures=0.0, event="update", drain=True)
@given(pubsub_faults=st.sampled_from([0.0, 0.3]), commit_failures=st.sampled_from([0.0, 0.2]),
       engine_failures=st.sampled_from([0.0, 0.05]), event=st.sampled_from(["none", "pause", "kill", "update"]),
       drain=st.booleans())
def test_every_drawn_schedule_keeps_the_vms_promises(vm, vllm_server, emulator, proxy, pubsub_faults,
                                                      commit_failures, engine_failures, event, drain):
    """Whatever the schedule, with a backlog ten times the worker's bound: each request ends once (a completion,
    or a drain or lost-stream dead letter), streams gapless; no key is left holding anything (every timer
    committed); what the VM took from the backlog and has not ended stays within the bound plus the stated slack;
    a full worker's reads take nothing and defer, and no read fails; timers get a thread within one work item;
    and without a move, a host death or a failing engine, nothing is generated twice."""
    run, faults_before = next(RUNS), proxy.counts()
    new_schedule(vm, emulator, proxy, run, Schedule(commit_failure_rate=commit_failures,
                                                    engine_failure_rate=engine_failures, seed=run), pubsub_faults)
    sent = requests(f"vm{run}", 10 * vm.settings.max_held, 8)
    before = generated_tokens(vllm_server.base_url)
    malformed = f'{{"id": "vm{run}-cut", "prompt": '  # JSON cut short: the parse step makes it a dead letter
    vm.publish_raw(malformed.encode())
    vm.publish(sent)
    vm.run_for(1.5)
    if event == "pause":
        vm.pause(1)
        vm.run_for(3 * LEASE_S)
        vm.resume(1)
    elif event == "kill":
        vm.kill(vm.host())
    elif event == "update":
        vm.update()
    if drain:
        vm.run_for(0.5)
        vm.drain()
        sent = [r for r in sent if r.id in vm.taken]  # the rest stays in the subscription for the next job
    else:
        vm.run_until_idle()
    if not drain:
        # Nothing ended is left to come back: each message is acknowledged, one whose acknowledgement failed once
        # Pub/Sub delivers it again and the job's dedupe serves it (the readers read on as a job's do).
        vm.keep_reading = True
        ended = {r.id for r in sent} | {malformed}
        assert vm.run_until(lambda: ended <= acknowledged_ids(proxy), timeout_s=3 * READ_ACK_DEADLINE_S + 30), (
            sorted(ended - acknowledged_ids(proxy)), dict(proxy.counts() - faults_before))
        vm.keep_reading = False
        vm.run_until_idle()
    completions = assert_each_ends_once_and_whole(vm, sent, letters=drain or engine_failures > 0)
    for letter in vm.committed.dead_letters:
        assert letter["stage"] in (STAGE_DRAIN, STAGE_INFERENCE, STAGE_PARSE), letter
    parsed = [d for d in vm.committed.dead_letters if d["stage"] == STAGE_PARSE]
    # Read (always, without a drain): its dead letter, and again only if Pub/Sub delivered it again (an
    # acknowledgement that failed): a message that is no request has no id for the dedupe to know it by.
    assert {d["payload"] for d in parsed} == ({malformed} if not drain or malformed not in vm.unread else set()), parsed
    assert not vm.busy(), "every key's timers committed; nothing left holding"

    settings_ = vm.settings
    # Stated slack (docs/contract.md): streams finished at the engine and not yet collected (at most max_in_flight;
    # they leave the engine's count before their key's).
    assert max(vm.holds) <= settings_.max_held + settings_.engine.max_in_flight, (max(vm.holds), settings_.max_held)
    if not (drain and event == "update"):  # a drain soon after an update may end the reading before it fills
        assert max(vm.holds) >= settings_.max_held, ("the backlog filled the worker", vm.rounds)
        assert vm.deferred > 0, ("a full worker's reads took nothing and deferred", vm.rounds, proxy.counts())
    if event in ("none", "pause"):
        assert not vm.retried, "no work item failed: reads defer, they do not fail"
    # While reading and undisturbed (no pause, kill or update since the timer was due): a thread frees within one
    # work item. A work item waits for the runtime at most its calls' bound_s (pipeline/worker/runtime_client.py;
    # a host slow to answer, as a loaded 2-core machine's can be, costs the whole bound);
    # three seconds more for the rest of a busy 2-core machine's work item and its dispatch.
    longest = sorted(vm.work_items, reverse=True)[:3]
    assert max(vm.timer_delays, default=0.0) <= settings_.calls.bound_s + 3.0, (max(vm.timer_delays), longest)
    attempts = [c["attempt"] for c in completions.values()]
    if event in ("none", "pause") and not engine_failures:
        assert set(attempts) <= {1}, attempts
        assert wait_until(lambda: server_metrics(vllm_server.base_url)["vllm:num_requests_running"] == 0, 30)
        generated = generated_tokens(vllm_server.base_url) - before
        delivered = sum(c["usage"]["completion_tokens"] for c in completions.values())
        assert generated <= 1.05 * delivered, (generated, delivered)
    elif event in ("kill", "update") and not engine_failures:
        assert set(attempts) <= {1, 2}, f"a stream cut by the host's death is sent again once: {attempts}"
    print(f"vm run {run}: Pub/Sub faults {pubsub_faults:g} ({dict(proxy.counts() - faults_before)}), "
          f"{event}{' + drain' if drain else ''}, peak hold {max(vm.holds)} of "
          f"{settings_.max_held}, {vm.deferred} reads deferred, {vm.failed_commits} failed commits, "
          f"{vm.retried} work items retried, attempts {sorted(set(attempts))}, "
          f"{len(vm.committed.dead_letters)} dead letters")


def test_one_sdk_process_paused_longer_than_the_lease_while_another_polls_keeps_its_streams(vm, vllm_server,
                                                                                              emulator, proxy):
    """Process 1 stops (SIGSTOP) for three leases while process 0 polls its own streams the whole time. Each
    stream's lease runs on the clocks of the process that polls it: process 1's are kept, and collected when it
    resumes, not generated again (attempt 1).

    The premise is the runner's: it hands process 0 a work item within a lease throughout. A round of the runner
    itself later than half a lease (the test process starved: CI saw one stall 48 s) lets process 0's streams
    lapse as a worker that polls nothing should, and proves nothing; such a try is played again, up to three."""
    tries = []
    for _ in range(3):
        new_schedule(vm, emulator, proxy, next(RUNS), Schedule())
        tokens = int(80 * LEASE_S)  # all still running after a pause of three leases
        busy, paused = requests(f"busy{len(tries)}", 2, tokens), requests(f"paused{len(tries)}", 2, tokens)
        for n, request in enumerate(busy):
            vm.assign(f"a{n}", 0)
            vm.deliver(f"a{n}", [request])
        for n, request in enumerate(paused):
            vm.assign(f"b{n}", 1)
            vm.deliver(f"b{n}", [request])
        vm.run_for(0.5)
        vm.pause(1)
        paused_at = time.monotonic()
        vm.run_for(3 * LEASE_S)  # process 0 polls throughout: to a VM-wide lease, process 1's keys moved away
        assert vm.busy(), "process 0's streams still run: it polled for the whole pause"
        vm.resume(1)
        resumed_at = time.monotonic()
        vm.run_until_idle()
        stalls = [late for _, late in vm.late_rounds if late > LEASE_S / 2]
        completions = assert_each_ends_once_and_whole(vm, busy + paused)
        attempts = {r.id: completions[r.id]["attempt"] for r in busy + paused}
        tries.append((attempts, stalls))
        if not stalls:
            break
    assert not stalls, f"the runner itself stalled past half a lease in every try: {tries}"
    assert attempts == {r.id: 1 for r in busy + paused}, (
        f"attempts {attempts}; paused at {paused_at:.1f}, resumed at {resumed_at:.1f}; each key's longest time "
        f"unpolled (s, from): {vm.unpolled()}; the runner's late rounds (at, s late): {vm.late_rounds}")


def test_a_managed_vllms_host_paused_then_killed_with_failing_rebuilds_loses_nothing_and_leaks_nothing(
        checkpoint, tmp_path):
    """The runtime's host starts the worker's vLLM itself, as on Dataflow; three things happen to it.

    1. SIGSTOP for three call bounds, then SIGCONT. Every SDK process's keys keep their timers: each work item
       ends within one call bound (its calls count the host as silent, then fail at once while the first
       unanswered call still waits), instead of waiting on the proxy for the whole pause. Silent is not dead:
       nothing reconnects, and every stream goes on (attempt 1).
    2. SIGKILL mid-stream: its vLLM dies with it (the server's parent-death signal).
    3. The model folder is gone meanwhile, so the first two rebuilds fail (a real start that cannot find its model)
       and leave nothing behind; the folder comes back and the next rebuild starts a new vLLM.

    Every request ends once, each cut stream sent again once; nothing is left running (the old server gone, the
    new one idle, one host alive) and no SDK process has more threads than before the kill."""
    bound_s = 1.5
    model = tmp_path / "model"
    model.symlink_to(checkpoint)
    spec = local_server_spec(model, stall_timeout_s=10.0, health_interval_s=1.0)
    settings_ = vm_settings("", server=spec, server_url=None, served_model_name=None, call_bound_s=bound_s)
    with VmStandIn(settings_, processes=PROCESSES, threads=THREADS) as vm:
        _, silent = streams_on_each_process(vm, "silent", 160)
        vm.signal_host(signal.SIGSTOP)
        try:
            seen = len(vm.work_items)
            vm.run_for(3 * bound_s)
        finally:
            vm.signal_host(signal.SIGCONT)
        during = vm.work_items[seen:]
        assert during, "no work item ended while the host was stopped"
        # One bound, and two seconds for a busy 2-core machine; without the bound each waits out the whole pause.
        assert max(seconds for seconds, _, _ in during) <= bound_s + 2.0, during
        vm.run_until_idle()
        completions = assert_each_ends_once_and_whole(vm, silent)
        assert {c["attempt"] for c in completions.values()} == {1}, "a silent host is not rebuilt"

        _, cut = streams_on_each_process(vm, "cut", 128)
        first_url = vm.server_url()
        threads = vm.thread_counts()
        model.unlink()  # the next rebuilds cannot find the model
        killed = vm.signal_host(signal.SIGKILL)
        hosts, deadline = set(), time.monotonic() + 300
        while len(failed := hosts - vm.host_processes() - {killed}) < 2:
            assert time.monotonic() < deadline, f"two failed rebuilds within 300 s: saw hosts {hosts}"
            hosts |= vm.host_processes()
            vm.run_for(0.1)
        model.symlink_to(checkpoint)
        vm.run_until_idle(timeout_s=600)
        completions = assert_each_ends_once_and_whole(vm, silent + cut)
        attempts = {r.id: completions[r.id]["attempt"] for r in cut}
        assert set(attempts.values()) == {2}, f"each stream cut by the kill, and sent again once: {attempts}"
        assert not is_healthy(first_url), "the killed host's vLLM died with it"
        assert len(vm.host_processes()) == 1, (vm.host_processes(), failed)
        second_url = vm.server_url()
        assert second_url != first_url
        assert wait_until(lambda: server_metrics(second_url)["vllm:num_requests_running"] == 0, 30)
        after = vm.thread_counts()
        assert all(after[n] <= threads[n] for n in threads), f"threads before the kill {threads}, after {after}"
