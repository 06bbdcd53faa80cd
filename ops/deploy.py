"""What the deploy targets send to Dataflow: deploy settings in, gcloud's flags or Beam's options out, values intact.

The Makefile's deploy targets (``make template``, ``run``, ``update``, ``run-dataflow``) export their
settings (``.env``, the command line, the Makefile's defaults) to this command, which builds the
call and runs it. Template parameter values are free text (a system prompt, a JSON schema, several
``lora_adapters``, ``vllm_args``), and no shell or ``--parameters`` string carries every character:
gcloud splits ``--parameters`` on commas (``gcloud topic escaping``). So the parameters, experiments
and pipeline options go to gcloud in a ``--flags-file`` (``gcloud topic flags-file``: YAML or JSON,
"any characters"), and to Beam's option parser as one argv element each. Nothing is split after the
user wrote it, except ``EXTRA_PARAMETERS``, whose rule is stated in :func:`split_extra_parameters`.

Before anything is launched, the parameters are checked with the template's own validation
(:class:`pipeline.config.settings.JobSettings`) and the launch with the launcher's own checks (GPU type,
count and machine type against the image and Compute Engine's shapes, the worker image, a gated model's
token, the LoRA adapters: :func:`pipeline.config.launch_checks.launch_problems`), so a bad value fails here,
naming the parameter, rather than on the launcher VM minutes later. Then ``make run`` and ``make update`` print the
job's hourly ceiling at the catalog's prices and, above ``MAX_HOURLY_COST``, have it confirmed (:mod:`ops.cost`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from apache_beam.options.pipeline_options import PipelineOptions

from ops import cost
from ops.settings import PUBSUB_SETTINGS, STAGING_PREFIX, TEMP_PREFIX, DeployError, Settings, gcloud_output
from pipeline.config.launch_checks import launch_problems
from pipeline.config.options import ConfigError
from pipeline.config.settings import JobSettings
from pipeline.contract.parameters import DEFAULT_DISK_SIZE_GB, PARAMETERS_BY_NAME, WORKER_OPTIONS
from pipeline.serving.gpus import CUDA_MAJORS, DEFAULT_CUDA_MAJOR, FIXED_SHAPES

# Parameters the Makefile names as settings of their own (the rest come from PARAMETERS_FILE or EXTRA_PARAMETERS).
NAMED_SETTINGS = {"INPUT_SUBSCRIPTION": "input_subscription", "BULK_SUBSCRIPTION": "bulk_subscription",
                  "CHUNKS_TOPIC": "output_chunks_topic",
                  "COMPLETIONS_TOPIC": "output_completions_topic", "DEAD_LETTER_TOPIC": "dead_letter_topic",
                  "MODEL": "model", "HF_TOKEN_SECRET": "hf_token_secret"}
# Beam's worker options a launch may pass beside the template's parameters (the launcher hands every one to Beam).
PIPELINE_OPTION_PARAMETERS = tuple(option.name for option in WORKER_OPTIONS)
JOB_NAME_REGEX = r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$"  # Dataflow's job names


def split_extra_parameters(text: str) -> list[tuple[str, str]]:
    """``EXTRA_PARAMETERS`` as (name, value) pairs.

    A comma starts a new pair only where a template parameter's name and ``=`` follow it, so values
    keep their spaces, ``=`` and commas that no parameter name follows (``bucket_boundaries=64,128``,
    ``lora_adapters=a=gs://x,b=gs://y``). A value that itself contains ``,<parameter>=`` belongs in
    ``PARAMETERS_FILE``.
    """
    if not text.strip():
        return []
    names = "|".join(map(re.escape, sorted([*PARAMETERS_BY_NAME, *PIPELINE_OPTION_PARAMETERS], key=len,
                                           reverse=True)))
    pieces = re.split(rf",\s*(?=(?:{names})=)", text.strip())
    pairs = []
    for piece in pieces:
        name, sep, value = piece.partition("=")
        if not sep:
            raise DeployError(f"EXTRA_PARAMETERS: {piece!r} is not name=value")
        pairs.append((name.strip(), value))
    return pairs


def read_parameters_file(path: str) -> list[tuple[str, str]]:
    """A JSON object of parameter name -> value; numbers and booleans become their text, objects and lists
    their JSON text (a ``response_schema`` may be written as the schema itself)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise DeployError(f"PARAMETERS_FILE={path}: {exc.strerror or exc}") from None
    except (ValueError, RecursionError) as exc:
        raise DeployError(f"PARAMETERS_FILE={path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise DeployError(f"PARAMETERS_FILE={path} must hold a JSON object of parameter name -> value")
    pairs = []
    for name, value in data.items():
        if value is None:
            continue
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (dict, list)):
            text = json.dumps(value, ensure_ascii=False)
        else:
            text = str(value)
        pairs.append((name, text))
    return pairs


def template_parameters(settings: Settings) -> dict[str, str]:
    """The template parameters from the named settings, ``PARAMETERS_FILE`` and ``EXTRA_PARAMETERS``, checked.

    A parameter given by two sources is refused (which would win is not obvious), as is a name the
    template does not have; then the values are checked as the launcher will check them.
    """
    named = [(param, settings.pubsub_path(var) if var in PUBSUB_SETTINGS else settings.get(var))
             for var, param in NAMED_SETTINGS.items()]
    sources: list[tuple[str, list[tuple[str, str]]]] = [("the Makefile settings", [(p, v) for p, v in named if v])]
    if settings.get("PARAMETERS_FILE"):
        sources.append((f"PARAMETERS_FILE={settings.get('PARAMETERS_FILE')}",
                        read_parameters_file(settings.get("PARAMETERS_FILE"))))
    sources.append(("EXTRA_PARAMETERS", split_extra_parameters(settings.values.get("EXTRA_PARAMETERS") or "")))
    parameters: dict[str, str] = {}
    origin: dict[str, str] = {}
    problems = []
    for source, pairs in sources:
        for name, value in pairs:
            if name not in PARAMETERS_BY_NAME and name not in PIPELINE_OPTION_PARAMETERS:
                problems.append(f"{source}: {name!r} is not a template parameter (docs/parameters.md lists them)")
            elif name in parameters:
                problems.append(f"{name} is set by {origin[name]} and by {source}: set it in one place")
            else:
                parameters[name], origin[name] = value, source
    if problems:
        raise DeployError("Template parameters:\n  - " + "\n  - ".join(problems))
    try:
        JobSettings.from_mapping(parameters)
    except ConfigError as exc:
        raise DeployError(str(exc)) from None
    return parameters


def cuda_major(settings: Settings) -> int:
    """``CUDA``: the CUDA major the worker image is built for (make image CUDA=...)."""
    text = settings.get("CUDA") or str(DEFAULT_CUDA_MAJOR)
    if not text.isdigit() or int(text) not in CUDA_MAJORS:
        raise DeployError(f"CUDA={text}: the worker image is built for CUDA {' or '.join(map(str, CUDA_MAJORS))}")
    return int(text)


def check_launch(settings: Settings, parameters: Mapping[str, str]) -> None:
    """The launcher's own checks (:func:`pipeline.config.launch_checks.launch_problems`), run here on the options
    the launcher will get, before anything is submitted: warnings are printed, problems stop the launch."""
    staging, temp = staging_locations(settings)
    args = ["--runner=DataflowRunner", f"--project={settings.get('PROJECT')}", f"--region={settings.get('REGION')}",
            f"--temp_location={temp}", f"--machine_type={settings.get('MACHINE_TYPE')}",
            *[f"--dataflow_service_options={option}" for option in experiments(settings)],
            *[f"--{name}={value}" for name, value in parameters.items()]]
    options = PipelineOptions(args)
    try:
        job = JobSettings.from_options(options)
    except ConfigError as exc:
        raise DeployError(str(exc)) from None
    problems, warnings = launch_problems(options, job, cuda_major(settings))
    if found := private_ip_warning(Network.of(settings), parameters):
        warnings = [*warnings, found]
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    if problems:
        raise DeployError("This launch would fail:\n  - " + "\n  - ".join(problems))


# Compute Engine's resource names (networks, subnetworks): lower-case letters, digits and '-', a letter first.
RESOURCE_NAME_REGEX = r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$"
# A subnetwork as Dataflow takes it: a full URL (needed for a Shared VPC's) or regions/REGION/subnetworks/NAME.
SUBNETWORK_REGEX = (r"^(https://www\.googleapis\.com/compute/v1/projects/[^/]+/)?regions/(?P<region>[^/]+)/"
                    r"subnetworks/[^/]+$")
NETWORKS_PAGE = "https://cloud.google.com/dataflow/docs/guides/specifying-networks"


@dataclass(frozen=True)
class Network:
    """Where the workers run: NETWORK, SUBNETWORK and PUBLIC_IPS, checked against Dataflow's rules for them."""

    network: str | None
    subnetwork: str | None
    public_ips: bool

    @classmethod
    def of(cls, settings: Settings) -> Network:
        network, subnetwork = settings.get("NETWORK") or None, settings.get("SUBNETWORK") or None
        if network is not None and not re.match(RESOURCE_NAME_REGEX, network):
            raise DeployError(f"NETWORK={network!r}: Dataflow takes a network by its name only ({NETWORKS_PAGE}); "
                              "for a Shared VPC, set SUBNETWORK to the subnetwork's full URL instead")
        if subnetwork is not None:
            if re.match(RESOURCE_NAME_REGEX, subnetwork):
                subnetwork = f"regions/{settings.get('REGION')}/subnetworks/{subnetwork}"
            found = re.match(SUBNETWORK_REGEX, subnetwork)
            if found is None:
                raise DeployError(f"SUBNETWORK={subnetwork!r}: give a name, regions/REGION/subnetworks/NAME, or for "
                                  "a Shared VPC https://www.googleapis.com/compute/v1/projects/HOST_PROJECT/regions/"
                                  f"REGION/subnetworks/NAME ({NETWORKS_PAGE})")
            if found.group("region") != settings.get("REGION"):
                raise DeployError(f"SUBNETWORK={subnetwork!r} is in {found.group('region')}, but the job runs in "
                                  f"REGION={settings.get('REGION')}: Dataflow needs a subnetwork in the workers' "
                                  "region")
        public = settings.get("PUBLIC_IPS").lower() or "true"
        if public not in ("true", "false"):
            raise DeployError(f"PUBLIC_IPS={settings.get('PUBLIC_IPS')!r}: true (the default) or false")
        return cls(network, subnetwork, public == "true")

    def gcloud_flags(self) -> list[str]:
        """The flags of ``gcloud dataflow flex-template run`` and ``build`` (the same in both)."""
        return ([*(["--network", self.network] if self.network else []),
                 *(["--subnetwork", self.subnetwork] if self.subnetwork else []),
                 *([] if self.public_ips else ["--disable-public-ips"])])

    def beam_options(self) -> list[str]:
        """Beam's worker options for the same (``make run-dataflow``)."""
        return ([*([f"--network={self.network}"] if self.network else []),
                 *([f"--subnetwork={self.subnetwork}"] if self.subnetwork else []),
                 *([] if self.public_ips else ["--no_use_public_ips"])])


def private_ip_warning(network: Network, parameters: Mapping[str, str]) -> str | None:
    """What a job whose workers have no public IP needs that no flag sets (docs/operations.md#networking)."""
    if network.public_ips:
        return None
    model = parameters.get("model") or PARAMETERS_BY_NAME["model"].default
    hub = not parameters.get("model_gcs_folder") and not model.startswith(("/", "gs://"))
    return ("workers without public IPs reach Google's APIs only with Private Google Access on their subnetwork"
            + (f", and the Hugging Face Hub (model {model}) only through Cloud NAT or from a copy in Cloud Storage "
               "(model_gcs_folder)" if hub else "") + ": docs/operations.md#networking")


def gpu_experiment(settings: Settings) -> str:
    """Dataflow's GPU service option, as its GPU pages write it."""
    driver = "install-nvidia-driver" + (f":{settings.get('NVIDIA_DRIVER')}" if settings.get("NVIDIA_DRIVER") else "")
    return f"worker_accelerator=type:{settings.get('GPU_TYPE')};count:{settings.get('GPU_COUNT')};{driver}"


def experiments(settings: Settings) -> list[str]:
    found = [gpu_experiment(settings)] if settings.get("GPU_TYPE") else []
    if settings.get("UTILIZATION_HINT"):
        found.append(f"worker_utilization_hint={settings.get('UTILIZATION_HINT')}")
    return found


def transform_name_mappings(settings: Settings) -> dict[str, str]:
    """``TRANSFORM_NAME_MAPPINGS``: a JSON object of old step name -> new, for an update whose steps were renamed."""
    text = settings.get("TRANSFORM_NAME_MAPPINGS")
    if not text:
        return {}
    try:
        mappings = json.loads(text)
    except ValueError as exc:
        raise DeployError(f"TRANSFORM_NAME_MAPPINGS is not a JSON object: {exc}") from None
    if not isinstance(mappings, dict) or not all(isinstance(v, str) for v in mappings.values()):
        raise DeployError('TRANSFORM_NAME_MAPPINGS must be a JSON object of old step name -> new, e.g. {"Old": "New"}')
    return mappings


def job_name(settings: Settings, update: bool) -> str:
    name = settings.get("JOB_NAME")
    if not name:
        if update:
            raise DeployError("Set JOB_NAME to the name of the running job to update "
                              "(gcloud dataflow jobs list --region REGION --status active)")
        name = "streaming-llm-" + datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    if not re.match(JOB_NAME_REGEX, name):
        raise DeployError(f"JOB_NAME={name!r}: Dataflow job names are lower-case letters, digits and '-', "
                          "starting with a letter, at most 63 characters")
    return name


def staging_locations(settings: Settings) -> tuple[str, str]:
    """(staging, temp) locations in the bucket, for gcloud and Beam alike."""
    return f"gs://{settings.get('BUCKET')}/{STAGING_PREFIX}", f"gs://{settings.get('BUCKET')}/{TEMP_PREFIX}"


def job_environment(settings: Settings) -> list[str]:
    """The worker, staging and identity flags that ``flex-template run`` and ``build`` share."""
    staging, temp = staging_locations(settings)
    args = ["--worker-machine-type", settings.get("MACHINE_TYPE"), "--num-workers", settings.get("NUM_WORKERS"),
            "--max-workers", settings.get("MAX_WORKERS"), "--enable-streaming-engine",
            "--staging-location", staging, "--temp-location", temp,
            # The launcher VM and the workers run as the job's own account (make setup), never by default as the
            # Compute Engine default account that every VM of the project shares.
            "--service-account-email", settings.service_account()]
    # A zone of REGION with the GPU in stock (docs/operations.md#quota-and-gpu-stockouts).
    if settings.get("WORKER_ZONE"):
        args += ["--worker-zone", settings.get("WORKER_ZONE")]
    return args + Network.of(settings).gcloud_flags()


def flex_template_run(settings: Settings, update: bool) -> tuple[list[str], dict[str, Any]]:
    """``gcloud dataflow flex-template run``: its argv and its flags file."""
    settings.require("PROJECT", "REGION", "BUCKET", "TEMPLATE_PATH", "WORKER_IMAGE", "MACHINE_TYPE",
                     "NUM_WORKERS", "MAX_WORKERS")
    name = job_name(settings, update)
    parameters = template_parameters(settings)
    parameters.setdefault("sdk_container_image", settings.get("WORKER_IMAGE"))
    check_launch(settings, parameters)
    flags: dict[str, Any] = {"--parameters": parameters}
    if settings.get("DISK_SIZE_GB"):
        flags["--additional-pipeline-options"] = [f"disk_size_gb={settings.get('DISK_SIZE_GB')}"]
    if found := experiments(settings):
        flags["--additional-experiments"] = found
    argv = ["gcloud", "dataflow", "flex-template", "run", name, "--project", settings.get("PROJECT"),
            "--region", settings.get("REGION"), "--template-file-gcs-location", settings.get("TEMPLATE_PATH"),
            *job_environment(settings)]
    if settings.get("LAUNCHER_MACHINE_TYPE"):
        argv += ["--launcher-machine-type", settings.get("LAUNCHER_MACHINE_TYPE")]
    if update:
        argv.append("--update")
        if mappings := transform_name_mappings(settings):
            flags["--transform-name-mappings"] = mappings
    return argv, flags


def flex_template_build(settings: Settings) -> tuple[list[str], dict[str, Any]]:
    """``gcloud dataflow flex-template build``, with the job settings ``make run`` uses as the spec's defaults,
    so that a launch from the console gets them too."""
    settings.require("PROJECT", "REGION", "BUCKET", "TEMPLATE_PATH", "LAUNCHER_IMAGE", "METADATA", "MACHINE_TYPE",
                     "NUM_WORKERS", "MAX_WORKERS")
    argv = ["gcloud", "dataflow", "flex-template", "build", settings.get("TEMPLATE_PATH"),
            "--project", settings.get("PROJECT"), "--image", settings.get("LAUNCHER_IMAGE"),
            "--sdk-language", "PYTHON", "--metadata-file", settings.get("METADATA"), *job_environment(settings)]
    found = experiments(settings)
    flags = {"--additional-experiments": found} if found else {}
    return argv, flags


def spec_defaults(settings: Settings) -> dict[str, Any]:
    """What ``make run`` passes that ``gcloud dataflow flex-template build`` has no flag for, in the fields the
    spec's default environment (``FlexTemplateRuntimeEnvironment`` in Dataflow's API) has for them."""
    found: dict[str, Any] = {}
    if settings.get("LAUNCHER_MACHINE_TYPE"):
        found["launcherMachineType"] = settings.get("LAUNCHER_MACHINE_TYPE")
    if settings.get("DISK_SIZE_GB"):
        found["diskSizeGb"] = int(settings.get("DISK_SIZE_GB"))
    return found


def complete_spec(settings: Settings, dry_run: bool) -> int:
    """Adds :func:`spec_defaults` to the spec ``flex-template build`` wrote: read it back, add them, write it."""
    extra = spec_defaults(settings)
    if not extra:
        return 0
    path, project = settings.get("TEMPLATE_PATH"), ["--project", settings.get("PROJECT")]
    found = gcloud_output(["gcloud", "storage", "cat", path, *project], f"reading the spec at {path} back", dry_run)
    print(f"    and write it back with defaultEnvironment + {json.dumps(extra)}:", flush=True)
    if found is None:
        print(f"==> {shlex.join(['gcloud', 'storage', 'cp', 'SPEC.json', path, *project])}", flush=True)
        return 0
    try:
        spec = json.loads(found)
    except ValueError:
        raise DeployError(f"the spec at {path} is not JSON: {found[:200]!r}") from None
    spec.setdefault("defaultEnvironment", {}).update(extra)
    with tempfile.TemporaryDirectory(prefix="streaming-llm-spec-") as folder:
        local = Path(folder) / "spec.json"
        local.write_text(json.dumps(spec, indent=2), encoding="utf-8")
        write = ["gcloud", "storage", "cp", str(local), path, *project]
        print(f"==> {shlex.join(write)}", flush=True)
        return subprocess.run(write, check=False).returncode


def dataflow_runner(settings: Settings) -> list[str]:
    """The template's entry point on Beam's DataflowRunner, straight from this checkout: one argv element a value."""
    settings.require("PROJECT", "REGION", "BUCKET", "WORKER_IMAGE", "MACHINE_TYPE", "NUM_WORKERS", "MAX_WORKERS")
    parameters = template_parameters(settings)
    parameters.setdefault("sdk_container_image", settings.get("WORKER_IMAGE"))
    check_launch(settings, parameters)
    staging, temp = staging_locations(settings)
    argv = [sys.executable, "-m", "template.main", "--runner=DataflowRunner",
            f"--project={settings.get('PROJECT')}", f"--region={settings.get('REGION')}",
            f"--job_name={job_name(settings, update=False)}", f"--staging_location={staging}",
            f"--temp_location={temp}",
            f"--machine_type={settings.get('MACHINE_TYPE')}", f"--num_workers={settings.get('NUM_WORKERS')}",
            f"--max_num_workers={settings.get('MAX_WORKERS')}",
            "--enable_streaming_engine", "--experiments=use_runner_v2",
            f"--service_account_email={settings.service_account()}"]
    if settings.get("DISK_SIZE_GB"):
        argv.append(f"--disk_size_gb={settings.get('DISK_SIZE_GB')}")
    if settings.get("WORKER_ZONE"):
        argv.append(f"--worker_zone={settings.get('WORKER_ZONE')}")
    argv += Network.of(settings).beam_options()
    argv += [f"--dataflow_service_options={option}" for option in experiments(settings)]
    argv += [f"--{name}={value}" for name, value in parameters.items()]
    return argv


# Characters YAML does not allow unescaped, even in a quoted string (YAML 1.2, "c-printable"); JSON leaves these
# alone, gcloud's YAML reader refuses them, so they are written as the \u escapes both languages read.
_NOT_YAML_PRINTABLE = re.compile("[\x7f-\x9f\ufffe\uffff]")


def job_command(settings: Settings, verb: str, dry_run: bool) -> int:
    """``gcloud dataflow jobs drain|cancel`` for the active job named ``JOB_NAME`` (the one identifier every target
    takes): its id is looked up first, and a name that matches no active job, or several, is refused."""
    settings.require("PROJECT", "REGION", "JOB_NAME")
    name, where = settings.get("JOB_NAME"), ["--project", settings.get("PROJECT"), "--region", settings.get("REGION")]
    listing = ["gcloud", "dataflow", "jobs", "list", *where, "--status", "active", "--filter", f"name={name}",
               "--format", "value(id)"]
    found = gcloud_output(listing, "listing the active jobs", dry_run)
    if found is None:
        print(f"==> {shlex.join(['gcloud', 'dataflow', 'jobs', verb, f'<the id of {name}>', *where])}", flush=True)
        return 0
    ids = found.split()
    if len(ids) != 1:
        raise DeployError(f"{'no' if not ids else len(ids)} active jobs named {name} in {settings.get('REGION')}"
                          + (": gcloud dataflow jobs list --status active lists them" if not ids else
                             f" ({', '.join(ids)}): {verb} the one you mean with gcloud dataflow jobs {verb} ID"))
    command = ["gcloud", "dataflow", "jobs", verb, ids[0], *where]
    print(f"==> {shlex.join(command)}", flush=True)
    return subprocess.run(command, check=False).returncode


def flags_file_text(flags: dict[str, Any]) -> str:
    """A gcloud ``--flags-file``: JSON, which gcloud reads as YAML, with every value's characters kept."""
    text = json.dumps(flags, indent=2, ensure_ascii=False)
    return _NOT_YAML_PRINTABLE.sub(lambda match: f"\\u{ord(match.group()):04x}", text)


def run_gcloud(argv: list[str], flags: dict[str, Any], dry_run: bool,
               files: Mapping[str, Any] | None = None) -> int:
    """Prints the command and the files it reads, then runs it (unless ``dry_run``).

    ``flags`` go in a flags file; ``files`` maps a flag that takes a file's path (``--config-from-file``) to
    the JSON that file holds.
    """
    with tempfile.TemporaryDirectory(prefix="streaming-llm-deploy-") as folder:
        written = []
        for flag, content in {**({"--flags-file": flags} if flags else {}), **(files or {})}.items():
            text = flags_file_text(content)
            path = Path(folder) / f"{flag.lstrip('-')}.json"
            path.write_text(text, encoding="utf-8")
            argv = [*argv, f"{flag}={path}"]
            written.append((path.name, text))
        print(f"==> {shlex.join(argv)}", flush=True)
        for name, text in written:
            print(f"    where {name} holds:\n" + "\n".join("      " + line for line in text.splitlines()), flush=True)
        return 0 if dry_run else subprocess.run(argv, check=False).returncode


# What gcloud says of a resource that is not there (describe: NOT_FOUND for the APIs, "not found: 404" for Storage).
_NOT_FOUND = ("NOT_FOUND", "not found", "404", "does not exist")


def launch_resources(settings: Settings, parameters: Mapping[str, str]) -> list[tuple[str, list[str], str]]:
    """What a launch needs to exist already, as (what it is, the gcloud command that describes it, what to do if it
    is missing): the spec, the job's account, its input subscription and output topics."""
    path, where = settings.get("TEMPLATE_PATH"), ["--project", settings.get("PROJECT")]
    folder = path.rsplit("/", 1)[0] + "/"
    found = [(f"the template spec {path}", ["gcloud", "storage", "objects", "describe", path, *where,
                                           "--format=value(name)"],
              "TAG names the checkout's commit, and no spec was built for it. Run make image and make template for "
              f"this commit, or set TAG to the commit of a spec that exists (gcloud storage ls {folder})"),
             (f"the job's service account {settings.service_account()}",
              ["gcloud", "iam", "service-accounts", "describe", settings.service_account(), *where,
               "--format=value(email)"],
              "make setup creates it and grants its roles (or set SERVICE_ACCOUNT to one that exists)")]
    for name in ("input_subscription", "bulk_subscription", "output_chunks_topic", "output_completions_topic",
                 "dead_letter_topic"):
        value = parameters.get(name) or ""
        if re.match(r"^projects/[^/]+/(topics|subscriptions)/[^/]+$", value):
            project, kind, resource = value.removeprefix("projects/").split("/")
            found.append((f"the {kind[:-1]} {value}", ["gcloud", "pubsub", kind, "describe", resource,
                                                       "--project", project, "--format=value(name)"],
                          "make setup creates the job's topics and subscriptions"))
    return found


def require_resources(settings: Settings, parameters: Mapping[str, str], dry_run: bool) -> None:
    """Stops a launch whose spec, account, subscription or topics do not exist, naming each and what makes it;
    gcloud would otherwise launch a job that fails on its launcher or its workers minutes later (or say only 'not
    found'). The describes run at once, side by side. A resource that could not be read for another reason (the
    person launching may not hold a role that reads it) is a warning: the launch goes on."""
    checks = launch_resources(settings, parameters)
    for _, command, _ in checks:
        print(f"==> {shlex.join(command)}", flush=True)
    if dry_run:
        return
    running = [subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
               for _, command, _ in checks]
    missing = []
    for (what, _, advice), process in zip(checks, running, strict=True):
        _, stderr = process.communicate()
        if process.returncode == 0:
            continue
        if any(sign in stderr for sign in _NOT_FOUND):
            missing.append(f"{what} does not exist: {advice}")
        else:
            print(f"warning: {what} could not be checked: {stderr.strip()[-300:]}", file=sys.stderr, flush=True)
    if missing:
        raise DeployError("This launch would fail:\n  - " + "\n  - ".join(missing))


def whole_number(settings: Settings, name: str, default: str) -> int:
    text = settings.get(name) or default
    if not text.isdigit():
        raise DeployError(f"{name}={text!r} is not a whole number")
    return int(text)


def check_cost(settings: Settings, parameters: Mapping[str, str], dry_run: bool,
               environ: Mapping[str, str] | None = None) -> None:
    """Prints the job's hourly ceiling (:mod:`ops.cost`) and, above ``MAX_HOURLY_COST``, has it confirmed
    (``CONFIRM_COST=1``, or an answer on the terminal); refused, it stops the launch before gcloud runs."""
    limit = cost.parse_limit(settings.get("MAX_HOURLY_COST"))
    confirmed = cost.parse_confirm(settings.get("CONFIRM_COST"))
    disk = settings.get("DISK_SIZE_GB") or parameters.get("disk_size_gb") or str(DEFAULT_DISK_SIZE_GB)
    # A machine type that comes with its GPUs has them without GPU_TYPE; the workers bill in WORKER_ZONE's region.
    gpu_type, gpu_count = (settings.get("GPU_TYPE"), whole_number(settings, "GPU_COUNT", "1")) \
        if settings.get("GPU_TYPE") else FIXED_SHAPES.get(settings.get("MACHINE_TYPE"), ("", 0))
    zone = settings.get("WORKER_ZONE")
    job = cost.Job(project=settings.get("PROJECT"), region=zone.rsplit("-", 1)[0] if zone else settings.get("REGION"),
                   zone=zone, machine_type=settings.get("MACHINE_TYPE"), gpu_type=gpu_type, gpu_count=gpu_count,
                   disk_gb=int(disk) if disk.isdigit() else DEFAULT_DISK_SIZE_GB,
                   max_workers=max(whole_number(settings, "MAX_WORKERS", "1"),
                                   whole_number(settings, "NUM_WORKERS", "1")),
                   launcher_machine_type=settings.get("LAUNCHER_MACHINE_TYPE"))
    cost.check_ceiling(job, limit, confirmed, dry_run, environ)


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.deploy", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("template", "run", "update", "run-dataflow", "drain", "cancel"))
    parser.add_argument("--dry-run", action="store_true", help="print the command (and its flags file); run nothing")
    args = parser.parse_args(argv)
    environ = os.environ if environ is None else environ
    settings = Settings(dict(environ))
    try:
        if args.action == "template":
            built = run_gcloud(*flex_template_build(settings), dry_run=args.dry_run)
            return built or complete_spec(settings, args.dry_run)
        if args.action in ("drain", "cancel"):
            return job_command(settings, args.action, args.dry_run)
        if args.action in ("run", "update"):
            launch = flex_template_run(settings, update=args.action == "update")
            require_resources(settings, launch[1]["--parameters"], args.dry_run)
            check_cost(settings, launch[1]["--parameters"], args.dry_run, environ)
            return run_gcloud(*launch, dry_run=args.dry_run)
        command = dataflow_runner(settings)
        print(f"==> {shlex.join(command)}", flush=True)
        return 0 if args.dry_run else subprocess.run(command, check=False).returncode
    except DeployError as exc:
        print(f"make {args.action}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
