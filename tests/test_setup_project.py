"""Step 1 of the README, `make setup`: every gcloud command it runs is one the real gcloud accepts, flags and all
(run offline, its API endpoints pointed at the loopback recorder), and it covers every account and resource the
later steps need."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from ops import setup_project
from ops.deploy import DeployError, Settings
from tests.gcloud_recorder import Recorder

REPO = Path(__file__).resolve().parent.parent
SETTINGS = {"PROJECT": "proj-123456", "REGION": "us-central1", "BUCKET": "bkt-test",
            "INPUT_TOPIC": "projects/proj-123456/topics/prompts",
            "INPUT_SUBSCRIPTION": "projects/proj-123456/subscriptions/prompts-sub",
            "CHUNKS_TOPIC": "projects/proj-123456/topics/llm-chunks",
            "COMPLETIONS_TOPIC": "projects/proj-123456/topics/llm-completions",
            "DEAD_LETTER_TOPIC": "projects/proj-123456/topics/llm-dead-letters"}


def test_every_command_of_step_one_is_one_the_real_gcloud_accepts(tmp_path):
    recorder = Recorder(str(tmp_path / "gcloud-config"))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("CLOUDSDK_")}, **recorder.env()}
    try:
        for command in setup_project.commands(Settings(SETTINGS), "123456789012"):
            before = len(recorder.requests)
            result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
            # gcloud parses every argument before it calls anything: 2 and these words are a parse error.
            assert result.returncode != 2 and "unrecognized arguments" not in result.stderr \
                and "Invalid choice" not in result.stderr, (command, result.stderr)
            assert len(recorder.requests) > before, f"gcloud made no API call for {command}: {result.stderr}"
    finally:
        recorder.close()


def test_step_one_creates_what_the_later_steps_use_and_grants_each_account():
    commands = [" ".join(c) for c in setup_project.commands(Settings(SETTINGS), "123456789012")]
    text = "\n".join(commands)
    assert all(api in commands[0] for api in ("dataflow.googleapis.com", "secretmanager.googleapis.com",
                                                "monitoring.googleapis.com", "artifactregistry.googleapis.com"))
    assert "buckets create gs://bkt-test" in text and "--location us-central1" in text
    assert "repositories create dataflow --repository-format docker --location us-central1" in text
    for topic in ("prompts", "llm-chunks", "llm-completions", "llm-dead-letters"):
        assert f"pubsub topics create {topic} " in text
    assert "pubsub subscriptions create prompts-sub --topic prompts" in text
    default = "serviceAccount:123456789012-compute@developer.gserviceaccount.com"
    for role in setup_project.WORKER_ROLES:
        assert f"--member {default} --role {role}" in text
    for role in setup_project.BUILD_ROLES:
        assert f"--member serviceAccount:123456789012@cloudbuild.gserviceaccount.com --role {role}" in text
    named = "\n".join(" ".join(c) for c in setup_project.commands(
        Settings({**SETTINGS, "SERVICE_ACCOUNT": "llm@proj-123456.iam.gserviceaccount.com"}), "123456789012"))
    assert "--member serviceAccount:llm@proj-123456.iam.gserviceaccount.com --role roles/dataflow.worker" in named
    bare = "\n".join(" ".join(c) for c in setup_project.commands(Settings({**SETTINGS, "INPUT_SUBSCRIPTION": "mine"})))
    assert "subscriptions create mine --topic prompts --project proj-123456" in bare, "a bare ID is in PROJECT"
    with pytest.raises(DeployError, match="is in project my-project, not PROJECT=proj-123456"):
        setup_project.commands(Settings({**SETTINGS, "INPUT_SUBSCRIPTION": "projects/my-project/subscriptions/s"}))
    with pytest.raises(DeployError, match="projects/PROJECT/subscriptions/ID"):
        setup_project.commands(Settings({**SETTINGS, "INPUT_SUBSCRIPTION": "projects/proj-123456/topics/s"}))


def test_make_setup_dry_run_prints_every_command_with_the_settings_of_env_example(tmp_path):
    env_file = tmp_path / "deploy.env"
    env_file.write_text((REPO / ".env.example").read_text())
    unused = tmp_path / "deploy-venv"  # gcloud-only targets run on the system's Python: no Beam install first
    result = subprocess.run(["make", "--no-print-directory", "setup", "DRY_RUN=1", f"ENV_FILE={env_file}",
                             f"DEPLOY_VENV={unused}"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert not unused.exists(), "a dry run of make setup installed the deploy virtualenv"
    printed = "\n".join(line for line in result.stdout.splitlines() if line.startswith("==> gcloud"))
    # Only PROJECT, REGION and BUCKET are set: every Pub/Sub name is derived from PROJECT, in PROJECT.
    for topic in ("prompts", "llm-chunks", "llm-completions", "llm-dead-letters"):
        assert f"pubsub topics create {topic} --project my-project" in printed
    assert "pubsub subscriptions create prompts-sub --topic prompts --project my-project" in printed
    assert "PROJECT_NUMBER-compute@developer.gserviceaccount.com" in result.stdout
    assert "Next:" in result.stdout and "make image" in result.stdout  # logging in came before (README step 1)
