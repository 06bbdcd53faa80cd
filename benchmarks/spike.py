"""A traffic spike on paper: where the backlog waits decides whether Dataflow adds GPU workers.

Arrivals rise tenfold for ten minutes. Three cases meet the same spike:

- ``in state`` (a read that takes whatever the subscription gives, as Dataflow's
  own source does): every worker takes every message at once and queues what
  its engine has no room for in keyed state; the subscription's backlog, what
  the autoscaler reads for that source, stays near zero.
- ``in Pub/Sub, seen`` (the job's reader, :mod:`pipeline.flow.subscription_reader`):
  a worker holds at most ``max_in_flight + worker_queue`` requests; the rest is
  never pulled and stays in the subscription, and the autoscaler is assumed to
  see it through the size the reader reports (not documented for a Python
  splittable DoFn: docs/operations.md says how a first job checks it).
- ``in Pub/Sub, unseen``: the same reader, if the autoscaler does not weigh that
  size: the job keeps the workers it has.

The autoscaler is modelled from Dataflow's published behaviour, with the
assumptions this file makes marked as such (see ``--help`` and the docs):
a job that stays backlogged (backlog > ``--backlog-threshold-s`` seconds of
work at its current throughput) for ``--decision-delay-s`` scales up to the
workers that would serve the arrivals and clear the backlog in about 150 s
("Horizontal Autoscaling", earlier revision: "targets clearing the backlog in
approximately 150 seconds after scaling up"), capped by ``max_num_workers``;
a new GPU worker serves after ``--worker-start-s`` (VM, image, weights: an
assumption). It scales down after as long without backlog, to the workers that
serve the arrivals at 75 % ("after scaling down, workers utilize on average 75 %").

Per case: the peak backlog the autoscaler sees, the most workers it runs,
when the queue is back to what the workers hold (drain), the time to first
chunk of a request that arrives as the spike ends (FIFO wait + ``--ttft-s``),
GPU worker-hours, and what holding the backlog in Pub/Sub costs: while the
workers are full, every reader runs a round that takes nothing every
``FULL_DELAY_S`` (a work item that ends at once, no error), holding a harness
thread for ``--round-s`` (a lock on what its process's feed pulled); the log gets
at most one line a minute per SDK process. A second table gives what the read
path spends per second on a job of ``--cost-workers`` workers, idle and full:
readers' work items, pull calls (one feed a subscription and SDK process, each
with one long pull open while there is room: :mod:`pipeline.flow.subscription_feed`),
and the threads it keeps. Needs no cloud: ``python -m benchmarks.spike``.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from pipeline.contract.parameters import PARAMETERS
from pipeline.flow.subscription_feed import FULL_WAIT_S, PULL_DEADLINE_S, PULL_EVERY_S, PULL_FIRST
from pipeline.flow.subscription_reader import EMPTY_DELAY_S, FULL_DELAY_S, readers_for

DEFAULTS = {p.name: p.default for p in PARAMETERS}
CLEAR_BACKLOG_S = 150.0


@dataclass(frozen=True)
class Outcome:
    design: str
    peak_visible_backlog: int
    peak_held_in_state: int
    max_workers: int
    drained_after_s: float | None  # from the spike's start
    ttft_at_peak_s: float | None
    worker_hours: float
    deferred_rounds: int  # readers' rounds that took nothing while the workers were full (work items, no error)
    round_thread_s: float  # harness-thread seconds those rounds held


def simulate(design: str, args: argparse.Namespace) -> Outcome:
    """Steps of one second: arrivals, service at each serving worker's rate, the autoscaler's rule."""
    hold = args.max_in_flight + args.worker_queue
    workers, booting = args.workers, []  # booting: times at which added workers start serving
    queue = 0.0  # requests arrived and not yet finished (held by workers, waiting in state, or in Pub/Sub)
    arrived = started = 0.0
    backlogged_since: float | None = None
    quiet_since: float | None = None
    peak_visible = peak_held = max_workers = 0
    drained_at: float | None = None
    marker: float | None = None  # cumulative arrivals when the marked request (at the spike's end) arrives
    marker_started_at: float | None = None
    worker_seconds = deferred = 0.0
    readers = readers_for(args.max_num_workers)
    spike_end = args.spike_at_s + args.spike_s
    for t in range(int(args.duration_s)):
        workers += sum(1 for at in booting if at == t)
        booting = [at for at in booting if at > t]
        rate = args.rate * (args.spike_factor if args.spike_at_s <= t < spike_end else 1.0)
        queue += rate
        arrived += rate
        if t == spike_end:
            marker = arrived
        capacity = workers * args.worker_rps
        served = min(queue, capacity)
        in_flight = min(queue - served, workers * args.max_in_flight)
        queue -= served
        started = arrived - queue + in_flight
        if marker is not None and marker_started_at is None and started >= marker:
            marker_started_at = t
        held = queue if design == "in state" else min(queue, workers * hold)
        waiting = queue - held  # in the subscription
        visible = 0.0 if design == "in Pub/Sub, unseen" else waiting
        peak_visible, peak_held = max(peak_visible, int(visible)), max(peak_held, int(held))
        if design != "in state" and waiting > 0:  # every worker full: each reader's round takes nothing
            deferred += readers / FULL_DELAY_S
        worker_seconds += workers + len(booting)
        if t >= spike_end and drained_at is None and queue <= workers * args.max_in_flight:
            drained_at = t - args.spike_at_s
        # The autoscaler sees the subscription's backlog in seconds of work at the current throughput.
        backlog_s = visible / max(capacity, 1e-9)
        if backlog_s > args.backlog_threshold_s:
            backlogged_since = t if backlogged_since is None else backlogged_since
            if t - backlogged_since >= args.decision_delay_s and not booting:
                target = math.ceil((rate + visible / CLEAR_BACKLOG_S) / args.worker_rps)
                target = min(target, args.max_num_workers)
                booting += [t + int(args.worker_start_s)] * max(target - workers, 0)
        else:
            backlogged_since = None
            quiet_since = t if quiet_since is None else quiet_since
            # Scale-down: a couple of minutes without backlog, to the workers that serve arrivals at 75 %.
            if t - quiet_since >= args.decision_delay_s and not booting:
                workers = min(workers, max(args.workers, math.ceil(rate / (0.75 * args.worker_rps))))
        if backlogged_since is not None:
            quiet_since = None
        max_workers = max(max_workers, workers + len(booting))
    ttft = None if marker_started_at is None else marker_started_at - spike_end + args.ttft_s
    return Outcome(design, peak_visible, peak_held, max_workers,
                   None if drained_at is None else float(drained_at), ttft, worker_seconds / 3600, int(deferred),
                   deferred * args.round_s)


# The threads a process's feed of a subscription runs: its own (the long pulls), its acknowledgements'
# (pipeline/flow/feed_acks.py) and its calls to the worker's runtime (feed-dispatch); its backlog's refresh from
# Cloud Monitoring adds a short-lived one once a minute.
FEED_THREADS = 3

def read_costs(workers: int, processes: int, hold: int,
               round_s: float) -> list[tuple[str, float, float, float, float, float]]:
    """Per second, for a job of ``workers`` workers at its ceiling, ``processes`` SDK processes each and a hold of
    ``hold`` requests a worker: (state, readers' work items, harness-thread seconds they hold, pull calls, feed
    threads, calls to the worker's runtime). Idle: as many feeds as the hold has room for ``PULL_FIRST`` places each
    (an idle feed's pull asks for that many) keep one long pull open, which the real service holds to its deadline
    when nothing comes (an assumption: Pub/Sub's pull guide says a pull may wait); the other feeds find no room, ask
    whether the worker is full (it is not) and try again every ``FULL_WAIT_S``; each reader's round finds nothing
    and comes back after ``EMPTY_DELAY_S``. Full: no pull at all; each feed asks for places and whether the worker
    is full every ``FULL_WAIT_S``, each reader's round comes back every ``FULL_DELAY_S``.

    A process has a feed once a reader's round ran in it, so there are at most as many feeds as readers; each
    feed runs ``FEED_THREADS`` threads (its pulls, its acknowledgements, its calls to the runtime). A feed that
    finds no room waits ``FULL_WAIT_S``, and at least ``PULL_EVERY_S`` from its last pull's start."""
    readers = readers_for(workers)
    feeds = min(workers * processes, readers)
    pulling = min(workers * min(processes, hold // PULL_FIRST), feeds)
    asking_every_s = max(FULL_WAIT_S, PULL_EVERY_S)
    idle_items, full_items = readers / EMPTY_DELAY_S, readers / FULL_DELAY_S
    idle_calls = pulling * 2 / PULL_DEADLINE_S + (feeds - pulling) * 2 / asking_every_s  # take + give back; + ask
    threads = feeds * FEED_THREADS
    return [("idle", idle_items, idle_items * round_s, pulling / PULL_DEADLINE_S, threads, idle_calls),
            ("full", full_items, full_items * round_s, 0.0, threads, feeds * 2 / asking_every_s)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=1, help="workers before the spike")
    parser.add_argument("--max-num-workers", type=int, default=8)
    parser.add_argument("--worker-rps", type=float, default=4.0,
                        help="requests a GPU worker finishes per second at saturation (assumption: see the docs)")
    parser.add_argument("--rate", type=float, default=2.4, help="arrivals per second before and after the spike")
    parser.add_argument("--spike-factor", type=float, default=10.0)
    parser.add_argument("--spike-at-s", type=float, default=300.0)
    parser.add_argument("--spike-s", type=float, default=600.0)
    parser.add_argument("--duration-s", type=float, default=3 * 3600.0)
    parser.add_argument("--max-in-flight", type=int, default=DEFAULTS["max_in_flight"])
    parser.add_argument("--worker-queue", type=int, default=DEFAULTS["worker_queue"])
    parser.add_argument("--backlog-threshold-s", type=float, default=10.0,
                        help="backlog (seconds of work) above which a job counts as backlogged (assumption)")
    parser.add_argument("--decision-delay-s", type=float, default=120.0,
                        help="how long a job stays backlogged before it scales up ('a couple of minutes')")
    parser.add_argument("--worker-start-s", type=float, default=360.0,
                        help="from the decision to a new GPU worker serving: VM, image, weights (assumption)")
    parser.add_argument("--ttft-s", type=float, default=0.3, help="time to first chunk once a request starts")
    parser.add_argument("--round-s", type=float, default=0.001,
                        help="how long a reader's round that takes nothing holds a harness thread: a work item that "
                             "takes a lock (assumption)")
    parser.add_argument("--cost-workers", type=int, default=10, help="the job the per-second read costs are for")
    parser.add_argument("--sdk-processes", type=int, default=8,
                        help="SDK processes a worker runs: Dataflow runs one per vCPU for Python (g2-standard-8: 8)")
    args = parser.parse_args(argv)
    outcomes = [simulate(design, args) for design in ("in state", "in Pub/Sub, seen", "in Pub/Sub, unseen")]
    print(f"Spike: {args.rate:g} -> {args.rate * args.spike_factor:g} requests/s for {args.spike_s / 60:g} min; "
          f"{args.workers} worker(s) of {args.worker_rps:g} requests/s, max_num_workers={args.max_num_workers}, "
          f"hold {args.max_in_flight}+{args.worker_queue} a worker; new workers serve after "
          f"{args.worker_start_s / 60:g} min, decisions after {args.decision_delay_s:g} s backlogged")
    print("| backlog waits | peak backlog the autoscaler sees | peak held in state | workers (max) "
          "| drained after spike start | first chunk, request at the spike's end | GPU worker-hours "
          "| reader rounds that took nothing (thread-s they held) |")
    print("|---|---|---|---|---|---|---|---|")
    for o in outcomes:
        drained = "not within the window" if o.drained_after_s is None else f"{o.drained_after_s / 60:.0f} min"
        ttft = "not within the window" if o.ttft_at_peak_s is None else f"{o.ttft_at_peak_s / 60:.1f} min"
        print(f"| {o.design} | {o.peak_visible_backlog:,} | {o.peak_held_in_state:,} | {o.max_workers} | {drained} "
              f"| {ttft} | {o.worker_hours:.2f} | {o.deferred_rounds:,} ({o.round_thread_s:,.0f}) |")
    print(f"\nThe read path per second, a job of {args.cost_workers} workers at its ceiling "
          f"({readers_for(args.cost_workers)} readers, {args.sdk_processes} SDK processes a worker, one subscription):")
    print("| workers | readers' work items/s | harness thread-s/s | pull calls/s | feed threads (not harness) "
          "| calls to the runtime/s |")
    print("|---|---|---|---|---|---|")
    for state, items, held, pulls, threads, asks in read_costs(args.cost_workers, args.sdk_processes,
                                                               args.max_in_flight + args.worker_queue, args.round_s):
        print(f"| {state} | {items:.0f} | {held:.3f} | {pulls:.1f} | {threads:.0f} | {asks:.0f} |")


if __name__ == "__main__":
    main()
