"""Step 1 of the README, `make setup`: every gcloud command it runs is one the real gcloud accepts, flags and all
(run offline, its API endpoints pointed at the loopback recorder), and it covers every account and resource the
later steps need."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
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


# Step one with both token secrets set, their grants included: what the tests below run once through gcloud.
TOKEN_SETTINGS = {**SETTINGS, "HF_TOKEN_SECRET": "projects/proj-123456/secrets/hf-token/versions/latest",
                  "BAKE_TOKEN_SECRET": "projects/proj-123456/secrets/bake-token/versions/2"}


@dataclass(frozen=True)
class Ran:
    """One command of step one as the real gcloud ran it, and how many API calls it made."""

    command: list[str]
    result: subprocess.CompletedProcess
    calls: int


@pytest.fixture(scope="module")
def step_one(tmp_path_factory) -> tuple[list[Ran], list[tuple[str, str, str]]]:
    """Every command of step one run once, in order, by the real gcloud against the loopback recorder: what each
    did, and the grants the recorder received (resource, role, member)."""
    recorder = Recorder(str(tmp_path_factory.mktemp("gcloud") / "gcloud-config"))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("CLOUDSDK_")}, **recorder.env()}
    ran = []
    try:
        for command in setup_project.commands(Settings(TOKEN_SETTINGS), "123456789012"):
            before = len(recorder.requests)
            result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
            ran.append(Ran(command, result, len(recorder.requests) - before))
        return ran, recorder.grants()
    finally:
        recorder.close()


def test_every_command_of_step_one_is_one_the_real_gcloud_accepts(step_one):
    for ran in step_one[0]:
        # gcloud parses every argument before it calls anything: 2 and these words are a parse error.
        assert ran.result.returncode != 2 and "unrecognized arguments" not in ran.result.stderr \
            and "Invalid choice" not in ran.result.stderr, (ran.command, ran.result.stderr)
        assert ran.calls > 0, f"gcloud made no API call for {ran.command}: {ran.result.stderr}"


def test_step_one_creates_what_the_later_steps_use_and_the_jobs_own_account():
    commands = [" ".join(c) for c in setup_project.commands(Settings(SETTINGS), "123456789012")]
    text = "\n".join(commands)
    assert all(api in commands[0] for api in ("dataflow.googleapis.com", "secretmanager.googleapis.com",
                                                "monitoring.googleapis.com", "artifactregistry.googleapis.com",
                                                "iam.googleapis.com"))
    assert "buckets create gs://bkt-test" in text and "--location us-central1" in text
    assert "repositories create dataflow --repository-format docker --location us-central1" in text
    for topic in ("prompts", "llm-chunks", "llm-completions", "llm-dead-letters"):
        assert f"pubsub topics create {topic} " in text
    assert "pubsub subscriptions create prompts-sub --topic prompts" in text
    # The launcher and the workers get an account of their own, created before anything is granted to it.
    created = "iam service-accounts create streaming-llm --display-name"
    assert created in text and text.index(created) < text.index("add-iam-policy-binding")
    assert "123456789012-compute@developer.gserviceaccount.com --role roles/dataflow.worker" not in text
    bare = "\n".join(" ".join(c) for c in setup_project.commands(Settings({**SETTINGS, "INPUT_SUBSCRIPTION": "mine"})))
    assert "subscriptions create mine --topic prompts --project proj-123456" in bare, "a bare ID is in PROJECT"
    assert "pubsub subscriptions add-iam-policy-binding mine " in bare
    with pytest.raises(DeployError, match="is in project my-project, not PROJECT=proj-123456"):
        setup_project.commands(Settings({**SETTINGS, "INPUT_SUBSCRIPTION": "projects/my-project/subscriptions/s"}))
    with pytest.raises(DeployError, match="projects/PROJECT/subscriptions/ID"):
        setup_project.commands(Settings({**SETTINGS, "INPUT_SUBSCRIPTION": "projects/proj-123456/topics/s"}))


def test_a_bulk_lane_gets_its_topic_its_subscription_and_only_a_subscribers_roles_on_it():
    bulk = {**SETTINGS, "BULK_TOPIC": "bulk-prompts", "BULK_SUBSCRIPTION": "bulk-prompts-sub"}
    commands = [" ".join(c) for c in setup_project.commands(Settings(bulk), "123456789012")]
    text = "\n".join(commands)
    assert "pubsub topics create bulk-prompts --project proj-123456" in text
    assert "pubsub subscriptions create bulk-prompts-sub --topic bulk-prompts --project proj-123456" in text
    on_bulk = {grant.role for grant in setup_project.grants(Settings(bulk), "123456789012")
               if grant.resource == "bulk-prompts-sub"}
    assert on_bulk == {"roles/pubsub.subscriber", "roles/pubsub.viewer"}
    assert "bulk" not in "\n".join(" ".join(c) for c in setup_project.commands(Settings(SETTINGS), "1")), \
        "no lane unless asked for"
    for half in ({"BULK_TOPIC": "bulk-prompts"}, {"BULK_SUBSCRIPTION": "bulk-prompts-sub"}):
        with pytest.raises(DeployError, match="BULK_TOPIC and BULK_SUBSCRIPTION together"):
            setup_project.commands(Settings({**SETTINGS, **half}))


@pytest.mark.parametrize("account, created, email", [
    ("", "streaming-llm", "streaming-llm@proj-123456.iam.gserviceaccount.com"),
    ("llm-workers", "llm-workers", "llm-workers@proj-123456.iam.gserviceaccount.com"),
    ("llm-workers@proj-123456.iam.gserviceaccount.com", "llm-workers",
     "llm-workers@proj-123456.iam.gserviceaccount.com"),
    # Accounts that are not the project's own user-managed ones are granted to, never created.
    ("shared@other-project.iam.gserviceaccount.com", None, "shared@other-project.iam.gserviceaccount.com"),
    ("123456789012-compute@developer.gserviceaccount.com", None, "123456789012-compute@developer.gserviceaccount.com"),
])
def test_service_account_is_the_jobs_own_unless_named_and_made_only_in_project(account, created, email):
    settings = Settings({**SETTINGS, "SERVICE_ACCOUNT": account})
    assert settings.service_account() == email and settings.own_service_account_id() == created
    text = "\n".join(" ".join(c) for c in setup_project.commands(settings, "123456789012"))
    assert ("iam service-accounts create" in text) == (created is not None)
    assert f"--member serviceAccount:{email} --role roles/dataflow.worker" in text


@pytest.mark.parametrize("account", ["ab", "Upper-Case-Name", "1starts-with-digit", "not an email@x", "a@b.com"])
def test_a_service_account_that_cannot_exist_is_refused_by_name(account):
    with pytest.raises(DeployError, match="SERVICE_ACCOUNT="):
        setup_project.commands(Settings({**SETTINGS, "SERVICE_ACCOUNT": account}))


def _recording_env(recorder: Recorder, monkeypatch) -> None:
    for key in [k for k in os.environ if k.startswith("CLOUDSDK_")]:
        monkeypatch.delenv(key)
    for key, value in recorder.env().items():
        monkeypatch.setenv(key, value)


def test_every_grant_lands_on_its_one_resource_as_the_real_gcloud_sends_it(step_one):
    """Least privilege, checked in what gcloud sent: the job's account holds one role on the project (Dataflow
    Worker); each other role is on the bucket, the repository, the input subscription, each output topic or the
    one token secret. Cloud Build's accounts hold the build's roles the same way."""
    ran, sent = step_one
    grants = [r for r in ran if "add-iam-policy-binding" in r.command]
    assert len(grants) == len(setup_project.grants(Settings(TOKEN_SETTINGS), "123456789012"))
    assert all(r.result.returncode == 0 for r in grants), [(r.command, r.result.stderr) for r in grants]
    where = {"project": "/v1/projects/proj-123456", "bucket": "/storage/v1/b/bkt-test",
             "repository": "/v1/projects/proj-123456/locations/us-central1/repositories/dataflow",
             "subscription": "/v1/projects/proj-123456/subscriptions/prompts-sub"}
    job = "serviceAccount:streaming-llm@proj-123456.iam.gserviceaccount.com"
    held = {(resource, role) for resource, role, member in sent if member == job}
    assert held == {
        (where["project"], "roles/dataflow.worker"),
        (where["bucket"], "roles/storage.objectAdmin"),
        (where["repository"], "roles/artifactregistry.reader"),
        (where["subscription"], "roles/pubsub.subscriber"), (where["subscription"], "roles/pubsub.viewer"),
        *{(f"/v1/projects/proj-123456/topics/{topic}", "roles/pubsub.publisher")
          for topic in ("llm-chunks", "llm-completions", "llm-dead-letters")},
        ("/v1/projects/proj-123456/secrets/hf-token", "roles/secretmanager.secretAccessor")}
    for builder in ("123456789012@cloudbuild.gserviceaccount.com",
                    "123456789012-compute@developer.gserviceaccount.com"):
        assert {(resource, role) for resource, role, member in sent if member == f"serviceAccount:{builder}"} == {
            (where["repository"], "roles/artifactregistry.writer"), (where["bucket"], "roles/storage.objectViewer"),
            (where["project"], "roles/logging.logWriter"),
            ("/v1/projects/proj-123456/secrets/bake-token", "roles/secretmanager.secretAccessor")}
    on_project = {role for resource, role, _ in sent if resource == where["project"]}
    assert on_project <= setup_project.PROJECT_ROLES, "a project-wide role beyond the documented ones"


def test_a_grant_iam_cannot_apply_yet_is_tried_again_and_a_rerun_is_advised(tmp_path, monkeypatch, capsys):
    """Right after an account is created (or an API enabled), IAM can refuse a grant naming an account it does not
    know yet: the grant waits and is tried again; past the last wait, the run stops saying to run it again."""
    recorder = Recorder(str(tmp_path / "gcloud-config"))
    _recording_env(recorder, monkeypatch)
    monkeypatch.setattr(setup_project, "RETRY_WAITS_S", (7.0, 9.0))
    command = setup_project.grants(Settings(SETTINGS))[0].command("proj-123456", "us-central1")
    waits: list[float] = []
    try:
        recorder.not_yet = 2
        assert setup_project.run_command(command, sleep=waits.append) == 0
        assert waits == [7.0, 9.0] and recorder.grants(), "granted on the third try"
        out = capsys.readouterr().out
        assert out.count("not yet known to IAM") == 2 and "does not exist" in out
        recorder.not_yet, waits[:] = 3, []
        assert setup_project.run_command(command, sleep=waits.append) != 0
        assert waits == [7.0, 9.0] and "run make setup again" in capsys.readouterr().err
    finally:
        recorder.close()


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
    assert "iam service-accounts create streaming-llm " in printed, "the job's own account, from PROJECT"
    assert "--member serviceAccount:streaming-llm@my-project.iam.gserviceaccount.com --role roles/dataflow.worker" \
        in printed
    assert "PROJECT_NUMBER@cloudbuild.gserviceaccount.com" in printed  # looked up when it runs for real
    assert "Next:" in result.stdout and "make image" in result.stdout  # logging in came before (README step 1)
