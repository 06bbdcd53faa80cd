"""The job's Cloud Monitoring dashboard and alert policies, made for one job: ``make dashboard`` and ``make alerts``.

The dashboard (``ops/dashboard.json``) and the alert policies (``ops/alerts/*.json``) are the files
``gcloud monitoring dashboards create --config-from-file`` and ``gcloud alpha monitoring policies create
--policy-from-file`` take, with ``${NAME}`` placeholders in their strings: the job's name, the input
subscription's id and the alert thresholds. This command fills them in (in the parsed JSON, so no value
can break the file), checks the values first, and runs gcloud.

Every chart and condition is a PromQL query over metrics the job really has in Cloud Monitoring: Beam
counters, which Dataflow exports as ``dataflow.googleapis.com/job/user_counter`` with the counter's name
in the ``metric_name`` label; Dataflow's and Pub/Sub's own metrics. Counters only: a percentile of time to
first token is read from the ``first_token_over_<b>s`` counters (:data:`FIRST_TOKEN_BOUNDS_S`), because
Cloud Monitoring gets no percentiles of a Beam distribution. PromQL names follow Cloud Monitoring's
mapping (https://cloud.google.com/monitoring/promql/promql-mapping).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import string
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ops.deploy import JOB_NAME_REGEX, run_gcloud
from ops.settings import DeployError, Settings, gcloud_output
from pipeline.generation.step_outputs import FIRST_TOKEN_BOUNDS_S

OPS = Path(__file__).resolve().parent
DASHBOARD = OPS / "dashboard.json"
ALERTS = OPS / "alerts"
# The alert thresholds a job can set (make variables), with their defaults; docs/operations.md#alerts.
THRESHOLDS = {"ALERT_BACKLOG_AGE_S": "600", "ALERT_DEAD_LETTER_RATIO": "0.01", "ALERT_TTFT_P95_S": "5"}
# Pub/Sub's subscription ids (https://cloud.google.com/pubsub/docs/subscription-properties#name).
SUBSCRIPTION_REGEX = r"^projects/[^/]+/subscriptions/([A-Za-z][-A-Za-z0-9._~+%]{2,254})$"


def placeholders(settings: Settings) -> dict[str, str]:
    """The values the files' ``${NAME}`` placeholders take, each checked; a bad one raises DeployError."""
    settings.require("PROJECT", "JOB_NAME", "INPUT_SUBSCRIPTION")
    name = settings.get("JOB_NAME")
    if not re.match(JOB_NAME_REGEX, name):
        raise DeployError(f"JOB_NAME={name!r} is not a Dataflow job name (gcloud dataflow jobs list --status active)")
    subscription = re.match(SUBSCRIPTION_REGEX, settings.get("INPUT_SUBSCRIPTION"))
    if not subscription:
        raise DeployError(f"INPUT_SUBSCRIPTION={settings.get('INPUT_SUBSCRIPTION')!r} is not "
                          "projects/PROJECT/subscriptions/ID")
    values = {"JOB_NAME": name, "SUBSCRIPTION_ID": subscription.group(1)}
    for setting, fallback in THRESHOLDS.items():
        text = settings.get(setting) or fallback
        # Plain decimals only: Python's float() also takes "1_000", "inf" or other scripts' digits, PromQL does not.
        if not re.fullmatch(r"[0-9]+(\.[0-9]+)?", text) or not float(text) > 0:
            raise DeployError(f"{setting}={text!r} must be a number above 0, written like 600 or 0.01")
        values[setting] = text
    if float(values["ALERT_DEAD_LETTER_RATIO"]) >= 1:
        raise DeployError("ALERT_DEAD_LETTER_RATIO is a share of the answers: above 0 and below 1")
    if values["ALERT_TTFT_P95_S"] not in {str(bound) for bound in FIRST_TOKEN_BOUNDS_S}:
        raise DeployError(f"ALERT_TTFT_P95_S={values['ALERT_TTFT_P95_S']!r}: the job counts first tokens over "
                          f"{', '.join(map(str, FIRST_TOKEN_BOUNDS_S))} s; pick one of these")
    return values


def fill(template: Any, values: Mapping[str, str]) -> Any:
    """``template`` (parsed JSON) with every string's ``${NAME}`` replaced; an unknown NAME raises KeyError."""
    if isinstance(template, str):
        return string.Template(template).substitute(values)
    if isinstance(template, list):
        return [fill(item, values) for item in template]
    if isinstance(template, dict):
        return {key: fill(value, values) for key, value in template.items()}
    return template


def alert_files() -> list[Path]:
    return sorted(ALERTS.glob("*.json"))


def rendered(path: Path, values: Mapping[str, str]) -> dict[str, Any]:
    return fill(json.loads(path.read_text(encoding="utf-8")), values)


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.monitoring", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("dashboard", "alerts"))
    parser.add_argument("--dry-run", action="store_true", help="print the commands and their files; run nothing")
    args = parser.parse_args(argv)
    settings = Settings(dict(os.environ if environ is None else environ))
    try:
        values = placeholders(settings)
        return make(args.action, settings, values, args.dry_run)
    except DeployError as exc:
        print(f"make {args.action}: {exc}", file=sys.stderr)
        return 2


def make(action: str, settings: Settings, values: Mapping[str, str], dry_run: bool) -> int:
    """Creates the dashboard or the alert policies, or updates those made before for the same job."""
    project = ["--project", settings.get("PROJECT")]
    if action == "dashboard":
        dashboard = rendered(DASHBOARD, values)
        found = existing(["gcloud", "monitoring", "dashboards", "list", *project,
                          f"--filter=displayName={json.dumps(dashboard['displayName'])}"], dry_run)
        verb = ["update", found[0]] if found else ["create"]
        return run_gcloud(["gcloud", "monitoring", "dashboards", *verb, *project], {}, dry_run=dry_run,
                          files={"--config-from-file": dashboard})
    channels = [channel.strip() for channel in settings.get("NOTIFICATION_CHANNELS").split(",") if channel.strip()]
    if not channels:
        print(f"warning: NOTIFICATION_CHANNELS is empty, so the {len(alert_files())} alert policies "
              f"({', '.join(path.stem for path in alert_files())}) will notify no one: they show only on the "
              "Alerting page. Set NOTIFICATION_CHANNELS=projects/PROJECT/notificationChannels/ID (gcloud beta "
              "monitoring channels list) and run make alerts again: it updates them.", file=sys.stderr, flush=True)
    for path in alert_files():
        policy = rendered(path, values)
        labels = policy["userLabels"]
        found = existing(["gcloud", "alpha", "monitoring", "policies", "list", *project,
                          f"--filter=userLabels.streaming_llm_job={labels['streaming_llm_job']} AND "
                          f"userLabels.streaming_llm_alert={labels['streaming_llm_alert']}"], dry_run)
        argv = ["gcloud", "alpha", "monitoring", "policies", *(["update", found[0]] if found else ["create"]),
                *project]
        policy["notificationChannels"] = channels  # in the file, so that an update sets them as a create does
        status = run_gcloud(argv, {}, dry_run=dry_run, files={"--policy-from-file": policy})
        if status:
            return status
    return 0


def existing(listing: list[str], dry_run: bool) -> list[str]:
    """The names of what this command made before for the same job (a dashboard by its title, a policy by its
    labels), so that running it again updates them instead of adding copies; none on a dry run."""
    found = gcloud_output([*listing, "--format=value(name)"], "listing what exists", dry_run)
    return found.split() if found is not None else []


if __name__ == "__main__":
    sys.exit(main())
