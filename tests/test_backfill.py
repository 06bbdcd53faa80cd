"""The backfill feeder (ops/backfill.py): rows from files or BigQuery become the messages the stream would receive,
answered ids are skipped, bad rows (any shape: fuzzed) become dead letters with their position, a rerun leaves what
an earlier run published to wait in the subscription and sends again only what the job dead-lettered for a reason a
resend can change, --wait ends once every row is answered or dead-lettered, and a run killed half-way and run again
publishes every unanswered row and no answered one. Against the Pub/Sub and BigQuery emulators."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow
import pyarrow.parquet as parquet
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from local.emulators import PROJECT, GcsEmulator, PubSubEmulator, emulator_bigquery_client
from ops import backfill
from pipeline.contract.messages import STAGE_PARSE, DeadLetter, InferenceRequest
from pipeline.contract.request_parsing import parse_request
from pipeline.sinks.bigquery_sink import (
    KIND_COMPLETIONS,
    KIND_DEAD_LETTERS,
    completion_row,
    dead_letter_row,
    ensure_table,
)
from tests.conftest import activated, wait_until

REPO = Path(__file__).resolve().parent.parent
RUNS = iter(range(10**6))


def write_sources(folder: Path) -> list[str]:
    """The same kind of records three ways, with the bad rows a history has."""
    jsonl = folder / "tickets.jsonl"
    jsonl.write_text("\n".join([
        json.dumps({"id": "t-1", "prompt": "My card was charged twice.", "customer": "acme", "tier": 2}),
        "{not json",
        json.dumps({"id": "t-2", "prompt": "The app crashes on login.", "customer": "globex"}),
        json.dumps({"prompt": "A row without an id."}),
        json.dumps({"id": "t-3", "prompt": "Refund please.", "max_tokens": "lots"}),
        json.dumps({"id": "t-1", "prompt": "My card was charged twice.", "customer": "acme", "tier": 2}),
        json.dumps({"id": "t-2", "prompt": "Another text under an id already used."}),
    ]) + "\n")
    csv = folder / "tickets.csv"
    csv.write_text("ticket,body,variant,limit\nc-1,Where is my parcel?,,64\nc-2,,,\nc-3,Cancel my plan.,,16\n")
    table = pyarrow.table({"id": ["p-1", "p-2"], "prompt": ["Reset my password.", "Change my address."],
                           "opened": [1, 2]})
    parquet.write_table(table, folder / "tickets.parquet")
    return [str(jsonl), str(csv), str(folder / "tickets.parquet")]


def test_each_row_becomes_the_message_the_stream_would_get_or_a_dead_letter_with_its_position(tmp_path):
    jsonl, csv, pq = write_sources(tmp_path)
    rows = list(backfill.read_rows([jsonl], PROJECT))
    assert [r.position for r in rows] == [f"{jsonl}:{n}" for n in range(1, 8)]
    mapping = backfill.Mapping()
    made = [backfill.checked(row, mapping) for row in rows]
    data, request = made[0]
    assert json.loads(data) == {"id": "t-1", "prompt": "My card was charged twice.",
                                "metadata": {"customer": "acme", "tier": 2}}
    assert request == parse_request(data, now=request.received_at), "the template's own parser reads it"
    letters = {i: m for i, m in enumerate(made) if not isinstance(m, tuple)}
    assert sorted(letters) == [1, 3, 4]
    assert letters[1].reason.startswith(f"{jsonl}:2: not JSON") and letters[1].attributes["source_position"]
    assert "no id" in letters[3].reason and "max_tokens" in letters[4].reason
    csv_rows = list(backfill.read_rows([csv], PROJECT))
    by_column = backfill.Mapping("ticket", "body", {"max_tokens": "limit"})
    first = backfill.checked(csv_rows[0], by_column)
    assert isinstance(first, tuple) and first[1].max_tokens == 64 and first[1].id == "c-1"
    assert csv_rows[1].position == f"{csv}:3" and not isinstance(backfill.checked(csv_rows[1], by_column), tuple), \
        "a row without a prompt is a dead letter"
    parquet_rows = list(backfill.read_rows([pq], PROJECT))
    assert [backfill.checked(r, mapping)[1].id for r in parquet_rows] == ["p-1", "p-2"]
    with pytest.raises(backfill.BackfillError, match="no such file"):
        list(backfill.read_rows([str(tmp_path / "missing-*.jsonl")], PROJECT))


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=12), st.one_of(st.none(), st.booleans(), st.integers(), st.floats(),
                                                          st.text(max_size=30), st.lists(st.integers(), max_size=3)),
                       max_size=6))
def test_no_row_makes_the_feeder_raise_it_is_a_request_or_a_dead_letter(values):
    result = backfill.checked(backfill.Row("fuzz:1", values), backfill.Mapping())
    if isinstance(result, tuple):
        assert isinstance(result[1], InferenceRequest) and result[1].id == str(values["id"])
    else:
        assert result.reason.startswith("fuzz:1: ") and result.attributes["source_position"] == "fuzz:1"


# The pieces hostile histories are made of: CSV's own syntax, long runs, bytes that are not UTF-8, NULs, deep JSON.
_PIECES = st.sampled_from([b",", b"\"", b"\n", b"\r\n", b"\x00", b"\xff\xfe", b"\xc3", b"id", b"prompt", b"{",
                           b"[", b"}", b"\\", "é".encode(), b"messages", b"max_tokens", b"-1", b"1e999", b"null"])
_CHUNKS = st.one_of(_PIECES, st.binary(max_size=40),
                    st.builds(lambda piece, n: piece * n, _PIECES, st.sampled_from([2, 64, 5000, 140_000])))


@given(header=st.sampled_from([b"id,prompt\n", b"id,prompt,messages,max_tokens\n", b"", b"\"id\n"]),
       body=st.lists(_CHUNKS, max_size=40), suffix=st.sampled_from([".csv", ".jsonl"]))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                                   HealthCheck.function_scoped_fixture])
def test_fuzz_no_csv_or_jsonl_file_stops_a_backfill(tmp_path, header, body, suffix):
    """Whatever a CSV or JSONL file holds, every row it yields is a request or a dead letter with its position;
    nothing raises (it used to: a field over csv's 131,072-character limit, bytes that are not UTF-8, JSON nested
    deeper than Python parses)."""
    path = tmp_path / f"history{suffix}"
    path.write_bytes(header + b"".join(body))
    _every_row_is_a_request_or_a_letter(str(path))


@given(st.lists(st.one_of(st.none(), st.integers(), st.floats(), st.text(max_size=20), st.binary(max_size=20),
                          st.lists(st.integers(), max_size=3), st.datetimes()), min_size=1, max_size=5),
       st.sampled_from(["id", "prompt", "messages", "max_tokens", "metadata"]))
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_fuzz_no_parquet_column_stops_a_backfill(tmp_path, values, column):
    """Parquet columns of any type under any name (bytes, timestamps, lists, NaN): a request or a dead letter."""
    try:
        table = pyarrow.table({column: values, "id": [f"r-{i}" for i in range(len(values))]} if column != "id"
                              else {column: values})
    except (pyarrow.ArrowInvalid, pyarrow.ArrowTypeError, OverflowError):
        return  # values Arrow cannot put in one column: no such file exists
    parquet.write_table(table, tmp_path / "history.parquet")
    _every_row_is_a_request_or_a_letter(str(tmp_path / "history.parquet"))


def test_each_kind_of_row_that_stopped_a_backfill_is_now_its_own_dead_letter(tmp_path):
    """The shapes found by hand, each of which stopped the feeder before it published anything."""
    (tmp_path / "long.csv").write_text("id,prompt\nr-1," + "x" * 140_000 + "\nr-2,short\n")
    (tmp_path / "huge.csv").write_text("id,prompt\nr-1," + "y" * 10_000_001 + "\nr-2,short\n")
    (tmp_path / "latin1.csv").write_bytes(b"id,prompt\nr-1,caf\xe9\nr-2,short\n")
    (tmp_path / "deep.jsonl").write_text("[" * 100_000 + "\n" + json.dumps({"id": "r-2", "prompt": "short"}) + "\n")
    (tmp_path / "big.jsonl").write_text(json.dumps({"id": "r-1", "prompt": "z" * 10_000_001}) + "\n")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not a parquet file")
    results = {path.name: [backfill.checked(row, backfill.Mapping()) for row in backfill.read_file(str(path))]
               for path in sorted(tmp_path.iterdir())}
    assert isinstance(results["long.csv"][0], tuple), "a long prompt is a prompt: the job measures it"
    for name, reason in (("huge.csv", "not a CSV record: field larger than field limit"),
                         ("latin1.csv", "the row is not UTF-8 text"), ("deep.jsonl", "not JSON: RecursionError"),
                         ("big.jsonl", "over Pub/Sub's 10,000,000"), ("broken.parquet", "not a Parquet file")):
        assert isinstance(results[name][0], DeadLetter) and reason in results[name][0].reason, (name, results[name])
    assert all(isinstance(results[name][-1], tuple) for name in ("huge.csv", "latin1.csv", "deep.jsonl")), \
        "the next row is read and published"


def _every_row_is_a_request_or_a_letter(path: str) -> None:
    for row in backfill.read_file(path):
        result = backfill.checked(row, backfill.Mapping())
        if isinstance(result, DeadLetter):
            assert result.reason.startswith(f"{row.position}: ") and \
                result.attributes["source_position"] == row.position
            json.dumps(result.to_record())  # it can be written
        else:
            data, request = result
            assert len(data) <= backfill.PUBSUB_MESSAGE_MAX_BYTES and data.decode("utf-8")
            assert isinstance(request, InferenceRequest)


def test_files_in_cloud_storage_are_read_as_the_same_files_on_disk(tmp_path):
    """The Storage emulator: a glob over gs:// lists the objects, and each format reads as it does locally."""
    sources = write_sources(tmp_path)
    with GcsEmulator() as gcs, activated(gcs):
        folder = gcs.upload_folder(tmp_path, "history", "2026/tickets")
        in_storage = list(backfill.read_rows([f"{folder}/tickets.*"], PROJECT))
    on_disk = list(backfill.read_rows(sorted(sources), PROJECT))
    assert [r.values for r in in_storage] == [r.values for r in on_disk]
    assert [r.position for r in in_storage] == [r.position.replace(str(tmp_path), folder) for r in on_disk]


@pytest.fixture
def places(emulator, bigquery):
    run = next(RUNS)
    topic = emulator.create_topic(f"backfill-{run}", subscription=f"backfill-{run}-sub")
    completions = f"{PROJECT}:llm.backfill_completions_{run}"
    letters = f"{PROJECT}:llm.backfill_dead_letters_{run}"
    ensure_table(completions, KIND_COMPLETIONS, create=True)
    ensure_table(letters, KIND_DEAD_LETTERS, create=True)
    return topic, emulator.subscription(f"backfill-{run}-sub"), completions, letters


def answered_already(table: str, ids: list[str]) -> None:
    """Completions of an earlier run, as the job's sink writes them."""
    client = emulator_bigquery_client(PROJECT)
    rows = [completion_row({"id": i, "attempt": 1, "stream": f"{i}#1", "model": "m", "prompt": "p", "messages": None,
                            "text": "x", "finish_reason": "stop", "usage": {"prompt_tokens": 1, "completion_tokens": 1},
                            "time_to_first_token_ms": 1.0, "total_ms": 2.0, "metadata": {},
                            "received_at": time.time(), "finished_at": time.time()})[0] for i in ids]
    assert not client.insert_rows_json(table.replace(":", "."), rows)


def pulled_ids(subscription: str) -> list[str]:
    return [json.loads(data)["id"] for data in PubSubEmulator.take(subscription)]


def message_waiting(subscription: str) -> bool:
    """Whether a message is there (pulled without acknowledging: it comes again once its deadline passes)."""
    from google.cloud import pubsub_v1

    response = pubsub_v1.SubscriberClient().pull(subscription=subscription, max_messages=1, timeout=5)
    if response.received_messages:
        pubsub_v1.SubscriberClient().modify_ack_deadline(subscription=subscription, ack_deadline_seconds=0,
                                                         ack_ids=[response.received_messages[0].ack_id])
    return bool(response.received_messages)


def args_for(sources: list[str], places, *extra: str) -> list[str]:
    topic, _, completions, letters = places
    return [*[f"--source={s}" for s in sources], f"--project={PROJECT}", f"--topic={topic}",
            f"--completions-table={completions}", f"--dead-letter-table={letters}", "--quiet", *extra]


def test_a_backfill_skips_answered_ids_publishes_the_rest_once_and_letters_bad_rows(tmp_path, places, capsys):
    jsonl, _, pq = write_sources(tmp_path)
    _, subscription, completions, letters = places
    answered_already(completions, ["p-2"])
    assert backfill.main(args_for([jsonl, pq], places)) == 0
    summary = capsys.readouterr().out
    assert "Read 9 rows" in summary and "3 published, 1 skipped as answered, 4 dead letters" in summary
    assert "1 repeated rows" in summary and "GPU-hours" in summary
    assert sorted(pulled_ids(subscription)) == ["p-1", "t-1", "t-2"]
    rows = list(emulator_bigquery_client(PROJECT).query(
        f"SELECT reason FROM `{letters.replace(':', '.')}`").result())
    reasons = sorted(r["reason"] for r in rows)
    assert [r.split(": ", 1)[0] for r in reasons] == [f"{jsonl}:{n}" for n in (2, 4, 5, 7)]
    assert "another row of this backfill has id 't-2'" in reasons[-1]

    # BigQuery as the source: a table of the same records.
    client = emulator_bigquery_client(PROJECT)
    source = f"{PROJECT}.llm.backfill_source_{next(RUNS)}"
    from google.cloud import bigquery

    client.create_table(bigquery.Table(source, schema=[bigquery.SchemaField("id", "STRING"),
                                                       bigquery.SchemaField("prompt", "STRING"),
                                                       bigquery.SchemaField("customer", "STRING")]))
    assert not client.insert_rows_json(source, [{"id": "b-1", "prompt": "Hello.", "customer": "acme"},
                                                {"id": "b-2", "prompt": "Bye.", "customer": "initech"}])
    assert backfill.main(args_for([f"bq:{source}"], places)) == 0
    assert sorted(pulled_ids(subscription)) == ["b-1", "b-2"]


def test_a_backfill_killed_half_way_and_run_again_publishes_every_unanswered_row_and_no_answered_one(tmp_path, places):
    _, subscription, completions, _ = places
    source = tmp_path / "history.jsonl"
    total = 4 * backfill.CHUNK_ROWS
    source.write_text("".join(json.dumps({"id": f"h-{i}", "prompt": f"Record {i}."}) + "\n" for i in range(total)))
    answered = [f"h-{i}" for i in range(0, total, 7)]
    answered_already(completions, answered)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    first = subprocess.Popen([sys.executable, "-m", "local.backfill", *args_for([str(source)], places)], cwd=REPO,
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert wait_until(lambda: message_waiting(subscription), 300), first.stderr
    first.send_signal(signal.SIGKILL)  # as soon as the first messages reach Pub/Sub
    seen = pulled_ids(subscription)
    first.wait(timeout=30)
    assert len(seen) < total - len(answered), "killed before the end"
    recorded = published_ids(completions)
    again = subprocess.run([sys.executable, "-m", "local.backfill", *args_for([str(source)], places)], cwd=REPO,
                           env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    sent_again = pulled_ids(subscription)
    assert not recorded & set(sent_again), "what the first run recorded as published is not sent again"
    seen += sent_again
    expected = {f"h-{i}" for i in range(total)} - set(answered)
    assert set(seen) == expected, "every unanswered row published, at least once; no answered one"
    assert f"{len(answered):,} skipped as answered" in again.stdout


def published_ids(completions: str) -> set[str]:
    """What the feeder recorded as published (Pub/Sub confirmed) beside this completions table."""
    table = completions.replace(":", ".") + "_published"
    return {row["request_id"] for row in emulator_bigquery_client(PROJECT).query(
        f"SELECT request_id FROM `{table}`").result()}


def job_gave_up_on(letters: str, request_id: str, stage: str = STAGE_PARSE,
                   reason: str = "prompt_template needs {customer}") -> None:
    """A dead letter the job wrote for a request it received: by default at its parse step, as for a message its
    prompt_template cannot fill (the feeder, which does not know the template, published it)."""
    letter = DeadLetter.from_bytes(stage, reason, b"{}", id=request_id, attributes={}, at=time.time())
    row, insert_id = dead_letter_row(letter.to_record())
    assert not emulator_bigquery_client(PROJECT).insert_rows_json(letters.replace(":", "."), [row],
                                                                  row_ids=[insert_id])


def letter_count(letters: str) -> int:
    return list(emulator_bigquery_client(PROJECT).query(
        f"SELECT COUNT(*) AS n FROM `{letters.replace(':', '.')}`").result())[0]["n"]


def test_a_rerun_sends_again_only_what_a_resend_can_change(tmp_path, places, capsys):
    """No answers yet (no job reads the topic): a rerun sends nothing again, so a deep backlog does not get a
    second copy of each row to answer past dedupe_window_s, and writes none of its own dead letters again. A row the
    job dead-lettered since for a reason a resend can change (a full queue, a failure) is sent again; one it
    lettered at parse, validate or measure is not (the same row gets the same letter) until --republish."""
    jsonl, _, _ = write_sources(tmp_path)
    _, subscription, completions, letters = places
    assert backfill.main(args_for([jsonl], places)) == 0
    assert sorted(pulled_ids(subscription)) == ["t-1", "t-2"] and published_ids(completions) == {"t-1", "t-2"}
    assert letter_count(letters) == 4  # the feeder's: lines 2, 4, 5 and 7
    capsys.readouterr()
    assert backfill.main(args_for([jsonl], places)) == 0
    summary = capsys.readouterr().out
    assert ": 0 published, 0 skipped as answered, 0 dead letters" in summary and "4 more lettered by an earlier run" \
        in summary and "2 published by an earlier run" in summary
    assert pulled_ids(subscription) == [], "nothing sent again"
    assert letter_count(letters) == 4, "no letter written twice"
    job_gave_up_on(letters, "t-1", "measure", "prompt too long for the model's context")
    job_gave_up_on(letters, "t-2", "inference", "the queue for its key is full: republish it")
    assert backfill.main(args_for([jsonl], places)) == 0
    summary = capsys.readouterr().out
    assert ": 1 published, 0 skipped as answered" in summary and "0 published by an earlier run" in summary
    assert "1 dead-lettered by the job at parse, validate or measure" in summary
    assert pulled_ids(subscription) == ["t-2"], "the row a resend can help, again; not the one too long"
    assert backfill.main(args_for([jsonl], places, "--republish")) == 0
    assert ": 2 published, 0 skipped as answered" in capsys.readouterr().out
    assert sorted(pulled_ids(subscription)) == ["t-1", "t-2"]


def test_wait_ends_when_every_row_is_answered_or_dead_lettered_by_the_job_and_names_those(tmp_path, places, capsys):
    """--wait used to wait out its timeout (seven days by default) for a row the job had dead-lettered."""
    jsonl, _, _ = write_sources(tmp_path)
    _, subscription, completions, letters = places
    assert backfill.main(args_for([jsonl], places)) == 0
    pulled_ids(subscription)
    job_gave_up_on(letters, "t-2", "measure", "prompt too long for the model's context")
    capsys.readouterr()
    result: list[int] = []
    waiting = threading.Thread(target=lambda: result.append(backfill.main(args_for(
        [jsonl], places, "--wait", "--wait-poll-s=0.2", "--wait-timeout-s=120"))))
    waiting.start()
    time.sleep(2)
    assert waiting.is_alive(), "t-1 is neither answered nor lettered yet"
    answered_already(completions, ["t-1"])
    waiting.join(timeout=60)
    assert result == [0], capsys.readouterr()
    out = capsys.readouterr().out
    assert "Answered 1 of 2" in out and "1 dead-lettered by the job: t-2 (measure: prompt too long" in out


def test_a_completions_table_that_does_not_exist_is_named_before_anything_is_published(tmp_path, places, capsys):
    jsonl, _, _ = write_sources(tmp_path)
    topic, subscription, _, letters = places
    missing = f"{PROJECT}:llm.no_such_completions_{next(RUNS)}"
    assert backfill.main([f"--source={jsonl}", f"--project={PROJECT}", f"--topic={topic}",
                          f"--completions-table={missing}", f"--dead-letter-table={letters}", "--quiet"]) == 2
    assert f"the completions table {missing} does not exist" in capsys.readouterr().err
    assert pulled_ids(subscription) == []


@pytest.mark.parametrize("setting", ["BACKFILL_TOPIC", "BULK_TOPIC"])
def test_make_backfill_takes_its_topic_and_tables_from_the_deploy_settings(tmp_path, places, setting):
    """One command: the job's outputs come from the same settings make run launches it with; its topic is a job's of
    its own (BACKFILL_TOPIC) or the live job's bulk lane (BULK_TOPIC)."""
    topic, subscription, completions, letters = places
    jsonl, _, _ = write_sources(tmp_path)
    env_file = tmp_path / "deploy.env"
    env_file.write_text("\n".join([
        f"PROJECT={PROJECT}", f"{setting}={topic}",
        f"INPUT_SUBSCRIPTION=projects/{PROJECT}/subscriptions/prompts-sub",
        f"COMPLETIONS_TOPIC=projects/{PROJECT}/topics/llm-completions", "DEAD_LETTER_TOPIC=",  # letters: the table
        f"EXTRA_PARAMETERS=output_completions_table={completions},dead_letter_table={letters}"]) + "\n")
    result = subprocess.run(["make", "--no-print-directory", "backfill", f"ENV_FILE={env_file}", f"SOURCE={jsonl}",
                             "BACKFILL_ARGS=--quiet", "BACKFILL_MODULE=local.backfill"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 published" in result.stdout and "4 dead letters" in result.stdout
    assert sorted(pulled_ids(subscription)) == ["t-1", "t-2"]


def test_wait_counts_a_job_letter_that_lands_before_the_feeder_records_its_row(tmp_path, places, capsys, monkeypatch):
    """The job may letter a row (a refusal takes milliseconds) before the feeder has recorded it as published, which
    waits for Pub/Sub's confirmation of the whole chunk: the record's time is taken before the chunk is published,
    so the letter still counts as the job's answer to this run, and --wait ends."""
    jsonl, _, _ = write_sources(tmp_path)
    _, subscription, completions, letters = places
    recording = backfill.Outputs.record

    def letter_first(self, rows, published_at):
        if any(request_id == "t-2" for request_id, _ in rows):
            job_gave_up_on(letters, "t-2", "measure", "prompt too long for the model's context")
        recording(self, rows, published_at)

    monkeypatch.setattr(backfill.Outputs, "record", letter_first)
    answered_already(completions, ["t-1"])
    started = time.monotonic()
    assert backfill.main(args_for([jsonl], places, "--wait", "--wait-poll-s=0.2",
                                  "--wait-timeout-s=60")) == 0, capsys.readouterr()
    assert time.monotonic() - started < 30
    assert "1 dead-lettered by the job: t-2 (measure" in capsys.readouterr().out



def test_what_only_the_job_knows_is_left_to_the_job_a_rows_own_faults_are_lettered_here():
    """The feeder knows the row, not the job: the adapters it serves (a job on a server_url leaves them to its
    server) and its model's context are the job's settings, so a row naming an adapter or asking for more tokens
    than the template's default context is published, for the job to answer or letter for good (at validate, or
    by its server's refusal). A row that is wrong whatever the job (no prompt, no whole count of tokens, more tokens
    than any model's context) is lettered here."""
    from pipeline.contract.parameters import default

    mapping = backfill.Mapping()
    for values in ({"id": "a-1", "prompt": "Summarise.", "adapter": "support-tone"},
                   {"id": "a-2", "prompt": "Summarise.", "max_tokens": default("max_model_len") + 1000}):
        made = backfill.checked(backfill.Row("mem:1", values), mapping)
        assert isinstance(made, tuple), (values, made)
    for values in ({"id": "b-1", "prompt": "Summarise.", "max_tokens": -5}, {"id": "b-2"},
                   {"id": "b-3", "prompt": "Summarise.", "max_tokens": 1 << 21}):  # past any model's context
        assert not isinstance(backfill.checked(backfill.Row("mem:2", values), mapping), tuple), values


def test_wait_without_the_jobs_letter_table_is_refused_before_anything_is_published(tmp_path, capsys):
    """--wait ends when every row is answered or lettered, and reads both from the job's tables: with only a letter
    topic, a row the job letters would be waited for a week (and without the completions table --wait did nothing).
    Refused at once, naming what to add."""
    jsonl, _, _ = write_sources(tmp_path)
    with pytest.raises(SystemExit):
        backfill.main([f"--source={jsonl}", f"--project={PROJECT}", f"--topic=projects/{PROJECT}/topics/t",
                       f"--dead-letter-topic=projects/{PROJECT}/topics/letters", "--wait", "--quiet"])
    assert "--wait reads the job's answers from --completions-table and its letters from --dead-letter-table" in \
        capsys.readouterr().err
