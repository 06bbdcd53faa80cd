"""A backfill end to end (local/backfill_smoke.py's path): a JSONL history through the feeder, the real pipeline on
the DirectRunner with the local vLLM and a prompt template, into BigQuery tables on the emulator. Every good row is
answered exactly once, the bad ones are dead letters with their position; the same backfill again publishes
nothing; a feeder killed while the job answers its rows, and run again, leaves no row unanswered and none answered
twice."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from local import backfill_smoke
from local.emulators import emulator_bigquery_client
from local.harness import REPO_ROOT, LocalRun
from pipeline.serving.vllm_server import free_port
from tests.conftest import SERVED_NAME, wait_until

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def run(vllm_server, emulator, bigquery):
    """The template's pipeline on the DirectRunner, writing to the backfill's tables, on the suite's vLLM (what
    the model server's ownership changes is the end-to-end tests' of the managed server, not a backfill's)."""
    pipeline = LocalRun([f"--server_url={vllm_server.base_url}", f"--served_model_name={SERVED_NAME}",
                         "--max_in_flight=16", "--num_shards=2", f"--prompt_template={backfill_smoke.TEMPLATE}",
                         f"--output_completions_table={backfill_smoke.COMPLETIONS}",
                         f"--dead_letter_table={backfill_smoke.DEAD_LETTERS}"],
                        log_path=REPO_ROOT / ".cache" / "test-backfill" / "pipeline.log", emulator=emulator)
    pipeline.start()
    try:
        assert backfill_smoke.warmed_up(pipeline, 600), pipeline.log_tail()
        yield pipeline
    finally:
        pipeline.stop()


def answered(prefix: str) -> list[dict]:
    return [a for a in backfill_smoke.answers() if a["request_id"].startswith(prefix)]


def test_a_history_is_answered_once_and_a_second_run_publishes_nothing(run, tmp_path, capsys):
    history = tmp_path / "history.jsonl"
    good = backfill_smoke.write_history(history)
    assert backfill_smoke.feed(run, history, "--wait", "--wait-poll-s=1", "--wait-timeout-s=600",
                               "--quiet") == 0, run.log_tail()
    first = capsys.readouterr().out
    assert f"{len(good)} published, 0 skipped as answered, 2 dead letters" in first
    assert f"Answered {len(good)} of {len(good)}" in first
    assert backfill_smoke.feed(run, history, "--quiet") == 0
    second = capsys.readouterr().out
    assert f"0 published, {len(good)} skipped as answered, 0 dead letters (each with its position; 2 more " \
        "lettered by an earlier run, not again)" in second
    answers = answered("ticket-")
    assert sorted(a["request_id"] for a in answers) == sorted(good), "each good row answered exactly once"
    assert all(a["customer"].startswith("customer-") for a in answers), "the other columns travel as metadata"
    letters = list(emulator_bigquery_client("local-project").query(
        f"SELECT reason FROM `{backfill_smoke.DEAD_LETTERS.replace(':', '.')}` WHERE stage = 'parse'").result())
    positions = [row["reason"].split(": ", 1)[0].rsplit(":", 1)[1] for row in letters]
    assert sorted(positions) == ["4", "7"], "the two bad rows, with their lines, each lettered once over two runs"


def test_a_feeder_killed_while_the_job_answers_and_run_again_answers_every_row_once(run, tmp_path):
    """docs/operations.md#backfill: a run stopped at any point and started again publishes only the rows never
    published; those the stopped run published and the job has not answered yet are left to wait for it."""
    history = tmp_path / "records.jsonl"
    total = 40
    history.write_text("".join(json.dumps({"id": f"record-{i}", "prompt": f"Record {i}: the parcel came late.",
                                           "max_tokens": 32, "min_tokens": 32}) + "\n" for i in range(total)))
    command = [sys.executable, "-m", "local.backfill",
               *backfill_smoke.feed_args(run, history, "--wait", "--wait-poll-s=1", "--wait-timeout-s=600")]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    first = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
    try:
        assert wait_until(lambda: len(answered("record-")) >= 4, 600, interval_s=0.5), run.log_tail()
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    at_kill = len(answered("record-"))
    assert at_kill < total, "killed before every row was answered"
    again = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr + run.log_tail()
    counts = [int(re.search(pattern, again.stdout).group(1).replace(",", "")) for pattern in (
        r"([\d,]+) skipped as answered", r": ([\d,]+) published,", r"([\d,]+) published by an earlier run")]
    skipped, published, waiting = counts
    assert skipped >= at_kill and skipped + published + waiting == total, again.stdout
    ids = [a["request_id"] for a in answered("record-")]
    assert sorted(ids) == sorted(f"record-{i}" for i in range(total)), "every row answered, none twice"


@pytest.mark.parametrize("refused, status", [
    # A prompt over the server's context (about 2,500 tokens against 2,048), which a job on a server_url does not
    # refuse itself: it estimates prompts by characters.
    ({"id": "refused-long", "prompt": "The parcel came late. " * 500, "max_tokens": 4}, 400),
    # An adapter the server lacks: a job on a server_url leaves it to the server which adapters it serves.
    ({"id": "refused-adapter", "prompt": "The parcel came late.", "max_tokens": 4, "adapter": "no-such-adapter"},
     404)], ids=["too-long", "no-such-adapter"])
def test_a_row_the_model_server_refuses_ends_the_wait_and_is_not_published_again(run, tmp_path, capsys, refused,
                                                                                  status):
    """A row the job passes and vLLM refuses for what it is (HTTP 4xx) is lettered at the inference stage as
    refused: --wait counts it as ended, however soon after its publishing the job's letter lands, and a rerun
    leaves it alone, as it does a row lettered at parse, validate or measure."""
    history = tmp_path / "refused.jsonl"
    kept = {"id": f"kept-{refused['id']}", "prompt": "The parcel came late.", "max_tokens": 4}
    history.write_text(json.dumps(kept) + "\n" + json.dumps(refused) + "\n")
    assert backfill_smoke.feed(run, history, "--wait", "--wait-poll-s=1", "--wait-timeout-s=300",
                               "--quiet") == 0, run.log_tail()
    first = capsys.readouterr().out
    assert "Answered 1 of 2" in first and (f"1 dead-lettered by the job: {refused['id']} (inference: the server "
                                           f"rejected the request: HTTP {status}") in first, first
    assert backfill_smoke.feed(run, history, "--quiet") == 0
    again = capsys.readouterr().out
    assert ": 0 published, 1 skipped as answered" in again and \
        "1 dead-lettered by the job at parse, validate or measure or refused by its model server" in again, again


def test_a_row_the_job_could_not_answer_while_its_server_was_down_is_published_again_and_answered(
        run, vllm_server, emulator, tmp_path, capsys):
    """A job whose model server does not answer (nothing listens at its server_url) letters a row at the inference
    stage once request_timeout_s passed, for a reason a resend can change: --wait ends on it. The same job started
    again with its server up (a successor on the same subscription and tables) answers it when a rerun of the
    feeder publishes it again, without --republish; a rerun after that publishes nothing. (``run``: the module's
    job, which made the tables.)"""
    history = tmp_path / "transient.jsonl"
    history.write_text(json.dumps({"id": "transient-1", "prompt": "The parcel came late.", "max_tokens": 4}) + "\n")
    tables = [f"--prompt_template={backfill_smoke.TEMPLATE}", f"--served_model_name={SERVED_NAME}",
              f"--output_completions_table={backfill_smoke.COMPLETIONS}",
              f"--dead_letter_table={backfill_smoke.DEAD_LETTERS}"]
    folder = REPO_ROOT / ".cache" / "test-backfill"
    down = LocalRun([f"--server_url=http://127.0.0.1:{free_port()}", "--request_timeout_s=3", *tables],
                    log_path=folder / "pipeline-down.log", emulator=emulator).start()
    try:
        assert backfill_smoke.feed(down, history, "--wait", "--wait-poll-s=1", "--wait-timeout-s=300",
                                   "--quiet") == 0, down.log_tail()
    finally:
        down.stop()
    first = capsys.readouterr().out
    assert "Answered 0 of 1" in first and "1 dead-lettered by the job: transient-1 (inference: no answer within " \
        "request_timeout_s=3" in first, first
    up = down.successor([f"--server_url={vllm_server.base_url}", *tables], log_path=folder / "pipeline-up.log").start()
    try:
        assert backfill_smoke.feed(up, history, "--wait", "--wait-poll-s=1", "--wait-timeout-s=300",
                                   "--quiet") == 0, up.log_tail()
        again = capsys.readouterr().out
        assert ": 1 published, 0 skipped as answered" in again and "Answered 1 of 1" in again, again
        assert backfill_smoke.feed(up, history, "--quiet") == 0
        assert ": 0 published, 1 skipped as answered" in capsys.readouterr().out
    finally:
        up.stop()
    assert [a["request_id"] for a in answered("transient-")] == ["transient-1"], "answered once"
