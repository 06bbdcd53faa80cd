"""The dashboard and alert policies in ops/: Google's own types parse them, every query is PromQL over a metric the job
really has, `make dashboard` and `make alerts` send them through the real gcloud (to the loopback recorder), and the
counters they read count what they say."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import apache_beam as beam
import promql_parser
import pytest
from apache_beam.metrics.execution import MetricsContainer
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.runners.worker import statesampler
from apache_beam.utils.counters import CounterFactory
from google.cloud import monitoring_dashboard_v1, monitoring_v3
from hypothesis import given, settings, strategies as st

from ops import monitoring
from ops.deploy import DeployError, Settings
from pipeline.contract.messages import STAGE_INFERENCE, STAGE_PARSE, STAGE_SINK
from pipeline.generation.step_outputs import FIRST_TOKEN_BOUNDS_S, StepOutputs, first_token_counter_name
from pipeline.sinks.dead_letter_count import CountDeadLetters
from tests.gcloud_recorder import Recorder
from tests.test_deploy import make

REPO = Path(__file__).resolve().parent.parent
SETTINGS = {"PROJECT": "proj-123456", "JOB_NAME": "streaming-llm-20261125-120000",
            "INPUT_SUBSCRIPTION": "projects/proj-123456/subscriptions/prompts-sub"}
USER_COUNTER = "dataflow_googleapis_com:job_user_counter"
# The Google metrics the files may read, each with the label that ties a series to this job, and where it is listed.
DATAFLOW_METRICS = "https://cloud.google.com/monitoring/api/metrics_gcp_d_h#gcp-dataflow"
PUBSUB_METRICS = "https://cloud.google.com/monitoring/api/metrics_gcp_p_z#gcp-pubsub"
GOOGLE_METRICS = {
    USER_COUNTER: ("job_name", DATAFLOW_METRICS),
    "dataflow_googleapis_com:job_gpu_utilization": ("job_name", DATAFLOW_METRICS),
    "dataflow_googleapis_com:job_gpu_memory_utilization": ("job_name", DATAFLOW_METRICS),
    "pubsub_googleapis_com:subscription_oldest_unacked_message_age": ("subscription_id", PUBSUB_METRICS),
    "pubsub_googleapis_com:subscription_num_undelivered_messages": ("subscription_id", PUBSUB_METRICS),
}


def filled() -> dict[str, dict]:
    """Every file in ops/ as make fills it in with the default thresholds."""
    values = monitoring.placeholders(Settings(SETTINGS))
    files = {monitoring.DASHBOARD: monitoring.rendered(monitoring.DASHBOARD, values)}
    files.update({path: monitoring.rendered(path, values) for path in monitoring.alert_files()})
    return files


def queries(document: dict) -> list[str]:
    found = []

    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("prometheusQuery", "query") and isinstance(value, str):
                    found.append(value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)
    walk(document)
    return found


def published_counters() -> list[re.Pattern]:
    """The names of the Beam counters the pipeline's code makes: ``Metrics.counter(namespace, NAME)`` where NAME is a
    literal, an f-string (its fields match anything), a call of a function of the same module returning one, or
    the variable of a comprehension over a module-level tuple of literals (of any module of pipeline/)."""
    names = []
    trees = [ast.parse(path.read_text(encoding="utf-8")) for path in (REPO / "pipeline").rglob("*.py")]
    tuples = {target.id: [item.value for item in node.value.elts] for tree in trees for node in tree.body
              if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple)
              and all(isinstance(item, ast.Constant) and isinstance(item.value, str) for item in node.value.elts)
              for target in node.targets if isinstance(target, ast.Name)}
    for tree in trees:
        over = {generator.target.id: tuples[generator.iter.id] for node in ast.walk(tree)
                if isinstance(node, ast.comprehension) for generator in (node,)
                if isinstance(generator.target, ast.Name) and isinstance(generator.iter, ast.Name)
                and generator.iter.id in tuples}
        returned = {node.name: node.body[-1].value for node in tree.body if isinstance(node, ast.FunctionDef)
                    and isinstance(node.body[-1], ast.Return) and isinstance(node.body[-1].value, ast.JoinedStr)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "counter"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "Metrics"):
                name = node.args[1]
                if isinstance(name, ast.Call) and isinstance(name.func, ast.Name) and name.func.id in returned:
                    name = returned[name.func.id]
                if isinstance(name, ast.Name) and name.id in over:
                    names.extend(re.compile(re.escape(value)) for value in over[name.id])
                elif isinstance(name, ast.Constant):
                    names.append(re.compile(re.escape(name.value)))
                elif isinstance(name, ast.JoinedStr):
                    names.append(re.compile("".join(re.escape(part.value) if isinstance(part, ast.Constant) else ".+"
                                                    for part in name.values)))
    return names


def test_the_counter_scan_sees_literal_f_string_and_helper_names():
    """The check below is only as good as this scan: names of all three kinds are found, a made-up one is not."""
    names = published_counters()
    for name in ("completions", "dead_letters_inference", first_token_counter_name(5), "server_restarts",
                 "failed_parse"):
        assert any(pattern.fullmatch(name) for pattern in names), name
    assert not any(pattern.fullmatch("completion") for pattern in names)


def test_every_file_is_a_dashboard_or_alert_policy_to_google_s_own_types():
    files = filled()
    assert len(files) == 1 + 5
    for path, document in files.items():
        text = json.dumps(document)
        assert "${" not in text.replace("${metric.labels.", ""), f"{path.name}: a placeholder left unfilled"
        if path == monitoring.DASHBOARD:
            # Strict: a field the API does not know raises, as the API would refuse it.
            dashboard = monitoring_dashboard_v1.Dashboard.from_json(text)
            tiles = dashboard.mosaic_layout.tiles
            assert len(tiles) >= 9
            cells = set()
            for tile in tiles:  # tiles lie inside the grid and do not overlap
                assert tile.x_pos + tile.width <= dashboard.mosaic_layout.columns
                area = {(x, y) for x in range(tile.x_pos, tile.x_pos + tile.width)
                        for y in range(tile.y_pos, tile.y_pos + tile.height)}
                assert not area & cells, tile.widget.title
                cells |= area
        else:
            policy = monitoring_v3.AlertPolicy.from_json(text)
            assert policy.documentation.content and "docs/operations.md#alerts" in policy.documentation.content
            assert policy.conditions and all(c.condition_prometheus_query_language.query for c in policy.conditions)


def test_every_query_is_promql_over_a_metric_the_job_has_for_this_job_only():
    names = published_counters()
    for path, document in filled().items():
        for query in queries(document):
            selectors = []
            promql_parser.walk(promql_parser.parse(query), lambda node: selectors.append(node) if isinstance(
                node, promql_parser.VectorSelector) else None)
            assert selectors, query
            for selector in selectors:
                assert selector.name in GOOGLE_METRICS, f"{path.name}: {selector.name} is not a metric we know of"
                matchers = {m.name: m for m in selector.matchers.matchers}
                scope = GOOGLE_METRICS[selector.name][0]
                expected = {"job_name": SETTINGS["JOB_NAME"], "subscription_id": "prompts-sub"}[scope]
                assert matchers[scope].op == promql_parser.MatchOp.Equal and matchers[scope].value == expected, query
                if selector.name == USER_COUNTER:
                    metric = matchers["metric_name"]
                    if metric.op == promql_parser.MatchOp.Equal:
                        assert any(p.fullmatch(metric.value) for p in names), \
                            f"{path.name}: no counter {metric.value!r} in pipeline/"
                    else:
                        assert metric.op == promql_parser.MatchOp.Re and metric.value in {p.pattern for p in names}, \
                            f"{path.name}: {metric.value!r} is not the pattern of a counter in pipeline/"


def test_make_dashboard_and_make_alerts_send_the_files_through_gcloud(tmp_path):
    recorder = Recorder(str(tmp_path / "gcloud-config"))
    try:
        dashboard = make("dashboard", recorder, None, **SETTINGS)
        assert dashboard.returncode == 0, dashboard.stdout + dashboard.stderr
        alerts = make("alerts", recorder, None, **SETTINGS, ALERT_TTFT_P95_S="10",
                      NOTIFICATION_CHANNELS="projects/proj-123456/notificationChannels/42")
        assert alerts.returncode == 0, alerts.stdout + alerts.stderr
    finally:
        recorder.close()
    sent = recorder.find("POST", r"^/v1/projects/proj-123456/dashboards$")
    assert len(sent) == 1 and sent[0].json() == filled()[monitoring.DASHBOARD]
    policies = [request.json() for request in recorder.find("POST", r"^/v3/projects/proj-123456/alertPolicies$")]
    values = monitoring.placeholders(Settings({**SETTINGS, "ALERT_TTFT_P95_S": "10"}))
    expected = [monitoring.rendered(path, values) for path in monitoring.alert_files()]
    assert [{k: v for k, v in p.items() if k != "notificationChannels"} for p in policies] == \
        [{k: v for k, v in p.items() if k != "notificationChannels"} for p in expected]
    assert all(p["notificationChannels"] == ["projects/proj-123456/notificationChannels/42"] for p in policies)
    assert any('metric_name="first_token_over_10s"' in query for p in policies for query in queries(p))


def test_running_make_dashboard_and_make_alerts_again_updates_what_they_made(tmp_path):
    """A second run (new thresholds, channels added) updates the job's dashboard and each of its policies, found
    by title and labels, instead of adding copies; alerts without channels are named in a warning."""
    recorder = Recorder(str(tmp_path / "gcloud-config"))
    try:
        first = make("alerts", recorder, None, **SETTINGS)
        assert first.returncode == 0, first.stderr
        assert "NOTIFICATION_CHANNELS is empty" in first.stderr and "backlog-age" in first.stderr
        for _ in range(2):
            assert make("dashboard", recorder, None, **SETTINGS).returncode == 0
        again = make("alerts", recorder, None, **SETTINGS, ALERT_BACKLOG_AGE_S="900",
                     NOTIFICATION_CHANNELS="projects/proj-123456/notificationChannels/42")
        assert again.returncode == 0, again.stderr
        assert "NOTIFICATION_CHANNELS is empty" not in again.stderr
        other = make("dashboard", recorder, None, **{**SETTINGS, "JOB_NAME": "another-job"})
        assert other.returncode == 0
    finally:
        recorder.close()
    stems = [path.stem for path in monitoring.alert_files()]
    assert len(recorder.find("POST", r"^/v3/projects/proj-123456/alertPolicies$")) == len(stems)
    assert len(recorder.find("PATCH", r"^/v3/projects/proj-123456/alertPolicies/")) == len(stems)
    assert len(recorder.find("POST", r"^/v1/projects/proj-123456/dashboards$")) == 2, "one per job"
    assert len(recorder.find("PATCH", r"^/v1/projects/proj-123456/dashboards/")) == 1
    policies = [m for m in recorder.made if "/alertPolicies/" in m["name"]]
    assert sorted(p["userLabels"]["streaming_llm_alert"] for p in policies) == sorted(stems)
    assert all(p.get("notificationChannels") == ["projects/proj-123456/notificationChannels/42"] for p in policies)
    assert any("900 s" in p["displayName"] for p in policies)


@pytest.mark.parametrize("bad, words", [
    ({"JOB_NAME": "Not_A_Job"}, "JOB_NAME"),
    ({"INPUT_SUBSCRIPTION": "prompts-sub"}, "projects/PROJECT/subscriptions/ID"),
    ({"ALERT_TTFT_P95_S": "3"}, "pick one of these"),
    ({"ALERT_DEAD_LETTER_RATIO": "1.5"}, "below 1"),
    ({"ALERT_BACKLOG_AGE_S": "-1"}, "above 0"),
    ({"ALERT_BACKLOG_AGE_S": "nan"}, "above 0"),
    ({"PROJECT": ""}, "Set PROJECT"),
])
def test_a_bad_setting_is_named_and_nothing_is_sent(tmp_path, bad, words):
    recorder = Recorder(str(tmp_path / "gcloud-config"))
    try:
        result = make("alerts", recorder, None, **{**SETTINGS, **bad})
    finally:
        recorder.close()
    assert result.returncode != 0 and words in result.stderr, result.stderr
    assert not recorder.requests


NUMBER_LOOKALIKES = st.sampled_from(["1_000", "\uff15", "inf", "1e3", "0x10", " 5", "0.5", "10", "600.0", "-0"])


@given(st.dictionaries(st.sampled_from(sorted(SETTINGS) + sorted(monitoring.THRESHOLDS)),
                       st.one_of(st.text(max_size=40), NUMBER_LOOKALIKES)))
@settings(max_examples=300, deadline=None)
def test_any_setting_fills_valid_files_or_is_refused_by_name(changes):
    """Fuzzed settings: either DeployError, or files whose queries still parse and name only this job."""
    try:
        values = monitoring.placeholders(Settings({**SETTINGS, **changes}))
    except DeployError as exc:
        assert any(name in str(exc) for name in (*SETTINGS, *monitoring.THRESHOLDS))
        return
    for path in (monitoring.DASHBOARD, *monitoring.alert_files()):
        for query in queries(monitoring.rendered(path, values)):
            promql_parser.parse(query)
            assert values["JOB_NAME"] in query or values["SUBSCRIPTION_ID"] in query


def counters_of(run) -> dict[str, int]:
    """What Beam's own counters hold after ``run()``, run as a worker runs a DoFn (a metrics container in scope)."""
    container = MetricsContainer("step")
    sampler = statesampler.StateSampler("stage", CounterFactory())
    statesampler.set_current_tracker(sampler)
    try:
        with sampler.scoped_state("step", "process", metrics_container=container):
            run()
    finally:
        statesampler.set_current_tracker(None)
    return {key.metric.name: value for key, value in container.get_cumulative().counters.items()}


@given(st.lists(st.integers(0, 120_000), max_size=60))
@settings(max_examples=100, deadline=None)
def test_first_token_counters_say_how_many_answers_waited_over_each_bound(ttfts_ms):
    outputs = StepOutputs()
    counters = counters_of(lambda: [outputs.count_first_token(ttft) for ttft in ttfts_ms])
    assert counters.get("first_tokens", 0) == len(ttfts_ms)
    for bound in FIRST_TOKEN_BOUNDS_S:
        assert counters.get(first_token_counter_name(bound), 0) == sum(t > 1000 * bound for t in ttfts_ms)
    if ttfts_ms:  # the alert's reading: p95 over a bound exactly when more than 5 % of answers are over it
        ranked = sorted(ttfts_ms)
        p95 = ranked[-(len(ranked) // 20) - 1]  # the smallest value with at most 5 % of answers above it
        for bound in FIRST_TOKEN_BOUNDS_S:
            over = counters.get(first_token_counter_name(bound), 0) / counters["first_tokens"]
            assert (over > 0.05) == (p95 > 1000 * bound), (bound, p95, over)


def test_every_dead_letter_is_counted_under_its_stage():
    letters = [{"id": f"r{i}", "stage": stage, "reason": "x"}
               for i, stage in enumerate([STAGE_PARSE] * 3 + [STAGE_INFERENCE] * 2 + [STAGE_SINK])]
    pipeline = beam.Pipeline(runner="BundleBasedDirectRunner")
    _ = pipeline | beam.Create(letters) | beam.ParDo(CountDeadLetters())
    result = pipeline.run()
    result.wait_until_finish()
    found = {c.key.metric.name: c.committed
             for c in result.metrics().query(MetricsFilter().with_namespace("dead_letters"))["counters"]}
    assert found == {"dead_letters_parse": 3, "dead_letters_inference": 2, "dead_letters_sink": 1}


def test_the_docs_explain_every_alert():
    docs = (REPO / "docs" / "operations.md").read_text(encoding="utf-8")
    section = docs[docs.index("## Dashboard and alerts"):]
    for path in monitoring.alert_files():
        assert f"`ops/alerts/{path.name}`" in section, path.name
    for setting in monitoring.THRESHOLDS:
        assert f"`{setting}`" in section
