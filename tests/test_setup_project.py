"""Step 1 of the README, `make setup`: every gcloud command it runs is one the real gcloud accepts, flags and all
(run offline, its API endpoints pointed at the loopback recorder), and it covers every account and resource the
later steps need."""

from __future__ import annotations

import contextlib
import copy
import io
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
class Run:
    """One whole ``make setup`` (``ops.setup_project.main``) against the recorder: its exit status, what it printed,
    and the recorder's requests, policies and resources once it ended."""

    status: int
    out: str
    err: str
    requests: list
    policies: dict
    made: frozenset


def setup_runs(recorder: Recorder, settings: dict[str, str], times: int) -> list[Run]:
    """``make setup`` run ``times`` times, one after another, the real gcloud pointed at ``recorder``."""
    runs = []
    with pytest.MonkeyPatch.context() as patch:
        for key in [k for k in os.environ if k.startswith("CLOUDSDK_")]:
            patch.delenv(key)
        for key, value in recorder.env().items():
            patch.setenv(key, value)
        patch.setattr(setup_project, "RETRY_WAITS_S", (0.5, 1.0))  # IAM's catching up, shortened
        for _ in range(times):
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                status = setup_project.main([], settings)
            runs.append(Run(status, out.getvalue(), err.getvalue(), list(recorder.requests),
                            copy.deepcopy(recorder.policies), frozenset(recorder.made_resources)))
    return runs


@pytest.fixture(scope="module")
def step_one(tmp_path_factory) -> list[Run]:
    """Step one with both token secrets set run twice on a blank project, as IAM answers a new project: each
    account it creates is unknown to the first grant that names it (eventual consistency)."""
    recorder = Recorder(str(tmp_path_factory.mktemp("gcloud") / "gcloud-config"))
    recorder.propagation = 1
    recorder.enabling = 2  # and the APIs it enables refuse the next two calls, as not yet on
    try:
        return setup_runs(recorder, TOKEN_SETTINGS, 2)
    finally:
        recorder.close()


def test_make_setup_runs_through_on_a_blank_project_and_again(step_one):
    """The README's "then make setup again": the second run meets every resource the first made, as the
    services answer it (409 ALREADY_EXISTS, Cloud Storage's "you already own it"), pass and change nothing."""
    for run in step_one:
        assert run.status == 0, run.err
        assert "unrecognized arguments" not in run.err and "Invalid choice" not in run.err
    first, again = step_one
    creates = len([c for c in setup_project.commands(Settings(TOKEN_SETTINGS)) if "create" in c[:4]])
    assert first.out.count("not yet known to IAM") >= 4, "each new account was refused once, then granted"
    assert first.out.count("SERVICE_DISABLED") + first.out.count("has not been used") >= 2, \
        "an API just enabled refused twice, then answered: a wait, not a missing permission"
    assert again.out.count("already there") == creates, again.out
    assert again.made == first.made and again.policies == first.policies, "a rerun changed what exists"
    assert first.made >= {"/storage/v1/b/bkt-test", "/v1/projects/proj-123456/subscriptions/prompts-sub",
                          "/v1/projects/proj-123456/locations/us-central1/repositories/dataflow"}


def test_every_subscription_never_expires_and_the_tails_chunks_come_in_order(step_one):
    """Pub/Sub deletes a subscription inactive for 31 days unless its expiration policy has no ttl; make tail's
    chunk subscription orders by key, as the chunks carry the request id as their ordering key. A subscription a
    rerun finds is set never to expire too (an earlier make setup made them with the default)."""
    first, second = step_one
    made = {r.path.split("?")[0].rsplit("/", 1)[1]: r.json() for r in first.requests
            if r.method == "PUT" and "/subscriptions/" in r.path}
    assert set(made) == {"prompts-sub", "llm-completions-sub", "llm-completions-tail", "llm-dead-letters-sub",
                         "llm-dead-letters-tail", "llm-chunks-tail"}
    assert all(body["expirationPolicy"] == {} for body in made.values()), made
    assert [name for name, body in made.items() if body.get("enableMessageOrdering")] == ["llm-chunks-tail"]
    updated = {r.path.split("?")[0].rsplit("/", 1)[1]: r.json() for r in second.requests[len(first.requests):]
               if r.method == "PATCH" and "/subscriptions/" in r.path}
    assert set(updated) == set(made)
    assert all(u["subscription"]["expirationPolicy"] == {} and "expirationPolicy" in u["updateMask"]
               for u in updated.values())
    # What the job reads keeps a pulled message for the reader's own ack deadline, on a rerun too.
    from pipeline.flow.subscription_reader import ACK_DEADLINE_S
    assert made["prompts-sub"]["ackDeadlineSeconds"] == ACK_DEADLINE_S == setup_project.READ_ACK_DEADLINE_S
    assert updated["prompts-sub"]["subscription"]["ackDeadlineSeconds"] == ACK_DEADLINE_S
    assert all("ackDeadlineSeconds" not in body for name, body in made.items() if name != "prompts-sub")


def test_the_image_repository_keeps_its_tags_immutable(step_one):
    created = [r.json() for r in step_one[0].requests if r.method == "POST" and r.path.split("?")[0].endswith(
        "/repositories")]
    assert created and created[0]["dockerConfig"] == {"immutableTags": True}


def test_a_run_stopped_half_way_is_finished_by_the_next_and_a_missing_permission_names_its_role(tmp_path):
    recorder = Recorder(str(tmp_path / "gcloud-config"))
    try:
        recorder.denied.append(r"^PUT /v1/projects/proj-123456/topics/")
        stopped, = setup_runs(recorder, SETTINGS, 1)
        assert stopped.status != 0 and "Pub/Sub Admin (roles/pubsub.admin)" in stopped.err
        assert "User not authorized to perform this action" in stopped.err, "gcloud's own words are shown"
        assert "/storage/v1/b/bkt-test" in stopped.made and not any("/topics/" in m for m in stopped.made)
        recorder.denied.clear()
        finished, = setup_runs(recorder, SETTINGS, 1)
        assert finished.status == 0, finished.err
        assert "/v1/projects/proj-123456/topics/prompts" in finished.made
        assert finished.out.count("already there") == 3, "the two buckets and the repository"
    finally:
        recorder.close()


def test_a_project_an_earlier_setup_made_is_brought_to_what_setup_makes_now(tmp_path):
    """IAM grants add up, and a create that finds its resource changes nothing: what an earlier make setup (or the
    user) made otherwise is brought in line. The bucket gets uniform bucket-level access (its conditional grants
    need it), the repository immutable tags, the job's account loses its Object Admin on the whole bucket, the
    project's default accounts what they were granted for builds, and make tail's unordered chunk subscription is
    made again with ordering."""
    recorder = Recorder(str(tmp_path / "gcloud-config"))
    job = Settings(SETTINGS).service_account()
    legacy = f"serviceAccount:{recorder.project_number}@cloudbuild.gserviceaccount.com"
    compute = f"serviceAccount:{recorder.project_number}-compute@developer.gserviceaccount.com"
    repository = "/v1/projects/proj-123456/locations/us-central1/repositories/dataflow"
    tail = "/v1/projects/proj-123456/subscriptions/llm-chunks-tail"
    try:
        recorder.made_resources |= {"/storage/v1/b/bkt-test", repository, "/v1/projects/proj-123456/topics/llm-chunks",
                                    tail}
        recorder.subscriptions[tail] = {"topic": "projects/proj-123456/topics/llm-chunks"}  # no ordering
        recorder.buckets["bkt-test"] = {"name": "bkt-test", "iamConfiguration": {
            "uniformBucketLevelAccess": {"enabled": False}}}
        recorder.repositories[repository] = {"name": repository.removeprefix("/v1/"), "format": "DOCKER"}
        recorder.accounts |= {job, legacy.split(":")[1], compute.split(":")[1]}
        recorder.policies["/storage/v1/b/bkt-test"] = {"version": 1, "etag": "BwYAAAAAAAA=", "bindings": [
            {"role": "roles/storage.objectAdmin", "members": [f"serviceAccount:{job}"]},
            {"role": "roles/storage.objectViewer", "members": [legacy, compute]}]}
        recorder.policies[repository] = {"etag": "BwYAAAAAAAA=", "bindings": [
            {"role": "roles/artifactregistry.writer", "members": [legacy, compute]}]}
        recorder.policies["/v1/projects/proj-123456"] = {"etag": "BwYAAAAAAAA=", "bindings": [
            {"role": "roles/logging.logWriter", "members": [legacy, compute]},
            {"role": "roles/owner", "members": ["user:owner@example.com"]}]}
        run, = setup_runs(recorder, SETTINGS, 1)
        assert run.status == 0, run.err
        assert recorder.buckets["bkt-test"]["iamConfiguration"]["uniformBucketLevelAccess"]["enabled"] is True
        assert recorder.repositories[repository]["dockerConfig"] == {"immutableTags": True}
        admin = [b for b in recorder.policies["/storage/v1/b/bkt-test"]["bindings"]
                 if b["role"] == "roles/storage.objectAdmin" and f"serviceAccount:{job}" in b["members"]]
        assert len(admin) == 1 and "staging/" in admin[0]["condition"]["expression"], admin
        members = {m for resource, policy in recorder.policies.items() if resource != "/v1/projects/proj-123456"
                   for b in policy["bindings"] for m in b["members"]}
        assert not members & {legacy, compute}, "the default accounts keep nothing an earlier setup granted them"
        project = recorder.policies["/v1/projects/proj-123456"]["bindings"]
        assert {"user:owner@example.com", legacy, compute} <= {m for b in project for m in b["members"]}, \
            "a project-wide grant is left: other VMs may rely on it, and setup cannot tell it made it"
        assert recorder.subscriptions[tail].get("enableMessageOrdering") is True
        assert recorder.find("DELETE", "/subscriptions/llm-chunks-tail$")
    finally:
        recorder.close()


def test_a_default_account_named_as_service_account_keeps_what_setup_grants_it(tmp_path):
    """SERVICE_ACCOUNT may name the Compute Engine default account (make update's old jobs run as it): the removals
    of what an older setup gave the default accounts must not take back what this one grants it."""
    recorder = Recorder(str(tmp_path / "gcloud-config"))
    compute = f"{recorder.project_number}-compute@developer.gserviceaccount.com"
    try:
        recorder.accounts.add(compute)
        run, = setup_runs(recorder, {**SETTINGS, "SERVICE_ACCOUNT": compute}, 1)
        assert run.status == 0, run.err
        bucket = recorder.policies["/storage/v1/b/bkt-test"]["bindings"]
        assert any(b["role"] == "roles/storage.objectViewer" and f"serviceAccount:{compute}" in b["members"]
                   and not b.get("condition") for b in bucket), bucket
    finally:
        recorder.close()


def test_a_bucket_name_another_project_holds_stops_with_what_to_do(tmp_path):
    recorder = Recorder(str(tmp_path / "gcloud-config"))
    try:
        recorder.taken_buckets.add("bkt-test")
        run, = setup_runs(recorder, SETTINGS, 1)
        assert run.status != 0 and "set another BUCKET" in run.err and "not available" in run.err
        assert not any("/topics/" in r.path for r in run.requests), "nothing after the bucket ran"
    finally:
        recorder.close()


def test_step_one_creates_what_the_later_steps_use_and_the_jobs_own_account():
    commands = [" ".join(c) for c in setup_project.commands(Settings(SETTINGS))]
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
    assert "subscriptions create mine --topic prompts --expiration-period never --ack-deadline 120 --project proj-123456" in bare, \
        "a bare ID is in PROJECT"
    assert "pubsub subscriptions add-iam-policy-binding mine " in bare
    with pytest.raises(DeployError, match="is in project my-project, not PROJECT=proj-123456"):
        setup_project.commands(Settings({**SETTINGS, "INPUT_SUBSCRIPTION": "projects/my-project/subscriptions/s"}))
    with pytest.raises(DeployError, match="projects/PROJECT/subscriptions/ID"):
        setup_project.commands(Settings({**SETTINGS, "INPUT_SUBSCRIPTION": "projects/proj-123456/topics/s"}))


def test_a_bulk_lane_gets_its_topic_its_subscription_and_only_a_subscribers_roles_on_it():
    bulk = {**SETTINGS, "BULK_TOPIC": "bulk-prompts", "BULK_SUBSCRIPTION": "bulk-prompts-sub"}
    commands = [" ".join(c) for c in setup_project.commands(Settings(bulk))]
    text = "\n".join(commands)
    assert "pubsub topics create bulk-prompts --project proj-123456" in text
    assert "pubsub subscriptions create bulk-prompts-sub --topic bulk-prompts --expiration-period never " \
        "--ack-deadline 120 --project proj-123456" in text
    on_bulk = {grant.role for grant in setup_project.grants(Settings(bulk))
               if grant.resource == "bulk-prompts-sub"}
    assert on_bulk == {"roles/pubsub.subscriber", "roles/pubsub.viewer"}
    assert "bulk" not in "\n".join(" ".join(c) for c in setup_project.commands(Settings(SETTINGS))), \
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
    text = "\n".join(" ".join(c) for c in setup_project.commands(settings))
    assert (f"iam service-accounts create {created} " in text) == (created is not None)
    assert text.count("iam service-accounts create") == 1 + (created is not None), "and the build's, always"
    assert f"--member serviceAccount:{email} --role roles/dataflow.worker" in text


@pytest.mark.parametrize("account", ["ab", "Upper-Case-Name", "1starts-with-digit", "not an email@x", "a@b.com"])
def test_a_service_account_that_cannot_exist_is_refused_by_name(account):
    with pytest.raises(DeployError, match="SERVICE_ACCOUNT="):
        setup_project.commands(Settings({**SETTINGS, "SERVICE_ACCOUNT": account}))


def test_every_grant_lands_on_its_one_resource_as_the_real_gcloud_sends_it(step_one):
    """Least privilege, checked in what gcloud sent: the job's account holds two roles on the project (Dataflow
    Worker, Monitoring Viewer for its subscriptions' backlog); each other role is on the bucket (writes only under the staging and temp prefixes), the repository,
    the input subscription, each output topic or the one token secret. The build's own account holds the build's
    roles the same way; the project's default accounts hold nothing."""
    first = step_one[0]
    where = {"project": "/v1/projects/proj-123456", "bucket": "/storage/v1/b/bkt-test",
             "repository": "/v1/projects/proj-123456/locations/us-central1/repositories/dataflow",
             "subscription": "/v1/projects/proj-123456/subscriptions/prompts-sub"}
    bindings = [(resource, b["role"], member, (b.get("condition") or {}).get("expression"))
                for resource, policy in first.policies.items() for b in policy["bindings"] for member in b["members"]]
    job = "serviceAccount:streaming-llm@proj-123456.iam.gserviceaccount.com"
    build = "serviceAccount:streaming-llm-build@proj-123456.iam.gserviceaccount.com"
    objects = 'resource.name.startsWith("projects/_/buckets/bkt-test/objects/'
    assert {(resource, role, condition) for resource, role, member, condition in bindings if member == job} == {
        (where["project"], "roles/dataflow.worker", None), (where["project"], "roles/monitoring.viewer", None),
        (where["bucket"], "roles/storage.objectViewer", None),
        (where["bucket"], "roles/storage.objectAdmin", f'{objects}staging/") || {objects}tmp/")'),
        (where["repository"], "roles/artifactregistry.reader", None),
        (where["subscription"], "roles/pubsub.subscriber", None), (where["subscription"], "roles/pubsub.viewer", None),
        *{(f"/v1/projects/proj-123456/topics/{topic}", "roles/pubsub.publisher", None)
          for topic in ("llm-chunks", "llm-completions", "llm-dead-letters")},
        ("/v1/projects/proj-123456/secrets/hf-token", "roles/secretmanager.secretAccessor", None)}
    assert {(resource, role, condition) for resource, role, member, condition in bindings if member == build} == {
        (where["repository"], "roles/artifactregistry.writer", None),
        (where["bucket"], "roles/storage.objectViewer", f'{objects}cloudbuild-source/")'),
        ("/storage/v1/b/bkt-test-build-logs", "roles/storage.admin", None),
        ("/v1/projects/proj-123456/secrets/bake-token", "roles/secretmanager.secretAccessor", None)}
    assert {member for _, _, member, _ in bindings} == {job, build}, "the default accounts are granted nothing"
    on_project = {role for resource, role, _, _ in bindings if resource == where["project"]}
    assert on_project <= setup_project.PROJECT_ROLES, "a project-wide role beyond the documented ones"
    assert len(first.policies[where["bucket"]]["bindings"]) == 3 and first.policies[where["bucket"]]["version"] == 3


def test_make_image_builds_as_the_account_setup_made():
    """Cloud Build's default account is the legacy one, the Compute Engine default one, or none an organisation
    allows: make image names the one make setup made and granted."""
    from ops import image

    submit, = image.commands({**SETTINGS, "WORKER_IMAGE": "w", "LAUNCHER_IMAGE": "l"})
    assert submit[submit.index("--service-account") + 1] == \
        "projects/proj-123456/serviceAccounts/streaming-llm-build@proj-123456.iam.gserviceaccount.com"
    assert Settings(SETTINGS).build_service_account() in {g.account for g in setup_project.grants(Settings(SETTINGS))}


def test_a_grant_iam_cannot_apply_yet_is_tried_again_and_a_rerun_is_advised(tmp_path, monkeypatch, capsys):
    """Right after an account is created, IAM can refuse a grant naming it as an account it does not know yet: the
    grant waits and is tried again; past the last wait, the run stops saying to run it again."""
    recorder = Recorder(str(tmp_path / "gcloud-config"))
    for key in [k for k in os.environ if k.startswith("CLOUDSDK_")]:
        monkeypatch.delenv(key)
    for key, value in recorder.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(setup_project, "RETRY_WAITS_S", (7.0, 9.0))
    create = next(c for c in setup_project.commands(Settings(SETTINGS)) if c[:4] == ["gcloud", "iam",
                                                                                     "service-accounts", "create"])
    grant = setup_project.grants(Settings(SETTINGS))[0].command("proj-123456", "us-central1")
    waits: list[float] = []
    try:
        recorder.propagation = 2
        assert setup_project.run_command(create) == 0
        assert setup_project.run_command(grant, sleep=waits.append) == 0
        assert waits == [7.0, 9.0] and recorder.grants(), "granted on the third try"
        out = capsys.readouterr().out
        assert out.count("not yet known to IAM") == 2 and "does not exist" in out
        recorder.unknown[Settings(SETTINGS).service_account()], waits[:] = 3, []
        assert setup_project.run_command(grant, sleep=waits.append) != 0
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
    assert "pubsub subscriptions create prompts-sub --topic prompts --expiration-period never --ack-deadline 120 --project my-project" \
        in printed
    assert "iam service-accounts create streaming-llm " in printed, "the job's own account, from PROJECT"
    assert "--member serviceAccount:streaming-llm@my-project.iam.gserviceaccount.com --role roles/dataflow.worker" \
        in printed
    assert "iam service-accounts create streaming-llm-build " in printed, "the build's own account"
    assert "Next:" in result.stdout and "make image" in result.stdout  # logging in came before (README step 1)
