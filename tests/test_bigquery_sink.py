"""BigQuery output against the local BigQuery emulator (bqemulator)."""

from __future__ import annotations

import datetime
import json
import uuid
from collections import defaultdict

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PipelineOptions

from local.emulators import emulator_bigquery_client
from pipeline.sinks.bigquery_sink import (KIND_CHUNKS, KIND_COMPLETIONS, KIND_DEAD_LETTERS, PARTITION_COLUMN, SCHEMAS,
                                          TableError, WriteToBigQueryTable, ensure_table)

PROJECT = "local-project"
COMPLETION = {"id": "r1", "attempt": 1, "stream": "s1", "model": "smollm2", "prompt": "Hi", "messages": None, "text": "Hello!",
              "finish_reason": "stop", "usage": {"prompt_tokens": 31, "completion_tokens": 3},
              "time_to_first_token_ms": 120.5, "total_ms": 300.25, "received_at": 1795322892.5,
              "finished_at": 1795322892.8, "metadata": {"team": "qa", "n": 1}, "queue_ms": 40.0, "decode_ms": 179.75,
              "accelerator_seconds": 0.0625,
              "lineage": {"model": {"source": "org/m", "revision": "0123abc", "config": "sha256:00ff"}, "adapter": None,
                          "engine": "vllm 0.32.0", "image": None, "settings": {"dtype": "bfloat16"},
                          "sampling": {"temperature": 0.7, "seed": 12345}}}
CHUNK = {"id": "r1", "attempt": 1, "stream": "s1", "seq": 0, "text": "Hello!", "tokens": 3, "final": True, "finish_reason": "stop",
         "time_to_first_token_ms": 120.5, "elapsed_ms": 300.25, "emitted_at": 1795322892.8}
DEAD_LETTER = {"stage": "validate", "reason": "'max_tokens' must be a positive integer", "payload": '{"prompt": 1}',
               "payload_encoding": "utf-8", "id": "r2", "attributes": {"source": "app"}, "at": 1795322892.9}
_OUT: dict[str, list] = defaultdict(list)


def table(name: str) -> str:
    return f"{PROJECT}:llm.{name}_{uuid.uuid4().hex[:8]}"


def rows(spec: str) -> list[dict]:
    name = spec.replace(":", ".")
    return [dict(row) for row in emulator_bigquery_client(PROJECT).query(f"SELECT * FROM `{name}`").result()]


def _record(letter: dict, run_id: str) -> None:
    # Module-level, so it is pickled by reference and appends to this process's _OUT.
    _OUT[run_id].append(letter)


def write(spec: str, kind: str, records: list[dict], **kwargs) -> list[dict]:
    """Runs the sink over ``records``; returns the dead letters it produced."""
    run_id = uuid.uuid4().hex
    with beam.Pipeline(options=PipelineOptions(flags=[], runner="BundleBasedDirectRunner")) as pipeline:
        rejected = pipeline | beam.Create(records) | WriteToBigQueryTable(spec, kind, **kwargs)
        rejected | beam.Map(_record, run_id)
    return _OUT.pop(run_id, [])


@pytest.mark.parametrize("kind", [KIND_COMPLETIONS, KIND_CHUNKS, KIND_DEAD_LETTERS])
def test_missing_tables_are_created_with_the_schema_and_day_partitions(bigquery, kind):
    spec = table(kind)
    ensure_table(spec, kind, create=True)
    created = emulator_bigquery_client(PROJECT).get_table(spec.replace(":", "."))
    assert [(f.name, f.field_type, f.mode) for f in created.schema] == [
        (c.name, c.type, c.mode) for c in SCHEMAS[kind]]
    assert created.time_partitioning.field == PARTITION_COLUMN[kind]
    assert created.time_partitioning.type_ == "DAY"
    ensure_table(spec, kind, create=False)  # now it exists: accepted


def test_required_tables_that_are_missing_stop_the_launch(bigquery):
    with pytest.raises(TableError, match="does not exist; create it .* or set --bigquery_create_tables=true"):
        ensure_table(table("missing"), KIND_COMPLETIONS, create=False)
    with pytest.raises(TableError, match="dataset local-project:nowhere does not exist"):
        ensure_table(f"{PROJECT}:nowhere.completions", KIND_COMPLETIONS, create=True)


def test_a_table_without_our_columns_is_refused(bigquery):
    from google.cloud import bigquery as bq
    spec = table("foreign")
    emulator_bigquery_client(PROJECT).create_table(bq.Table(spec.replace(":", "."), schema=[bq.SchemaField("x", "STRING")]))
    with pytest.raises(TableError, match="lacks the column"):
        ensure_table(spec, KIND_CHUNKS, create=True)


def test_a_table_of_an_earlier_version_gets_the_new_nullable_columns_only_when_tables_may_be_changed(bigquery):
    """An update that adds columns (the cost fields, the lineage, the lane) must not stop at a table an earlier version
    created."""
    from google.cloud import bigquery as bq
    spec = table("earlier")
    earlier = [c for c in SCHEMAS[KIND_COMPLETIONS] if c.name not in ("queue_ms", "decode_ms", "accelerator_seconds",
                                                                               "lineage", "lane")]
    emulator_bigquery_client(PROJECT).create_table(bq.Table(spec.replace(":", "."), schema=[
        bq.SchemaField(c.name, c.type, mode=c.mode) for c in earlier]))
    with pytest.raises(TableError, match="lacks the column.*queue_ms, decode_ms, accelerator_seconds, lineage, lane.*"
                                         "bigquery_create_tables=true"):
        ensure_table(spec, KIND_COMPLETIONS, create=False)
    ensure_table(spec, KIND_COMPLETIONS, create=True)
    grown = emulator_bigquery_client(PROJECT).get_table(spec.replace(":", "."))
    assert [f.name for f in grown.schema] == [c.name for c in SCHEMAS[KIND_COMPLETIONS]]
    ensure_table(spec, KIND_COMPLETIONS, create=False)  # now it has them all


def test_rows_land_with_the_schema_and_values(bigquery):
    specs = {kind: table(kind) for kind in SCHEMAS}
    for kind, spec in specs.items():
        ensure_table(spec, kind, create=True)
    second = dict(COMPLETION, id="r3", prompt=None, messages=[{"role": "user", "content": "Hi"}], metadata={})
    assert write(specs[KIND_COMPLETIONS], KIND_COMPLETIONS, [COMPLETION, second]) == []
    assert write(specs[KIND_CHUNKS], KIND_CHUNKS, [CHUNK]) == []
    assert write(specs[KIND_DEAD_LETTERS], KIND_DEAD_LETTERS, [DEAD_LETTER]) == []

    completions = {row["request_id"]: row for row in rows(specs[KIND_COMPLETIONS])}
    assert set(completions) == {"r1", "r3"}
    row = completions["r1"]
    assert (row["completion_text"], row["finish_reason"], row["prompt_tokens"], row["completion_tokens"]) == \
        ("Hello!", "stop", 31, 3)
    assert row["metadata"] == {"team": "qa", "n": 1} and row["messages"] is None
    assert row["finished_at"] == datetime.datetime.fromtimestamp(1795322892.8, tz=datetime.timezone.utc)
    assert completions["r3"]["messages"] == [{"role": "user", "content": "Hi"}] and completions["r3"]["prompt"] is None
    assert (row["queue_ms"], row["decode_ms"], row["accelerator_seconds"]) == (40.0, 179.75, 0.0625)
    assert row["lineage"] == COMPLETION["lineage"] and completions["r3"]["lineage"] == COMPLETION["lineage"]

    (chunk,) = rows(specs[KIND_CHUNKS])
    assert (chunk["request_id"], chunk["seq"], chunk["text"], chunk["final"]) == ("r1", 0, "Hello!", True)
    (letter,) = rows(specs[KIND_DEAD_LETTERS])
    assert (letter["stage"], letter["reason"], letter["attributes"]) == (
        "validate", DEAD_LETTER["reason"], {"source": "app"})
    assert letter["accelerator_seconds"] is None  # it never reached the model


def test_rows_bigquery_rejects_become_dead_letters_with_its_reason(bigquery):
    # The emulator accepts rows real BigQuery would refuse for their values, so the test uses the two
    # refusals it does give: a table that vanished after launch, and a row over the insert size limit.
    gone = table("gone")
    ensure_table(gone, KIND_COMPLETIONS, create=True)
    emulator_bigquery_client(PROJECT).delete_table(gone.replace(":", "."))
    letters = write(gone, KIND_COMPLETIONS, [COMPLETION], max_retries=0)
    assert len(letters) == 1 and letters[0]["stage"] == "sink" and letters[0]["id"] == "r1"
    assert letters[0]["reason"].startswith(f"BigQuery rejected the row for {gone}") and "Not Found" in letters[0]["reason"]
    assert json.loads(letters[0]["payload"])["completion_text"] == "Hello!"

    spec = table("small")
    ensure_table(spec, KIND_COMPLETIONS, create=True)
    huge = dict(COMPLETION, id="huge", text="x" * 50_000)
    letters = write(spec, KIND_COMPLETIONS, [COMPLETION, huge], max_insert_payload_size=20_000)
    assert [letter["id"] for letter in letters] == ["huge"]
    assert "exceeds the maximum insert payload size" in letters[0]["reason"]
    assert [row["request_id"] for row in rows(spec)] == ["r1"]


def test_the_docs_schemas_are_generated_from_the_code():
    from local.template_docs import DOCS, SCHEMAS_PAGE, page_with_schemas
    page = (DOCS / SCHEMAS_PAGE).read_text()
    assert page_with_schemas(page) == page, "docs/contract.md schemas are stale: run `make metadata`"
