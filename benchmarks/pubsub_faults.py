"""``make bench-pubsub-faults``: the reader's feed delivering a backlog through a Pub/Sub that misbehaves, against
the same backlog through one that does not, interleaved.

Each repetition publishes a backlog (``--messages``, ten times the worker's bound by default) to a fresh
subscription of the Pub/Sub emulator and serves it through the real feed (pipeline/flow/subscription_feed.py) and the
real admission ledger, rounds played as the reader's DoFn plays them (tests/feed_harness.py), behind the fault proxy
(tests/pubsub_fault_proxy.py): once with no faults, once with the faults ``--faults`` names, alternately. It prints
per arm the delivered rate (requests ended per second) as median and range, the ratio of the medians, the most the
worker held against its bound, and what the proxy did. Nothing here is a model: the feed's cost is Pub/Sub's and the
ledger's, so the figures are the read path's own.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time

from local.emulators import PubSubEmulator
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make bench-pubsub-faults", description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=100)
    parser.add_argument("--bound", type=int, default=10)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    results: dict[str, list[dict[str, float]]] = collections.defaultdict(list)
    with PubSubEmulator() as emulator:
        emulator.activate()
        proxy = FaultProxy(os.environ["PUBSUB_EMULATOR_HOST"], seed=args.seed)
        try:
            for run in range(args.repetitions):
                for arm, faults in FAULTS.items():  # interleaved: each repetition runs both arms
                    results[arm].append(one_run(emulator, proxy, faults, args.messages, args.bound, run))
                    print(f"  run {run} {arm}: {results[arm][-1]}", flush=True)
        finally:
            proxy.close()
    print(f"\n{args.messages} requests, a worker bound of {args.bound}, {args.repetitions} interleaved repetitions; "
          f"faults 'stated' = {FAULTS['stated']}")
    print("| Pub/Sub | delivered req/s, median (range) | most held / bound | ledger after | faults injected |")
    print("|---|---|---|---|---|")
    medians = {}
    for arm, runs in results.items():
        rates = [r["rate"] for r in runs]
        medians[arm] = statistics.median(rates)
        print(f"| {arm} | {medians[arm]:.1f} ({min(rates):.1f}-{max(rates):.1f}) | "
              f"{max(r['most'] for r in runs):.0f} / {args.bound} | {max(r['left'] for r in runs):.0f} | "
              f"{statistics.median(r['faults'] for r in runs):.0f} |")
    print(f"\nfaulty / fault-free delivered rate: {medians['stated'] / medians['none']:.2f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"args": vars(args), "results": results}, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
