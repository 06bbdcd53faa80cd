"""``make backfill``: the stream's enrichment over history, by feeding the rows to a job of this template.

Why a feeder and not a batch pipeline: docs/architecture.md#backfill-the-same-enrichment-over-history. Each row
of the source (a BigQuery table or query, or JSONL, CSV or Parquet files, local or ``gs://``) becomes the
message the stream would receive: its id and prompt from the columns named (``--id-column``,
``--prompt-column``), request fields from others (``--column adapter=model_variant``), every other column in
``metadata``, where the job's ``prompt_template`` finds its ``{placeholders}``. Then:

* **Resumable.** Rows whose id has a row in the completions table (``--completions-table``) are skipped, a
  chunk of rows at a time; so are rows an earlier run published that are not answered yet: each run records
  the ids Pub/Sub confirmed in a table beside the completions (``<completions table>_published``), and a
  rerun leaves those to the job's subscription, where they wait, unless the job dead-lettered them since for
  a reason a resend can change (:data:`FINAL_STAGES` are those it cannot; ``--republish`` sends them all
  again). A backfill stopped anywhere and run again publishes only what was never published, or failed for
  a passing reason. Only the rows of the chunk a kill interrupts between Pub/Sub's confirmation and that
  record are published twice; the job drops the second copy when it arrives within ``dedupe_window_s`` of
  the first's answer (docs/contract.md#duplicate-ids).
* **Bad rows never stop it.** Each message is checked with the template's own parser before it is
  published; a row that cannot become a request (no id, no prompt, a value of the wrong type, a second row
  with the id of another, a record the reader cannot read, text that is not UTF-8, a message over Pub/Sub's
  limit) becomes a dead letter in the dead-letter table or topic, with its reason and its source position
  (``file:line``, or ``table#row``), once: a rerun does not write the same letter again. Nothing is skipped
  silently: the summary counts rows read, skipped as answered, published, lettered (now or before),
  repeated (the same row again), waiting and lettered for good by the job, and they add up.
* **Progress and cost.** A progress bar while it reads and publishes; with ``--wait``, a second one while the
  job answers, with answers/s, tokens/s and an ETA from the completions table, until every row is answered or
  dead-lettered by the job (those are named). Once it has published (it reads the rows once), an estimate of the
  GPU-hours and cost of what it published, from the rows' ``max_tokens`` (the answers' upper bound) and
  ``--gpu-tokens-per-s``, replaced by the measured rate once answers arrive.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import fnmatch
import glob
import io
import json
import os
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from google.api_core.exceptions import NotFound

from ops.deploy import template_parameters
from ops.settings import DeployError, Settings
from pipeline.contract.messages import REFUSED_BY_SERVER, STAGE_INFERENCE, STAGE_PARSE, DeadLetter, InferenceRequest
from pipeline.contract.parameters import default
from pipeline.contract.request_parsing import RequestLimits, parse_request
from pipeline.serving.model_weights import storage_client
from pipeline.sinks import bigquery_sink

CHUNK_ROWS = 5_000  # rows looked up in the completions table, and published, at a time
# Pub/Sub's largest message ("Pub/Sub quotas and limits": 10 MB): a larger row is a dead letter, not a failed publish
# that stops the run. A CSV field larger than this is read as that row's problem (csv refuses past its limit).
PUBSUB_MESSAGE_MAX_BYTES = 10_000_000
# The job's dead-letter stages that a resend of the same row cannot change while the job's settings stay the same:
# the message itself (parse, validate) or its length against the model's context (measure); and at the inference
# stage, a request the model server refused for what it is (REFUSED_BY_SERVER: final). Letters of the other stages
# (batch, inference, drain, sink: a full queue, a server failure, a drain) are worth a resend.
FINAL_STAGES = frozenset({"parse", "validate", "measure"})
WAIT_POLL_S = 10.0
# What the feeder checks a row against: what the row is, not what the job serves. The adapters a job serves and its
# model's context are its settings (a job on a server_url leaves the adapters to its server), so a row past them is
# the job's to letter, at validate or by its server's refusal: final either way, and not sent again. A row asking
# for more than a million tokens is wrong whatever the job (no model this template serves reads that much context),
# and that bound also keeps one row from swelling the estimate.
ROW_LIMITS = RequestLimits(max_model_len=1 << 20, adapters=None)
# What one L4 worker is assumed to generate (a 2 B model, 256-token answers: docs/benchmarks.md#traffic-spike) and
# cost an hour (docs/operations.md#idle-worker-cost); both are settings, the estimate says which it used.
DEFAULT_GPU_TOKENS_PER_S = 1000.0
DEFAULT_WORKER_HOUR_USD = 1.2366
FIELDS = ("adapter", "max_tokens", "min_tokens", "temperature", "top_p", "seed", "stop", "deadline_ms",
          "response_format", "messages", "system_prompt")


class BackfillError(ValueError):
    """A source or setting the backfill cannot use; the message names it."""


@dataclass(frozen=True)
class Row:
    position: str  # where it came from: file:line, or table#row
    values: dict[str, Any]


@dataclass
class Tally:
    read: int = 0
    skipped: int = 0  # answered already (an id in the completions table)
    published: int = 0
    lettered: int = 0  # could not become a request: a dead letter with its position
    lettered_before: int = 0  # ... and an earlier run wrote that same letter: not written again
    repeated: int = 0  # the same row again under an id already published in this run
    waiting: int = 0  # published by an earlier run, not answered yet: left to the job's subscription
    final: int = 0  # published by an earlier run and dead-lettered by the job at a final stage: not sent again
    max_tokens: int = 0  # the published rows' max_tokens, summed: the answers' upper bound

    def adds_up(self) -> bool:
        return self.read == (self.skipped + self.published + self.lettered + self.lettered_before + self.repeated
                             + self.waiting + self.final)


# Reading ------------------------------------------------------------------------------------------------


def _jsonable(value: Any) -> Any:
    if isinstance(value, (datetime.date, datetime.datetime, datetime.time)):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item"):  # numpy scalars from Parquet
        return value.item()
    return value


def _gcs_path(path: str) -> tuple[str, str]:
    """``gs://bucket/name`` as its bucket and object name."""
    bucket, _, name = path.removeprefix("gs://").partition("/")
    return bucket, name


def _gcs_blob(path: str) -> Any:
    bucket, name = _gcs_path(path)
    return storage_client().bucket(bucket).blob(name)


def _open_text(path: str) -> io.TextIOBase:
    """The file as text; bytes that are not UTF-8 are kept as lone surrogates, so their row (not the whole file)
    becomes a dead letter when its message is encoded (:func:`checked`)."""
    if path.startswith("gs://"):
        return io.StringIO(_gcs_blob(path).download_as_bytes().decode("utf-8", "surrogateescape"), newline="")
    return open(path, encoding="utf-8", errors="surrogateescape", newline="")


def _expand(pattern: str) -> list[str]:
    """The files a path or glob names, local or ``gs://``, in name order."""
    if pattern.startswith("gs://"):
        bucket, name = _gcs_path(pattern)
        prefix = name.split("*", 1)[0].split("?", 1)[0]
        found = [f"gs://{bucket}/{blob.name}" for blob in storage_client().list_blobs(bucket, prefix=prefix)
                 if fnmatch.fnmatchcase(blob.name, name)]
    else:
        found = glob.glob(pattern) if any(c in pattern for c in "*?[") else [pattern]
    if not found or (not pattern.startswith("gs://") and not all(Path(p).is_file() for p in found)):
        raise BackfillError(f"{pattern}: no such file")
    return sorted(found)


def read_file(path: str) -> Iterator[Row]:
    """Rows of one JSONL, CSV or Parquet file; a line that is not a JSON object is a row of its own problem."""
    name = path.lower()
    if name.endswith(".parquet"):
        import pyarrow.parquet as parquet

        try:
            data = parquet.read_table(io.BytesIO(_gcs_blob(path).download_as_bytes()) if path.startswith("gs://")
                                      else path)
        except Exception as exc:  # pyarrow's own types for a file it cannot read: the file is one row's problem
            yield Row(f"{path}#0", {"__problem__": f"not a Parquet file pyarrow reads: {str(exc)[:300]}"})
            return
        number = 0
        for batch in data.to_batches():
            try:
                rows = batch.to_pylist()
            except Exception:  # a value Python cannot hold (a timestamp past year 9999): find its row
                rows = [_parquet_row(batch, i) for i in range(batch.num_rows)]
            for values in rows:
                number += 1
                yield Row(f"{path}#{number}", {k: _jsonable(v) for k, v in values.items()})
    elif name.endswith(".csv"):
        csv.field_size_limit(PUBSUB_MESSAGE_MAX_BYTES)
        with _open_text(path) as handle:
            reader = csv.DictReader(handle)
            number = 1  # line 1 is the header
            while True:
                number += 1
                try:
                    values = next(reader)
                except StopIteration:
                    break
                except csv.Error as exc:  # the reader goes on at the next record
                    yield Row(f"{path}:{number}", {"__problem__": f"not a CSV record: {exc}"})
                    continue
                yield Row(f"{path}:{number}", {k: v for k, v in values.items() if v not in (None, "")})
    elif name.endswith((".jsonl", ".ndjson", ".json")):
        with _open_text(path) as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    values = json.loads(line)
                except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than Python parses
                    values = {"__problem__": f"not JSON: {type(exc).__name__}: {str(exc)[:200]}",
                              "__raw__": line.rstrip("\n")}
                if not isinstance(values, dict):
                    values = {"__problem__": "a JSON line that is not an object", "__raw__": line.rstrip("\n")}
                yield Row(f"{path}:{number}", values)
    else:
        raise BackfillError(f"{path}: a backfill reads .jsonl, .csv or .parquet files")


def _parquet_row(batch: Any, index: int) -> dict[str, Any]:
    """Row ``index`` of a Parquet record batch, or that row's problem where a value cannot be read into Python."""
    try:
        return {name: column[index].as_py() for name, column in zip(batch.schema.names, batch.columns, strict=True)}
    except Exception as exc:
        return {"__problem__": f"a value Python cannot read: {type(exc).__name__}: {str(exc)[:200]}"}


def read_bigquery(source: str, project: str) -> Iterator[Row]:
    """Rows of a table (``bq:project.dataset.table``) or a query (``bq:SELECT ...``)."""
    client = bigquery_sink.bigquery_client(project)
    spec = source[3:]
    if spec.lstrip().upper().startswith(("SELECT", "WITH")):
        rows, label = client.query(spec).result(), "query"
    else:
        table_project, dataset, table = bigquery_sink.parse_table(spec)
        rows, label = client.list_rows(f"{table_project}.{dataset}.{table}"), f"{table_project}.{dataset}.{table}"
    for number, row in enumerate(rows, start=1):
        yield Row(f"{label}#{number}", {k: _jsonable(v) for k, v in dict(row).items()})


def read_rows(sources: Sequence[str], project: str) -> Iterator[Row]:
    for source in sources:
        if source.startswith("bq:"):
            yield from read_bigquery(source, project)
        else:
            for path in _expand(source):
                yield from read_file(path)


# Rows to messages ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mapping:
    """Which columns make the request: its id, its prompt, request fields (a column named as a field is that field
    unless ``columns`` maps the field to another), and the rest as metadata."""

    id_column: str = "id"
    prompt_column: str = "prompt"
    columns: dict[str, str] = field(default_factory=dict)  # request field -> column

    def message(self, row: Row) -> dict[str, Any]:
        values = row.values
        if "__problem__" in values:
            raise BackfillError(values["__problem__"])
        request_id = values.get(self.id_column)
        if request_id in (None, ""):
            raise BackfillError(f"no id: column {self.id_column!r} is empty or missing")
        message: dict[str, Any] = {"id": str(request_id)}
        prompt = values.get(self.prompt_column)
        if prompt not in (None, ""):
            message["prompt"] = prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False)
        columns = {**{name: name for name in FIELDS if name in values}, **self.columns}  # a field's own name maps
        for name, column in columns.items():
            if values.get(column) not in (None, ""):
                message[name] = _typed(name, values[column])
        used = {self.id_column, self.prompt_column, *columns.values()}
        metadata = {k: v for k, v in values.items() if k not in used and v is not None}
        if metadata:
            message["metadata"] = metadata
        return message


def _typed(name: str, value: Any) -> Any:
    """A CSV cell is text: the request fields that are numbers or JSON are read as such."""
    if not isinstance(value, str):
        return value
    if name in ("max_tokens", "min_tokens", "seed", "deadline_ms"):
        return int(value) if value.strip().lstrip("-").isdigit() else value
    if name in ("temperature", "top_p"):
        try:
            return float(value)
        except ValueError:
            return value
    if name in ("response_format", "messages", "stop"):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def checked(row: Row, mapping: Mapping) -> tuple[bytes, InferenceRequest] | DeadLetter:
    """The message a row makes and the request the template reads from it, or its dead letter (reason and
    position). The feeder's one guard: whatever a row holds, it becomes one or the other, and the run goes on."""
    try:
        data = json.dumps(mapping.message(row), ensure_ascii=False).encode("utf-8")
        if len(data) > PUBSUB_MESSAGE_MAX_BYTES:
            raise BackfillError(f"its message is {len(data):,} bytes, over Pub/Sub's {PUBSUB_MESSAGE_MAX_BYTES:,}")
    except UnicodeEncodeError:
        return _row_letter(row, "the row is not UTF-8 text")
    except Exception as exc:  # a row's own problem, whatever the library raised for it (json: RecursionError too)
        return _row_letter(row, str(exc)[:1000] or type(exc).__name__)
    parsed = parse_request(data, limits=ROW_LIMITS)
    if isinstance(parsed, DeadLetter):
        return DeadLetter.from_bytes(parsed.stage, f"{row.position}: {parsed.reason}", data, id=parsed.id,
                                     attributes={"source_position": row.position}, at=time.time())
    return data, parsed


def _row_letter(row: Row, reason: str) -> DeadLetter:
    """The dead letter of a row that makes no message: the row as JSON (ASCII, so any text survives)."""
    try:
        raw = json.dumps(row.values, default=str).encode("ascii")
    except (ValueError, RecursionError):  # nested deeper than Python writes out: its columns' names at least
        raw = json.dumps({"columns": [str(name) for name in row.values]}).encode("ascii")
    return DeadLetter.from_bytes(STAGE_PARSE, f"{row.position}: {reason}", raw, id=None,
                                 attributes={"source_position": row.position}, at=time.time())


# Where things go ----------------------------------------------------------------------------------------


def _query_name(table: str | None) -> str | None:
    """A table as the command line names it (``project:dataset.table`` or dotted) as queries name it."""
    return ".".join(bigquery_sink.parse_table(table)) if table else None


class Outputs:
    """The input topic, the completions table (what is answered) and where dead letters go."""

    def __init__(self, args: argparse.Namespace) -> None:
        import google.cloud.pubsub_v1 as pubsub_v1

        self.args = args
        self.publisher = pubsub_v1.PublisherClient()
        # A client whenever a table is named; every use of it is behind a named table.
        self.bigquery: Any = bigquery_sink.bigquery_client(args.project) if (
            args.completions_table or args.dead_letter_table) else None
        self.pending: list[Any] = []
        # project.dataset.table, as queries name them; the published ids are recorded beside the completions.
        self.completions = _query_name(args.completions_table)
        self.dead_letters = _query_name(args.dead_letter_table)
        self.published_table = f"{self.completions}_published" if self.completions else None

    def _query(self, query: str, ids: list[str]) -> list[Any]:
        from google.cloud import bigquery

        config = bigquery.QueryJobConfig(query_parameters=[bigquery.ArrayQueryParameter("ids", "STRING", ids)])
        return list(self.bigquery.query(query, job_config=config).result())

    def answered(self, ids: Iterable[str]) -> set[str]:
        ids = list(ids)
        if not self.completions or not ids:
            return set()
        rows = self._query(f"SELECT DISTINCT request_id FROM `{self.completions}` WHERE request_id IN UNNEST(@ids)",
                           ids)
        return {row["request_id"] for row in rows}

    def _published_at(self, ids: list[str]) -> dict[str, Any]:
        """When each of ``ids`` was last recorded as published (by any run); ids never published are left out."""
        if self.published_table is None or not ids:
            return {}
        return {row["request_id"]: row["at"] for row in self._query(
            f"SELECT request_id, MAX(published_at) AS at FROM `{self.published_table}` "
            "WHERE request_id IN UNNEST(@ids) GROUP BY request_id", ids)}

    def _letters_since(self, published_at: dict[str, Any]) -> dict[str, tuple[str, str]]:
        """For each id the job dead-lettered after its last publish, its latest letter's (stage, reason). The job's
        letters only: this feeder's carry the row's source position."""
        if self.dead_letters is None or not published_at:
            return {}
        found: dict[str, tuple[Any, str, str]] = {}
        for row in self._query(f"SELECT request_id, failed_at, stage, reason FROM `{self.dead_letters}` WHERE "
                               "request_id IN UNNEST(@ids) AND JSON_VALUE(attributes, '$.source_position') IS NULL",
                               list(published_at)):
            request_id, at = row["request_id"], row["failed_at"]
            if at > published_at[request_id] and (request_id not in found or at > found[request_id][0]):
                found[request_id] = (at, row["stage"], row["reason"])
        return {request_id: (stage, reason) for request_id, (_, stage, reason) in found.items()}

    def job_letters(self, ids: Sequence[str]) -> dict[str, tuple[str, str]]:
        """(stage, reason) of the job's latest dead letter for each of ``ids`` dead-lettered since its last publish."""
        letters: dict[str, tuple[str, str]] = {}
        for start in range(0, len(ids), CHUNK_ROWS):
            letters.update(self._letters_since(self._published_at(list(ids[start:start + CHUNK_ROWS]))))
        return letters

    def waiting(self, ids: Iterable[str]) -> tuple[set[str], set[str]]:
        """(ids an earlier run published that wait in the job's subscription, ids of those the job dead-lettered
        since at a final stage, :data:`FINAL_STAGES`): neither is sent again. An id the job lettered at another
        stage (a full queue, a failure, a drain) is in neither: it is sent again. With ``--republish``: none."""
        if self.args.republish:
            return set(), set()
        published_at = self._published_at(list(ids))
        letters = self._letters_since(published_at)
        final = {request_id for request_id, (stage, reason) in letters.items() if is_final(stage, reason)}
        return set(published_at) - set(letters), final

    def letters_at(self, positions: Sequence[str]) -> dict[str, set[str]]:
        """The reasons an earlier run of this feeder lettered the rows at ``positions`` with, by position."""
        if self.dead_letters is None or not positions:
            return {}
        found: dict[str, set[str]] = {}
        for row in self._query(f"SELECT JSON_VALUE(attributes, '$.source_position') AS position, reason FROM "
                               f"`{self.dead_letters}` WHERE JSON_VALUE(attributes, '$.source_position') IN "
                               "UNNEST(@ids)", list(positions)):
            found.setdefault(row["position"], set()).add(row["reason"])
        return found

    def prepare(self) -> None:
        """Checks that the completions table exists, and creates the table of published ids beside it if missing."""
        if self.published_table is None:
            return
        from google.cloud import bigquery

        try:
            self.bigquery.get_table(self.completions)
        except NotFound:
            raise BackfillError(f"the completions table {self.args.completions_table} does not exist (the job "
                                "creates it when it starts): check the name, or start the job first") from None
        self.bigquery.create_table(bigquery.Table(self.published_table, schema=[
            bigquery.SchemaField("request_id", "STRING", mode="REQUIRED"),
            bigquery.SchemaField("published_at", "TIMESTAMP", mode="REQUIRED"),
            bigquery.SchemaField("source_position", "STRING")]), exists_ok=True)

    def record(self, rows: list[tuple[str, str]], published_at: datetime.datetime) -> None:
        """Notes (id, source position) pairs as published at ``published_at``, taken before they were published (a
        letter the job writes for one, however soon, is then later); called once Pub/Sub has confirmed them."""
        if self.published_table is None or not rows:
            return
        at = published_at.isoformat()
        errors = self.bigquery.insert_rows_json(
            self.published_table, [{"request_id": i, "published_at": at, "source_position": p} for i, p in rows],
            row_ids=[f"{i}@{at}" for i, _ in rows])
        if errors:
            raise BackfillError(f"the table of published ids {self.published_table} refused rows: {errors[:3]}")

    def publish(self, data: bytes) -> None:
        self.pending.append(self.publisher.publish(self.args.topic, data))

    def letter(self, letter: DeadLetter) -> None:
        record = letter.to_record()
        if self.args.dead_letter_topic:
            self.pending.append(self.publisher.publish(self.args.dead_letter_topic, json.dumps(record).encode()))
        if self.dead_letters:
            row, insert_id = bigquery_sink.dead_letter_row(record)
            errors = self.bigquery.insert_rows_json(self.dead_letters, [row], row_ids=[insert_id])
            if errors:
                raise BackfillError(f"the dead-letter table refused a row: {errors}")

    def flush(self) -> None:
        """Waits until Pub/Sub has confirmed everything published so far."""
        for future in self.pending:
            future.result(timeout=120)
        self.pending = []

    def progress_of(self, ids: Sequence[str]) -> tuple[int, int]:
        """(answered, their completion tokens) among ``ids`` in the completions table."""
        answered = tokens = 0
        for start in range(0, len(ids), CHUNK_ROWS):
            (row,) = self._query(f"SELECT COUNT(DISTINCT request_id) AS n, SUM(completion_tokens) AS t FROM "
                                 f"`{self.completions}` WHERE request_id IN UNNEST(@ids)",
                                 list(ids[start:start + CHUNK_ROWS]))
            answered, tokens = answered + (row["n"] or 0), tokens + (row["t"] or 0)
        return answered, tokens


# The run ------------------------------------------------------------------------------------------------


def is_final(stage: str, reason: str) -> bool:
    """Whether a job's letter at ``stage`` for ``reason`` is what a resend of the same row gets again."""
    return stage in FINAL_STAGES or (stage == STAGE_INFERENCE and reason.startswith(REFUSED_BY_SERVER))


def chunks(rows: Iterable[Row], size: int) -> Iterator[list[Row]]:
    chunk: list[Row] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def feed(rows: Iterable[Row], mapping: Mapping, outputs: Outputs, tally: Tally, published: dict[str, bytes],
         progress: Any = None) -> None:
    """Publishes every unanswered row once, letters the rows that cannot be requests; counts each row once."""
    for chunk in chunks(rows, CHUNK_ROWS):
        publishing_at = datetime.datetime.now(datetime.UTC)  # before any of the chunk reaches the job
        made = [(row, checked(row, mapping)) for row in chunk]
        ids = {result[1].id for _, result in made if isinstance(result, tuple)}
        answered = outputs.answered(ids)
        waiting, final = outputs.waiting(ids - answered)
        before: dict[str, set[str]] | None = None  # the letters earlier runs wrote, read at the chunk's first letter
        sent: list[tuple[str, str]] = []

        def letter(row: Row, dead_letter: DeadLetter, chunk: list[Row] = chunk) -> None:
            """A row's letter, written unless an earlier run wrote the same one: a rerun adds no copy."""
            nonlocal before
            if before is None:
                before = outputs.letters_at([row.position for row in chunk])
            if dead_letter.reason in before.get(row.position, ()):
                tally.lettered_before += 1
            else:
                outputs.letter(dead_letter)
                tally.lettered += 1

        for row, result in made:
            tally.read += 1
            if isinstance(result, DeadLetter):
                letter(row, result)
            else:
                data, request = result
                if request.id in answered:
                    tally.skipped += 1
                elif request.id in waiting or request.id in final:  # an earlier run published it: not again
                    if request.id in final:
                        tally.final += 1
                    else:
                        tally.waiting += 1
                    waiting.discard(request.id)  # a later row with this id is a repeat or another row
                    final.discard(request.id)
                    published[request.id] = data
                elif request.id in published:
                    if published[request.id] == data:
                        tally.repeated += 1
                    else:
                        letter(row, DeadLetter.from_bytes(
                            STAGE_PARSE, f"{row.position}: another row of this backfill has id {request.id!r}",
                            data, id=request.id, attributes={"source_position": row.position}, at=time.time()))
                else:
                    outputs.publish(data)
                    published[request.id] = data
                    sent.append((request.id, row.position))
                    tally.published += 1
                    tally.max_tokens += request.max_tokens or default("default_max_tokens")
            if progress is not None:
                progress.update(1)
                progress.set_postfix(published=tally.published, skipped=tally.skipped, lettered=tally.lettered,
                                     refresh=False)
        outputs.flush()
        outputs.record(sent, publishing_at)


def estimate(args: argparse.Namespace, tally: Tally) -> str:
    hours = tally.max_tokens / args.gpu_tokens_per_s / 3600 if tally.max_tokens else 0.0
    return (f"at most {tally.max_tokens:,} output tokens (the rows' max_tokens): {hours:.2f} GPU-hours at "
            f"{args.gpu_tokens_per_s:g} tokens/s a GPU worker, about {hours * args.worker_hour_usd:.2f} USD at "
            f"{args.worker_hour_usd:g} USD a worker-hour (assumed: docs/operations.md#idle-worker-cost; set "
            "--gpu-tokens-per-s and --worker-hour-usd for yours)")


@dataclass(frozen=True)
class Waited:
    """What ``--wait`` saw end: answers (and their tokens) and the job's dead letters, by id, in ``elapsed_s``."""

    answered: int
    tokens: int
    lettered: dict[str, tuple[str, str]]  # id -> (stage, reason): the job's, for ids it did not answer
    elapsed_s: float


def wait_for_answers(outputs: Outputs, ids: Sequence[str], args: argparse.Namespace) -> Waited:
    """Polls the completions and dead-letter tables until every published id is answered or dead-lettered by the
    job (or ``--wait-timeout-s``): a row the job cannot serve ends the wait as an answer does."""
    from tqdm import tqdm

    started = time.monotonic()
    waited = Waited(0, 0, {}, 0.0)
    with tqdm(total=len(ids), desc="ended", unit="row", file=sys.stderr, disable=args.quiet) as bar:
        while waited.answered + len(waited.lettered) < len(ids) and \
                time.monotonic() - started < args.wait_timeout_s:
            time.sleep(args.wait_poll_s)
            answered, tokens = outputs.progress_of(ids)
            letters = outputs.job_letters(ids)
            served = outputs.answered(letters)  # lettered once, answered since (a drained request redriven)
            waited = Waited(answered, tokens, {i: found for i, found in letters.items() if i not in served},
                            time.monotonic() - started)
            bar.update(waited.answered + len(waited.lettered) - bar.n)
            bar.set_postfix(lettered=len(waited.lettered), tokens_per_s=f"{tokens / waited.elapsed_s:.0f}",
                            refresh=True)
    return waited


def from_settings(args: argparse.Namespace) -> None:
    """What ``make backfill`` knows: the project, the topic, and the outputs of the job the settings launch."""
    settings = Settings(dict(os.environ))
    parameters = template_parameters(settings)
    args.project = args.project or settings.get("PROJECT")
    args.topic = (args.topic or settings.pubsub_path("BACKFILL_TOPIC") or settings.pubsub_path("BULK_TOPIC")
                  or settings.pubsub_path("INPUT_TOPIC"))
    args.completions_table = args.completions_table or parameters.get("output_completions_table")
    args.dead_letter_table = args.dead_letter_table or parameters.get("dead_letter_table")
    args.dead_letter_topic = args.dead_letter_topic or parameters.get("dead_letter_topic")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.backfill", description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", action="append", required=True,
                        help="bq:PROJECT.DATASET.TABLE, bq:SELECT ..., or a .jsonl/.csv/.parquet path or glob "
                             "(local or gs://); repeat for more")
    parser.add_argument("--project", help="the project of the topic and tables")
    parser.add_argument("--topic", help="the backfill job's input topic, projects/P/topics/T")
    parser.add_argument("--completions-table", help="the job's completions table: answered ids are skipped")
    parser.add_argument("--dead-letter-table", help="where rows that cannot become requests go (BigQuery)")
    parser.add_argument("--dead-letter-topic", help="... or (and) this topic")
    parser.add_argument("--id-column", default="id")
    parser.add_argument("--prompt-column", default="prompt")
    parser.add_argument("--column", action="append", default=[], metavar="FIELD=COLUMN",
                        help=f"a request field from a column; fields: {', '.join(FIELDS)}")
    parser.add_argument("--gpu-tokens-per-s", type=float, default=DEFAULT_GPU_TOKENS_PER_S)
    parser.add_argument("--worker-hour-usd", type=float, default=DEFAULT_WORKER_HOUR_USD)
    parser.add_argument("--republish", action="store_true",
                        help="send again the rows an earlier run published that are not answered yet (by default "
                             "they are left to wait in the job's subscription, and those the job dead-lettered at "
                             "parse, validate or measure, or its model server refused, are not sent again): for a "
                             "subscription deleted or emptied "
                             "since, or a job whose settings were changed to take them")
    parser.add_argument("--wait", action="store_true",
                        help="then wait until the job has answered or dead-lettered every row, showing its progress, "
                             "and name the rows it dead-lettered (its letters are read from --dead-letter-table)")
    parser.add_argument("--wait-timeout-s", type=float, default=7 * 24 * 3600.0)
    parser.add_argument("--wait-poll-s", type=float, default=WAIT_POLL_S)
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("--from-settings", action="store_true",
                        help="fill what is not given from the deploy settings (make backfill): PROJECT, "
                             "BACKFILL_TOPIC, BULK_TOPIC or INPUT_TOPIC, and the job's output_completions_table and "
                             "dead-letter outputs from its parameters")
    args = parser.parse_args(argv)
    if args.from_settings:
        try:
            from_settings(args)
        except DeployError as exc:
            parser.error(str(exc))
    if not (args.project and args.topic):
        parser.error("--project and --topic are required (or --from-settings)")
    try:
        columns = dict(pair.split("=", 1) for pair in args.column)
    except ValueError:
        parser.error("--column takes FIELD=COLUMN")
    unknown = set(columns) - set(FIELDS)
    if unknown:
        parser.error(f"--column: {', '.join(sorted(unknown))} is not a request field ({', '.join(FIELDS)})")
    if not (args.dead_letter_table or args.dead_letter_topic):
        parser.error("name --dead-letter-table or --dead-letter-topic: rows that cannot become requests go there")
    if args.wait and not (args.completions_table and args.dead_letter_table):
        parser.error("--wait reads the job's answers from --completions-table and its letters from "
                     "--dead-letter-table (the job's output_completions_table and dead_letter_table): without both "
                     "it cannot tell when every row ended")
    from tqdm import tqdm

    if not args.completions_table:
        print("warning: no completions table (--completions-table, or the job's output_completions_table): "
              "nothing can be skipped as answered, and a run again publishes every row again (the job drops "
              "repeats of an id only within its dedupe_window_s)", file=sys.stderr, flush=True)
    mapping, tally = Mapping(args.id_column, args.prompt_column, columns), Tally()
    published: dict[str, bytes] = {}
    outputs = Outputs(args)
    started = time.monotonic()
    try:
        outputs.prepare()
        with tqdm(desc="published", unit="row", file=sys.stderr, disable=args.quiet) as bar:
            feed(read_rows(args.source, args.project), mapping, outputs, tally, published, bar)
    except BackfillError as exc:
        print(f"make backfill: {exc}", file=sys.stderr)
        return 2
    print(f"Read {tally.read:,} rows in {time.monotonic() - started:.1f} s: {tally.published:,} published, "
          f"{tally.skipped:,} skipped as answered, {tally.lettered:,} dead letters (each with its position; "
          f"{tally.lettered_before:,} more lettered by an earlier run, not again), {tally.repeated:,} repeated rows, "
          f"{tally.waiting:,} published by an earlier run and not answered yet (left to wait in the job's "
          f"subscription), {tally.final:,} dead-lettered by the job at parse, validate or measure or refused by "
          f"its model server (a resend gets the same letter: fix the row or the job's settings, then --republish "
          f"sends these and the waiting ones "
          f"again). Estimate: {estimate(args, tally)}.", flush=True)
    assert tally.adds_up(), tally
    if args.wait and published:
        waited = wait_for_answers(outputs, list(published), args)
        rate = waited.tokens / waited.elapsed_s if waited.elapsed_s else 0.0
        lettered = "; ".join(f"{i} ({stage}: {reason[:120]})" for i, (stage, reason) in
                             sorted(waited.lettered.items())[:5])
        print(f"Answered {waited.answered:,} of {len(published):,} in {waited.elapsed_s:.0f} s: {waited.tokens:,} "
              f"tokens, {rate:.0f} tokens/s measured ({rate / args.gpu_tokens_per_s:.2f}x the estimate's rate); "
              f"{len(waited.lettered):,} dead-lettered by the job" + (f": {lettered}" if lettered else "")
              + (" (all in its dead-letter table)" if len(waited.lettered) > 5 else "") + ".", flush=True)
        open_rows = len(published) - waited.answered - len(waited.lettered)
        if open_rows:
            print(f"--wait-timeout-s={args.wait_timeout_s:g} passed with {open_rows:,} rows neither answered nor "
                  "dead-lettered.", file=sys.stderr, flush=True)
        return 0 if not open_rows else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
