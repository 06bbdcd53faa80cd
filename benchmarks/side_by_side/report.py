"""The table on the terminal, and a folder with the Markdown report, the raw JSON and the plots."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path

from benchmarks.side_by_side.stats import HOPS, RequestTiming, RunResult, Spread, across_reps, ratio

RAW, BEAM = "raw vLLM", "Beam's vLLM handler"
RELAY = "Pub/Sub + raw vLLM (no Beam)"  # the floor for a Pub/Sub-fed system: raw vLLM plus the two Pub/Sub hops
PEERS = (RAW, RELAY, BEAM)
STATIC_ARRIVAL, STATIC_BUCKETS = "template, transformers (arrival order)", "template, transformers (length buckets)"
STATIC_PROMPT_BUCKETS = "template, transformers (prompt buckets only)"
STATIC = (STATIC_ARRIVAL, STATIC_PROMPT_BUCKETS, STATIC_BUCKETS)
COLUMNS = (("first chunk p50", "first_p50", "s"), ("p95", "first_p95", "s"), ("p99", "first_p99", "s"),
           ("done p50", "done_p50", "s"), ("p95", "done_p95", "s"), ("tokens/s", "tok_s", ""),
           ("CPU s / 1k tokens", "cpu_s_per_1k_tokens", ""), ("with the model's", "all_cpu_s_per_1k_tokens", ""),
           ("accel. s / 1k tokens", "accel_s_per_1k_tokens", ""), ("padded %", "padded_pct", ""),
           ("peak MiB", "peak_rss_mib", ""))


def _number(value: float) -> str:
    if math.isnan(value):
        return "–"
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"


def fmt(spread: Spread) -> str:
    """median (low–high); the range only when there was more than one repetition."""
    if spread.count > 1 and spread.low != spread.high:
        return f"{_number(spread.median)} ({_number(spread.low)}–{_number(spread.high)})"
    return _number(spread.median)


def _ratio_text(value: float) -> str:
    return "–" if math.isnan(value) else f"{value:.2f}×"


@dataclasses.dataclass
class Context:
    """What a reader needs to know about the run besides the figures."""

    machine: str
    date: str
    model: str
    max_tokens: int
    seed: int
    workload: str
    shapes: dict[str, str]  # shape name -> what arrives
    rates: dict[str, dict[str, float]]  # core plan -> paced shape -> its rate in requests/s
    cores: dict[str, str]  # core plan name -> its description
    server_start_s: dict[str, float]
    capacity_rps: dict[str, dict[str, float]]  # core plan -> answer lengths -> raw vLLM's burst capacity
    reps: int


def _ordered(systems) -> list[str]:
    """Raw vLLM, then the Pub/Sub relay, the template's variants in the order they ran, Beam's handler last."""
    systems = list(dict.fromkeys(systems))
    return sorted(systems, key=lambda s: (s != RAW, s != RELAY, s == BEAM))


def tables(runs: Sequence[RunResult], context: Context) -> list[tuple[str, list[str], list[list[str]], list[str]]]:
    """(title, header, rows, lines under the table) per core plan and shape."""
    spreads = across_reps(runs)
    result = []
    for cores in context.cores:
        for shape in context.shapes:
            systems = _ordered(key[2] for key in spreads if key[:2] == (cores, shape))
            if not systems:
                continue
            rate = context.rates.get(cores, {}).get(shape)
            title = (f"{cores} cores ({context.cores[cores]}) · {shape}: {context.shapes[shape]}"
                     + (f" at {rate:.2f} requests/s" if rate is not None else ""))
            header = ["system", *(name for name, _, _ in COLUMNS)]
            fixed = any(spreads[(cores, shape, system)]["token_surplus"].count for system in systems)
            unequal = {system for system in systems if fixed and _unequal(spreads[(cores, shape, system)])}
            rows = []
            for system in systems:
                figures = spreads[(cores, shape, system)]
                finished = figures["finished"]
                label = system if finished.low == figures["expected"].median else \
                    f"{system} (only {_number(finished.low)} of {_number(figures['expected'].median)} finished)"
                label += " ⚠ not the tokens asked for" if system in unequal else ""
                rows.append([label, *(fmt(figures[key]) for _, key, _ in COLUMNS)])
            notes = [work_note(runs, cores, shape)]
            if fixed:  # its ratios are tokens/s
                notes += engine_notes({system: spreads[(cores, shape, system)] for system in systems})
            for system in systems:
                if system in (RAW, BEAM):
                    continue
                figures = spreads[(cores, shape, system)]
                for peer in PEERS:
                    if peer == system or (system == RELAY and peer == BEAM) or (cores, shape, peer) not in spreads:
                        continue
                    other = spreads[(cores, shape, peer)]
                    throughput = (f"tokens/s {_ratio_text(ratio(figures['tok_s'], other['tok_s']))}"
                                  + (" (unequal work)" if {system, peer} & unequal else "")
                                  if fixed else "tokens/s not compared (natural lengths)")
                    first_p50 = _ratio_text(ratio(figures['first_p50'], other['first_p50']))
                    notes.append(f"{system} / {peer}: first chunk p50 {first_p50}, "
                                 f"p95 {_ratio_text(ratio(figures['first_p95'], other['first_p95']))}, {throughput}")
                hops = [f"{hop} {fmt(figures[f'hop_p50:{hop}'])} / {fmt(figures[f'hop_p95:{hop}'])} s" for hop in HOPS]
                notes.append(f"{system}, first chunk by hop (p50 / p95): " + "; ".join(hops))
            result.append((title, header, rows, notes))
    return result


def _unequal(figures: dict[str, Spread]) -> bool:
    surplus = figures["token_surplus"]
    return surplus.count > 0 and (surplus.low != 0 or surplus.high != 0)


def work_note(runs: Sequence[RunResult], cores: str, shape: str) -> str:
    """Whether every system of a table did the same work: each run's output tokens against what it asked for."""
    chosen = [r for r in runs if (r.cores, r.shape) == (cores, shape)]
    if any(r.requested_tokens is None for r in chosen):
        totals: dict[str, list[int]] = {}
        for run in chosen:
            totals.setdefault(run.system, []).append(run.output_tokens)
        spread = ", ".join(f"{system} {_number(Spread.of(values).median)}" for system, values in totals.items())
        return (f"natural lengths: answers end where the model stops, so the systems' output tokens may differ "
                f"(median per run: {spread}); tokens/s are not compared")
    off = [f"{r.system} rep {r.rep}: {r.output_tokens} of {r.requested_tokens}" for r in chosen if r.off_request]
    requested = sorted({r.requested_tokens for r in chosen})
    asked = f"{requested[0]}" if len(requested) == 1 else f"{requested[0]}–{requested[-1]}"
    if not off:
        return f"equal work: every system generated exactly the tokens asked for ({asked} per run) in every repetition"
    return f"UNEQUAL WORK, tokens/s ratios with these runs compare different work: {'; '.join(off)}"


def equal_work(runs: Sequence[RunResult]) -> str:
    """One line over the whole run: did every fixed-length run generate exactly what it asked for?"""
    fixed = [r for r in runs if r.requested_tokens is not None]
    off = [r for r in fixed if r.off_request]
    if not fixed:
        return "Equal work: no run had fixed answer lengths, so tokens/s compare different amounts of work."
    if not off:
        return (f"Equal work: all {len(fixed)} fixed-length runs generated exactly the output tokens they asked "
                "for, so their tokens/s compare the same work.")
    return (f"UNEQUAL WORK: {len(off)} of {len(fixed)} fixed-length runs did not generate the tokens they asked "
            "for (see each table's notes); tokens/s ratios with them compare different work.")


def engine_notes(figures: dict[str, dict[str, Spread]]) -> list[str]:
    """The static engine's ratios: length buckets against arrival order, and each vLLM system against it."""
    if STATIC_ARRIVAL not in figures:
        return []
    arrival, notes = figures[STATIC_ARRIVAL], []
    for system, what in ((STATIC_PROMPT_BUCKETS, "prompt buckets only"), (STATIC_BUCKETS, "length buckets")):
        if system in figures:
            buckets = figures[system]
            notes.append(f"transformers, {what} / arrival order: tokens/s "
                         f"{_ratio_text(ratio(buckets['tok_s'], arrival['tok_s']))}, padded "
                         f"{fmt(arrival['padded_pct'])} % → {fmt(buckets['padded_pct'])} % "
                         f"(goal: ≥ 1.5× and ≤ 10 %)")
    for system, other in figures.items():
        if system not in (*STATIC, BEAM, RELAY):
            notes.append(f"{system} / transformers in arrival order: tokens/s "
                         f"{_ratio_text(ratio(other['tok_s'], arrival['tok_s']))}, CPU s per 1k tokens with the "
                         "model's "
                         f"{_ratio_text(ratio(other['all_cpu_s_per_1k_tokens'], arrival['all_cpu_s_per_1k_tokens']))}, "
                         f"done p50 {_ratio_text(ratio(other['done_p50'], arrival['done_p50']))}")
    return notes


def headline(runs: Sequence[RunResult], context: Context) -> list[str]:
    """A compact Markdown table: first chunk p50 / p95 and tokens/s per system, for every core plan and shape."""
    spreads = across_reps(runs)
    systems = _ordered(r.system for r in runs)
    lines = ["| cores | load | " + " | ".join(systems) + " |", "|---|---|" + "---|" * len(systems)]
    for cores in context.cores:
        for shape in context.shapes:
            cells = []
            for system in systems:
                figures = spreads.get((cores, shape, system))
                cells.append("–" if figures is None else
                             f"{_number(figures['first_p50'].median)} / {_number(figures['first_p95'].median)} s, "
                             f"{_number(figures['tok_s'].median)} tok/s")
            if any(cell != "–" for cell in cells):
                lines.append(f"| {cores} | {shape} | " + " | ".join(cells) + " |")
    return lines


def terminal(runs: Sequence[RunResult], context: Context) -> str:
    lines = ["", equal_work(runs)]
    for title, header, rows, notes in tables(runs, context):
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        lines += ["", title,
                  "  ".join(h.ljust(widths[0]) if i == 0 else h.rjust(widths[i]) for i, h in enumerate(header))]
        for row in rows:
            lines.append("  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(row)))
        lines += [f"  {note}" for note in notes]
    return "\n".join(lines)


def markdown(runs: Sequence[RunResult], context: Context) -> str:
    lines = [f"# `make bench`: {context.date}, {context.machine}", "",
             f"Model {context.model}; greedy, max_tokens {context.max_tokens}; seed {context.seed}; "
             f"{context.workload}. Each configuration {context.reps}×, interleaved; "
             "cells are the median over repetitions and (in brackets) the range. Times in seconds from the "
             "moment each prompt was sent; tokens/s are output tokens over the run's wall time; CPU excludes the "
             "server. With fixed lengths every answer runs to its max_tokens (vLLM's min_tokens), so every "
             "system does the same work; with natural lengths answers end where the model stops.", "",
             equal_work(runs), ""]
    for cores, description in context.cores.items():
        capacity = "; ".join(f"{rps:.2f} requests/s with {lengths}"
                             for lengths, rps in context.capacity_rps.get(cores, {}).items())
        lines.append(f"- **{cores}**: {description}; server start {context.server_start_s.get(cores, math.nan):.0f} s "
                     f"(not in the figures); capacity (raw vLLM, burst) {capacity or '–'}, from which the paced "
                     "rates at those lengths are set.")
    lines += ["", "First chunk p50 / p95 and output tokens/s (medians over repetitions):", "", *headline(runs, context)]
    for title, header, rows, notes in tables(runs, context):
        lines += ["", f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        lines += [""] + [f"- {note}" for note in notes]
    noted = [f"{r.cores} / {r.shape} / {r.system}, rep {r.rep}: " + "; ".join(r.notes) for r in runs if r.notes]
    if noted:
        lines += ["", "## Notes", ""] + [f"- {line}" for line in noted]
    return "\n".join(lines) + "\n"


def raw_json(runs: Sequence[RunResult], context: Context) -> str:
    return json.dumps({"context": dataclasses.asdict(context), "runs": [dataclasses.asdict(r) for r in runs]}, indent=1)


def load_json(text: str) -> tuple[list[RunResult], Context]:
    """The runs and context :func:`raw_json` wrote, to make the report again."""
    data = json.loads(text)
    runs = []
    for run in data["runs"]:
        timings = [RequestTiming(**{**t, "hops": tuple(t["hops"]) if t["hops"] is not None else None})
                   for t in run.pop("timings")]
        runs.append(RunResult(timings=timings, **run))
    return runs, Context(**data["context"])


def write(runs: Sequence[RunResult], context: Context, folder: Path) -> str:
    """Writes report.md, runs.json and the plots into ``folder``; returns the terminal table."""
    (folder / "report.md").write_text(markdown(runs, context), encoding="utf-8")
    (folder / "runs.json").write_text(raw_json(runs, context), encoding="utf-8")
    written = plots(runs, context, folder)
    return (terminal(runs, context) + f"\n\nreport: {folder / 'report.md'}; raw data: {folder / 'runs.json'}; plots: "
            + ", ".join(p.name for p in written))


def _save(plt, figure, axes, path: Path) -> Path:
    axes[0][0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def plots(runs: Sequence[RunResult], context: Context, folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spreads = across_reps(runs)
    plans, shapes = list(context.cores), list(context.shapes)
    systems = _ordered(r.system for r in runs)
    written = []

    figure, axes = plt.subplots(len(plans), len(shapes), figsize=(4.2 * len(shapes), 3.4 * len(plans)), squeeze=False)
    for row, cores in enumerate(plans):
        for col, shape in enumerate(shapes):
            axis = axes[row][col]
            for system in systems:
                values = sorted(t.first - t.sent for r in runs if (r.cores, r.shape, r.system) == (cores, shape, system)
                                for t in r.timings)
                if values:
                    axis.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=system)
            axis.set_xscale("log")
            axis.set_title(f"{cores} · {shape}", fontsize=9)
            axis.set_xlabel("first chunk (s, log)")
            axis.set_ylabel("share of requests")
            axis.grid(alpha=0.3)
    figure.suptitle("First-chunk latency, all repetitions pooled")
    written.append(_save(plt, figure, axes, folder / "first_chunk_cdf.png"))

    figure, axes = plt.subplots(1, len(plans), figsize=(6 * len(plans), 3.8), squeeze=False)
    width = 0.8 / max(len(systems), 1)
    for col, cores in enumerate(plans):
        axis = axes[0][col]
        for index, system in enumerate(systems):
            xs, heights, errors = [], [], [[], []]
            for x, shape in enumerate(shapes):
                spread = spreads.get((cores, shape, system), {}).get("tok_s")
                if spread is None or math.isnan(spread.median):
                    continue
                xs.append(x + index * width)
                heights.append(spread.median)
                errors[0].append(spread.median - spread.low)
                errors[1].append(spread.high - spread.median)
            axis.bar(xs, heights, width, yerr=errors, capsize=3, label=system)
        axis.set_xticks([x + width * (len(systems) - 1) / 2 for x in range(len(shapes))], shapes, fontsize=8)
        axis.set_ylabel("output tokens/s (median, range)")
        axis.set_title(f"{cores} cores", fontsize=9)
        axis.grid(axis="y", alpha=0.3)
    written.append(_save(plt, figure, axes, folder / "throughput.png"))

    templates = [s for s in systems if s not in (RAW, BEAM)]
    if templates:
        figure, axes = plt.subplots(1, len(plans), figsize=(6 * len(plans), 4), squeeze=False)
        for col, cores in enumerate(plans):
            axis = axes[0][col]
            bars = [(shape, system) for shape in shapes for system in templates if (cores, shape, system) in spreads]
            bottoms = [0.0] * len(bars)
            for hop in HOPS:
                heights = [max(0.0, spreads[(cores, shape, system)][f"hop_p50:{hop}"].median) for shape, system in bars]
                heights = [0.0 if math.isnan(h) else h for h in heights]
                axis.bar(range(len(bars)), heights, bottom=bottoms, label=hop)
                bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
            labels = [f"{shape}\n{system}" for shape, system in bars]
            axis.set_xticks(range(len(bars)), labels, fontsize=6, rotation=30, ha="right")
            axis.set_ylabel("seconds (p50 of each hop, median over reps)")
            axis.set_title(f"{cores} cores: first chunk by hop", fontsize=9)
            axis.grid(axis="y", alpha=0.3)
        written.append(_save(plt, figure, axes, folder / "first_chunk_hops.png"))
    return written
