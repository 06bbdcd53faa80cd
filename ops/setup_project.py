"""``make setup``: step 1 of the README, a blank Google Cloud project made ready for ``make image``, ``template`` and
``run``: the APIs enabled, the bucket, the image repository, the topics and their subscriptions, the job's and the
build's own service accounts created, and each account granted the roles docs/operations.md#roles lists, each on the
narrowest resource it applies to.

Every command is printed before it runs (``DRY_RUN=1``: printed only), and each is one ``gcloud`` call a person
could type. It can be run again at any time, and changes nothing that is already as it should be: each create that
finds its resource is read by the answer the service documents for it (Pub/Sub, Artifact Registry and IAM say
``ALREADY_EXISTS``; Cloud Storage answers a bucket its caller owns with ``HTTPError 409: Your previous request to
create the named bucket succeeded and you already own it.``, and a name another project holds with 409 "not
available"), so a rerun after a failure continues where it stopped. A command refused for want of a permission
stops the run, naming the role to ask for. The accounts, from Google's pages:

* the launcher's and workers' account: ``SERVICE_ACCOUNT``, by default
  ``streaming-llm@PROJECT.iam.gserviceaccount.com``, which this creates ("Dataflow security and permissions",
  worker service account: https://cloud.google.com/dataflow/docs/concepts/security-and-permissions; a Flex
  Template's launcher VM runs as the same account: https://cloud.google.com/dataflow/docs/guides/templates/run-flex-templates).
  Only ``roles/dataflow.worker`` is granted on the project; the input subscription, the output topics and the token
  secret are granted one by one, and in the bucket it may read every object but write only under Dataflow's staging
  and temp prefixes (an IAM condition on object names), so a worker cannot replace the template specs;
* the build's: ``streaming-llm-build@PROJECT.iam.gserviceaccount.com``, which this creates and ``make image`` names
  (``gcloud builds submit --service-account``). Which account Cloud Build uses by default depends on when the
  project first enabled it: the legacy ``PROJECT_NUMBER@cloudbuild.gserviceaccount.com`` exists only on projects
  from before Cloud Build's 2024 change, newer ones build as the Compute Engine default account, and an organisation
  policy (``constraints/cloudbuild.disableCreateDefaultServiceAccount``) can forbid the legacy one
  (https://cloud.google.com/build/docs/cloud-build-service-account-updates). Google recommends an account of one's
  own for builds (https://cloud.google.com/build/docs/securing-builds/configure-user-specified-service-accounts):
  it exists on every project because this makes it, and the default accounts, shared by every VM or build of the
  project, are granted nothing. The image repository is created with immutable tags, so no account can move a tag
  the workers pull.

IAM is eventually consistent: an account just created can be unknown to a grant for a minute or more ("Access
change propagation": https://cloud.google.com/iam/docs/access-change-propagation). A grant that fails so is tried
again after a wait, saying so; if it still fails, the run stops and says to run it again later.

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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ops.settings import (
    BUILD_SERVICE_ACCOUNT_ID,
    BUILD_SOURCE_PREFIX,
    STAGING_PREFIX,
    TEMP_PREFIX,
    DeployError,
    Settings,
    gcloud_output,
    output_subscription,
)

# Every API the product uses (docs/operations.md#roles says which for what); IAM's, to create the accounts; Cloud
# Billing's, whose catalog make run prices the job's ceiling from; Resource Manager's, which the project's own
# policy and number are read and written through.
APIS = ("dataflow.googleapis.com", "compute.googleapis.com", "pubsub.googleapis.com", "storage.googleapis.com",
        "artifactregistry.googleapis.com", "cloudbuild.googleapis.com", "secretmanager.googleapis.com",
        "monitoring.googleapis.com", "logging.googleapis.com", "bigquery.googleapis.com", "iam.googleapis.com",
        "cloudbilling.googleapis.com", "cloudresourcemanager.googleapis.com")
REPOSITORY = "dataflow"  # the Makefile's IMAGE_REPOSITORY: REGION-docker.pkg.dev/PROJECT/dataflow
# The ack deadline of the subscriptions the job reads: the reader's own (pipeline/flow/subscription_reader.py).
READ_ACK_DEADLINE_S = 120
# The only roles granted on the whole project: the job's account's Dataflow Worker and Monitoring Viewer.
PROJECT_ROLES = {"roles/dataflow.worker", "roles/monitoring.viewer"}
NUMBER = "PROJECT_NUMBER"  # stands for the project's number in a dry run
# A command refused for these reasons is an API just enabled not having caught up yet (its 403 SERVICE_DISABLED:
# https://cloud.google.com/apis/design/errors), or, for a grant, IAM not knowing a new account yet: it is tried again
# after a wait. Checked before DENIED, as gcloud prints the former as PERMISSION_DENIED too.
NOT_YET = ("SERVICE_DISABLED", "has not been used in project", "wait a few minutes")
NOT_YET_FOR_GRANTS = ("does not exist",)
# Seconds to wait before each retry of such a grant (about two and a half minutes in all).
RETRY_WAITS_S = (5.0, 10.0, 20.0, 40.0, 80.0)
# How each service says a create found its resource: Pub/Sub, Artifact Registry, IAM and Service Usage answer
# ALREADY_EXISTS (gcloud prints "already exists"); Cloud Storage answers a bucket its caller owns with a 409 of its own.
ALREADY_THERE = ("ALREADY_EXISTS", "already exists", "you already own it")
# How gcloud prints a refusal for want of a permission: the APIs' PERMISSION_DENIED, with Google's usual message,
# Pub/Sub's own, or Cloud Storage's 403.
DENIED = ("PERMISSION_DENIED", "HTTPError 403", "does not have permission", "not authorized to perform",
          "Permission denied")
# The role that lets the person running make setup do each kind of command (Owner holds them all).
ROLE_FOR = (("services enable", "Service Usage Admin (roles/serviceusage.serviceUsageAdmin)"),
            ("storage buckets", "Storage Admin (roles/storage.admin)"),
            ("artifacts repositories", "Artifact Registry Administrator (roles/artifactregistry.admin)"),
            ("pubsub", "Pub/Sub Admin (roles/pubsub.admin)"),
            ("iam service-accounts create", "Service Account Admin (roles/iam.serviceAccountAdmin)"),
            ("projects add-iam-policy-binding", "Project IAM Admin (roles/resourcemanager.projectIamAdmin)"),
            ("projects remove-iam-policy-binding", "Project IAM Admin (roles/resourcemanager.projectIamAdmin)"),
            ("secrets", "Secret Manager Admin (roles/secretmanager.admin)"))


@dataclass(frozen=True)
class Grant:
    """One role for one account on one resource: ``scope`` is its kind (a topic, subscription, secret as
    ``PROJECT/SECRET``, repository, bucket or project), ``resource`` its name; on a bucket, ``prefixes`` limits the
    role to the objects whose names start with one of them (an IAM condition on ``resource.name``)."""

    account: str
    role: str
    scope: str
    resource: str
    prefixes: tuple[str, ...] = ()

    def condition(self) -> str | None:
        """The IAM condition of a grant limited to prefixes, as gcloud's ``--condition`` takes it (``^;^``: ';'
        separates its keys, as the expression holds no ';'), or None.

        Cloud Storage names an object ``projects/_/buckets/BUCKET/objects/NAME`` in a condition
        (https://cloud.google.com/storage/docs/access-control/iam#conditions); a bucket with conditions needs uniform
        bucket-level access, which make setup's bucket has. A listing is checked against the bucket, not an
        object, so a role limited to prefixes cannot list: the job's account lists through its unconditional
        Storage Object Viewer."""
        if not self.prefixes:
            return None
        names = " || ".join(f'resource.name.startsWith("projects/_/buckets/{self.resource}/objects/{prefix}/")'
                            for prefix in self.prefixes)
        return f"^;^title={self.role.rsplit('.', 1)[-1]} on {', '.join(self.prefixes)};expression={names}"

    def command(self, project: str, region: str) -> list[str]:
        member = ["--member", f"serviceAccount:{self.account}", "--role", self.role]
        if self.scope == "project":
            return ["gcloud", "projects", "add-iam-policy-binding", self.resource, *member, "--condition=None",
                    "--quiet"]
        if self.scope == "bucket":
            # The bucket's policy holds conditional bindings, beside which gcloud adds one only when told which.
            return ["gcloud", "storage", "buckets", "add-iam-policy-binding", f"gs://{self.resource}", *member,
                    f"--condition={self.condition() or 'None'}", "--project", project]
        if self.scope == "repository":
            return ["gcloud", "artifacts", "repositories", "add-iam-policy-binding", self.resource,
                    "--location", region, *member, "--project", project]
        if self.scope == "secret":
            secret_project, _, secret = self.resource.partition("/")
            return ["gcloud", "secrets", "add-iam-policy-binding", secret, *member, "--project", secret_project]
        kind = {"topic": "topics", "subscription": "subscriptions"}[self.scope]
        return ["gcloud", "pubsub", kind, "add-iam-policy-binding", self.resource, *member, "--project", project]

    def removal(self, project: str, region: str) -> list[str]:
        """The command that takes this unconditional grant away again (gcloud's remove-iam-policy-binding beside
        each add). ``--condition=None`` on every kind: without it gcloud refuses to choose, in a script, when the
        policy holds a conditional binding."""
        found = [word for word in self.command(project, region) if word != "--quiet"]
        found[found.index("add-iam-policy-binding")] = "remove-iam-policy-binding"
        return found if any(word.startswith("--condition") for word in found) else [*found, "--condition=None"]


def resource_id(settings: Settings, name: str) -> str:
    """The ID of the topic or subscription setting ``name`` names in PROJECT (another project's is refused)."""
    return settings.pubsub_path(name).rsplit("/", 1)[-1]


def grants(settings: Settings) -> list[Grant]:
    """What each account is granted, on what: the workers' account on the project only ``roles/dataflow.worker``
    (Dataflow's security page: the role a worker account needs), everything else on its one resource; the build's
    account only what a build of container/cloudbuild.yaml uses."""
    project, bucket = settings.get("PROJECT"), settings.get("BUCKET")
    workers, builder = settings.service_account(), settings.build_service_account()
    found = [Grant(workers, "roles/dataflow.worker", "project", project),
             # The readers report their subscriptions' backlog bytes to the autoscaler, read from Cloud Monitoring
             # (pipeline/flow/subscription_backlog.py); Monitoring's roles are granted on projects only.
             Grant(workers, "roles/monitoring.viewer", "project", project),
             # The template spec the launcher reads, a model or adapters kept in the bucket (Flex Templates'
             # "Required permissions": read the spec; write the staging and temp locations, and nothing else).
             Grant(workers, "roles/storage.objectViewer", "bucket", bucket),
             Grant(workers, "roles/storage.objectAdmin", "bucket", bucket, (STAGING_PREFIX, TEMP_PREFIX)),
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
    found += [Grant(builder, "roles/artifactregistry.writer", "repository", REPOSITORY),  # pushing the images
              # The build source make image stages (gcloud builds submit --gcs-source-staging-dir).
              Grant(builder, "roles/storage.objectViewer", "bucket", bucket, (BUILD_SOURCE_PREFIX,)),
              # Its log (--gcs-log-dir): the role Cloud Build documents for a bucket of the user's, on that bucket.
              Grant(builder, "roles/storage.admin", "bucket", settings.build_logs_bucket())]
    if token := settings.secret("BAKE_TOKEN_SECRET"):
        found.append(Grant(builder, "roles/secretmanager.secretAccessor", "secret", "/".join(token)))
    return list(dict.fromkeys(found))


def subscription(name: str, topic: str, where: list[str], *flags: str) -> list[str]:
    """Creating a subscription that never expires: Pub/Sub deletes one inactive for 31 days by default, and a
    quiet one (the dead letters' copy that only ops.redrive reads) would take what its topic gets with it
    (https://cloud.google.com/pubsub/docs/subscription-properties#expiration_period)."""
    return ["gcloud", "pubsub", "subscriptions", "create", name, "--topic", topic, "--expiration-period", "never",
            *flags, *where]


def commands(settings: Settings, number: str = NUMBER) -> list[list[str]]:
    """The gcloud commands of step 1, in order; ``number`` is the project's number, which names its default
    accounts (for :func:`retired`)."""
    settings.require("PROJECT", "REGION", "BUCKET", "INPUT_TOPIC", "INPUT_SUBSCRIPTION")
    if bool(settings.get("BULK_TOPIC")) != bool(settings.get("BULK_SUBSCRIPTION")):
        raise DeployError("set BULK_TOPIC and BULK_SUBSCRIPTION together (the bulk lane's topic and the subscription "
                          "the job reads), or neither")
    project, region = settings.get("PROJECT"), settings.get("REGION")
    where = ["--project", project]
    found = [["gcloud", "services", "enable", *APIS, *where],
             *[["gcloud", "storage", "buckets", "create", f"gs://{bucket}", *where, "--location", region,
                "--uniform-bucket-level-access"] for bucket in (settings.get("BUCKET"), settings.build_logs_bucket())],
             ["gcloud", "artifacts", "repositories", "create", REPOSITORY, "--repository-format", "docker",
              "--location", region, "--immutable-tags", *where]]
    input_topic = resource_id(settings, "INPUT_TOPIC")
    topics = [input_topic] + [resource_id(settings, name) for name in
                              ("CHUNKS_TOPIC", "COMPLETIONS_TOPIC", "DEAD_LETTER_TOPIC") if settings.get(name)]
    found += [["gcloud", "pubsub", "topics", "create", topic, *where] for topic in dict.fromkeys(topics)]
    # What the job reads keeps a pulled message for the reader's ack deadline before it is extended
    # (pipeline/flow/subscription_feed.py): Pub/Sub's default is 10 s.
    read = ("--ack-deadline", str(READ_ACK_DEADLINE_S))
    found.append(subscription(resource_id(settings, "INPUT_SUBSCRIPTION"), input_topic, where, *read))
    if settings.get("BULK_SUBSCRIPTION"):  # the bulk lane: its topic and the subscription the job reads
        bulk_topic = resource_id(settings, "BULK_TOPIC")
        found += [["gcloud", "pubsub", "topics", "create", bulk_topic, *where],
                  subscription(resource_id(settings, "BULK_SUBSCRIPTION"), bulk_topic, where, *read)]
    # The outputs' subscriptions (output_subscription): Pub/Sub keeps nothing on a topic without one. The answers
    # and dead letters are kept for an application and ops.redrive; what make tail reads is for watching live, so
    # it is kept for the shortest retention Pub/Sub allows, and the chunks' one delivers each request's chunks in
    # the order they were published (they carry the request id as ordering key).
    for name in ("COMPLETIONS_TOPIC", "DEAD_LETTER_TOPIC", "CHUNKS_TOPIC"):
        if settings.get(name):
            path = settings.pubsub_path(name)
            topic = path.rsplit("/", 1)[1]
            if name != "CHUNKS_TOPIC":
                found.append(subscription(output_subscription(path).rsplit("/", 1)[1], topic, where))
            ordered = ("--enable-message-ordering",) if name == "CHUNKS_TOPIC" else ()
            found.append(subscription(output_subscription(path, "tail").rsplit("/", 1)[1], topic, where,
                                      "--message-retention-duration", "10m", *ordered))
    accounts = [(settings.own_service_account_id(), "Streaming LLM launcher and workers"),
                (BUILD_SERVICE_ACCOUNT_ID, "Streaming LLM image builds")]
    found += [["gcloud", "iam", "service-accounts", "create", account_id, "--display-name", title, *where]
              for account_id, title in accounts if account_id]
    return found + [grant.command(project, region) for grant in grants(settings)] + retired(settings, number)


def follow_up(command: list[str]) -> list[str] | None:
    """What brings a resource a create found to what the create would have made, where that can change (an earlier
    make setup, or the user, made it otherwise): a subscription is set never to expire, the image repository's tags
    immutable, the bucket to uniform bucket-level access (which its conditional grants need)."""
    where = command[command.index("--project"):command.index("--project") + 2]
    if command[:4] == ["gcloud", "pubsub", "subscriptions", "create"]:
        deadline = command[command.index("--ack-deadline"):command.index("--ack-deadline") + 2] \
            if "--ack-deadline" in command else []
        return ["gcloud", "pubsub", "subscriptions", "update", command[4], "--expiration-period", "never",
                *deadline, *where]
    if command[:4] == ["gcloud", "artifacts", "repositories", "create"]:
        location = command[command.index("--location"):command.index("--location") + 2]
        return ["gcloud", "artifacts", "repositories", "update", command[4], *location, "--immutable-tags", *where]
    if command[:4] == ["gcloud", "storage", "buckets", "create"]:
        return ["gcloud", "storage", "buckets", "update", command[4], "--uniform-bucket-level-access", *where]
    return None


def retired(settings: Settings, number: str = NUMBER) -> list[list[str]]:
    """Grants an earlier make setup made that this one no longer does, removed where they are (IAM grants add up, so
    each would outweigh what replaced it; a removal that finds nothing is fine): the job's account's Storage Object
    Admin on the whole bucket; the build account's Logs Writer on the project (its log is now in a bucket); and
    what the project's default accounts were granted for builds before the build had an account of its own, on
    the repository, the bucket and the bake token (``number`` is the project's number, which names them). Each
    removal names no condition, so only an unconditional grant is removed."""
    project, bucket = settings.get("PROJECT"), settings.get("BUCKET")
    old = [Grant(settings.service_account(), "roles/storage.objectAdmin", "bucket", bucket),
           Grant(settings.build_service_account(), "roles/logging.logWriter", "project", project)]
    for account in (f"{number}@cloudbuild.gserviceaccount.com", f"{number}-compute@developer.gserviceaccount.com"):
        # Their Logs Writer on the project is left: the project's other VMs and builds may rely on it, and a grant
        # setup made cannot be told from one an administrator made (docs/operations.md#roles says how to remove it).
        old += [Grant(account, "roles/artifactregistry.writer", "repository", REPOSITORY),
                Grant(account, "roles/storage.objectViewer", "bucket", bucket)]
        if token := settings.secret("BAKE_TOKEN_SECRET"):
            old.append(Grant(account, "roles/secretmanager.secretAccessor", "secret", "/".join(token)))
    if settings.service_account() in {grant.account for grant in old[2:]}:  # SERVICE_ACCOUNT names one of them
        old = [grant for grant in old if (grant.account, grant.role, grant.resource) not in
               {(g.account, g.role, g.resource) for g in grants(settings)}]
    return [grant.removal(project, settings.get("REGION")) for grant in old]


def project_number(settings: Settings) -> str:
    """The project's number, which names its default accounts (read with the project's describe)."""
    command = ["gcloud", "projects", "describe", settings.get("PROJECT"), "--format=value(projectNumber)"]
    number = (gcloud_output(command, "reading the project's number") or "").strip()
    if not number.isdigit():
        raise DeployError(f"the project's number could not be read: {number!r}")
    return number


def ordered(command: list[str]) -> bool:
    """Whether the subscription a create with message ordering found delivers in order: Pub/Sub cannot turn ordering
    on for a subscription once made (https://cloud.google.com/pubsub/docs/ordering), and an earlier make setup made
    make tail's chunk subscription without it."""
    where = command[command.index("--project"):command.index("--project") + 2]
    found = gcloud_output(["gcloud", "pubsub", "subscriptions", "describe", command[4], *where,
                           "--format=value(enableMessageOrdering)"], "reading whether it is ordered")
    return (found or "").strip().lower() == "true"


def reordered(command: list[str], sleep: Callable[[float], None]) -> int:
    """Deletes and makes again, once, an unordered subscription a create with ordering found. Only make tail's chunk
    subscription is made so, and it is for watching live (10 minutes' retention): nothing kept is lost, but a make
    tail running now loses its subscription and must be started again."""
    where = command[command.index("--project"):command.index("--project") + 2]
    delete = ["gcloud", "pubsub", "subscriptions", "delete", command[4], *where, "--quiet"]
    print(f"    made without message ordering, which a subscription cannot gain: made again (start a running make "
          f"tail again)\n==> {shlex.join(delete)}", flush=True)
    deleted = subprocess.run(delete, capture_output=True, text=True, check=False)
    if deleted.returncode and "NOT_FOUND" not in deleted.stderr and "not found" not in deleted.stderr.lower():
        sys.stderr.write(deleted.stderr)
        return deleted.returncode
    print(f"==> {shlex.join(command)}", flush=True)
    made = subprocess.run(command, capture_output=True, text=True, check=False)
    if made.returncode:
        sys.stderr.write(made.stderr)
    else:
        print("    done", flush=True)
    return made.returncode


def role_for(command: list[str]) -> str:
    """The role that lets its caller run this command of step 1."""
    return next((role for words, role in ROLE_FOR if " ".join(command[1:]).startswith(words)), "Owner")


def run_command(command: list[str], sleep: Callable[[float], None] = time.sleep) -> int:
    """Runs one command of step 1: a resource that exists already is fine (and brought up to date, see
    :func:`follow_up`); a command an API just enabled refuses, or a grant IAM cannot apply yet (see the module
    docstring), is tried again after each of :data:`RETRY_WAITS_S`; a refusal names the role to ask for. Returns
    gcloud's exit status."""
    granting = "add-iam-policy-binding" in command
    for attempt, wait_s in enumerate((*RETRY_WAITS_S, None), start=1):
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if not result.returncode:
            print("    done", flush=True)
            return 0
        if "remove-iam-policy-binding" in command and "not found!" in result.stderr:
            print("    not there", flush=True)
            return 0
        if "create" in command[:4] and any(word in result.stderr for word in ALREADY_THERE):
            print("    already there", flush=True)
            if "--enable-message-ordering" in command and not ordered(command):
                return reordered(command, sleep)
            if (update := follow_up(command)) is not None:
                print(f"==> {shlex.join(update)}", flush=True)
                return run_command(update, sleep)
            return 0
        not_yet = any(reason in result.stderr for reason in (*NOT_YET, *(NOT_YET_FOR_GRANTS if granting else ())))
        if not_yet and wait_s is not None:
            print(f"    not yet known to IAM or the API ({result.stderr.strip().splitlines()[-1][:160]}); trying again "
                  f"in {wait_s:.0f} s ({attempt} of {len(RETRY_WAITS_S)})", flush=True)
            sleep(wait_s)
            continue
        sys.stderr.write(result.stderr)
        if not_yet:
            print("make setup: an API or account is still not known (a new one can take up to 7 minutes; an account "
                  "named in SERVICE_ACCOUNT must exist): run make setup again in a few minutes; what exists is left "
                  "as it is.", file=sys.stderr, flush=True)
            return result.returncode
        if any(word in result.stderr for word in DENIED):
            print(f"make setup: you lack a permission this command needs: ask the project's owner for "
                  f"{role_for(command)} (or Owner) on the project, then run make setup again; what exists is left "
                  "as it is.", file=sys.stderr, flush=True)
            return result.returncode
        if "HTTPError 409" in result.stderr and "buckets create" in " ".join(command):
            print("make setup: that bucket name is taken (Cloud Storage's names are shared by every project): set "
                  "another BUCKET in .env and run make setup again.", file=sys.stderr, flush=True)
            return result.returncode
        return result.returncode
    raise AssertionError("unreachable: the last attempt returns")


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
        # gcloud's projects commands bill Resource Manager to gcloud's own project, so this works before the
        # project's APIs are on; the real number also tells a SERVICE_ACCOUNT that is a default account apart.
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
