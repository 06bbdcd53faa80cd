"""No-code structured output end to end: a plain-text stream, three template parameters, rows of JSON in BigQuery.

The template is launched as a user launches it (``python -m template.main`` with
string values), against the session's vLLM server, the Pub/Sub emulator and
the BigQuery emulator.
"""

from __future__ import annotations

import json
import re

import pytest
from jsonschema import validate

from benchmarks.structured_records import RECORD_SETS, RecordSet
from local.harness import REPO_ROOT, LocalRun
from local.emulators import emulator_bigquery_client
from tests.conftest import SERVED_NAME, wait_until
from tests.test_engine import TICKET_SCHEMA, TICKETS

pytestmark = pytest.mark.engine


def test_a_plain_text_stream_becomes_structured_completions_and_rows(vllm_server, emulator, bigquery):
    table = "local-project:llm.completions_structured"
    run = LocalRun([f"--server_url={vllm_server.base_url}", f"--served_model_name={SERVED_NAME}",
                    "--system_prompt=You triage support tickets. Answer with the requested JSON only.",
                    "--prompt_template=Classify this support ticket: {text}",
                    f"--response_schema={json.dumps(TICKET_SCHEMA)}", "--default_max_tokens=200",
                    f"--output_completions_table={table}"],
                   log_path=REPO_ROOT / ".cache" / "test-e2e" / "structured.log", emulator=emulator)
    run.start()
    collector = run.collector()
    ids = [f"ticket-{i}" for i in range(len(TICKETS))]
    try:
        for request_id, ticket in zip(ids, TICKETS):
            run.publish([ticket], attributes={"id": request_id})
        run.publish(['{"metadata": {"title": "no text"}}'], attributes={"id": "no-text"})
        missing = collector.wait_for(ids + ["no-text"], 300)
        assert not missing, f"no outcome for {missing}:\n{run.log_tail()}"
    finally:
        collector.stop()
        run.stop()
    completions = {c.data["id"]: c.data for c in collector.completions}
    for request_id, ticket in zip(ids, TICKETS):
        completion = completions[request_id]
        assert completion["messages"][1]["content"] == f"Classify this support ticket: {ticket}"
        assert completion["messages"][0]["role"] == "system"
        assert completion["output_error"] is None, completion
        validate(completion["output_json"], TICKET_SCHEMA)
    (letter,) = [d.data for d in collector.dead_letters if d.data["id"] == "no-text"]
    assert "prompt_template needs {text}" in letter["reason"]

    client = emulator_bigquery_client("local-project")
    query = ("SELECT request_id, JSON_VALUE(output_json, '$.category') AS category, output_error "
             "FROM `local-project.llm.completions_structured`")
    assert wait_until(lambda: len(list(client.query(query).result())) >= len(ids), 60)
    rows = {row["request_id"]: row for row in client.query(query).result()}
    for request_id in ids:
        assert rows[request_id]["category"] == completions[request_id]["output_json"]["category"]
        assert rows[request_id]["output_error"] is None


def outside_strings(text: str) -> str:
    """JSON text with every string literal emptied: what the grammar, not the model's words, laid out."""
    return re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)


@pytest.mark.parametrize("record_set", RECORD_SETS, ids=lambda s: s.name.replace(" ", "-"))
def test_every_record_of_an_enrichment_stream_gets_a_schema_valid_compact_answer(record_set: RecordSet, vllm_server,
                                                                                  emulator):
    """The enrichment a user sets up with three parameters, the template's default answer budget, every record whole.

    The session's server is the model manager's, started with the template's own settings (tests.conftest), so it
    runs with the template's default structured-output config.
    """
    run = LocalRun([f"--server_url={vllm_server.base_url}", f"--served_model_name={SERVED_NAME}",
                    *record_set.template_args()],
                   log_path=REPO_ROOT / ".cache" / "test-e2e" / "structured-records.log", emulator=emulator)
    run.start()
    collector = run.collector()
    ids = [f"record-{i}" for i in range(len(record_set.records))]
    try:
        for request_id, record in zip(ids, record_set.records):
            run.publish([record], attributes={"id": request_id})
        missing = collector.wait_for(ids, 600)
        assert not missing, f"no outcome for {missing}:\n{run.log_tail()}"
    finally:
        collector.stop()
        run.stop()
    assert len(ids) >= 20 and not collector.dead_letters, collector.dead_letters
    for completion in (c.data for c in collector.completions):
        assert completion["output_error"] is None, completion
        assert completion["finish_reason"] == "stop", completion
        validate(completion["output_json"], record_set.schema)
        layout = outside_strings(completion["text"])
        assert not any(ch.isspace() for ch in layout), f"whitespace between JSON tokens: {completion['text']!r}"
