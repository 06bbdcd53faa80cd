"""The deploy settings as the Makefile exports them, the error that names one, and how a target reads gcloud's output.

The standard library only: a target that only calls gcloud (``make setup``, ``make image``) runs on the system's
Python, without the Beam install the launch targets need (:mod:`ops.deploy`).
"""

from __future__ import annotations

import re
import shlex
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

# The launcher's and workers' account make setup creates when SERVICE_ACCOUNT is unset (NAME@PROJECT.iam...).
DEFAULT_SERVICE_ACCOUNT_ID = "streaming-llm"
# The account make image's Cloud Build runs as, which make setup creates (ops/setup_project.py says why).
BUILD_SERVICE_ACCOUNT_ID = "streaming-llm-build"
# A user-managed service account's ID (IAM: 6-30 characters, lower-case letters, digits and '-', a letter first).
SERVICE_ACCOUNT_ID_REGEX = r"^[a-z][-a-z0-9]{4,28}[a-z0-9]$"
# Where in BUCKET each writer puts its files: Dataflow's staging and temp locations (the job's account writes
# them), and the build source make image uploads (the build account reads it). make setup grants on these prefixes.
STAGING_PREFIX, TEMP_PREFIX, BUILD_SOURCE_PREFIX = "staging", "tmp", "cloudbuild-source"
# Secret Manager settings (a secret's version, or the secret itself), read by make setup and make run.
SECRET_REGEX = r"^projects/(?P<project>[^/]+)/secrets/(?P<secret>[^/]+)(/versions/(?P<version>[^/]+))?$"

# The Pub/Sub resources a job uses, by setting: which kind each is.
PUBSUB_SETTINGS = {"INPUT_TOPIC": "topics", "INPUT_SUBSCRIPTION": "subscriptions", "CHUNKS_TOPIC": "topics",
                   "COMPLETIONS_TOPIC": "topics", "DEAD_LETTER_TOPIC": "topics", "BACKFILL_TOPIC": "topics",
                   "BULK_TOPIC": "topics", "BULK_SUBSCRIPTION": "subscriptions"}


class DeployError(ValueError):
    """A deploy setting that cannot work; the message names it and what to set."""


@dataclass(frozen=True)
class Settings:
    """The deploy settings, as the Makefile exports them (empty strings are unset)."""

    values: Mapping[str, str]

    def get(self, name: str) -> str:
        return (self.values.get(name) or "").strip()

    def require(self, *names: str) -> None:
        missing = [name for name in names if not self.get(name)]
        if missing:
            raise DeployError(f"Set {', '.join(missing)} (in .env, see .env.example, or on the make command line)")

    def pubsub_path(self, name: str) -> str:
        """Setting ``name`` (a topic or a subscription, see :data:`PUBSUB_SETTINGS`) as a full path in PROJECT: a bare
        id becomes ``projects/PROJECT/<kind>/ID``; a path of another project is refused, naming both ("" if unset).
        The Makefile derives each from PROJECT, so only a value set by hand can name another project."""
        value, kind = self.get(name), PUBSUB_SETTINGS[name]
        if not value:
            return ""
        project = self.get("PROJECT")
        if "/" not in value:
            return f"projects/{project}/{kind}/{value}"
        parts = value.split("/")
        if len(parts) != 4 or parts[0] != "projects" or parts[2] != kind or not parts[3]:
            raise DeployError(f"{name}={value!r} is not projects/PROJECT/{kind}/ID (or a bare ID)")
        if parts[1] != project:
            raise DeployError(f"{name}={value} is in project {parts[1]}, not PROJECT={project}: a job of this "
                              f"project would read or write another project's {kind}. Set {name} to an ID (or "
                              f"leave it out of .env: the Makefile derives it from PROJECT)")
        return value

    def service_account(self) -> str:
        """The account the launcher and the workers run as: ``SERVICE_ACCOUNT`` (an email, or an ID in PROJECT), or
        else the one make setup creates, ``streaming-llm@PROJECT.iam.gserviceaccount.com``. Never the Compute Engine
        default account unless named: that one is shared by every VM of the project."""
        value, project = self.get("SERVICE_ACCOUNT") or DEFAULT_SERVICE_ACCOUNT_ID, self.get("PROJECT")
        if "@" not in value:
            if not re.match(SERVICE_ACCOUNT_ID_REGEX, value):
                raise DeployError(f"SERVICE_ACCOUNT={value!r}: a service account's email, or an ID of 6-30 lower-case "
                                  "letters, digits and '-' (a letter first), made in PROJECT")
            return f"{value}@{project}.iam.gserviceaccount.com"
        if not re.match(r"^[^@\s]+@[^@\s]+\.gserviceaccount\.com$", value):
            raise DeployError(f"SERVICE_ACCOUNT={value!r} is not a service account's email (NAME@PROJECT."
                              "iam.gserviceaccount.com)")
        return value

    def build_service_account(self) -> str:
        """The account ``make image``'s Cloud Build runs as: ``streaming-llm-build@PROJECT.iam.gserviceaccount.com``,
        made by make setup with only what a build needs (never the project's default accounts)."""
        return f"{BUILD_SERVICE_ACCOUNT_ID}@{self.get('PROJECT')}.iam.gserviceaccount.com"

    def build_logs_bucket(self) -> str:
        """The bucket ``make image``'s builds keep their logs in, ``BUCKET-build-logs``: a build with an account of
        its own must log to Cloud Logging or to a bucket of the user's, and only a bucket's log can be streamed by
        ``gcloud builds submit`` (its GA track tails a bucket's log object, never Cloud Logging). A bucket of its
        own, because the role Cloud Build asks for on it, Storage Admin
        (https://cloud.google.com/build/docs/securing-builds/store-manage-build-logs), would reach the template
        specs in BUCKET."""
        name = f"{self.get('BUCKET')}-build-logs"
        if len(name) > 63:  # Cloud Storage: a bucket name without dots is 3-63 characters
            raise DeployError(f"BUCKET={self.get('BUCKET')!r} is too long for its build logs' bucket {name!r} "
                              "(63 characters at most): set a BUCKET of 52 characters or fewer")
        return name

    def own_service_account_id(self) -> str | None:
        """The ID of :meth:`service_account` when it is a user-managed account of PROJECT, which make setup creates
        if missing; None for any other (the Compute Engine default, another project's)."""
        name, _, domain = self.service_account().partition("@")
        return name if domain == f"{self.get('PROJECT')}.iam.gserviceaccount.com" else None

    def secret(self, name: str) -> tuple[str, str] | None:
        """Setting ``name`` (``projects/P/secrets/S`` or ``.../versions/V``) as (project, secret); None if unset."""
        value = self.get(name)
        if not value:
            return None
        found = re.match(SECRET_REGEX, value)
        if found is None:
            raise DeployError(f"{name}={value!r} is not projects/PROJECT/secrets/NAME/versions/VERSION")
        return found.group("project"), found.group("secret")


def output_subscription(topic: str, reader: str = "sub") -> str:
    """A subscription make setup creates on one of the job's output topics (Pub/Sub keeps nothing for a topic
    without one), in the topic's project: ``<topic id>-sub`` on the completion and dead-letter topics, kept for
    an application and for ops.redrive; ``<topic id>-tail`` on each output, for make tail, which acknowledges what
    it prints and so must not read the others' copies."""
    project, _, name = topic.removeprefix("projects/").partition("/topics/")
    return f"projects/{project}/subscriptions/{name}-{reader}"


def gcloud_output(command: list[str], what: str, dry_run: bool = False) -> str | None:
    """Prints a gcloud command whose output a target reads, runs it and returns that output (None on a dry run,
    which runs nothing); a failure stops the target, naming ``what`` it was for."""
    print(f"==> {shlex.join(command)}", flush=True)
    if dry_run:
        return None
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode:
        raise DeployError(f"{what} failed: {result.stderr.strip()}")
    return result.stdout
