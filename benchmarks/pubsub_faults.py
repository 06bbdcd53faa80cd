"""``make bench-pubsub-faults``: a backlog delivered through a Pub/Sub that misbehaves, against the same backlog
through one that does not, interleaved: first the reader's feed alone, then the whole worker VM on the real vLLM.

Each repetition publishes a backlog (ten times the worker's bound) to a fresh subscription of the Pub/Sub emulator
behind the fault proxy (tests/pubsub_fault_proxy.py), once with no faults and once with the stated ones, alternately:

* **The feed** (``--messages``, ``--bound``): the real feed (pipeline/flow/subscription_feed.py) and the real
  admission ledger, rounds played as the reader's DoFn plays them (tests/feed_harness.py). Nothing here is a model:
  the figures are the read path's own (Pub/Sub's and the ledger's).
* **The VM** (``--vm-requests``; ``--vm-repetitions 0`` skips it): the VM stand-in (local/vm_stand_in.py), whose
  SDK processes run the real reader's round (``PullWithinRoomFn.process`` on Beam's tracker, its residual and its
  finalizer), the real parse, admission and generate steps, and the real engine on the local vLLM server. A
  request is delivered when its completion commits; the run ends when every request has, and then each must have
  ended exactly once, gapless, and the runtime's ledger must be back at zero.

It prints per arm the delivered rate (requests ended per second) as median and range, the ratio of the medians,
the most the worker held against its bound, what the ledger held after, and what the proxy did.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time

from local.cpu_server import apply_server_environment
from local.embedded_model import ensure_local_checkpoint
from local.emulators import PubSubEmulator
from local.vm_stand_in import Schedule, VmStandIn
from pipeline.contract.chunking import ChunkPolicy
from pipeline.contract.messages import InferenceRequest
from pipeline.engines.engine_settings import EngineSettings
from pipeline.flow import subscription_feed
from pipeline.serving.vllm_server import VLLMServer
from pipeline.worker.runtime import SharedRuntime
from pipeline.worker.runtime_settings import AdmissionSettings, CallSettings, RuntimeSettings
from tests.conftest import SERVED_NAME, local_server_spec
from tests.feed_harness import a_feed, a_worker, held, publish, serve_rounds, short_deadline_subscription
from tests.pubsub_fault_proxy import FaultProxy, Faults

FAULTS = {"none": Faults(),
          "stated": Faults(short=0.3, error=0.2, slow=0.05, slow_s=1.0, lost=0.05, ack_error=0.1)}


def one_run(emulator: PubSubEmulator, proxy: FaultProxy, faults: Faults, messages: int, bound: int,
            run: int) -> dict[str, float]:
    topic, path = short_deadline_subscription(emulator, f"bench-faults-{run}-{time.monotonic_ns()}")
    expected = set(publish(topic, messages))
    proxy.faults = faults
    before = sum(proxy.done.values())
    source = a_worker(bound=bound)
    feed = a_feed(path, source, proxy)
    started = time.monotonic()
    try:
        served = serve_rounds(feed, source, expected, timeout_s=600)
    finally:
        took = time.monotonic() - started
        feed.stop()
    return {"rate": len(served.ended) / took, "ended": len(served.ended), "most": served.most,
            "uncounted": served.uncounted, "left": held(source), "faults": sum(proxy.done.values()) - before}


def vm_settings(base_url: str) -> RuntimeSettings:
    """The VM's runtime: a bound of 6 (4 in flight, 2 waiting), as tests/test_vm_stand_in.py runs it."""
    engine = EngineSettings(server=None, server_url=base_url, served_model_name=SERVED_NAME, max_in_flight=4,
                            request_timeout_s=120, chunk_policy=ChunkPolicy(chunk_tokens=4, interval_ms=100))
    return RuntimeSettings(engine, AdmissionSettings(worker_queue=2, transit_s=60.0),
                           CallSettings(harness_threads=2, bound_s=5.0))


def vm_run(vm: VmStandIn, emulator: PubSubEmulator, proxy: FaultProxy, faults: Faults, count: int,
           run: int) -> dict[str, float]:
    name = f"bench-vm-{run}-{time.monotonic_ns()}"
    topic, subscription = short_deadline_subscription(emulator, name)  # the VM's READ_ACK_DEADLINE_S
    sent = [InferenceRequest(id=f"{name}-{i}", prompt=f"Count from {i} upwards, in words.", max_tokens=16,
                             min_tokens=16, temperature=0, received_at=time.time()) for i in range(count)]
    proxy.faults = faults
    before = sum(proxy.done.values())
    vm.reset(Schedule(seed=run), topic, subscription)
    vm.publish(sent)
    started = time.monotonic()
    ids = {r.id for r in sent}
    if not vm.run_until(lambda: ids <= vm.ended, timeout_s=600):
        raise RuntimeError(f"{len(ids - vm.ended)} of {count} requests never ended")
    took = time.monotonic() - started
    vm.run_until_idle()
    ended = [c["id"] for c in vm.committed.completions] + [d["id"] for d in vm.committed.dead_letters]
    if sorted(ended) != sorted(ids):
        raise RuntimeError(f"not each request ended once: {len(ended)} endings of {count}")
    most, deferred = max(vm.holds), vm.deferred
    # The readers' feeds stop, each giving back the places it keeps open once its long pull under way ends.
    vm.reset(Schedule())
    runtime = SharedRuntime(vm.settings, vm.tag).acquire()
    stopped = time.monotonic()
    while (left := _held(runtime.load())) and time.monotonic() < stopped + subscription_feed.PULL_DEADLINE_S + 10:
        time.sleep(0.2)
    return {"rate": count / took, "ended": len(ended), "most": most, "left": left,
            "zero_after_s": time.monotonic() - stopped if not left else None,
            "faults": sum(proxy.done.values()) - before, "deferred": deferred}


def _held(load: dict[str, int | None]) -> int:
    """What the worker's ledger counts: its streams, what waits in state and what is on its way in places."""
    return int(load["held"] or 0) + int(load["on_the_way"] or 0)


def table(results: dict[str, list[dict[str, float]]], bound: int) -> None:
    print("| Pub/Sub | delivered req/s, median (range) | most held / bound | ledger after | faults injected |")
    print("|---|---|---|---|---|")
    medians = {}
    for arm, runs in results.items():
        rates = [r["rate"] for r in runs]
        medians[arm] = statistics.median(rates)
        print(f"| {arm} | {medians[arm]:.2f} ({min(rates):.2f}-{max(rates):.2f}) | "
              f"{max(r['most'] for r in runs):.0f} / {bound} | {max(r['left'] for r in runs):.0f} | "
              f"{statistics.median(r['faults'] for r in runs):.0f} |")
    print(f"\nfaulty / fault-free delivered rate: {medians['stated'] / medians['none']:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make bench-pubsub-faults", description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=100, help="the feed's backlog")
    parser.add_argument("--bound", type=int, default=10, help="the feed's worker bound")
    parser.add_argument("--repetitions", type=int, default=3, help="the feed's interleaved repetitions")
    parser.add_argument("--vm-requests", type=int, default=60, help="the VM's backlog (its bound is 6)")
    parser.add_argument("--vm-repetitions", type=int, default=3, help="the VM's interleaved repetitions (0: none)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    feed: dict[str, list[dict[str, float]]] = collections.defaultdict(list)
    vm_results: dict[str, list[dict[str, float]]] = collections.defaultdict(list)
    bound = 0
    with PubSubEmulator() as emulator:
        emulator.activate()
        proxy = FaultProxy(os.environ["PUBSUB_EMULATOR_HOST"], seed=args.seed)
        try:
            for run in range(args.repetitions):
                for arm, faults in FAULTS.items():  # interleaved: each repetition runs both arms
                    feed[arm].append(one_run(emulator, proxy, faults, args.messages, args.bound, run))
                    print(f"  feed run {run} {arm}: {feed[arm][-1]}", flush=True)
            if args.vm_repetitions:
                apply_server_environment()  # the local CPU settings, as the tests' servers get them
                server = VLLMServer(local_server_spec(ensure_local_checkpoint())).start()
                try:
                    settings = vm_settings(server.base_url)
                    bound = settings.max_held
                    with VmStandIn(settings, processes=2, threads=2, pubsub_host=proxy.host) as vm:
                        for run in range(args.vm_repetitions):
                            for arm, faults in FAULTS.items():
                                vm_results[arm].append(vm_run(vm, emulator, proxy, faults, args.vm_requests, run))
                                print(f"  vm run {run} {arm}: {vm_results[arm][-1]}", flush=True)
                finally:
                    server.stop()
        finally:
            proxy.close()
    print(f"\nfaults 'stated' = {FAULTS['stated']}")
    if feed:
        print(f"\nThe feed: {args.messages} requests, a worker bound of {args.bound}, {args.repetitions} interleaved "
              "repetitions")
        table(feed, args.bound)
    if vm_results:
        print(f"\nThe VM on vLLM: {args.vm_requests} requests of 16 tokens, a worker bound of {bound}, "
              f"{args.vm_repetitions} interleaved repetitions (most held counts streams finished at the engine "
              "and not yet collected: the contract's slack, at most max_in_flight=4; ledger after: once the "
              "readers' feeds stopped and their long pulls ended)")
        table(vm_results, bound)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"args": vars(args), "feed": feed, "vm": vm_results}, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
