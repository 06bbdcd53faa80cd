"""``make bench``'s statistics, workload and core plans, and a tiny real run of the whole harness."""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys
import time

import numpy
import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.side_by_side import report, workload
from benchmarks.side_by_side.cores import plans, renice_tree
from benchmarks.side_by_side.stats import HOPS, RequestTiming, RunResult, Spread, across_reps, percentile, ratio, summarize
from pipeline.engines.lane_governor import LaneGovernor
from tests.conftest import wait_until


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(min_value=-1e6, max_value=1e6, allow_nan=False), min_size=1, max_size=60),
       st.floats(min_value=0, max_value=1))
def test_percentile_matches_numpy_linear_interpolation(values, q):
    assert percentile(values, q) == pytest.approx(float(numpy.percentile(values, q * 100)), rel=1e-9, abs=1e-6)


def test_percentile_edges():
    assert math.isnan(percentile([], 0.5))
    assert percentile([3.0, 1.0, 2.0], 0.0) == 1.0 and percentile([3.0, 1.0, 2.0], 1.0) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    with pytest.raises(ValueError):
        percentile([1.0], 1.5)


def _timing(key: str, sent: float, first: float, done: float, tokens: int, hops=None) -> RequestTiming:
    return RequestTiming(key, "question", sent, first, done, tokens, hops)


def test_summarize_measures_from_each_send_and_over_the_run_wall_time():
    run = RunResult("s", "burst", 1, "shared", [_timing("a", 10.0, 10.5, 12.0, 30, (0.1, 0.2, 0.0, 0.2)),
                                                 _timing("b", 11.0, 11.2, 14.0, 10, (0.05, 0.1, 0.0, 0.05))],
                    expected=3, cpu_s=2.0, peak_rss_mib=100.0)
    figures = summarize(run)
    assert figures["finished"] == 2 and figures["expected"] == 3
    assert figures["first_p50"] == pytest.approx(statistics.median([0.5, 0.2]))
    assert figures["done_p50"] == pytest.approx(statistics.median([2.0, 3.0]))
    assert figures["tok_s"] == pytest.approx(40 / 4.0)  # from the first send (10) to the last end (14)
    assert figures["cpu_s_per_1k_tokens"] == pytest.approx(2.0 / 40 * 1000)
    assert figures[f"hop_p50:{HOPS[0]}"] == pytest.approx(0.075)
    assert figures[f"hop_p50:{HOPS[3]}"] == pytest.approx(0.125)
    assert math.isnan(figures["accel_s_per_1k_tokens"])  # no system here reported its accelerator time


def test_accelerator_seconds_per_1k_tokens_come_from_every_answer_or_not_at_all():
    shared = dict(kind="question", sent=0.0, first=0.5, done=1.0)
    both = [RequestTiming("a", tokens=30, accelerator_s=0.3, **shared),
            RequestTiming("b", tokens=10, accelerator_s=0.1, **shared)]
    assert summarize(RunResult("s", "burst", 1, "shared", both, expected=2))["accel_s_per_1k_tokens"] == \
        pytest.approx(0.4 / 40 * 1000)
    partial = [both[0], RequestTiming("b", tokens=10, **shared)]  # a figure over some answers would flatter it
    assert math.isnan(summarize(RunResult("s", "burst", 1, "shared", partial, expected=2))["accel_s_per_1k_tokens"])


def test_padding_comes_from_the_batches_the_static_engine_logs_and_cpu_counts_the_model():
    from benchmarks.side_by_side.systems import padded_share
    from pipeline.engines.transformers_engine import BATCH_LOG, BatchPadding

    batches = [BatchPadding(4, 160, 20, 480, 300), BatchPadding(2, 80, 0, 100, 10)]
    log = "\n".join("2026-11-22 INFO pipeline.engines.transformers_engine: " + BATCH_LOG % (
        b.requests, b.positions, b.padding, 100 * b.share, b.prompt_padding, b.prompt_positions, b.decode_padding,
        b.decode_positions, 1.5) for b in batches)
    assert padded_share(log) == pytest.approx(330 / 820)
    assert padded_share("no batches here") is None
    run = RunResult("s", "burst", 1, "shared", [_timing("a", 0.0, 0.5, 2.0, 40)], expected=1, cpu_s=1.0,
                    model_cpu_s=3.0, padded_share=0.25)
    figures = summarize(run)
    assert figures["cpu_s_per_1k_tokens"] == pytest.approx(25.0)
    assert figures["all_cpu_s_per_1k_tokens"] == pytest.approx(100.0) and figures["padded_pct"] == pytest.approx(25.0)


def test_engine_ratios_compare_buckets_with_arrival_order_and_vllm_with_static_batching():
    def run(system, tokens, padded):
        return RunResult(system, "burst", 1, "shared", [_timing("a", 0.0, 0.5, 2.0, tokens)], expected=1, cpu_s=1.0,
                         padded_share=padded)
    spreads = across_reps([run(report.STATIC_ARRIVAL, 20, 0.5), run(report.STATIC_BUCKETS, 40, 0.05),
                           run(report.STATIC_PROMPT_BUCKETS, 25, 0.2), run(report.RAW, 100, None)])
    notes = report.engine_notes({system: figures for (_, _, system), figures in spreads.items()})
    assert notes[0].startswith("transformers, prompt buckets only / arrival order: tokens/s 1.25×, padded 50.0 % → 20.0 %")
    assert notes[1].startswith("transformers, length buckets / arrival order: tokens/s 2.00×, padded 50.0 % → 5.00 %")
    assert notes[2].startswith("raw vLLM / transformers in arrival order: tokens/s 5.00×")
    assert len(notes) == 3
    assert report.engine_notes({report.RAW: spreads[("shared", "burst", report.RAW)]}) == []


def test_hops_are_left_out_for_requests_without_them():
    run = RunResult("s", "burst", 1, "shared", [_timing("a", 0.0, 1.0, 2.0, 5), _timing("b", 0.0, 0.5, 1.0, 5, (0.1, 0.2, 0.0, 0.2))],
                    expected=2)
    figures = summarize(run)
    assert figures[f"hop_p50:{HOPS[1]}"] == pytest.approx(0.2)
    assert math.isnan(figures["cpu_s_per_1k_tokens"]) and math.isnan(figures["peak_rss_mib"])


def test_spreads_and_ratios_over_repetitions():
    runs = [RunResult("x", "burst", rep, "shared", [_timing("a", 0.0, first, 2.0, 10)], expected=1)
            for rep, first in ((1, 0.3), (2, 0.1), (3, 0.2))]
    runs += [RunResult("raw vLLM", "burst", 1, "shared", [_timing("a", 0.0, 0.05, 1.0, 10)], expected=1)]
    spreads = across_reps(runs)
    first = spreads[("shared", "burst", "x")]["first_p50"]
    assert (first.median, first.low, first.high, first.count) == (pytest.approx(0.2), 0.1, 0.3, 3)
    assert ratio(first, spreads[("shared", "burst", "raw vLLM")]["first_p50"]) == pytest.approx(4.0)
    assert math.isnan(ratio(first, Spread.of([])))
    assert math.isnan(ratio(first, Spread.of([0.0])))
    assert report.fmt(first) == "0.20 (0.10–0.30)" and report.fmt(Spread.of([250.0])) == "250"


def test_mixed_workload_is_seeded_and_has_every_kind():
    one, two = workload.mixed(200, 5), workload.mixed(200, 5)
    assert one == two and workload.mixed(200, 6) != one
    kinds = {p.kind for p in one}
    assert kinds == {"question", "record", "long answer"}
    records = [len(p.prompt) for p in one if p.kind == "record"]
    questions = [len(p.prompt) for p in one if p.kind == "question"]
    assert min(records) > 5 * max(questions)  # records are the long prompts
    assert len({p.id for p in one}) == 200


def test_budgets_give_each_kind_its_max_tokens_and_the_rest_the_runs():
    prompts = workload.with_budgets(workload.mixed(50, 5), workload.parse_budgets(" record=16, question=32"))
    messages = {p.kind: p.as_message(96)["max_tokens"] for p in prompts}
    assert messages == {"record": 16, "question": 32, "long answer": 96}
    assert workload.with_budgets(prompts, {}) == prompts
    for bad in ("record=0", "record", "record=x"):
        with pytest.raises(ValueError, match="KIND=TOKENS"):
            workload.parse_budgets(bad)
    with pytest.raises(ValueError, match="no prompts of kind \\['essay'\\]"):
        workload.with_budgets(prompts, {"essay": 8})


def test_budgets_are_refused_with_beams_handler_which_takes_one_max_tokens():
    from benchmarks.side_by_side.__main__ import parse_args

    assert parse_args(["--budgets", "record=16", "--systems", "raw,static-buckets"]).budgets == {"record": 16}
    with pytest.raises(SystemExit):
        parse_args(["--budgets", "record=16", "--systems", "raw,beam"])
    with pytest.raises(SystemExit):
        parse_args(["--budgets", "record=-1", "--systems", "raw"])


def test_fixed_lengths_ask_each_answer_to_run_to_its_budget_and_say_how_many_tokens_a_run_owes():
    prompts = workload.with_budgets(workload.mixed(12, 5), {"record": 16})
    fixed, natural = workload.with_lengths(prompts, workload.FIXED), workload.with_lengths(prompts, workload.NATURAL)
    assert all(m["min_tokens"] == m["max_tokens"] for m in (p.as_message(96) for p in fixed))
    assert not any("min_tokens" in p.as_message(96) for p in natural)
    assert workload.requested_tokens(fixed, 96) == sum(16 if p.kind == "record" else 96 for p in prompts)
    assert workload.requested_tokens(natural, 96) is None and workload.requested_tokens([], 96) is None
    with pytest.raises(ValueError):
        workload.with_lengths(prompts, "fixed")


def test_lengths_choose_fixed_bursts_and_natural_paced_arrivals_unless_told():
    from benchmarks.side_by_side.__main__ import _shapes, parse_args, used_lengths

    capacity = {workload.FIXED: 1.0, workload.NATURAL: 2.0}
    args = parse_args(["--rates", "0.5"])
    assert _shapes(args, capacity) == {"burst, fixed lengths": (None, workload.FIXED),
                                       "paced 0.5× capacity, natural lengths": (1.0, workload.NATURAL)}
    both = _shapes(parse_args(["--rates", "0.5", "--lengths", "both"]), capacity)
    assert list(both) == ["burst, fixed lengths", "burst, natural lengths", "paced 0.5× capacity, fixed lengths",
                          "paced 0.5× capacity, natural lengths"]
    assert used_lengths(parse_args(["--no-burst"])) == [workload.NATURAL]
    assert used_lengths(parse_args(["--lengths", "fixed"])) == [workload.FIXED]


def test_the_report_says_whether_every_system_did_the_work_asked_for():
    def run(system, shape, tokens, requested):
        return RunResult(system, shape, 1, "shared", [_timing("a", 0.0, 0.1, 1.0, tokens)], expected=1,
                         requested_tokens=requested)

    equal = [run(report.RAW, "burst", 8, 8), run("template", "burst", 8, 8)]
    assert report.work_note(equal, "shared", "burst").startswith("equal work: every system generated exactly")
    assert report.equal_work(equal).startswith("Equal work: all 2 fixed-length runs")
    unequal = [run(report.RAW, "burst", 8, 8), run("template", "burst", 7, 8)]
    assert "template rep 1: 7 of 8" in report.work_note(unequal, "shared", "burst")
    assert report.equal_work(unequal).startswith("UNEQUAL WORK: 1 of 2")
    context = report.Context(machine="m", date="d", model="x", max_tokens=8, seed=1, workload="w",
                             shapes={"burst": "burst of 1"}, rates={}, cores={"shared": "all"}, server_start_s={},
                             capacity_rps={}, reps=1)
    (_, _, rows, notes), = report.tables(unequal, context)
    assert [row[0] for row in rows] == [report.RAW, "template ⚠ not the tokens asked for"]
    assert "template / raw vLLM" in notes[-2] and notes[-2].endswith("tokens/s 0.88× (unequal work)")
    natural = [run(report.RAW, "burst", 8, None), run("template", "burst", 5, None)]
    assert report.work_note(natural, "shared", "burst").startswith("natural lengths:")
    (_, _, rows, notes), = report.tables(natural, context)
    assert rows[1][0] == "template" and "tokens/s not compared (natural lengths)" in notes[-2]


def test_workload_from_jsonl(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b", "id": "x", "kind": "k"}\n{"prompt": "c"}\n')
    prompts = workload.from_jsonl(path, 2)
    assert [(p.id, p.prompt, p.kind) for p in prompts] == [("p0", "a", "yours"), ("x", "b", "k")]
    path.write_text('{"text": "a"}\n')
    with pytest.raises(ValueError, match="prompts.jsonl:1"):
        workload.from_jsonl(path, 2)


def test_poisson_arrivals_have_the_asked_rate_and_bursts_arrive_at_once():
    assert workload.arrivals(5, None, 1) == [0.0] * 5
    offsets = workload.arrivals(4000, 2.0, 3)
    gaps = numpy.diff(offsets)
    assert offsets == sorted(offsets) and offsets[0] == 0.0
    assert numpy.mean(gaps) == pytest.approx(0.5, rel=0.06)
    assert numpy.std(gaps) == pytest.approx(0.5, rel=0.1)  # exponential: sd equals the mean
    with pytest.raises(ValueError):
        workload.arrivals(3, 0.0, 1)


def test_core_plans_split_and_refuse():
    isolated, shared = plans(["isolated", "shared"], {0, 1})
    assert (isolated.server, isolated.clients) == ({1}, {0})
    assert isolated.server_env() == {"VLLM_CPU_OMP_THREADS_BIND": "1"} and shared.server_env() == {}
    assert shared.server == shared.clients == {0, 1}
    big = plans(["isolated"], set(range(16)))[0]
    assert big.server == set(range(12, 16)) and big.clients == set(range(12))
    with pytest.raises(ValueError, match="at least 2"):
        plans(["isolated"], {0})


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="renicing threads reads Linux's /proc")
def test_server_niceness_variants_alternate_and_renice_every_thread_of_a_tree():
    from benchmarks.side_by_side.__main__ import niceness_order, parse_args

    assert niceness_order([], 1) == niceness_order([10], 2) == [None]
    assert niceness_order([0, 10], 1) == [0, 10] and niceness_order([0, 10], 2) == [10, 0]
    assert parse_args(["--server-niceness", "0,10"]).server_niceness == [0, 10]
    for bad in (["--server-niceness", "low"], ["--server-niceness", "5", "--server-url", "http://x:1", "--cores", "shared"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    # a parent with a thread of its own and a child: every thread of the tree moves
    script = "import subprocess, sys, threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); " \
             "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        tree = psutil.Process(parent.pid)
        for _ in range(100):
            if tree.children() and tree.num_threads() == 2:
                break
            time.sleep(0.05)
        threads = [(p.pid, t.id) for p in [tree, *tree.children()] for t in p.threads()]
        assert len(threads) == 3
        for niceness in (7, 12):  # upwards only: lowering needs root
            renice_tree(parent.pid, niceness)
            assert {os.getpriority(os.PRIO_PROCESS, tid) for _, tid in threads} == {niceness}
    finally:
        for process in [*tree.children(), tree]:
            process.kill()
        parent.wait()


@pytest.mark.engine
def test_a_tiny_run_of_the_harness_reports_every_system(vllm_server, emulator, tmp_path):
    from benchmarks.side_by_side.__main__ import parse_args, run

    args = parse_args(["--server-url", vllm_server.base_url, "--cores", "shared", "--reps", "1", "--requests", "3",
                       "--paced-requests", "2", "--rates-per-s", "4", "--max-tokens", "24",
                       "--systems", "raw,relay,template-buckets,static-arrival,beam", "--out", str(tmp_path)])
    with pytest.MonkeyPatch.context() as patch:
        for key, value in emulator.env().items():
            patch.setenv(key, value)
        folder = run(args, emulator)
    data = json.loads((folder / "runs.json").read_text())
    runs = data["runs"]
    assert {(r["system"], r["shape"]) for r in runs} == {
        (system, shape) for system in (report.RAW, report.RELAY, "template (length buckets)", report.STATIC_ARRIVAL,
                                       report.BEAM)
        for shape in ("burst, fixed lengths", "paced 4/s, natural lengths")}
    for run_record in runs:
        assert len(run_record["timings"]) == run_record["expected"], run_record
        tokens = sum(timing["tokens"] for timing in run_record["timings"])
        if run_record["shape"].startswith("burst"):  # every system, Beam's handler too, answered at full length
            assert tokens == run_record["requested_tokens"] == 3 * 24, run_record["system"]
        else:
            assert run_record["requested_tokens"] is None
        for timing in run_record["timings"]:
            assert timing["sent"] <= timing["first"] and timing["sent"] <= timing["done"]  # chunks and completions travel apart
            over_pubsub = run_record["system"].startswith("template") or run_record["system"] == report.RELAY
            if over_pubsub and timing["hops"] is not None:
                assert all(hop >= -0.005 for hop in timing["hops"]), timing
                assert sum(timing["hops"]) == pytest.approx(timing["first"] - timing["sent"], abs=0.005)
        if run_record["system"].startswith("template"):
            assert run_record["cpu_s"] > 0 and run_record["peak_rss_mib"] > 50
        if run_record["system"] == report.RELAY:  # it relays each first token at once, in its own process
            split = [timing["hops"] for timing in run_record["timings"] if timing["hops"] is not None]
            assert split and all(abs(hops[2]) < 0.005 for hops in split), split
            assert run_record["cpu_s"] > 0 and run_record["peak_rss_mib"] > 20
        static = run_record["system"] == report.STATIC_ARRIVAL  # its padding is measured, its model is its own
        assert (run_record["padded_share"] is not None) == static
        assert 0 <= (run_record["padded_share"] or 0) < 1 and run_record["model_cpu_s"] is None
    markdown = (folder / "report.md").read_text()
    assert "Equal work: all 5 fixed-length runs generated exactly the output tokens they asked for" in markdown
    assert "template (length buckets) / raw vLLM: first chunk p50" in markdown
    assert f"template (length buckets) / {report.RELAY}: first chunk p50" in markdown
    assert f"{report.RELAY} / raw vLLM: first chunk p50" in markdown
    assert f"template (length buckets) / {report.BEAM}: first chunk p50" in markdown
    assert "template (length buckets) / transformers in arrival order: tokens/s" in markdown
    for name in ("first_chunk_cdf.png", "throughput.png", "first_chunk_hops.png"):
        assert (folder / name).stat().st_size > 10_000


@pytest.mark.engine
def test_the_relay_publishes_as_many_chunks_as_the_template_would(vllm_server, emulator):
    """The floor pays for the same Pub/Sub messages as the template: every chunk by its default policy."""
    import argparse
    import threading

    from google.cloud import pubsub_v1

    from benchmarks.side_by_side.pubsub_relay import CHUNK_POLICY, Relay
    from tests.test_chunk_publisher import _Received

    name = f"relay-{int(time.time() * 1000) % 10**9}"
    emulator.create_topic(f"{name}-prompts", subscription=f"{name}-prompts-sub")
    topics = {kind: emulator.create_topic(f"{name}-{kind}", subscription=f"{name}-{kind}-sub", ordering=True)
              for kind in ("chunks", "completions")}
    chunks, completions = (_Received(emulator.subscription(f"{name}-{kind}-sub")) for kind in ("chunks", "completions"))
    args = argparse.Namespace(input_subscription=emulator.subscription(f"{name}-prompts-sub"),
                              chunks_topic=topics["chunks"], completions_topic=topics["completions"],
                              base_url=vllm_server.base_url, model=vllm_server.spec.served_model_name, max_tokens=48)
    stop = threading.Event()
    relay = threading.Thread(target=Relay(args).run, args=(stop,), daemon=True)
    relay.start()
    try:
        prompt = next(p for p in workload.mixed(8, 11) if p.kind == "record").prompt
        publisher = pubsub_v1.PublisherClient()
        publisher.publish(emulator.topic(f"{name}-prompts"), json.dumps({"id": "r1", "prompt": prompt}).encode()).result()
        assert wait_until(lambda: completions.of("r1") and any(c["final"] for c in chunks.of("r1")), 120)
        (completion,) = completions.of("r1")
        mine = sorted(chunks.of("r1"), key=lambda c: c["seq"])
        assert [c["seq"] for c in mine] == list(range(len(mine))) and mine[-1]["final"]
        assert "".join(c["text"] for c in mine) == completion["text"]
        tokens = completion["usage"]["completion_tokens"]
        assert tokens > CHUNK_POLICY.chunk_tokens  # enough to cut more than the first chunk
        assert len(mine) >= 1 + tokens // CHUNK_POLICY.chunk_tokens  # the first text, every chunk_tokens, the end
    finally:
        stop.set()
        relay.join(timeout=30)
        chunks.stop()
        completions.stop()


def test_the_scale_models_ranges_spread_real_ids_evenly_and_back_the_default_generate_keys():
    """benchmarks/scale.py's model of Dataflow's key ranges, and the claim behind DATAFLOW_GENERATE_SHARDS
    (pipeline/contract/parameters.py) that it measures: per-request keys do no better at 100 workers, where the
    batcher's 16 shards leave most GPUs idle."""
    from collections import Counter

    from benchmarks.scale import simulate, worker_of
    from pipeline.contract.parameters import DATAFLOW_GENERATE_SHARDS

    ids = [f"req-{i}" for i in range(20_000)]
    workers = Counter(worker_of(i.encode(), 10) for i in ids)
    assert sorted(workers) == list(range(10)) and max(workers.values()) < 1.1 * len(ids) / 10
    rows = {(r.keying, r.workers): r for r in simulate(20_000, seed=1, in_flight=1024, requests_per_s=200,
                                                         poll_interval_s=0.05)}
    default, per_request = rows[(f"{DATAFLOW_GENERATE_SHARDS} shards", 100)], rows[("request id", 100)]
    assert default.usable_share >= 0.9 * per_request.usable_share and default.idle_workers == 0
    assert rows[("16 shards", 100)].usable_share < 0.5 * default.usable_share


def test_step_cost_times_each_kind_of_step_on_this_device(capsys):
    """``make bench-step-cost`` on this machine's CPU, tiny: a row of figures for every step asked for, and each
    decoding size against the first (what docs/benchmarks.md#step-cost reports from a GPU and from here)."""
    from benchmarks import step_cost

    assert step_cost.main(["--shape", "135m", "--rows", "1,2", "--prompt-tokens", "8", "--past", "4",
                           "--reps", "2", "--warmup", "0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    figures = {m[1]: tuple(map(float, m.groups()[1:])) for line in lines
               if (m := re.fullmatch(r"\| (.+) \| ([\d.]+) \(([\d.]+)-([\d.]+)\) \|", line))}
    assert set(figures) == {"prompt step, 8 tokens", "decoding step, 1 rows", "decoding step, 2 rows"}, lines
    for name, (median, low, high) in figures.items():
        assert 0 < low <= median <= high, (name, median, low, high)
    assert any(line.startswith("decoding step, 2 rows against 1 (ms): ") for line in lines), lines


def test_the_lanes_frontier_names_the_best_fixed_share_that_keeps_the_goal_and_weighs_the_adaptive_lane(tmp_path):
    from benchmarks import lanes

    def measured(p95_alone, p95_beside, bulk):
        return {"alone p95": [p95_alone, p95_alone], "beside p95": [p95_beside, p95_beside],
                "alone inter p95": [50.0, 50.0], "beside inter p95": [60.0, 80.0], "bulk beside": [bulk, bulk]}
    figures = {"1": measured(0.5, 0.55, 40.0), "4": measured(0.5, 0.59, 90.0), "16": measured(0.5, 1.5, 150.0),
               "adaptive": measured(0.5, 0.58, 85.0), "adaptive:400": measured(0.5, 0.52, 45.0),
               "whole": measured(0.5, 2.0, 160.0)}
    points = lanes.frontier(figures)
    assert [p.lane for p in points] == ["1", "4", "16", "adaptive", "adaptive:400", "whole"]
    assert points[1].first_chunk_p95_ratio == pytest.approx(1.18) and points[0].inter_token_p95_ratio == 1.4
    table = lanes.frontier_table(points, 1.2)
    assert "Ratio 1.2 by first chunk: best fixed share keeping it: 4 streams" in table, table
    assert f"  adaptive: ratio 1.16 (within 1.2), bulk {85.0 / 90.0:.2f}x that share's" in table
    assert f"  adaptive:400: ratio 1.04 (within 1.2), bulk {45.0 / 90.0:.2f}x that share's" in table
    assert "whole: ratio" not in table, "the whole share is no adaptive lane"
    tight = lanes.frontier_table(lanes.frontier({"8": measured(0.5, 1.0, 99.0), "2": measured(0.5, 0.8, 20.0)}), 1.2)
    assert "none keeps it: the tightest): 2 streams" in tight, tight
    alone = {"alone server p95": [100.0, 100.0], "alone read p95": [200.0, 200.0]}
    calibrated = lanes.frontier({
        "1": measured(0.5, 0.75, 12.0) | alone | {"beside server p95": [150.0, 150.0], "beside read p95": [250.0] * 2},
        "2": measured(0.5, 1.1, 20.0) | alone | {"beside server p95": [210.0, 210.0], "beside read p95": [390.0] * 2},
        "adaptive:x2": measured(0.5, 0.9, 19.0) | alone | {"beside server p95": [190.0, 190.0],
                                                           "beside read p95": [300.0] * 2}})
    by_ratio = lanes.frontier_table(calibrated, 1.2)
    assert "Ratio 2 by first chunk: best fixed share keeping it: 2 streams, ratio 2.20" not in by_ratio
    assert "Ratio 2 by first token at the server: best fixed share keeping it: 1 streams, ratio 1.50" in by_ratio
    assert "Ratio 2 by first token from its read: best fixed share keeping it: 2 streams, ratio 1.95" in by_ratio
    assert f"  adaptive:x2: ratio 1.90 (within 2), bulk {19.0 / 12.0:.2f}x" in by_ratio, by_ratio
    assert f"  adaptive:x2: ratio 1.50 (within 2), bulk {19.0 / 20.0:.2f}x" in by_ratio, by_ratio
    lanes.plot(points, 1.2, tmp_path / "frontier.png")
    assert (tmp_path / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_lanes_report_prints_first_chunk_and_time_per_token_at_p50_and_p95_against_alone(capsys):
    import argparse

    from benchmarks import lanes
    figures = {name: [2.0, 4.0] for name in lanes.FIGURES} | {"alone p50": [1.0, 1.0], "alone inter p50": [50.0, 50.0],
                                                              "beside inter p50": [75.0, 100.0]}
    args = argparse.Namespace(reps=2, live=6, warm_live=2, tokens=16, live_every_s=1.0, bulk_tokens=32,
                              step_tokens=256, template_arg=[])
    lanes.report(args, figures, "4")
    out = capsys.readouterr().out
    assert "lane 4 (--live_first_token_slo_ms=0 --live_inter_token_slo_ms=0 --max_bulk_streams=4)" in out
    assert "a backlog of 16 unanswered" in out, "twice the lane's streams and some"
    assert "| live first token at the server p95 (ms) | 3.00 (2.00-4.00) | 3.00 (2.00-4.00) | 1.00 (1.00-1.00) |" \
        in out, out
    assert "| live first token from its read p95 (ms) | 3.00 (2.00-4.00) | 3.00 (2.00-4.00) | 1.00 (1.00-1.00) |" \
        in out, out
    lanes.report(args, figures, "adaptive:x1.2", ["--live_first_token_slo_ms=420"])
    assert "lane adaptive:x1.2 (--live_first_token_slo_ms=420)" in capsys.readouterr().out, "as it ran"
    assert "| live first chunk p50 | 1.00 s (1.00-1.00) | 3.00 s (2.00-4.00) | 3.00 (2.00-4.00) |" in out, out
    assert "| live time per token p50 (ms) | 50.00 (50.00-50.00) | 87.50 (75.00-100.00) | 1.75 (1.50-2.00) |" in out
    assert "| live time per token p95 (ms) |" in out


def test_each_lane_the_bench_compares_is_template_parameters_the_template_takes():
    from benchmarks import lanes
    from pipeline.config.settings import JobSettings

    project = "projects/my-project"
    base = {"input_subscription": f"{project}/subscriptions/live", "bulk_subscription": f"{project}/subscriptions/bulk",
            "output_chunks_topic": f"{project}/topics/chunks", "dead_letter_topic": f"{project}/topics/dead"}
    default_slo = JobSettings.from_mapping(base).engine.live_first_token_slo_ms
    for lane, ceiling, governed, slo in (("adaptive", 48, True, default_slo), ("adaptive:600", 48, True, 600),
                                         ("whole", 48, False, 0), ("4", 4, False, 0)):
        values = dict(arg.removeprefix("--").split("=", 1) for arg in lanes.lane_args(lane))
        engine = JobSettings.from_mapping({**base, **values}).engine
        governor = LaneGovernor(engine.live_first_token_slo_ms, engine.bulk_stream_ceiling,
                                engine.live_inter_token_slo_ms)
        assert (engine.bulk_stream_ceiling, governor.governed, engine.live_first_token_slo_ms) == \
            (ceiling, governed, slo), lane
    assert lanes.lane_args("adaptive:x1.5", [400.0, 600.0, 500.0]) == ["--live_first_token_slo_ms=750",
                                                                        "--live_inter_token_slo_ms=0"], \
        "1.5 times the median of live's first token p95s from its read measured alone"
    assert JobSettings.from_mapping(base).engine.bulk_streams == lanes.WHOLE_SHARE
    for bad in ("0", "adaptive:", "adaptive:fast", "adaptive:x", "adaptive:x0", "adaptive:x-1"):
        with pytest.raises(SystemExit, match="not adaptive, adaptive:MS, adaptive:xR, whole or a number"):
            lanes.lane_args(bad)
    with pytest.raises(SystemExit, match="takes its objective from another lane"):
        lanes.main(["--lanes", "adaptive:x1.2"])


def test_the_lanes_bulk_rate_counts_only_tokens_delivered_by_the_attempt_each_completion_names():
    """A lane that sheds a stream and starts it over generated the shed attempt's tokens for nothing: the rate
    weighed against fixed shares (which shed nothing) counts the attempt each completion names, once a chunk."""
    from benchmarks import lanes
    from local.harness import OutputCollector, Received

    collector = OutputCollector({})
    chunk = lambda stream, seq, tokens, at: Received({"id": "bulk-0-a", "stream": stream, "seq": seq,  # noqa: E731
                                                      "tokens": tokens}, at)
    collector.chunks += [chunk("shed", 0, 4, 1.0), chunk("shed", 1, 8, 2.0),  # the attempt shed, then
                         chunk("kept", 0, 4, 3.0), chunk("kept", 1, 8, 4.0), chunk("kept", 1, 8, 4.5),  # a copy
                         chunk("kept", 2, 12, 9.0)]  # after the span
    collector.completions.append(Received({"id": "bulk-0-a", "stream": "kept"}, 9.5))
    assert lanes.tokens_between(collector, "bulk-0-", 0.0, 5.0) == 8, "the kept attempt's 8, none of the shed 8"
    assert lanes.tokens_between(collector, "bulk-1-", 0.0, 5.0) == 0


def test_each_governed_repetition_is_judged_against_the_objective_it_was_given_in_milliseconds():
    from benchmarks import lanes

    figures = {"alone read p95": [300.0, 280.0], "beside read p95": [400.0, 525.0]}
    assert lanes.objective_verdict(["--live_first_token_slo_ms=540", "--live_inter_token_slo_ms=0"], figures) == (
        "objective 540 ms: live first token from its read p95 525 ms beside the lane (within it), 1.88 times its "
        "own 280 ms alone")
    assert "(past it)" in lanes.objective_verdict(["--live_first_token_slo_ms=500"], figures)
    assert lanes.objective_verdict(list(lanes.OBJECTIVES_OFF) + ["--max_bulk_streams=2"], figures) is None
    assert lanes.objective_verdict([], figures) is None
