"""BigQuery output: completions, chunks and dead letters in tables with one defined schema.

Each table's schema is declared once here (:data:`SCHEMAS`); tables are
created at launch when missing (partitioned by day on their time column), or
required to exist. Rows are written with Beam's streaming-insert writer,
``BigQueryWriteFn`` — the DoFn inside ``WriteToBigQuery`` — because
``WriteToBigQuery`` assigns random insert ids, and ours are derived from the
request id and stream (and sequence number), so a retried bundle does not
duplicate rows in BigQuery. Rows BigQuery rejects come back through Beam's
failed-rows output and become dead letters with BigQuery's reason.

For exactly-once on Dataflow, BigQuery's Storage Write API is the better
choice; see the README.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import apache_beam as beam
from apache_beam.io.gcp.bigquery import BigQueryDisposition, BigQueryWriteFn
from apache_beam.io.gcp.bigquery_tools import RetryStrategy

from pipeline.contract.element_guard import TAG_DEAD_LETTERS, guarded_value
from pipeline.contract.messages import LANE_LIVE, STAGE_SINK, DeadLetter

LOGGER = logging.getLogger(__name__)
KIND_COMPLETIONS, KIND_CHUNKS, KIND_DEAD_LETTERS = "completions", "chunks", "dead_letters"


@dataclass(frozen=True)
class Column:
    name: str
    type: str
    description: str
    mode: str = "NULLABLE"


SCHEMAS: dict[str, tuple[Column, ...]] = {
    KIND_COMPLETIONS: (
        Column("request_id", "STRING", "The request's id", "REQUIRED"),
        Column("attempt", "INTEGER", "Attempt that produced this completion (1 unless a worker was lost)", "REQUIRED"),
        Column("stream", "STRING", "The stream whose chunks make up completion_text"),
        Column("model", "STRING", "Served model name"),
        Column("prompt", "STRING", "The prompt text; null for chat requests"),
        Column("messages", "JSON", "Chat messages; null for prompt requests"),
        Column("completion_text", "STRING", "The whole generated text"),
        Column("finish_reason", "STRING", "stop or length"),
        Column("prompt_tokens", "INTEGER", "Prompt tokens, as the server counted them"),
        Column("completion_tokens", "INTEGER", "Generated tokens"),
        Column("time_to_first_token_ms", "FLOAT", "From receipt by the pipeline to the first token"),
        Column("total_latency_ms", "FLOAT", "From receipt by the pipeline to the last token"),
        Column("received_at", "TIMESTAMP", "When the pipeline received the request", "REQUIRED"),
        Column("finished_at", "TIMESTAMP", "When generation finished (partitioning column)", "REQUIRED"),
        Column("metadata", "JSON", "The request's metadata object"),
        Column("output_json", "JSON", "With a response_format or response_schema: the answer, parsed"),
        Column("output_error", "STRING", "With a response_format: why the answer could not be parsed or validated"),
        Column("adapter", "STRING", "The LoRA adapter that answered; null for the model itself"),
        Column("queue_ms", "FLOAT", "From receipt to when the model took the request (the backlog it waited in)"),
        Column("decode_ms", "FLOAT", "From the first token to the last"),
        Column("accelerator_seconds", "FLOAT", "Its share of the model's busy time: each moment split evenly "
                                               "across the requests running then"),
        Column("lineage", "JSON", "What produced it: the weights' revision and digests, adapter, engine and version, "
                                  "worker image, server settings and the sampling as applied, seed included"),
        Column("lane", "STRING", "live, or bulk: the job's input it came from (its bulk_subscription)"),
    ),
    KIND_CHUNKS: (
        Column("request_id", "STRING", "The request's id", "REQUIRED"),
        Column("attempt", "INTEGER", "Attempt the chunk belongs to", "REQUIRED"),
        Column("stream", "STRING", "The stream the chunk belongs to; no other stream has this id"),
        Column("seq", "INTEGER", "Gapless sequence number within the stream, from 0", "REQUIRED"),
        Column("text", "STRING", "Text delta"),
        Column("tokens", "INTEGER", "Cumulative completion tokens"),
        Column("final", "BOOLEAN", "Whether this is the stream's last chunk"),
        Column("finish_reason", "STRING", "On the final chunk: stop or length"),
        Column("time_to_first_token_ms", "FLOAT", "From receipt to the first token"),
        Column("elapsed_ms", "FLOAT", "From receipt to this chunk"),
        Column("emitted_at", "TIMESTAMP", "When the chunk was cut (partitioning column)", "REQUIRED"),
    ),
    KIND_DEAD_LETTERS: (
        Column("request_id", "STRING", "The request's id, when one could be read"),
        Column("stage", "STRING", "parse, validate, measure, batch, inference, drain or sink", "REQUIRED"),
        Column("reason", "STRING", "Why it could not be served", "REQUIRED"),
        Column("payload", "STRING", "The raw message (or request) as received"),
        Column("payload_encoding", "STRING", "utf-8, or base64 for bytes that were not text"),
        Column("payload_truncated", "BOOLEAN", "True when the payload was cut to fit Pub/Sub and BigQuery (over 8 MB)"),
        Column("attributes", "JSON", "The Pub/Sub message attributes"),
        Column("failed_at", "TIMESTAMP", "When it failed (partitioning column)", "REQUIRED"),
        Column("accelerator_seconds", "FLOAT", "For a request that reached the model: its share of the model's "
                                               "busy time"),
        Column("lane", "STRING", "live, or bulk: the job's input it came from (its bulk_subscription)"),
    ),
}
PARTITION_COLUMN = {KIND_COMPLETIONS: "finished_at", KIND_CHUNKS: "emitted_at", KIND_DEAD_LETTERS: "failed_at"}


def _timestamp(epoch_seconds: float) -> str:
    return datetime.datetime.fromtimestamp(epoch_seconds, tz=datetime.UTC).isoformat()


def _json(value: Any) -> str | None:
    return None if value is None else json.dumps(value, separators=(",", ":"))


def completion_row(record: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """A completion record as a table row, with its insert id."""
    row = {
        "request_id": record["id"], "attempt": record["attempt"], "stream": record["stream"], "model": record["model"],
        "prompt": record["prompt"], "messages": _json(record["messages"]), "completion_text": record["text"],
        "finish_reason": record["finish_reason"], "prompt_tokens": record["usage"]["prompt_tokens"],
        "completion_tokens": record["usage"]["completion_tokens"],
        "time_to_first_token_ms": record["time_to_first_token_ms"], "total_latency_ms": record["total_ms"],
        "received_at": _timestamp(record["received_at"]), "finished_at": _timestamp(record["finished_at"]),
        "metadata": _json(record["metadata"]), "output_json": _json(record.get("output_json")),
        "output_error": record.get("output_error"), "adapter": record.get("adapter"),
        "queue_ms": record.get("queue_ms"), "decode_ms": record.get("decode_ms"),
        "accelerator_seconds": record.get("accelerator_seconds"), "lineage": _json(record.get("lineage")),
        "lane": record.get("lane"),
    }
    return row, f"{record['id']}#{record['stream']}"


def chunk_row(record: dict[str, Any]) -> tuple[dict[str, Any], str]:
    row = {
        "request_id": record["id"], "attempt": record["attempt"], "stream": record["stream"], "seq": record["seq"],
        "text": record["text"],
        "tokens": record["tokens"], "final": record["final"], "finish_reason": record["finish_reason"],
        "time_to_first_token_ms": record["time_to_first_token_ms"], "elapsed_ms": record["elapsed_ms"],
        "emitted_at": _timestamp(record["emitted_at"]),
    }
    return row, f"{record['stream']}#{record['seq']}"


def dead_letter_row(record: dict[str, Any]) -> tuple[dict[str, Any], str]:
    row = {
        "request_id": record.get("id"), "stage": record["stage"], "reason": record["reason"],
        "payload": record["payload"], "payload_encoding": record["payload_encoding"],
        "payload_truncated": record.get("payload_truncated", False),
        "attributes": _json(record.get("attributes") or {}), "failed_at": _timestamp(record["at"]),
        "accelerator_seconds": record.get("accelerator_seconds"), "lane": record.get("lane"),
    }
    digest = hashlib.sha1(f"{record['stage']}|{record['payload']}".encode()).hexdigest()[:16]
    return row, f"{record.get('id')}#{record['stage']}#{digest}"


ROW_BUILDERS: dict[str, Callable[[dict[str, Any]], tuple[dict[str, Any], str]]] = {
    KIND_COMPLETIONS: completion_row, KIND_CHUNKS: chunk_row, KIND_DEAD_LETTERS: dead_letter_row}


def parse_table(spec: str) -> tuple[str, str, str]:
    """'project:dataset.table' or 'project.dataset.table' -> (project, dataset, table)."""
    project, _, rest = spec.replace(":", ".", 1).partition(".")
    dataset, _, table = rest.partition(".")
    if not (project and dataset and table) or "." in table:
        raise ValueError(f"a BigQuery table is written project:dataset.table, got {spec!r}")
    return project, dataset, table


def bigquery_client(project: str):
    """A BigQuery client for ``project`` (the table checks' and creation's; the writes use Beam's own)."""
    from google.cloud import bigquery

    return bigquery.Client(project=project)


def schema_fields(columns: Sequence[Column]) -> list:
    """Our columns as BigQuery's schema fields."""
    from google.cloud import bigquery

    return [bigquery.SchemaField(c.name, c.type, mode=c.mode, description=c.description) for c in columns]


def table_definition(spec: str, kind: str):
    from google.cloud import bigquery

    table = bigquery.Table(".".join(parse_table(spec)), schema=schema_fields(SCHEMAS[kind]))
    table.time_partitioning = bigquery.TimePartitioning(type_=bigquery.TimePartitioningType.DAY,
                                                        field=PARTITION_COLUMN[kind])
    return table


class TableError(RuntimeError):
    """A configured table is missing or unusable; raised at launch."""


def ensure_table(spec: str, kind: str, *, create: bool, deadline_s: float = 60.0) -> None:
    """Creates the table if it is missing (``create``) or checks that it exists and has our columns."""
    from google.api_core import exceptions
    from google.cloud.bigquery import DEFAULT_RETRY

    retry = DEFAULT_RETRY.with_deadline(deadline_s)  # a launch should fail in a minute, not hang
    project, dataset, name = parse_table(spec)
    client = bigquery_client(project)
    try:
        existing = client.get_table(f"{project}.{dataset}.{name}", retry=retry)
    except exceptions.NotFound:
        existing = None
    if existing is not None:
        have = {f.name for f in existing.schema}
        missing = [c for c in SCHEMAS[kind] if c.name not in have]
        if missing and create and all(c.mode == "NULLABLE" for c in missing):
            # A table of an earlier version: BigQuery adds nullable columns in place (its rows read null there).
            existing.schema = list(existing.schema) + schema_fields(missing)
            client.update_table(existing, ["schema"], retry=retry)
            LOGGER.info("Added the column(s) %s to BigQuery table %s", ", ".join(c.name for c in missing), spec)
        elif missing:
            raise TableError(f"BigQuery table {spec} lacks the column(s) {', '.join(c.name for c in missing)}; "
                             "set --bigquery_create_tables=true to add them, or add them as the schema in "
                             "docs/contract.md says")
        return
    if not create:
        raise TableError(f"BigQuery table {spec} does not exist; create it (schema in the README) "
                         "or set --bigquery_create_tables=true")
    try:
        client.get_dataset(f"{project}.{dataset}", retry=retry)
    except exceptions.NotFound:
        raise TableError(f"BigQuery dataset {project}:{dataset} does not exist; create it first") from None
    with contextlib.suppress(exceptions.Conflict):  # created meanwhile by another launch
        client.create_table(table_definition(spec, kind), retry=retry)
    LOGGER.info("Created BigQuery table %s (partitioned by day on %s)", spec, PARTITION_COLUMN[kind])


class _InsertFn(BigQueryWriteFn):
    """Beam's streaming-insert DoFn, taking our records."""

    def __init__(self, table: str, kind: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._table = table
        self._kind = kind

    def process(self, record: dict[str, Any], window_value=beam.DoFn.WindowedValueParam):
        # The row is built here rather than in a Map before: one step less per chunk bundle.
        row, dead_letter = guarded_value(STAGE_SINK, record, lambda: ROW_BUILDERS[self._kind](record))
        if dead_letter is not None:
            return [dead_letter]  # a record no row can be made of
        return super().process((self._table, row), window_value)


def _rejected_as_dead_letter(failed: tuple[Any, dict[str, Any], Any]) -> dict[str, Any]:
    destination, row, errors = failed
    if isinstance(errors, list):
        reasons = "; ".join(f"{e.get('reason', '')}: {e.get('message', '')}".strip(": ") for e in errors)
    else:
        reasons = str(errors)
    letter = DeadLetter(STAGE_SINK, f"BigQuery rejected the row for {destination}: {reasons}",
                        json.dumps(row, default=str), id=row.get("request_id"), at=time.time(),
                        lane=row.get("lane") or LANE_LIVE)
    return letter.to_record()


class WriteToBigQueryTable(beam.PTransform):
    """Records (completion, chunk or dead-letter dicts) in; rows BigQuery rejected out, as dead letters.

    The table must exist (see :func:`ensure_table`); ``max_insert_payload_size``
    is BigQuery's limit for one streaming insert.
    """

    def __init__(self, table: str, kind: str, *, max_insert_payload_size: int = 9_000_000,
                 max_retries: int = 5) -> None:
        super().__init__()
        parse_table(table)
        if kind not in SCHEMAS:
            raise ValueError(f"kind must be one of {', '.join(SCHEMAS)}, got {kind!r}")
        self._table = table if ":" in table else table.replace(".", ":", 1)
        self._kind = kind
        self._max_insert_payload_size = max_insert_payload_size
        self._max_retries = max_retries

    def expand(self, records):
        results = (
            records
            | "StreamingInsert" >> beam.ParDo(_InsertFn(
                self._table, self._kind, batch_size=500, create_disposition=BigQueryDisposition.CREATE_NEVER,
                write_disposition=BigQueryDisposition.WRITE_APPEND,
                retry_strategy=RetryStrategy.RETRY_ON_TRANSIENT_ERROR, max_retries=self._max_retries,
                max_insert_payload_size=self._max_insert_payload_size)).with_outputs(
                    BigQueryWriteFn.FAILED_ROWS_WITH_ERRORS, BigQueryWriteFn.FAILED_ROWS, TAG_DEAD_LETTERS,
                    main="written"))
        rejected = results[BigQueryWriteFn.FAILED_ROWS_WITH_ERRORS] | "RejectedAsDeadLetters" >> beam.Map(
            _rejected_as_dead_letter)
        return (rejected, results[TAG_DEAD_LETTERS]) | "SinkDeadLetters" >> beam.Flatten()
