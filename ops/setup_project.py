"""``make setup``: step 1 of the README, a blank Google Cloud project made ready for ``make image``, ``template`` and
``run``: the APIs enabled, the bucket, the image repository, the topics and their subscriptions, the workers' own
service account created, and each account granted the roles docs/operations.md#roles lists, each on the narrowest
resource it applies to.

Every command is printed before it runs (``DRY_RUN=1``: printed only), and each is one ``gcloud`` call a person
could type. What exists already is left as it is: a create that finds its resource says so and the next command
runs, so a rerun after a failure continues. The accounts, from Google's pages:

* the launcher's and workers' account: ``SERVICE_ACCOUNT``, by default
  ``streaming-llm@PROJECT.iam.gserviceaccount.com``, which this creates ("Dataflow security and permissions",
  worker service account: https://cloud.google.com/dataflow/docs/concepts/security-and-permissions; a Flex
  Template's launcher VM runs as the same account: https://cloud.google.com/dataflow/docs/guides/templates/run-flex-templates).
  Only ``roles/dataflow.worker`` is granted on the project; the bucket, the image repository, the input
  subscription, the output topics and the token secrets are granted one by one;
* Cloud Build's: ``PROJECT_NUMBER@cloudbuild.gserviceaccount.com`` on projects made before Cloud Build's
  change of default, the Compute Engine default account on newer ones ("Cloud Build service account":
  https://cloud.google.com/build/docs/cloud-build-service-account); both are granted what the build needs.

IAM is eventually consistent: an account just created, or one a just-enabled API has yet to make, can be unknown to
a grant for a minute or more ("Access change propagation": https://cloud.google.com/iam/docs/access-change-propagation).
A grant that fails so is tried again after a wait, saying so; if it still fails, the run stops and says to run it
again later.

The person running the deploy targets needs roles of their own (operations.md lists them); an owner of the
project has them, and granting them to oneself is left to the project's owner.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from ops.settings import DeployError, Settings, gcloud_output, output_subscription

# Every API the product uses (docs/operations.md#roles says which for what); IAM's, to create the workers' account.
APIS = ("dataflow.googleapis.com", "compute.googleapis.com", "pubsub.googleapis.com", "storage.googleapis.com",
        "artifactregistry.googleapis.com", "cloudbuild.googleapis.com", "secretmanager.googleapis.com",
        "monitoring.googleapis.com", "logging.googleapis.com", "bigquery.googleapis.com", "iam.googleapis.com")
REPOSITORY = "dataflow"  # the Makefile's IMAGE_REPOSITORY: REGION-docker.pkg.dev/PROJECT/dataflow
NUMBER = "PROJECT_NUMBER"  # stands for the project's number in a dry run
# The only roles granted on the whole project: the job's account's Dataflow Worker, Cloud Build's Logs Writer.
PROJECT_ROLES = {"roles/dataflow.worker", "roles/logging.logWriter"}
# A grant refused for these reasons is IAM or a new API not having caught up yet: it is tried again after a wait.
NOT_YET = ("does not exist", "SERVICE_DISABLED", "has not been used in project", "wait a few minutes")
# Seconds to wait before each retry of such a grant (about two and a half minutes in all).
RETRY_WAITS_S = (5.0, 10.0, 20.0, 40.0, 80.0)


@dataclass(frozen=True)
class Grant:
    """One role for one account on one resource: ``scope`` is its kind (a topic, subscription, secret as
    ``PROJECT/SECRET``, repository, bucket or project), ``resource`` its name."""

    account: str
    role: str
    scope: str
    resource: str

    def command(self, project: str, region: str) -> list[str]:
        member = ["--member", f"serviceAccount:{self.account}", "--role", self.role]
        if self.scope == "project":
            return ["gcloud", "projects", "add-iam-policy-binding", self.resource, *member, "--condition=None",
                    "--quiet"]
        if self.scope == "bucket":
            return ["gcloud", "storage", "buckets", "add-iam-policy-binding", f"gs://{self.resource}", *member,
                    "--project", project]
        if self.scope == "repository":
            return ["gcloud", "artifacts", "repositories", "add-iam-policy-binding", self.resource,
                    "--location", region, *member, "--project", project]
        if self.scope == "secret":
            secret_project, _, secret = self.resource.partition("/")
            return ["gcloud", "secrets", "add-iam-policy-binding", secret, *member, "--project", secret_project]
        kind = {"topic": "topics", "subscription": "subscriptions"}[self.scope]
        return ["gcloud", "pubsub", kind, "add-iam-policy-binding", self.resource, *member, "--project", project]


def resource_id(settings: Settings, name: str) -> str:
    """The ID of the topic or subscription setting ``name`` names in PROJECT (another project's is refused)."""
    return settings.pubsub_path(name).rsplit("/", 1)[-1]


def grants(settings: Settings, number: str = NUMBER) -> list[Grant]:
    """What each account is granted, on what: the workers' account on the project only ``roles/dataflow.worker``
    (Dataflow's security page: the role a worker account needs), everything else on its one resource."""
    project, bucket = settings.get("PROJECT"), settings.get("BUCKET")
    workers = settings.service_account()
    found = [Grant(workers, "roles/dataflow.worker", "project", project),
             # Staging and temp files, the template spec the launcher reads (Flex Templates' "Required permissions").
             Grant(workers, "roles/storage.objectAdmin", "bucket", bucket),
             # Both images: the launcher's and the workers' (the same page: "read access to the Flex Template image").
             Grant(workers, "roles/artifactregistry.reader", "repository", REPOSITORY)]
    for name in ("INPUT_SUBSCRIPTION", "BULK_SUBSCRIPTION"):
        if settings.get(name):
            subscription = resource_id(settings, name)
            found += [Grant(workers, "roles/pubsub.subscriber", "subscription", subscription),
                      Grant(workers, "roles/pubsub.viewer", "subscription", subscription)]  # its metadata
    found += [Grant(workers, "roles/pubsub.publisher", "topic", resource_id(settings, name))
              for name in ("CHUNKS_TOPIC", "COMPLETIONS_TOPIC", "DEAD_LETTER_TOPIC") if settings.get(name)]
    if token := settings.secret("HF_TOKEN_SECRET"):
        found.append(Grant(workers, "roles/secretmanager.secretAccessor", "secret", "/".join(token)))
    builders = [f"{number}@cloudbuild.gserviceaccount.com", f"{number}-compute@developer.gserviceaccount.com"]
    for account in builders:
        found += [Grant(account, "roles/artifactregistry.writer", "repository", REPOSITORY),
                  Grant(account, "roles/storage.objectViewer", "bucket", bucket),  # the staged build source
                  Grant(account, "roles/logging.logWriter", "project", project)]  # the build's log
        if token := settings.secret("BAKE_TOKEN_SECRET"):
            found.append(Grant(account, "roles/secretmanager.secretAccessor", "secret", "/".join(token)))
    return list(dict.fromkeys(found))


def commands(settings: Settings, number: str = NUMBER) -> list[list[str]]:
    """The gcloud commands of step 1, in order; ``number`` is the project's number (looked up before granting)."""
    settings.require("PROJECT", "REGION", "BUCKET", "INPUT_TOPIC", "INPUT_SUBSCRIPTION")
    if bool(settings.get("BULK_TOPIC")) != bool(settings.get("BULK_SUBSCRIPTION")):
        raise DeployError("set BULK_TOPIC and BULK_SUBSCRIPTION together (the bulk lane's topic and the subscription "
                          "the job reads), or neither")
    project, region = settings.get("PROJECT"), settings.get("REGION")
    where = ["--project", project]
    found = [["gcloud", "services", "enable", *APIS, *where],
             ["gcloud", "storage", "buckets", "create", f"gs://{settings.get('BUCKET')}", *where, "--location", region,
              "--uniform-bucket-level-access"],
             ["gcloud", "artifacts", "repositories", "create", REPOSITORY, "--repository-format", "docker",
              "--location", region, *where]]
    input_topic = resource_id(settings, "INPUT_TOPIC")
    topics = [input_topic] + [resource_id(settings, name) for name in
                              ("CHUNKS_TOPIC", "COMPLETIONS_TOPIC", "DEAD_LETTER_TOPIC") if settings.get(name)]
    found += [["gcloud", "pubsub", "topics", "create", topic, *where] for topic in dict.fromkeys(topics)]
    found.append(["gcloud", "pubsub", "subscriptions", "create",
                  resource_id(settings, "INPUT_SUBSCRIPTION"), "--topic", input_topic, *where])
    if settings.get("BULK_SUBSCRIPTION"):  # the bulk lane: its topic and the subscription the job reads
        bulk_topic = resource_id(settings, "BULK_TOPIC")
        found += [["gcloud", "pubsub", "topics", "create", bulk_topic, *where],
                  ["gcloud", "pubsub", "subscriptions", "create", resource_id(settings, "BULK_SUBSCRIPTION"),
                   "--topic", bulk_topic, *where]]
    # The outputs' subscriptions (output_subscription): Pub/Sub keeps nothing on a topic without one. The answers
    # and dead letters are kept for an application and ops.redrive; what make tail reads is for watching live, so
    # it is kept for the shortest retention Pub/Sub allows.
    for name in ("COMPLETIONS_TOPIC", "DEAD_LETTER_TOPIC", "CHUNKS_TOPIC"):
        if settings.get(name):
            path = settings.pubsub_path(name)
            topic = ["--topic", path.rsplit("/", 1)[1]]
            if name != "CHUNKS_TOPIC":
                found.append(["gcloud", "pubsub", "subscriptions", "create",
                              output_subscription(path).rsplit("/", 1)[1], *topic, *where])
            found.append(["gcloud", "pubsub", "subscriptions", "create",
                          output_subscription(path, "tail").rsplit("/", 1)[1], *topic,
                          "--message-retention-duration", "10m", *where])
    if account_id := settings.own_service_account_id():
        found.append(["gcloud", "iam", "service-accounts", "create", account_id, "--display-name",
                      "Streaming LLM launcher and workers", *where])
    return found + [grant.command(project, region) for grant in grants(settings, number)]


def run_command(command: list[str], sleep: Callable[[float], None] = time.sleep) -> int:
    """Runs one command of step 1: a resource that exists already is fine; a grant that IAM cannot apply yet (see
    the module docstring) is tried again after each of :data:`RETRY_WAITS_S`. Returns gcloud's exit status."""
    granting = "add-iam-policy-binding" in command
    for attempt, wait_s in enumerate((*RETRY_WAITS_S, None), start=1):
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if not result.returncode or "ALREADY_EXISTS" in result.stderr or "already exists" in result.stderr:
            print("    already there" if result.returncode else "    done", flush=True)
            return 0
        not_yet = granting and any(reason in result.stderr for reason in NOT_YET)
        if not not_yet or wait_s is None:
            sys.stderr.write(result.stderr)
            if not_yet:
                print("make setup: IAM has still not caught up with a new account or API (it can take up to 7 "
                      "minutes): run make setup again in a few minutes; what exists is left as it is.",
                      file=sys.stderr, flush=True)
            return result.returncode
        print(f"    not yet known to IAM ({result.stderr.strip().splitlines()[-1][:160]}); trying again in "
              f"{wait_s:.0f} s ({attempt} of {len(RETRY_WAITS_S)})", flush=True)
        sleep(wait_s)
    raise AssertionError("unreachable: the last attempt returns")


def project_number(settings: Settings) -> str:
    command = ["gcloud", "projects", "describe", settings.get("PROJECT"), "--format=value(projectNumber)"]
    number = (gcloud_output(command, "reading the project's number") or "").strip()
    if not number.isdigit():
        raise DeployError(f"the project's number could not be read: {number!r}")
    return number


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.setup_project", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="print the commands; run nothing")
    args = parser.parse_args(argv)
    settings = Settings(dict(os.environ if environ is None else environ))
    try:
        commands(settings)  # every setting checked before anything runs
        if settings.service_account().endswith("-compute@developer.gserviceaccount.com"):
            print("warning: SERVICE_ACCOUNT is the Compute Engine default account, which every VM of the project "
                  "runs as unless told otherwise: what is granted to it here reaches them all. Leave SERVICE_ACCOUNT "
                  "unset for an account of the job's own (docs/operations.md#roles).", file=sys.stderr, flush=True)
        number = NUMBER if args.dry_run else project_number(settings)
        for command in commands(settings, number):
            print(f"==> {shlex.join(command)}", flush=True)
            if args.dry_run:
                continue
            if status := run_command(command):
                return status
    except DeployError as exc:
        print(f"make setup: {exc}", file=sys.stderr)
        return 2
    print("Next: the settings and the model (README steps 2-3), then commit and make image. GPU quota is per "
          "region and per project: docs/operations.md#quota-and-gpu-stockouts.", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
