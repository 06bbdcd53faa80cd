"""``make setup``: step 1 of the README, a blank Google Cloud project made ready for ``make image``, ``template`` and
``run``: the APIs enabled, the bucket, the image repository, the topics and their subscriptions created, and each
account granted the roles docs/operations.md#roles lists.

Every command is printed before it runs (``DRY_RUN=1``: printed only), and each is one ``gcloud`` call a person
could type. What exists already is left as it is: a create that finds its resource says so and the next command
runs. The accounts, from Google's pages:

* the workers' and launcher's account: ``SERVICE_ACCOUNT``, or else the project's Compute Engine default service
  account, ``PROJECT_NUMBER-compute@developer.gserviceaccount.com`` ("Dataflow security and permissions":
  https://cloud.google.com/dataflow/docs/concepts/security-and-permissions#worker-service-account);
* Cloud Build's: ``PROJECT_NUMBER@cloudbuild.gserviceaccount.com`` on projects made before Cloud Build's
  change of default, the Compute Engine default account on newer ones ("Cloud Build service account":
  https://cloud.google.com/build/docs/cloud-build-service-account); both are granted what the build needs.

The person running the deploy targets needs roles of their own (operations.md lists them); an owner of the
project has them, and granting them to oneself is left to the project's owner.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from typing import Mapping, Sequence

from ops.settings import DeployError, Settings, gcloud_output, output_subscription

# Every API the product uses (docs/operations.md#roles says which for what).
APIS = ("dataflow.googleapis.com", "compute.googleapis.com", "pubsub.googleapis.com", "storage.googleapis.com",
        "artifactregistry.googleapis.com", "cloudbuild.googleapis.com", "secretmanager.googleapis.com",
        "monitoring.googleapis.com", "logging.googleapis.com", "bigquery.googleapis.com")
REPOSITORY = "dataflow"  # the Makefile's IMAGE_REPOSITORY: REGION-docker.pkg.dev/PROJECT/dataflow
WORKER_ROLES = ("roles/dataflow.worker", "roles/storage.objectAdmin", "roles/artifactregistry.reader",
                "roles/pubsub.subscriber", "roles/pubsub.publisher", "roles/bigquery.dataEditor",
                "roles/bigquery.jobUser", "roles/secretmanager.secretAccessor", "roles/viewer")
BUILD_ROLES = ("roles/artifactregistry.writer", "roles/storage.objectViewer", "roles/logging.logWriter")
NUMBER = "PROJECT_NUMBER"  # stands for the project's number in a dry run


def resource_id(settings: Settings, name: str) -> str:
    """The ID of the topic or subscription setting ``name`` names in PROJECT (another project's is refused)."""
    return settings.pubsub_path(name).rsplit("/", 1)[-1]


def commands(settings: Settings, number: str = NUMBER) -> list[list[str]]:
    """The gcloud commands of step 1, in order; ``number`` is the project's number (looked up before granting)."""
    settings.require("PROJECT", "REGION", "BUCKET", "INPUT_TOPIC", "INPUT_SUBSCRIPTION")
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
    workers = settings.get("SERVICE_ACCOUNT") or f"{number}-compute@developer.gserviceaccount.com"
    builders = [f"{number}@cloudbuild.gserviceaccount.com", f"{number}-compute@developer.gserviceaccount.com"]
    grants = [(workers, role) for role in WORKER_ROLES] + \
             [(account, role) for account in builders for role in BUILD_ROLES]
    found += [["gcloud", "projects", "add-iam-policy-binding", project, "--member", f"serviceAccount:{account}",
               "--role", role, "--condition=None", "--quiet"] for account, role in dict.fromkeys(grants)]
    return found


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
        number = NUMBER if args.dry_run else project_number(settings)
        for command in commands(settings, number):
            print(f"==> {shlex.join(command)}", flush=True)
            if args.dry_run:
                continue
            result = subprocess.run(command, capture_output=True, text=True, check=False)
            if result.returncode and "ALREADY_EXISTS" not in result.stderr and "already exists" not in result.stderr:
                sys.stderr.write(result.stderr)
                return result.returncode
            print("    already there" if result.returncode else "    done", flush=True)
    except DeployError as exc:
        print(f"make setup: {exc}", file=sys.stderr)
        return 2
    print("Next: the settings and the model (README steps 2-3), then commit and make image. GPU quota is per "
          "region and per project: docs/operations.md#quota-and-gpu-stockouts.", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
