"""Scale-out simulation: how evenly the template's keying spreads generation over W GPU workers.

On Dataflow a key's state, timers and bundles live on one worker at a time, and
the key space is split into ranges over the workers: a key lands on the worker
whose range holds the hash of its encoded bytes, like a ball in a bin. The
generate step is where a worker's vLLM server gets its requests, so its keys
decide each GPU's share. This simulation assigns those keys to W workers by
uniform hash ranges, sends a seeded stream of requests (a mix of short and long
answers, as in the other benchmarks), and reports per keying and W:

- the busiest worker's load against the mean, and the usable share of the
  job's GPU capacity (mean / max: a saturated job runs at its hottest GPU's pace);
- what the keying costs on Streaming Engine: poll-timer firings and state
  writes per second for the whole job, at a given load.

Needs no cloud. ``python -m benchmarks.scale [--requests 200000] [--out DIR]``
prints the table and writes ``scale.md``, ``scale.json`` and ``scale.png``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from apache_beam.coders import StrUtf8Coder, VarIntCoder

from pipeline.contract.keying import generate_key
from pipeline.contract.parameters import PARAMETERS
from pipeline.generation.generate import template_poll_interval_ms
from pipeline.generation.key_events import WAITING_POLL_CAP_S

WORKERS = (1, 2, 4, 8, 16, 32, 64, 100)
DEFAULT_CHUNK_INTERVAL_MS = next(p.default for p in PARAMETERS if p.name == "chunk_interval_ms")
# State writes (adds, writes, clears, timer settings) per poll of a busy key, measured by make bench-state-cost
# on the real generate step with chunks through the poll (docs/benchmarks.md); per request: 2.6 measured at
# submission, plus the rewrite and release when it ends (2, counted from the code).
WRITES_PER_POLL = 3.6
WRITES_PER_REQUEST = 4.6
REPO_ROOT = Path(__file__).resolve().parent.parent


def worker_of(encoded_key: bytes, workers: int) -> int:
    """Uniform hash ranges: the key's 64-bit hash, scaled onto ``workers`` equal ranges."""
    digest = int.from_bytes(hashlib.blake2b(encoded_key, digest_size=8).digest(), "big")
    return digest * workers >> 64


@dataclass(frozen=True)
class Keying:
    name: str
    key_of: Callable[[str], object]  # request id -> the generate step's key
    encode: Callable[[object], bytes]
    keys: int | None  # distinct keys, None: one per request


def keyings() -> list[Keying]:
    int_coder, str_coder = VarIntCoder(), StrUtf8Coder()
    chosen = [Keying(f"{n} shards", lambda rid, n=n: generate_key(rid, n), int_coder.encode, n)
              for n in (16, 256, 4096, 16384, 65536, 262144)]
    return chosen + [Keying("request id", lambda rid: rid, str_coder.encode, None)]


@dataclass(frozen=True)
class Row:
    keying: str
    workers: int
    busiest_over_mean: float
    usable_share: float
    idle_workers: int
    timers_per_s: float
    state_writes_per_s: float


def streaming_engine_cost(keys: int | None, in_flight: float, requests_per_s: float, poll_interval_s: float,
                          dedupe_window_s: float = 600.0, waiting: float = 0.0) -> tuple[float, float]:
    """(timer firings/s, state writes/s) of the generate step for the whole job.

    A key polls at the chunk cadence while it has a request in flight: busy
    keys are the occupied bins when ``in_flight`` requests fall on ``keys``
    keys. A key whose requests only wait backs off to a poll every
    :data:`~pipeline.generation.generate.WAITING_POLL_CAP_S`: the bins ``waiting``
    requests occupy that no in-flight request does. A key that goes quiet fires
    once more, a de-duplication window later, to forget its ids: at most once
    per request, at most once per key and window. Writes per firing and per
    request are :data:`WRITES_PER_POLL` and :data:`WRITES_PER_REQUEST`, as
    ``make bench-state-cost`` measured them on the real step.
    """
    if keys is None:
        busy, waiting_keys = in_flight, waiting
    else:
        busy = keys * (1 - math.exp(-in_flight / keys))
        waiting_keys = keys * (1 - math.exp(-waiting / keys)) * math.exp(-in_flight / keys)
    cleanups = requests_per_s if keys is None else min(requests_per_s, keys / dedupe_window_s)
    timers = busy / poll_interval_s + waiting_keys / WAITING_POLL_CAP_S + cleanups
    return timers, WRITES_PER_POLL * timers + WRITES_PER_REQUEST * requests_per_s


def simulate(requests: int, seed: int, in_flight: float, requests_per_s: float,
             poll_interval_s: float, waiting: float = 0.0) -> list[Row]:
    rng = random.Random(seed)
    # Generated tokens per request: 60 % short answers, 40 % long ones (an assumption of this simulation).
    stream = [(f"req-{rng.getrandbits(64):016x}", rng.randint(8, 40) if rng.random() < 0.6 else rng.randint(150, 400))
              for _ in range(requests)]
    rows = []
    for keying in keyings():
        encoded = {}
        for request_id, _ in stream:
            key = keying.key_of(request_id)
            if key not in encoded:
                encoded[key] = keying.encode(key)
        timers, writes = streaming_engine_cost(keying.keys, in_flight, requests_per_s, poll_interval_s,
                                               waiting=waiting)
        for workers in WORKERS:
            load = [0] * workers
            for request_id, tokens in stream:
                load[worker_of(encoded[keying.key_of(request_id)], workers)] += tokens
            mean = sum(load) / workers
            rows.append(Row(keying.name, workers, round(max(load) / mean, 3), round(mean / max(load), 3),
                            sum(1 for x in load if x == 0), round(timers), round(writes)))
    return rows


def markdown(rows: list[Row], args: argparse.Namespace) -> str:
    by_keying: dict[str, dict[int, Row]] = {}
    for row in rows:
        by_keying.setdefault(row.keying, {})[row.workers] = row
    header = "| Generate-step keys | " + " | ".join(f"W={w}" for w in WORKERS) + \
             " | Timers/s | State writes/s |"
    lines = [f"Usable share of GPU capacity (mean / busiest worker's load), {args.requests:,} requests, seed "
             f"{args.seed}; Streaming Engine cost for the whole job at {args.in_flight:g} requests in flight, "
             f"{args.rate:g} requests/s, {args.waiting:g} waiting, a poll every {args.poll_interval_ms:g} ms.", "",
             header, "|---|" + "---|" * (len(WORKERS) + 2)]
    for keying, per_workers in by_keying.items():
        cells = []
        for w in WORKERS:
            row = per_workers[w]
            cells.append(f"{row.usable_share:.0%}" + (f" ({row.idle_workers} idle)" if row.idle_workers else ""))
        any_row = next(iter(per_workers.values()))
        lines.append(f"| {keying} | " + " | ".join(cells)
                     + f" | {any_row.timers_per_s:,} | {any_row.state_writes_per_s:,} |")
    return "\n".join(lines)


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 5))
    for keying in dict.fromkeys(r.keying for r in rows):
        mine = [r for r in rows if r.keying == keying]
        axis.plot([r.workers for r in mine], [100 * r.usable_share for r in mine], marker="o", label=keying)
    axis.axhline(90, color="grey", linestyle="--", linewidth=1)
    axis.set_xscale("log")
    axis.set_xticks(WORKERS, [str(w) for w in WORKERS])
    axis.set_ylim(0, 105)
    axis.set_xlabel("GPU workers (W)")
    axis.set_ylabel("usable share of GPU capacity (%)")
    axis.set_title("Generate-step keying: mean / busiest worker's load")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200_000)
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--in-flight", type=float, default=64.0 * 16, help="requests in flight, whole job")
    parser.add_argument("--rate", type=float, default=200.0, help="requests per second, whole job")
    parser.add_argument("--poll-interval-ms", type=float, default=template_poll_interval_ms(DEFAULT_CHUNK_INTERVAL_MS),
                        help="default: the template's, from the default chunk_interval_ms")
    parser.add_argument("--waiting", type=float, default=0.0, help="requests waiting for room, whole job")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / ".cache" / "bench" / "scale")
    args = parser.parse_args()
    rows = simulate(args.requests, args.seed, args.in_flight, args.rate, args.poll_interval_ms / 1000, args.waiting)
    table = markdown(rows, args)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scale.md").write_text(table + "\n")
    (args.out / "scale.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    plot(rows, args.out / "scale.png")
    print(f"\nWrote {args.out}/scale.md, scale.json and scale.png")


if __name__ == "__main__":
    main()
