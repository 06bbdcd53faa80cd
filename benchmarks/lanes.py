"""``make bench-lanes``: live traffic alone, and the same live traffic while a backfill fills the bulk lane, for
each way of sharing the server compared: the frontier of live latency against the lane's throughput.

One pipeline per lane in ``--lanes`` (the template on the DirectRunner, its model manager's vLLM server, a
``bulk_subscription``: docs/operations.md#the-bulk-lane): ``adaptive`` (the live objectives' governor,
pipeline/engines/lane_governor.py, at the template's objectives), ``adaptive:MS`` (the same with
``live_first_token_slo_ms`` MS), ``adaptive:xR`` (with R times what live's first token takes from its read alone:
the median of the p95s the lanes before it measured alone in this run, so the objective is the goal's ratio in the
governor's terms, and no inter-token objective: the goal is stated for the first chunk), ``whole`` (no objective:
the lane's whole share) and fixed shares of N bulk streams (no objective, ``max_bulk_streams`` N). In each of
``--reps`` repetitions, interleaved across the lanes, each lane's pipeline starts afresh on one Pub/Sub emulator and
stops before the next lane's starts, so that one pipeline and one server are up at a time (seven servers do not fit
in 24 GiB, and an idle local pipeline takes about a quarter of a core), and serves:

- **live alone**: ``--live`` requests published one every ``--live-every-s`` seconds to the input topic, after
  ``--warm-live`` such requests not measured (a fresh pipeline's first requests are slower);
- **beside the lane**: a feeder keeps a backlog on the bulk topic (twice the lane's streams and some, topped up as
  they are answered, so the lane is full throughout, whatever its rate); once its first answer came,
  ``--warm-live`` live requests let a governed lane learn (not measured: the first of them finds the lane at its
  whole share, opened while live was idle, and sheds it to the cap live traffic last left, here the alone phase's,
  as after any idle spell), then the same paced live traffic, measured;
- **the lane alone**: the same backlog with no live traffic, for ``--bulk-alone-s`` from ``IDLE_S`` and a second after
  the last live answer (a governed lane takes its whole share once live has been idle that long).

Every request answers exactly ``--tokens`` (live) or ``--bulk-tokens`` (bulk) tokens (``min_tokens`` equal to
``max_tokens``), so the phases do equal work. Measured from the outputs as a user sees them (the chunks and
completions topics): each live request's first chunk after its publication, as seen on the chunks topic and as
cut at the worker (the chunk's ``emitted_at``: the emulator delivers a sparse topic's messages up to half a second
late, which the lane does not change), its first token from its read (its completion's ``time_to_first_token_ms``:
what the governor's objective bounds) and at the server (less ``queue_ms``, the wait before the server took it),
and its time per token after it (from the engine cutting its first chunk to its last), and the bulk lane's
tokens/s while the measured live traffic runs and alone.
Printed per lane: medians and ranges of those against alone, and of the bulk rate beside live against alone; then
the frontier (each lane's live p95 ratios against its bulk tokens/s) and, for each adaptive lane, the best fixed
share that keeps its ratio (R, or ``--goal``) by each measure, and the adaptive lane against it; ``--plot`` draws
it. Every published request must end with one completion (nothing lost). The launcher keeps the pipeline's threads
off the cores vLLM computes on (:mod:`local.core_placement`), as ``make bench`` places
them. Figures and ratios; nothing is asserted.

A live request beside the lane waits at vLLM for the step in progress and shares every later step with the bulk
streams' rows. On this machine's CPU a step that reads vLLM's default 2,048 tokens of prompt takes seconds, so
the local server reads at most ``--step-tokens`` (256) a step, as a user sets ``--max-num-batched-tokens`` in
``vllm_args`` (docs/operations.md#the-bulk-lane); ``--step-tokens 0`` measures vLLM's default.

    python -m benchmarks.lanes [--reps 2] [--live 40] [--lanes 1,2,4,16,adaptive:x1.2 --plot f.png]
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from local.cpu_server import LOCAL_SERVER
from local.embedded_model import ensure_local_checkpoint
from local.emulators import PubSubEmulator
from local.harness import REPO_ROOT, LocalRun, OutputCollector
from pipeline.engines.lane_governor import IDLE_S

QUESTIONS = ["What is the capital of France?", "Name a primary color.", "What is 7 times 8?", "What do bees make?",
             "Name a planet.", "What is ice made of?"]


def live_requests(rep: int, phase: str, count: int, tokens: int) -> list[dict]:
    return [{"id": f"live-{rep}-{phase}-{i}", "prompt": QUESTIONS[i % len(QUESTIONS)], "max_tokens": tokens,
             "min_tokens": tokens, "temperature": 0} for i in range(count)]


def bulk_requests(rep: int, phase: str, count: int, tokens: int, first: int = 0) -> list[dict]:
    return [{"id": f"bulk-{rep}-{phase}-{i}", "prompt": f"Write a short story about a lighthouse keeper, part {i}.",
             "max_tokens": tokens, "min_tokens": tokens, "temperature": 0} for i in range(first, first + count)]


class BulkFeeder:
    """Keeps ``depth`` bulk requests unanswered on the bulk topic (topping it up every 0.2 s as the lane answers
    them), so the lane stays full through every phase whatever its rate, and what is left to drain after is small
    for a small lane."""

    def __init__(self, run: LocalRun, collector: OutputCollector, rep: int, phase: str, depth: int,
                 tokens: int) -> None:
        self.run, self.collector, self.rep, self.phase, self.depth, self.tokens = \
            run, collector, rep, phase, depth, tokens
        self.ids: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._feed, name="bulk-feeder", daemon=True)

    def start(self) -> BulkFeeder:
        self._thread.start()
        return self

    def _feed(self) -> None:
        while not self._stop.is_set():
            unanswered = len(set(self.ids) - self.collector.finished_ids())
            if unanswered < self.depth:
                more = bulk_requests(self.rep, self.phase, self.depth - unanswered, self.tokens, len(self.ids))
                self.run.publish(more, kind="bulk")
                self.ids += [request["id"] for request in more]
            self._stop.wait(0.2)

    def stop(self) -> list[str]:
        """Stops topping up; returns every bulk request published."""
        self._stop.set()
        self._thread.join()
        return list(self.ids)


def publish_paced(run: LocalRun, requests: list[dict], every_s: float) -> dict[str, float]:
    """Publishes one request every ``every_s``; returns when each was published."""
    published = {}
    for request in requests:
        run.publish([request])
        published[request["id"]] = time.time()
        time.sleep(every_s)
    return published


def first_chunks_cut(collector: OutputCollector, published: dict[str, float]) -> list[float]:
    """Per live request, s from its publication to the worker's engine cutting its first chunk (the chunk's
    ``emitted_at``): its first chunk less the way out through Pub/Sub, which on the emulator delivers a sparse
    topic's messages up to half a second late (seen alone, not beside a busy lane) and which the lane does not
    change."""
    cut: dict[str, float] = {}
    for chunk in list(collector.chunks):
        request_id = chunk.data["id"]
        if request_id in published:
            cut[request_id] = min(cut.get(request_id, chunk.data["emitted_at"]), chunk.data["emitted_at"])
    return [cut[i] - published[i] for i in published if i in cut]


def first_chunks(collector: OutputCollector, published: dict[str, float]) -> list[float]:
    first: dict[str, float] = {}
    for chunk in list(collector.chunks):
        request_id = chunk.data["id"]
        if request_id in published:
            first[request_id] = min(first.get(request_id, chunk.at), chunk.at)
    return [first[i] - published[i] for i in published if i in first]


def inter_token_ms(collector: OutputCollector, published: dict[str, float]) -> list[float]:
    """Per live request, its time per token after its first chunk (ms): from the engine cutting its first chunk
    to cutting its last, over the tokens between (each stream once; its last attempt's chunks)."""
    spans: dict[str, dict[int, tuple[float, int]]] = {}
    ids: dict[str, str] = {}
    for chunk in list(collector.chunks):
        data = chunk.data
        if data["id"] in published:
            spans.setdefault(data["stream"], {})[data["seq"]] = (data["emitted_at"], data["tokens"])
            ids[data["stream"]] = data["id"]
    per_request: dict[str, float] = {}
    for stream, chunks in spans.items():
        first, last = chunks[min(chunks)], chunks[max(chunks)]
        if last[1] > first[1]:
            per_request[ids[stream]] = (last[0] - first[0]) * 1000.0 / (last[1] - first[1])
    return list(per_request.values()) or [float("nan")]


def tokens_between(collector: OutputCollector, prefix: str, start: float, end: float) -> int:
    """Tokens delivered by the requests whose ids start with ``prefix``, cut in chunks that arrived between start
    and end: of the streams their completions name (an attempt a lane shed and started over, or any attempt
    that did not finish, delivered nothing)."""
    delivered = {c.data["stream"] for c in list(collector.completions) if c.data["id"].startswith(prefix)}
    seen: dict[tuple[str, int], int] = {}
    total = 0
    for chunk in sorted(list(collector.chunks), key=lambda c: (c.data["stream"], c.data["seq"])):
        data = chunk.data
        if not data["id"].startswith(prefix) or data["stream"] not in delivered:
            continue
        key = (data["stream"], data["seq"])
        if key in seen:
            continue  # at-least-once: the same chunk again
        before = seen.get((data["stream"], data["seq"] - 1), 0)
        seen[key] = data["tokens"]
        if start <= chunk.at <= end:
            total += data["tokens"] - before
    return total


def where_time_went(collector: OutputCollector, published: dict[str, float]) -> str:
    """Per live request, in seconds: from its read to the engine taking it (``queue_ms``), from its read to its first
    token, and from the engine cutting its first chunk to the chunk arriving on the topic (publishing)."""
    completions = {c.data["id"]: c.data for c in list(collector.completions) if c.data["id"] in published}
    first: dict[str, tuple[float, float]] = {}
    for chunk in list(collector.chunks):
        data = chunk.data
        if data["id"] in published and data["seq"] == 0 and data["id"] not in first:
            first[data["id"]] = (data["emitted_at"], chunk.at)
    parts = []
    for request_id in sorted(completions, key=lambda i: published[i]):
        data = completions[request_id]
        cut, seen = first.get(request_id, (float("nan"), float("nan")))
        parts.append(f"{data['queue_ms'] / 1000:.1f}/{(data['time_to_first_token_ms'] or float('nan')) / 1000:.1f}/"
                     f"{seen - cut:.1f}")
    return ", ".join(parts)


def ended(collector: OutputCollector, ids: list[str], timeout_s: float) -> None:
    missing = collector.wait_for(ids, timeout_s)
    if missing:
        raise RuntimeError(f"{len(missing)} requests had no outcome (lost?), e.g. {sorted(missing)[:3]}")
    answered = [c.data["id"] for c in collector.completions if c.data["id"] in set(ids)]
    if sorted(set(answered)) != sorted(ids):
        raise RuntimeError("a request ended without a completion: " +
                           str(sorted(set(ids) - set(answered))[:3]))


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(share * len(ordered)), len(ordered) - 1)]


def spread(values: list[float], unit: str = "") -> str:
    return f"{statistics.median(values):.2f}{unit} ({min(values):.2f}-{max(values):.2f})"


FIGURES = ("alone p50", "alone p95", "beside p50", "beside p95", "alone inter p50", "alone inter p95",
           "beside inter p50", "beside inter p95", "bulk beside", "bulk alone", "live tokens/s", "alone server p95",
           "beside server p95", "alone cut p95", "beside cut p95", "alone read p95", "beside read p95")
WHOLE_SHARE = 48  # the lane's whole share at the template's defaults: max_in_flight 64 less live_reserve 0.25
OBJECTIVES_OFF = ("--live_first_token_slo_ms=0", "--live_inter_token_slo_ms=0")


def lane_args(lane: str, alone_read_p95_ms: list[float] | None = None) -> list[str]:
    """The template parameters of one lane compared: ``adaptive`` (the governor, at the objectives the template
    arguments give or its defaults), ``adaptive:MS`` (the governor with ``live_first_token_slo_ms`` MS),
    ``adaptive:xR`` (with R times live's own first token from its read, the median of the p95s measured alone so
    far in this run: ``alone_read_p95_ms``), ``whole`` (no objective: the lane's whole share), or a number N (no
    objective, ``max_bulk_streams`` N: a fixed share)."""
    if lane == "adaptive":
        return []
    kind, _, value = lane.partition(":")
    if kind == "adaptive" and value.isdigit():
        return [f"--live_first_token_slo_ms={int(value)}"]
    if kind == "adaptive" and value.startswith("x") and calibrated(value):
        # The goal is stated for the first chunk: the calibrated lane follows that objective alone, as the fixed
        # shares it is weighed against follow none.
        if not alone_read_p95_ms:
            return [f"--live_first_token_slo_ms=(R x live alone from its read, R={value[1:]})", OBJECTIVES_OFF[1]]
        return [f"--live_first_token_slo_ms={round(float(value[1:]) * statistics.median(alone_read_p95_ms))}",
                OBJECTIVES_OFF[1]]
    if lane == "whole":
        return list(OBJECTIVES_OFF)
    if lane.isdigit() and int(lane) >= 1:
        return [*OBJECTIVES_OFF, f"--max_bulk_streams={int(lane)}"]
    raise SystemExit(f"--lanes: {lane!r} is not adaptive, adaptive:MS, adaptive:xR, whole or a number of bulk "
                     "streams of at least 1")


def calibrated(value: str) -> bool:
    try:
        return float(value[1:]) > 0
    except ValueError:
        return False


def adaptive(lane: str) -> bool:
    return lane == "adaptive" or lane.startswith("adaptive:")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--live", type=int, default=40, help="live requests measured a phase")
    parser.add_argument("--warm-live", type=int, default=10,
                        help="live requests sent before those measured alone and beside the lane (not measured)")
    parser.add_argument("--live-every-s", type=float, default=0.75)
    parser.add_argument("--tokens", type=int, default=16, help="each live answer's tokens")
    parser.add_argument("--bulk-tokens", type=int, default=32)
    parser.add_argument("--bulk-alone-s", type=float, default=15.0,
                        help="how long the lane's rate alone is measured after the live traffic")
    parser.add_argument("--step-tokens", type=int, default=256,
                        help="vLLM's --max-num-batched-tokens, the most prompt a step reads (0: vLLM's default)")
    parser.add_argument("--lanes", default="4,adaptive:x1.2",
                        help="comma-separated lanes, one pipeline each, their repetitions interleaved: 'adaptive' "
                             "(the live objectives' governor), 'adaptive:MS' (the governor with "
                             "live_first_token_slo_ms MS), 'adaptive:xR' (with R times live's first token from "
                             "its read alone, measured by the lanes before it), 'whole' (no objective, the lane's "
                             "whole share), or N (no objective, a fixed share of N bulk streams: max_bulk_streams), "
                             "e.g. 1,2,4,16,adaptive:x1.2 for the frontier")
    parser.add_argument("--goal", type=float, default=1.2,
                        help="the live first chunk p95 ratio (beside / alone) the frontier's best fixed share keeps")
    parser.add_argument("--plot", type=Path, default=None, help="draw the frontier to this PNG")
    parser.add_argument("--template-arg", action="append", default=[], metavar="--NAME=VALUE",
                        help="a template parameter for every pipeline (repeat), e.g. --live_first_token_slo_ms=600")
    args = parser.parse_args(argv)
    lanes = [value.strip() for value in args.lanes.split(",") if value.strip()]
    for lane in lanes:
        lane_args(lane)  # a lane that is none of the kinds stops the run before anything starts
    # The calibrated lanes go last in each repetition: they take their objective from the lanes' alone phases before.
    lanes = [lane for lane in lanes if ":x" not in lane] + [lane for lane in lanes if ":x" in lane]
    if lanes and ":x" in lanes[0]:
        raise SystemExit("--lanes: an adaptive:xR lane takes its objective from another lane's alone phase: name one")
    logging.basicConfig(level=logging.WARNING)
    folder = REPO_ROOT / ".cache" / "bench-lanes"
    folder.mkdir(parents=True, exist_ok=True)
    server = (replace(LOCAL_SERVER, extra_args=("--max-num-batched-tokens", str(args.step_tokens)))
              if args.step_tokens else LOCAL_SERVER)
    figures: dict[str, dict[str, list[float]]] = {lane: {name: [] for name in FIGURES} for lane in lanes}
    used: dict[str, list[str]] = {}  # each lane's template parameters, a calibrated one's every repetition's
    emulator = PubSubEmulator()
    emulator.start()
    try:
        for rep in range(args.reps):
            for lane in lanes:  # interleaved: one pipeline, started afresh, works at a time
                measured = [p for mine in figures.values() for p in mine["alone read p95"]]
                this = lane_args(lane, measured)
                used[lane] = list(dict.fromkeys([*used.get(lane, []), *this]))
                run = LocalRun([f"--model={ensure_local_checkpoint()}", "--served_model_name=smollm2",
                                *server.template_args(), "--chunk_tokens=4", *args.template_arg, *this],
                               log_path=folder / f"pipeline-{lane}-{rep}.log", emulator=emulator, bulk_lane=True)
                run.start()
                collector = run.collector()
                try:
                    first = live_requests(-1, f"first{lane}-{rep}", 1, 1)  # the server up, the job reading
                    run.publish(first)
                    ended(collector, [first[0]["id"]], 900)
                    warm = live_requests(-1, f"warm{lane}-{rep}", args.warm_live, args.tokens)  # not measured
                    ended(collector, list(publish_paced(run, warm, args.live_every_s)), 600)
                    one_repetition(run, collector, rep, f"{lane}-", args, figures[lane], lane)
                    verdict = objective_verdict(this, figures[lane])
                    if verdict:
                        print(f"[{lane}] rep {rep + 1}: {verdict}", flush=True)
                finally:
                    collector.stop()
                    run.stop()
    finally:
        emulator.stop()
    for lane in lanes:
        report(args, figures[lane], lane, used.get(lane, []))
    points = frontier(figures)
    print(frontier_table(points, args.goal))
    if args.plot is not None:
        plot(points, args.goal, args.plot)
        print(f"\nThe frontier: {args.plot}")
    return 0


def first_token_completions(collector: OutputCollector, published: dict[str, float]) -> list[dict]:
    """The completions of these live requests that tell when their first token came."""
    return [c.data for c in list(collector.completions)
            if c.data["id"] in published and c.data.get("time_to_first_token_ms") is not None]


def read_first_tokens(collector: OutputCollector, published: dict[str, float]) -> list[float]:
    """Per live request, ms from the pipeline's read of it to its first token, as its completion tells it: what
    the governor's objective bounds."""
    return [data["time_to_first_token_ms"] for data in first_token_completions(collector, published)]


def server_first_tokens(collector: OutputCollector, published: dict[str, float]) -> list[float]:
    """Per live request, ms from the server taking it to its first token, as its completion tells it (its first
    token after its read less its wait before the server took it): where the steps it shares cost it."""
    return [data["time_to_first_token_ms"] - data["queue_ms"] for data in first_token_completions(collector, published)]


def backlog_depth(lane: str) -> int:
    """How many bulk requests the feeder keeps unanswered: twice the lane's streams and some (the whole share, 48
    at the template's defaults, for the others), so the lane never runs dry and little is left to drain."""
    streams = min(int(lane), WHOLE_SHARE) if lane.isdigit() else WHOLE_SHARE
    return 2 * streams + 8


def one_repetition(run: LocalRun, collector: OutputCollector, rep: int, tag: str, args: argparse.Namespace,
                   figures: dict[str, list[float]], lane: str) -> None:
    """Live alone; then, beside a bulk lane the feeder keeps full, live traffic to warm the lane in (not measured)
    and the measured live traffic; then the lane alone for ``--bulk-alone-s`` (from ``IDLE_S`` and a second after
    the last live answer: a governed lane takes its whole share once live is idle that long)."""
    live = live_requests(rep, f"{tag}alone", args.live, args.tokens)
    published = publish_paced(run, live, args.live_every_s)
    ended(collector, list(published), 600)
    ttft = first_chunks(collector, published)
    print(f"[{lane}] rep {rep + 1}: each live request alone, s (read to the engine / read to its first token / "
          f"first chunk cut to seen on the topic): {where_time_went(collector, published)}", flush=True)
    figures["alone p50"].append(statistics.median(ttft))
    figures["alone p95"].append(percentile(ttft, 0.95))
    figures["alone server p95"].append(percentile(server_first_tokens(collector, published), 0.95))
    figures["alone read p95"].append(percentile(read_first_tokens(collector, published), 0.95))
    figures["alone cut p95"].append(percentile(first_chunks_cut(collector, published), 0.95))
    inter = inter_token_ms(collector, published)
    figures["alone inter p50"].append(statistics.median(inter))
    figures["alone inter p95"].append(percentile(inter, 0.95))

    feeder = BulkFeeder(run, collector, rep, f"{tag}lane", backlog_depth(lane), args.bulk_tokens).start()
    prefix = f"bulk-{rep}-{tag}lane-"
    try:
        until(lambda: any(i in collector.finished_ids() for i in list(feeder.ids)), 600)
        warm = live_requests(rep, f"{tag}warm", args.warm_live, args.tokens)
        ended(collector, list(publish_paced(run, warm, args.live_every_s)), 600)
        live = live_requests(rep, f"{tag}beside", args.live, args.tokens)
        start = time.time()
        published = publish_paced(run, live, args.live_every_s)
        ended(collector, list(published), 600)
        end = time.time()
        time.sleep(IDLE_S + 1.0)
        alone_from = time.time()
        time.sleep(args.bulk_alone_s)
        alone_to = time.time()
    finally:
        ids = feeder.stop()
    ttft = first_chunks(collector, published)
    print(f"[{lane}] rep {rep + 1}: each live request beside the backfill, s (read to the engine / read to its "
          f"first token / first chunk cut to seen on the topic): {where_time_went(collector, published)}", flush=True)
    figures["beside p50"].append(statistics.median(ttft))
    figures["beside p95"].append(percentile(ttft, 0.95))
    figures["beside server p95"].append(percentile(server_first_tokens(collector, published), 0.95))
    figures["beside read p95"].append(percentile(read_first_tokens(collector, published), 0.95))
    figures["beside cut p95"].append(percentile(first_chunks_cut(collector, published), 0.95))
    inter = inter_token_ms(collector, published)
    figures["beside inter p50"].append(statistics.median(inter))
    figures["beside inter p95"].append(percentile(inter, 0.95))
    ended(collector, ids, 1800)  # the streams that delivered are known once every bulk request ended
    figures["bulk beside"].append(tokens_between(collector, prefix, start, end) / (end - start))
    figures["live tokens/s"].append(args.live * args.tokens / (end - start))
    figures["bulk alone"].append(tokens_between(collector, prefix, alone_from, alone_to) / (alone_to - alone_from))
    print(f"[{lane}] rep {rep + 1}: live first chunk p95 {figures['alone p95'][-1]:.2f} s alone, "
          f"{figures['beside p95'][-1]:.2f} s beside the backfill (from the read {figures['alone read p95'][-1]:.0f} "
          f"and {figures['beside read p95'][-1]:.0f} ms, at the server {figures['alone server p95'][-1]:.0f}"
          f" and {figures['beside server p95'][-1]:.0f} ms); bulk {figures['bulk beside'][-1]:.0f} tokens/s beside "
          f"live, {figures['bulk alone'][-1]:.0f} alone; {len(ids)} bulk requests, all answered", flush=True)


def objective_verdict(template_args: list[str], figures: dict[str, list[float]]) -> str | None:
    """A governed lane's last repetition against the objective it was given, in milliseconds (what the template
    promises) and against its own alone phase; None for a lane with no first-token objective."""
    given = [arg.partition("=")[2] for arg in template_args if arg.startswith("--live_first_token_slo_ms=")]
    if not given or not given[-1].isdigit() or int(given[-1]) == 0:
        return None
    objective, beside, alone = int(given[-1]), figures["beside read p95"][-1], figures["alone read p95"][-1]
    return (f"objective {objective} ms: live first token from its read p95 {beside:.0f} ms beside the lane "
            f"({'within' if beside <= objective else 'past'} it), {beside / alone:.2f} times its own {alone:.0f} "
            "ms alone")


def until(condition, timeout_s: float) -> float:
    """When ``condition`` first held (polled every 50 ms)."""
    deadline = time.time() + timeout_s
    while not condition():
        if time.time() > deadline:
            raise RuntimeError(f"not within {timeout_s:g} s")
        time.sleep(0.05)
    return time.time()


def report(args: argparse.Namespace, figures: dict[str, list[float]], lane: str = "adaptive",
           used: list[str] | None = None) -> None:
    """One lane's figures against live alone; ``used``: its template parameters as run (a calibrated lane's)."""
    p50 = [b / a for a, b in zip(figures["alone p50"], figures["beside p50"], strict=True)]
    p95 = [b / a for a, b in zip(figures["alone p95"], figures["beside p95"], strict=True)]
    inter50 = [b / a for a, b in zip(figures["alone inter p50"], figures["beside inter p50"], strict=True)]
    inter = [b / a for a, b in zip(figures["alone inter p95"], figures["beside inter p95"], strict=True)]
    share = [b / max(c, 1e-9) for b, c in zip(figures["bulk beside"], figures["bulk alone"], strict=True)]
    print(f"\nlane {lane} ({' '.join(used or lane_args(lane)) or 'the template objectives'}): {args.reps} "
          f"interleaved repetitions, {platform.processor() or platform.machine()}, {os.cpu_count()} "
          f"cores; live: {args.live} requests x {args.tokens} tokens measured (after {args.warm_live} beside the "
          f"lane not measured), one every {args.live_every_s:g} s; bulk: a backlog of {backlog_depth(lane)} "
          f"unanswered x {args.bulk_tokens} tokens, kept full; vLLM reads at most "
          f"{args.step_tokens or 'its default'} prompt tokens a step; template parameters "
          f"{' '.join(args.template_arg) or '(defaults)'}. Median (range):")
    print("| figure | live alone | live beside the backfill | ratio |\n|---|---|---|---|")
    print(f"| live first chunk p50 | {spread(figures['alone p50'], ' s')} | {spread(figures['beside p50'], ' s')} "
          f"| {spread(p50)} |")
    print(f"| live first chunk p95 | {spread(figures['alone p95'], ' s')} | {spread(figures['beside p95'], ' s')} "
          f"| {spread(p95)} |")
    cut = [b / a for a, b in zip(figures["alone cut p95"], figures["beside cut p95"], strict=True)]
    print(f"| live first chunk cut at the worker p95 | {spread(figures['alone cut p95'], ' s')} | "
          f"{spread(figures['beside cut p95'], ' s')} | {spread(cut)} |")
    read = [b / a for a, b in zip(figures["alone read p95"], figures["beside read p95"], strict=True)]
    print(f"| live first token from its read p95 (ms) | {spread(figures['alone read p95'])} | "
          f"{spread(figures['beside read p95'])} | {spread(read)} |")
    server = [b / a for a, b in zip(figures["alone server p95"], figures["beside server p95"], strict=True)]
    print(f"| live first token at the server p95 (ms) | {spread(figures['alone server p95'])} | "
          f"{spread(figures['beside server p95'])} | {spread(server)} |")
    print(f"| live time per token p50 (ms) | {spread(figures['alone inter p50'])} | "
          f"{spread(figures['beside inter p50'])} | {spread(inter50)} |")
    print(f"| live time per token p95 (ms) | {spread(figures['alone inter p95'])} | "
          f"{spread(figures['beside inter p95'])} | {spread(inter)} |")
    print("\n| bulk lane | tokens/s |\n|---|---|")
    print(f"| alone (what the engine delivers) | {spread(figures['bulk alone'])} |")
    print(f"| live traffic's own | {spread(figures['live tokens/s'])} |")
    print(f"| beside live | {spread(figures['bulk beside'])} |")
    print(f"| beside live / alone | {spread(share)} |")
    print("Nothing lost: every published request of both lanes ended with one completion.")


@dataclass(frozen=True)
class Point:
    """One lane on the frontier: medians over the repetitions."""

    lane: str
    first_chunk_p95_ratio: float  # live first chunk p95 beside the lane / alone
    inter_token_p95_ratio: float  # live time per token p95 beside the lane / alone
    bulk_tokens_per_s: float  # the lane's rate beside live
    server_p95_ratio: float = float("nan")  # live first token at the server p95 beside / alone
    cut_p95_ratio: float = float("nan")  # live first chunk cut at the worker p95 beside / alone
    read_p95_ratio: float = float("nan")  # live first token from its read p95 beside / alone: the governor's


def frontier(figures: dict[str, dict[str, list[float]]]) -> list[Point]:
    points = []
    for lane, mine in figures.items():
        ratio = [b / a for a, b in zip(mine["alone p95"], mine["beside p95"], strict=True)]
        inter = [b / a for a, b in zip(mine["alone inter p95"], mine["beside inter p95"], strict=True)]
        server, cut, read = ([b / a for a, b in zip(mine.get(f"alone {kind} p95", []),
                                                    mine.get(f"beside {kind} p95", []), strict=True)]
                             for kind in ("server", "cut", "read"))
        points.append(Point(lane, statistics.median(ratio), statistics.median(inter),
                            statistics.median(mine["bulk beside"]),
                            statistics.median(server) if server else float("nan"),
                            statistics.median(cut) if cut else float("nan"),
                            statistics.median(read) if read else float("nan")))
    return points


def frontier_table(points: list[Point], goal: float) -> str:
    """Each lane's live p95 ratios and bulk rate; for each adaptive lane, against the ratio it was given (its R for
    ``adaptive:xR``, else ``goal``), the best fixed share whose ratio keeps it (or, where none does, the one with
    the lowest ratio), by the first chunk a user sees, by the first token from its read (what the governor
    bounds) and at the server, and the adaptive lane's ratio and rate against that share's."""
    lines = [f"\nThe frontier (medians): live first chunk p95 beside / alone against the lane's bulk tokens/s "
             f"(goal {goal:g}):", "| lane | first chunk p95 ratio | cut at the worker | first token from its read | "
             "first token at the server | time per token p95 ratio | bulk tokens/s |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {p.lane} | {p.first_chunk_p95_ratio:.2f} | {p.cut_p95_ratio:.2f} | {p.read_p95_ratio:.2f} | "
              f"{p.server_p95_ratio:.2f} | {p.inter_token_p95_ratio:.2f} | {p.bulk_tokens_per_s:.1f} |"
              for p in points]
    fixed = [p for p in points if p.lane.isdigit()]
    targets = sorted({goal} | {float(p.lane.partition(":x")[2]) for p in points if ":x" in p.lane})
    for target in targets if fixed else []:
        mine = [p for p in points if adaptive(p.lane) and
                (float(p.lane.partition(":x")[2]) if ":x" in p.lane else goal) == target]
        for measure, ratio_of in (("first chunk", lambda p: p.first_chunk_p95_ratio),
                                  ("first chunk cut at the worker", lambda p: p.cut_p95_ratio),
                                  ("first token from its read", lambda p: p.read_p95_ratio),
                                  ("first token at the server", lambda p: p.server_p95_ratio)):
            keeping = [p for p in fixed if ratio_of(p) <= target]
            best = max(keeping, key=lambda p: p.bulk_tokens_per_s) if keeping else min(fixed, key=ratio_of)
            lines.append(f"Ratio {target:g} by {measure}: best fixed share "
                         f"{'keeping it' if keeping else '(none keeps it: the tightest)'}: {best.lane} streams, "
                         f"ratio {ratio_of(best):.2f}, {best.bulk_tokens_per_s:.1f} bulk tokens/s.")
            for point in mine:
                lines.append(f"  {point.lane}: ratio {ratio_of(point):.2f} "
                             f"({'within' if ratio_of(point) <= target else 'past'} {target:g}), bulk "
                             f"{point.bulk_tokens_per_s / max(best.bulk_tokens_per_s, 1e-9):.2f}x that share's "
                             "tokens/s (goal: within, at least 0.9x).")
    return "\n".join(lines)


def plot(points: list[Point], goal: float, path: Path) -> None:
    """Two panels, live p95 beside the lane over alone against the lane's bulk tokens/s: the first chunk cut at
    the worker (what a user waits for, less Pub/Sub's way out) and the first token from its read (what the
    governor's objective bounds); fixed shares a line, adaptive lanes stars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharex=True)
    fixed = sorted((p for p in points if p.lane.isdigit()), key=lambda p: p.bulk_tokens_per_s)
    for axis, title, ratio_of in ((axes[0], "first chunk cut at the worker", lambda p: p.cut_p95_ratio),
                                  (axes[1], "first token from its read", lambda p: p.read_p95_ratio)):
        axis.plot([p.bulk_tokens_per_s for p in fixed], [ratio_of(p) for p in fixed], marker="o",
                  color="tab:blue", label="fixed share (bulk streams)")
        for p in fixed:
            axis.annotate(p.lane, (p.bulk_tokens_per_s, ratio_of(p)), textcoords="offset points", xytext=(4, 4),
                          fontsize=8)
        colours = iter(["tab:red", "tab:purple", "tab:orange", "tab:green", "tab:brown"])
        for n, p in enumerate(p for p in points if not p.lane.isdigit()):
            axis.scatter([p.bulk_tokens_per_s], [ratio_of(p)], marker="*" if adaptive(p.lane) else "s",
                         s=180 if adaptive(p.lane) else 70, color=next(colours, "tab:grey"),
                         zorder=3, label=p.lane if n < 5 else None)
            # Alternately below and above: lanes that land close together keep their labels apart.
            axis.annotate(p.lane, (p.bulk_tokens_per_s, ratio_of(p)), textcoords="offset points",
                          xytext=(6, -12 if n % 2 == 0 else 8), fontsize=8)
        axis.axhline(goal, color="grey", linestyle="--", linewidth=1, label=f"goal {goal:g}x")
        axis.set_xlabel("bulk tokens/s beside live traffic")
        axis.set_ylabel(f"live {title} p95, beside / alone")
        axis.set_title(title)
        axis.legend(fontsize=8)
    figure.suptitle("The bulk lane's frontier")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
