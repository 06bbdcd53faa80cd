"""``make bench``: one vLLM server, the same seeded prompts, every system side by side.

    python -m benchmarks.side_by_side [--reps 3] [--cores both] [--systems ...] [--requests 32] ...

See ``--help`` for every option and the README's "Benchmarks" section for what
each figure means. Figures only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import platform
import shlex
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.side_by_side import report, workload
from benchmarks.side_by_side.cores import CorePlan, plans, renice_tree
from benchmarks.side_by_side.report import STATIC_ARRIVAL, STATIC_BUCKETS, STATIC_PROMPT_BUCKETS
from benchmarks.side_by_side.server import BenchServer
from benchmarks.side_by_side.stats import RunResult
from benchmarks.side_by_side.systems import BeamHandler, PubSubRelay, RawVLLM, System, Template
from local.cpu_server import LOCAL_SERVER, apply_server_environment
from local.embedded_model import ensure_local_checkpoint
from local.emulators import PubSubEmulator
from local.harness import REPO_ROOT

SYSTEMS = ("raw", "relay", "template-arrival", "template-buckets", "beam", "static-arrival", "static-prompt-buckets",
           "static-buckets")
DEFAULT_SYSTEMS = ("raw", "relay", "template-arrival", "template-buckets", "beam")
SETTLE_S = 1.0  # after resuming a paused pipeline, before sending it anything
LENGTHS = ("by-shape", "fixed", "natural", "both")


class ProgressLine:
    """One line that says where the run is: rewritten in place on a terminal, every 15 s otherwise."""

    def __init__(self) -> None:
        self.context = ""
        self._tty = sys.stderr.isatty()
        self._last = 0.0

    def __call__(self, finished: int, expected: int) -> None:
        line = f"{self.context} · {finished}/{expected} finished"
        now = time.monotonic()
        if self._tty:
            sys.stderr.write("\r" + line[:150].ljust(150))
            sys.stderr.flush()
        elif now - self._last >= 15 or finished == expected:
            print(line, file=sys.stderr, flush=True)
            self._last = now

    def note(self, text: str) -> None:
        if self._tty:
            sys.stderr.write("\r" + " " * 150 + "\r")
        print(text, file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.side_by_side", description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="repetitions of every configuration, interleaved")
    parser.add_argument("--cores", choices=("both", "isolated", "shared"), default="both",
                        help="isolated: server on its own cores (a GPU worker's shape); shared: a CPU-only user's")
    parser.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                        help=f"comma-separated, from {', '.join(SYSTEMS)} (relay: raw vLLM behind Pub/Sub, no Beam, "
                             "the floor for a Pub/Sub-fed pipeline; static-*: the template with "
                             "engine=transformers, on every core of the plan, static-prompt-buckets without answer "
                             "buckets; make bench-engines)")
    parser.add_argument("--template-repo", type=Path, action="append", default=[], metavar="DIR",
                        help="also run the template (length buckets) from another checkout, e.g. before a change")
    parser.add_argument("--template-args", default="", help="more template parameters for every template run, "
                        "one string (e.g. \"--batch_size_target=1 --chunk_tokens=4\")")
    parser.add_argument("--template-variant", action="append", default=[], metavar="LABEL=ARGS",
                        help="also run the template (length buckets) with these parameters, e.g. "
                        "\"target 1=--batch_size_target=1\"")
    parser.add_argument("--requests", type=int, default=32, help="prompts in a burst")
    parser.add_argument("--paced-requests", type=int, default=12, help="prompts per paced run")
    parser.add_argument("--rates", default="0.25,0.5,0.85",
                        help="paced rates as fractions of the capacity measured by raw vLLM's burst")
    parser.add_argument("--rates-per-s", default="", help="paced rates in requests/s instead (overrides --rates)")
    parser.add_argument("--no-burst", action="store_true", help="paced shapes only")
    parser.add_argument("--lengths", choices=LENGTHS, default="by-shape",
                        help="answer lengths: fixed (each runs to its max_tokens, so every system does the same "
                             "work and tokens/s compare), natural (answers end where the model stops: what users "
                             "see), both (every shape twice), by-shape (default: bursts fixed, for throughput; paced "
                             "arrivals natural, for latency). A --template-repo older than min_tokens needs natural")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--budgets", default="", metavar="KIND=TOKENS,...",
                        help="max_tokens by prompt kind instead of --max-tokens for all, e.g. record=16,question=32 "
                        "(not with beam: its handler takes one max_tokens for every element)")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--prompts", type=Path, help="a JSONL file of {\"prompt\": ...} to use instead of the mix")
    parser.add_argument("--model", help="model for the server (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default=LOCAL_SERVER.dtype, help="default: local/cpu_server.py's")
    parser.add_argument("--vllm-args", default=" ".join(LOCAL_SERVER.vllm_args),
                        help="more vLLM server flags, one string (default: local/cpu_server.py's)")
    parser.add_argument("--server-url", help="use a running server instead of starting one (cores: shared only)")
    parser.add_argument("--server-niceness", default="", metavar="N[,N...]",
                        help="renice the server (default: as the model manager starts it, at the pipeline's priority); "
                        "several values run every system at each, interleaved, the server reniced between runs")
    parser.add_argument("--from-json", type=Path, metavar="RUNS_JSON",
                        help="make the report, table and plots again from a run's runs.json (runs nothing)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / ".cache" / "bench" / "side_by_side",
                        help="where the report folder goes (git ignores .cache)")
    args = parser.parse_args(argv)
    unknown = set(args.systems.split(",")) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    if any("=" not in variant for variant in args.template_variant):
        parser.error("--template-variant takes LABEL=ARGS")
    if args.server_url and args.cores != "shared":
        parser.error("--server-url runs a server this command cannot pin: add --cores shared")
    try:
        args.server_niceness = [int(n) for n in args.server_niceness.split(",") if n.strip()]
    except ValueError:
        parser.error("--server-niceness takes whole numbers, e.g. 0,10")
    if args.server_niceness and args.server_url:
        parser.error("--server-niceness needs a server this command starts: drop --server-url")
    if len(args.server_niceness) > 1 and os.geteuid() != 0:
        parser.error("several --server-niceness values renice the server back down, which needs root")
    if min(args.reps, args.requests, args.paced_requests, args.max_tokens) < 1:
        parser.error("--reps, --requests, --paced-requests and --max-tokens must be at least 1")
    try:
        args.budgets = workload.parse_budgets(args.budgets)
    except ValueError as error:
        parser.error(str(error))
    if args.budgets and "beam" in args.systems.split(","):
        parser.error("--budgets does not go with the beam system: Beam's handler takes one max_tokens for all")
    return args


def shape_lengths(choice: str, paced: bool) -> list[str]:
    """The answer lengths a burst or a paced shape runs with, for a --lengths choice."""
    if choice == "both":
        return [workload.FIXED, workload.NATURAL]
    if choice == "by-shape":
        return [workload.NATURAL if paced else workload.FIXED]
    return [workload.FIXED if choice == "fixed" else workload.NATURAL]


def used_lengths(args: argparse.Namespace) -> list[str]:
    """Every answer length some shape of this run uses."""
    used = (shape_lengths(args.lengths, False) if not args.no_burst else []) + shape_lengths(args.lengths, True)
    return list(dict.fromkeys(used))


def _shapes(args: argparse.Namespace, capacity_rps: dict[str, float]) -> dict[str, tuple[float | None, str]]:
    """Shape name → (arrival rate (None: a burst), answer lengths); paced rates from the capacity at those lengths."""
    shapes: dict[str, tuple[float | None, str]] = {}
    if not args.no_burst:
        for lengths in shape_lengths(args.lengths, False):
            shapes[f"burst, {lengths}"] = (None, lengths)
    for lengths in shape_lengths(args.lengths, True):
        if args.rates_per_s:
            for rate in (float(r) for r in args.rates_per_s.split(",") if r):
                shapes[f"paced {rate:g}/s, {lengths}"] = (rate, lengths)
        else:  # named by the fraction, so that the core plans' shapes line up though their capacities differ
            for fraction in (float(f) for f in args.rates.split(",") if f):
                shapes[f"paced {fraction:g}× capacity, {lengths}"] = (fraction * capacity_rps[lengths], lengths)
    return shapes


def _load(args: argparse.Namespace, prompts: list[workload.Prompt], rate: float | None, lengths: str, rep: int,
          shape_index: int) -> tuple[list[workload.Prompt], list[float]]:
    """The prompts of one run and their send offsets, the same for every system.

    A burst sends the whole workload; a paced run a different stride through it each repetition.
    """
    if rate is None:
        chosen = prompts
    else:
        chosen = [prompts[(i * 7 + rep) % len(prompts)] for i in range(min(args.paced_requests, len(prompts)))]
    return workload.with_lengths(chosen, lengths), workload.arrivals(len(chosen), rate,
                                                                     args.seed * 1000 + rep * 10 + shape_index)


def _systems(args: argparse.Namespace, emulator: PubSubEmulator, server: BenchServer, log_dir: Path) -> list[System]:
    chosen = args.systems.split(",")
    extra = tuple(shlex.split(args.template_args))
    systems: list[System] = []
    if "raw" in chosen:
        systems.append(RawVLLM(server.base_url, server.model, args.max_tokens))
    if "relay" in chosen:
        systems.append(PubSubRelay(emulator, server.base_url, server.model, args.max_tokens, log_dir=log_dir))
    if "template-arrival" in chosen:
        systems.append(Template("template (arrival order)", emulator, server.base_url, args.max_tokens,
                                bucketing=False, log_dir=log_dir, extra_args=extra))
    if "template-buckets" in chosen:
        systems.append(Template("template (length buckets)", emulator, server.base_url, args.max_tokens,
                                bucketing=True, log_dir=log_dir, extra_args=extra))
    for repo in args.template_repo:
        systems.append(Template(f"template (length buckets) @ {repo.name}", emulator, server.base_url, args.max_tokens,
                                bucketing=True, log_dir=log_dir, repo_root=repo.resolve(), extra_args=extra))
    for variant in args.template_variant:
        label, variant_args = variant.split("=", 1)
        systems.append(Template(f"template (length buckets, {label})", emulator, server.base_url, args.max_tokens,
                                bucketing=True, log_dir=log_dir, extra_args=extra + tuple(shlex.split(variant_args))))
    # One batching key per bucket: a static batch is one worker's unit of work, and on this one worker more
    # keys would only split each bucket into smaller batches (in arrival order too).
    static = ("--engine=transformers", f"--model={args.model or ensure_local_checkpoint()}", f"--dtype={args.dtype}",
              "--num_shards=1")
    for name, label, bucketing, more in (("static-arrival", STATIC_ARRIVAL, False, ()),
                                         ("static-prompt-buckets", STATIC_PROMPT_BUCKETS, True,
                                          ("--answer_bucket_boundaries=none",)),
                                         ("static-buckets", STATIC_BUCKETS, True, ())):
        if name in chosen:  # the model's compute runs in the pipeline's tree: give it every core the plan has
            systems.append(Template(label, emulator, None, args.max_tokens, bucketing=bucketing, log_dir=log_dir,
                                    extra_args=static + extra + more, cores=server.plan.server | server.plan.clients))
    if "beam" in chosen:
        systems.append(BeamHandler(emulator, server.port, server.model, args.max_tokens, lengths=used_lengths(args),
                                   log_dir=log_dir))
    return systems


def niceness_order(values: list[int], rep: int) -> list[int | None]:
    """The server niceness of each run of a system (None: leave it), reversed every other repetition."""
    if len(values) < 2:
        return [None]
    return values if rep % 2 else values[::-1]


def _measure(system: System, server: BenchServer, niceness: int | None, prompts: list[workload.Prompt],
             offsets: list[float], *, shape: str, rep: int, reps: int, variant: int, max_tokens: int,
             progress: ProgressLine) -> RunResult:
    """One run of one system, the server first reniced to ``niceness`` unless it is None."""
    label = system.name if niceness is None else f"{system.name} · server nice {niceness}"
    if niceness is not None:
        renice_tree(server.server.pid, niceness)
    cores = server.plan.name
    progress.context = f"[{cores}] rep {rep}/{reps} · {shape} · {label}"
    system.resume()
    time.sleep(SETTLE_S)
    model_cpu = server.cpu_seconds()
    try:  # request ids differ between variants: the template drops a repeated id as a copy
        result = system.run(prompts, offsets, shape=shape, rep=rep + 1000 * variant, cores=cores, progress=progress)
        result = dataclasses.replace(result, system=label, rep=rep,
                                     requested_tokens=workload.requested_tokens(prompts, max_tokens))
        if not getattr(system, "holds_model", False) and model_cpu is not None:
            result = dataclasses.replace(result, model_cpu_s=server.cpu_seconds() - model_cpu)
    finally:
        system.pause()
    progress.note(f"{progress.context}: done")
    return result


def run_plan(args: argparse.Namespace, plan: CorePlan, prompts: list[workload.Prompt], emulator: PubSubEmulator,
             log_dir: Path, progress: ProgressLine, context: report.Context) -> list[RunResult]:
    """Every system, shape and repetition under one core plan, interleaved."""
    progress.note(f"[{plan.name}] starting the vLLM server ({plan.describe()}) ...")
    results: list[RunResult] = []
    with BenchServer(plan, model=args.model, dtype=args.dtype, vllm_args=args.vllm_args, server_url=args.server_url,
                     niceness=args.server_niceness[0] if args.server_niceness else None) as server:
        context.server_start_s[plan.name] = server.start_s
        systems = _systems(args, emulator, server, log_dir / plan.name)
        started: list[System] = []
        try:
            for system in systems:
                progress.note(f"[{plan.name}] starting {system.name} (start-up and warm-up are not measured) ...")
                system.start()
                started.append(system)
                system.pause()
            calibration = RawVLLM(server.base_url, server.model, args.max_tokens)
            capacities = context.capacity_rps.setdefault(plan.name, {})
            for lengths in used_lengths(args):
                progress.context = f"[{plan.name}] calibrating: raw vLLM burst of {len(prompts)}, {lengths}"
                burst = workload.with_lengths(prompts, lengths)
                probe = calibration.run(burst, workload.arrivals(len(burst), None, 0),
                                        shape=f"calibration-{lengths[0]}", rep=0, cores=plan.name, progress=progress)
                wall = max(t.done for t in probe.timings) - min(t.sent for t in probe.timings)
                capacities[lengths] = len(probe.timings) / wall
                progress.note(f"[{plan.name}] capacity {capacities[lengths]:.2f} requests/s ({lengths})")
            shapes = _shapes(args, capacities)
            for shape, (rate, lengths) in shapes.items():
                count = len(_load(args, prompts, rate, lengths, 1, 0)[0])
                context.shapes.setdefault(shape, f"burst of {count}" if rate is None else f"{count} Poisson arrivals")
                if rate is not None:
                    context.rates.setdefault(plan.name, {})[shape] = rate
            for rep in range(1, args.reps + 1):
                for shape_index, (shape, (rate, lengths)) in enumerate(shapes.items()):
                    chosen, offsets = _load(args, prompts, rate, lengths, rep, shape_index)
                    turn = (rep + shape_index) % len(started)
                    for system in started[turn:] + started[:turn]:  # a different order each time
                        for variant, niceness in enumerate(niceness_order(args.server_niceness, rep)):
                            results.append(_measure(system, server, niceness, chosen, offsets, shape=shape, rep=rep,
                                                    reps=args.reps, variant=variant, max_tokens=args.max_tokens,
                                                    progress=progress))
        finally:
            for system in started:
                system.resume()
                system.stop()
    return results


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    apply_server_environment()
    if args.from_json:
        runs, context = report.load_json(args.from_json.read_text(encoding="utf-8"))
        print(report.write(runs, context, args.from_json.parent))
        return args.from_json.parent
    with PubSubEmulator() as emulator:
        emulator.activate()
        return run(args, emulator)


def run(args: argparse.Namespace, emulator: PubSubEmulator) -> Path:
    """The whole benchmark against a started emulator; returns the report folder."""
    prompts = (workload.from_jsonl(args.prompts, args.requests) if args.prompts
               else workload.mixed(args.requests, args.seed))
    prompts = workload.with_budgets(prompts, args.budgets)
    names = ["isolated", "shared"] if args.cores == "both" else [args.cores]
    core_plans = plans(names)
    stamp = datetime.now(UTC)
    folder = args.out / stamp.strftime("%Y%m%dT%H%M%SZ")
    folder.mkdir(parents=True, exist_ok=True)
    kinds = {kind: sum(p.kind == kind for p in prompts) for kind in dict.fromkeys(p.kind for p in prompts)}
    context = report.Context(
        machine=f"{platform.machine()}, {os.cpu_count()} cores, {platform.node()}",
        date=stamp.strftime("%Y-%m-%d %H:%M UTC"),
        model=args.model or args.server_url or "SmolLM2-135M-Instruct (embedded, vLLM CPU build)",
        max_tokens=args.max_tokens, seed=args.seed,
        workload=(f"prompts from {args.prompts}" if args.prompts else "the mixed workload: ")
        + ", ".join(f"{n} {k}" for k, n in kinds.items())
        + "".join(f"; {kind}s max_tokens {budget}" for kind, budget in args.budgets.items()),
        shapes={}, cores={plan.name: plan.describe() for plan in core_plans}, server_start_s={}, capacity_rps={},
        rates={}, reps=args.reps)
    progress = ProgressLine()
    runs: list[RunResult] = []
    for plan in core_plans:
        runs += run_plan(args, plan, prompts, emulator, folder / "logs", progress, context)
    print(report.write(runs, context, folder))
    return folder


if __name__ == "__main__":
    main()
