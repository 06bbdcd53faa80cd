"""``make backfill-smoke``: a backfill end to end on this machine, and again to show it resumes.

Starts the Pub/Sub and BigQuery emulators and the pipeline on the DirectRunner (the local vLLM, a
``prompt_template`` for the enrichment, completions and dead letters in BigQuery tables), writes a small
history of support tickets to a JSONL file (two of its rows bad on purpose), and runs the backfill
(``ops/backfill.py``) over it with ``--wait``: progress while the rows are published and answered, then the
summary. It runs the same backfill a second time: every row is answered, so nothing is published again.
Then it prints the completions table. Stops everything it started.

    python -m local.backfill_smoke [--timeout-s 900]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import time
from pathlib import Path

from local.cpu_server import LOCAL_SERVER
from local.embedded_model import ensure_local_checkpoint
from local.emulators import BigQueryEmulator, emulator_bigquery_client
from local.harness import REPO_ROOT, LocalRun
from ops import backfill

TICKETS = ["I was charged twice this month.", "The app crashes when I open settings.",
           "How do I change my delivery address?", "My parcel never arrived.", "Please cancel my subscription.",
           "The invoice shows the wrong company name.", "Login fails with a timeout.",
           "Can I pay with a bank transfer?"]
TEMPLATE = "Answer with one word, billing, bug or other. Support ticket: {text}"
COMPLETIONS = "local-project:llm.backfill_completions"
DEAD_LETTERS = "local-project:llm.backfill_dead_letters"
WARM_UP = "warm-up"  # the request that starts the model server before the backfill; not one of its rows


def write_history(path: Path) -> list[str]:
    """The tickets as JSONL rows with a customer column (metadata), and two bad rows; returns the good ids."""
    rows = [json.dumps({"id": f"ticket-{n}", "prompt": text, "customer": f"customer-{n % 3}", "max_tokens": 4})
            for n, text in enumerate(TICKETS)]
    rows.insert(3, json.dumps({"prompt": "A ticket exported without its id."}))
    rows.insert(6, "{truncated export")
    path.write_text("\n".join(rows) + "\n")
    return [f"ticket-{n}" for n in range(len(TICKETS))]


def feed_args(run: LocalRun, history: Path, *extra: str) -> list[str]:
    """``ops/backfill.py``'s arguments for a backfill of ``history`` into this local pipeline's input."""
    return [f"--source={history}", "--project=local-project",
            f"--topic={run.emulator.topic(run.topic_name('prompts'))}", f"--completions-table={COMPLETIONS}",
            f"--dead-letter-table={DEAD_LETTERS}", *extra]


def feed(run: LocalRun, history: Path, *extra: str) -> int:
    return backfill.main(feed_args(run, history, *extra))


def answers(table: str = COMPLETIONS) -> list[dict]:
    client = emulator_bigquery_client("local-project")
    query = (f"SELECT request_id, completion_text, JSON_VALUE(metadata, '$.customer') AS customer "
             f"FROM `{table.replace(':', '.')}` WHERE request_id != '{WARM_UP}' ORDER BY request_id")
    return [dict(row) for row in client.query(query).result()]


def start_pipeline(bigquery: BigQueryEmulator, log_path: Path) -> LocalRun:
    emulator_bigquery_client(bigquery.project).create_dataset("llm", exists_ok=True)
    checkpoint = ensure_local_checkpoint()
    run = LocalRun([f"--model={checkpoint}", "--served_model_name=smollm2", *LOCAL_SERVER.template_args(),
                    "--max_in_flight=16", "--num_shards=2", f"--prompt_template={TEMPLATE}",
                    f"--output_completions_table={COMPLETIONS}", f"--dead_letter_table={DEAD_LETTERS}"],
                   log_path=log_path)
    run.start()
    return run


def warmed_up(run: LocalRun, timeout_s: float) -> bool:
    """One request through, so that the model server is up and the job's tables exist before the backfill."""
    collector = run.collector()
    try:
        run.publish([{"id": WARM_UP, "prompt": "Hi", "max_tokens": 1}])
        return not collector.wait_for([WARM_UP], timeout_s)
    finally:
        collector.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout-s", type=float, default=900)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log_path = REPO_ROOT / ".cache" / "backfill-smoke" / "pipeline.log"
    with contextlib.ExitStack() as stack:
        print("==> Starting the BigQuery and Pub/Sub emulators and the pipeline (DirectRunner, local vLLM: its "
              "server starts on first use, about a minute on CPU)", flush=True)
        bigquery = stack.enter_context(BigQueryEmulator())
        bigquery.activate()
        run = start_pipeline(bigquery, log_path)
        stack.callback(run.stop)
        if not warmed_up(run, args.timeout_s):
            print("FAILED: the model server did not answer; last pipeline log lines:\n" + run.log_tail(),
                  file=sys.stderr)
            return 1
        history = log_path.parent / "history.jsonl"
        write_history(history)
        print(f"==> Backfilling {history}", flush=True)
        started = time.time()
        code = feed(run, history, "--wait", "--wait-poll-s=2", f"--wait-timeout-s={args.timeout_s}")
        print(f"==> First run: exit {code} after {time.time() - started:.0f} s", flush=True)
        if code:
            print("FAILED; last pipeline log lines:\n" + run.log_tail(), file=sys.stderr)
            return code
        print("==> The same backfill again: every row is answered, so nothing is published", flush=True)
        code = feed(run, history, "--quiet")
        for row in answers():
            print(f"  {row['request_id']:>10} {row['customer']:>11}  {row['completion_text']!r}", flush=True)
        return code


if __name__ == "__main__":
    sys.exit(main())
