"""A backfill end to end (local/backfill_smoke.py's path): a JSONL history through the feeder, the real pipeline on
the DirectRunner with the local vLLM and a prompt template, into BigQuery tables on the emulator; then the same
backfill again. Every good row is answered exactly once, the bad ones are dead letters with their position, and
the second run publishes nothing."""

from __future__ import annotations

import pytest

from local import backfill_smoke
from local.harness import REPO_ROOT, LocalRun
from local.cpu_server import LOCAL_SERVER
from local.emulators import emulator_bigquery_client

pytestmark = pytest.mark.engine


def test_a_history_is_answered_once_and_a_second_run_publishes_nothing(tmp_path, checkpoint, emulator, bigquery,
                                                                        capsys):
    run = LocalRun([f"--model={checkpoint}", "--served_model_name=smollm2", *LOCAL_SERVER.template_args(),
                    "--max_in_flight=16", "--num_shards=2", f"--prompt_template={backfill_smoke.TEMPLATE}",
                    f"--output_completions_table={backfill_smoke.COMPLETIONS}",
                    f"--dead_letter_table={backfill_smoke.DEAD_LETTERS}"],
                   log_path=REPO_ROOT / ".cache" / "test-backfill" / "pipeline.log", emulator=emulator)
    run.start()
    try:
        assert backfill_smoke.warmed_up(run, 600), run.log_tail()
        history = tmp_path / "history.jsonl"
        good = backfill_smoke.write_history(history)
        assert backfill_smoke.feed(run, history, "--wait", "--wait-poll-s=1", "--wait-timeout-s=600",
                                   "--quiet") == 0, run.log_tail()
        first = capsys.readouterr().out
        assert f"{len(good)} published, 0 skipped as answered, 2 dead letters" in first
        assert f"Answered {len(good)} of {len(good)}" in first
        assert backfill_smoke.feed(run, history, "--quiet") == 0
        second = capsys.readouterr().out
        assert f"0 published, {len(good)} skipped as answered, 2 dead letters" in second
    finally:
        run.stop()
    answers = backfill_smoke.answers()
    assert sorted(a["request_id"] for a in answers) == sorted(good), "each good row answered exactly once"
    assert all(a["customer"].startswith("customer-") for a in answers), "the other columns travel as metadata"
    letters = emulator_bigquery_client("local-project").query(
        f"SELECT reason FROM `{backfill_smoke.DEAD_LETTERS.replace(':', '.')}` WHERE stage = 'parse'").result()
    positions = {row["reason"].split(": ", 1)[0].rsplit(":", 1)[1] for row in letters}
    assert positions == {"4", "7"}, "the two bad rows, with their lines"
