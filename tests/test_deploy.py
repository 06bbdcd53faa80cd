"""The deploy targets, run for real as a new user runs them: `.env` from `.env.example`, `make <target>`, the real
gcloud, whose Google Cloud endpoints point at a loopback recorder (tests/gcloud_recorder.py). What is asserted is
the request Dataflow, Cloud Storage or Cloud Build would receive."""

from __future__ import annotations

import json
import os
import io
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from apache_beam.options.pipeline_options import PipelineOptions

from ops import deploy, monitoring
from ops.settings import PUBSUB_SETTINGS
from pipeline.config.options import PipelineConfig
from tests.conftest import DEPLOY_TAG, DEPLOY_TEMPLATE_PATH
from tests.gcloud_recorder import Recorder

REPO = Path(__file__).resolve().parent.parent
TAG = DEPLOY_TAG
SETTINGS = {"PROJECT": "proj-123456", "BUCKET": "bkt-test"}
# The commit and the CUDA major (.env.example's CUDA=12): a build for the other CUDA never overwrites these.
WORKER_IMAGE = f"us-central1-docker.pkg.dev/proj-123456/dataflow/streaming-llm-worker:{TAG}-cu12"
LAUNCHER_IMAGE = f"us-central1-docker.pkg.dev/proj-123456/dataflow/streaming-llm-launcher:{TAG}-cu12"
TEMPLATE_PATH = DEPLOY_TEMPLATE_PATH
# Values no shell word, gcloud dict string or comma list carries as they are.
HOSTILE = {
    "system_prompt": 'You are terse, "very" terse.\nAnswer with one word ~ ^ = , ; \' $HOME `x` \\ ünïcödé 🙂 \x7f\x85',
    "prompt_template": "Classify, please: {text}\n(category=billing|bug)",
    "response_schema": json.dumps({"type": "object", "properties": {"category": {"enum": ["a,b", "c=d", "e~f"]}},
                                   "required": ["category"]}),
    "lora_adapters": "support=gs://bkt-test/adapters/support,extract=my-org/extract-lora",
    "vllm_args": "--max-num-seqs 128 --enforce-eager",
    "bucket_boundaries": "64,128,256",
}


# The account make setup creates for the job, from PROJECT alone (.env.example leaves SERVICE_ACCOUNT unset).
ACCOUNT = "streaming-llm@proj-123456.iam.gserviceaccount.com"


def make(target: str, recorder: Recorder | None, env_file: Path | None, **variables: str) -> \
        subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if not key.startswith("CLOUDSDK_")}
    if recorder:
        env.update(recorder.env())
    args = ["make", "--no-print-directory", target, f"TAG={TAG}"]
    if env_file:
        args.append(f"ENV_FILE={env_file}")
    args += [f"{key}={value}" for key, value in variables.items()]
    # The first deploy target creates .venv-deploy (Beam and the pipeline's light dependencies) from scratch.
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def launch_request(recorder: Recorder) -> dict:
    launches = recorder.find("POST", r"/flexTemplates:launch$")
    assert len(launches) == 1, [r.path for r in recorder.requests]
    return launches[0].json()["launchParameter"]


def test_a_filled_in_env_example_runs_every_deploy_target(recorder, env_file):
    image = make("image", recorder, env_file, IMAGE_BUILD_ARGS="--async", BAKE_MODEL="google/gemma-2-2b-it",
                 BAKE_TOKEN_SECRET="projects/proj-123456/secrets/hf-token/versions/3")
    assert image.returncode == 0, image.stdout + image.stderr
    build = recorder.find("POST", r"/v1/projects/proj-123456/locations/us-central1/builds$")[0].json()
    assert build["substitutions"]["_WORKER_IMAGE"] == WORKER_IMAGE
    # A build with its own account logs to a bucket of the user's, the log gcloud builds submit streams.
    assert build["logsBucket"] == "gs://bkt-test-build-logs" and build["options"]["logging"] == "GCS_ONLY"
    assert build["substitutions"]["_LAUNCHER_IMAGE"] == LAUNCHER_IMAGE
    assert build["substitutions"]["_BAKE_MODEL"] == "google/gemma-2-2b-it"
    assert build["substitutions"]["_BAKE_TOKEN_SECRET"] == "projects/proj-123456/secrets/hf-token/versions/3"
    worker_build = next(step for step in build["steps"] if "worker" in step["args"])
    assert "id=hf_token,src=.hf_token" in worker_build["args"]  # the token as a build secret, in no layer
    source = next(name for name in recorder.objects if name.startswith("bkt-test/cloudbuild-source/"))
    with tarfile.open(fileobj=io.BytesIO(recorder.objects[source])) as archive:
        names = set(archive.getnames())
    assert {"container/Dockerfile", "pipeline/assembly.py", "template/main.py"} <= names
    assert not any(name.startswith((".venv", ".git/")) for name in names)

    template = make("template", recorder, env_file, DISK_SIZE_GB="300")
    assert template.returncode == 0, template.stdout + template.stderr
    spec = json.loads(recorder.objects[TEMPLATE_PATH.removeprefix("gs://")])
    assert spec["image"] == LAUNCHER_IMAGE
    assert spec["metadata"]["parameters"] == json.loads((REPO / "metadata.json").read_text())["parameters"]
    # The console launches with these: the same job settings make run passes, the disk and the launcher's
    # machine (no flag of flex-template build takes them) added to the spec gcloud wrote, read back through gcloud.
    assert spec["defaultEnvironment"] == {
        "machineType": "g2-standard-8", "numWorkers": 1, "maxWorkers": 4, "enableStreamingEngine": True,
        "additionalExperiments": ["worker_accelerator=type:nvidia-l4;count:1;install-nvidia-driver:latest"],
        "stagingLocation": "gs://bkt-test/staging", "tempLocation": "gs://bkt-test/tmp",
        "serviceAccountEmail": ACCOUNT, "launcherMachineType": "e2-standard-4", "diskSizeGb": 300}

    run = make("run", recorder, env_file)
    assert run.returncode == 0, run.stdout + run.stderr
    launch = launch_request(recorder)
    assert launch["containerSpecGcsPath"] == TEMPLATE_PATH
    assert launch["jobName"].startswith("streaming-llm-") and "update" not in launch
    assert launch["parameters"] == {
        "input_subscription": "projects/proj-123456/subscriptions/prompts-sub",
        "output_chunks_topic": "projects/proj-123456/topics/llm-chunks",
        "output_completions_topic": "projects/proj-123456/topics/llm-completions",
        "dead_letter_topic": "projects/proj-123456/topics/llm-dead-letters",
        "sdk_container_image": WORKER_IMAGE}  # one commit: the spec's launcher and the workers
    assert launch["environment"] == {
        "machineType": "g2-standard-8", "launcherMachineType": "e2-standard-4", "numWorkers": 1, "maxWorkers": 4,
        "enableStreamingEngine": True, "stagingLocation": "gs://bkt-test/staging", "tempLocation": "gs://bkt-test/tmp",
        "serviceAccountEmail": ACCOUNT,  # the launcher and the workers run as the job's own account, not the default
        "additionalExperiments": ["worker_accelerator=type:nvidia-l4;count:1;install-nvidia-driver:latest"]}
    # No disk size: the template sets its own default (tests/test_dataflow_job.py sees it in the job).



def test_drain_and_cancel_find_the_running_job_by_its_name(recorder, env_file):
    """JOB_NAME is the one job identifier of every target: drain and cancel look its id up among the active jobs."""
    recorder.jobs = [{"id": "2026-11-25_00_00_00-1", "projectId": "proj-123456", "name": "streaming-llm-prod",
                      "location": "us-central1", "currentState": "JOB_STATE_RUNNING",
                      "createTime": "2026-11-25T00:00:00Z", "currentStateTime": "2026-11-25T00:00:01Z",
                      "type": "JOB_TYPE_STREAMING"},
                     {"id": "2026-11-25_00_00_00-2", "projectId": "proj-123456", "name": "another-job",
                      "location": "us-central1", "currentState": "JOB_STATE_RUNNING",
                      "createTime": "2026-11-25T00:00:00Z", "currentStateTime": "2026-11-25T00:00:01Z",
                      "type": "JOB_TYPE_STREAMING"}]
    drain = make("drain", recorder, env_file, JOB_NAME="streaming-llm-prod")
    assert drain.returncode == 0, drain.stdout + drain.stderr
    drained = recorder.find("PUT", r"/v1b3/projects/proj-123456/locations/us-central1/jobs/2026-11-25_00_00_00-1$")
    assert [r.json() for r in drained] == [{"requestedState": "JOB_STATE_DRAINED"}]
    cancel = make("cancel", recorder, env_file, JOB_NAME="streaming-llm-prod")
    assert cancel.returncode == 0, cancel.stdout + cancel.stderr
    cancelled = recorder.find("PUT", r"/jobs/2026-11-25_00_00_00-1$")[-1]
    assert cancelled.json() == {"requestedState": "JOB_STATE_CANCELLED"}
    missing = make("drain", recorder, env_file, JOB_NAME="no-such-job")
    assert missing.returncode != 0 and "no active jobs named no-such-job" in missing.stderr
    assert not recorder.find("PUT", r"/jobs/2026-11-25_00_00_00-2$"), "the other job is never touched"


def test_update_relaunches_the_running_job_by_name_with_renamed_steps(recorder, env_file):
    result = make("update", recorder, env_file, JOB_NAME="streaming-llm-prod",
                  TRANSFORM_NAME_MAPPINGS='{"StreamingGenerate": "Generate"}', EXTRA_PARAMETERS="max_in_flight=32")
    assert result.returncode == 0, result.stdout + result.stderr
    launch = launch_request(recorder)
    assert launch["jobName"] == "streaming-llm-prod" and launch["update"] is True
    assert launch["transformNameMappings"] == {"StreamingGenerate": "Generate"}
    assert launch["parameters"]["max_in_flight"] == "32"
    unnamed = make("update", recorder, env_file)
    assert unnamed.returncode != 0 and "Set JOB_NAME" in unnamed.stderr
    assert len(recorder.find("POST", r"/flexTemplates:launch$")) == 1


def test_any_parameter_value_reaches_dataflow_intact_through_a_parameters_file(recorder, env_file, tmp_path):
    parameters = tmp_path / "params.json"
    parameters.write_text(json.dumps({**HOSTILE, "max_in_flight": 32, "length_bucketing": True,
                                      "answer_bucket_boundaries": None}))
    result = make("run", recorder, env_file, PARAMETERS_FILE=str(parameters), SERVICE_ACCOUNT=
                  "llm-worker@proj-123456.iam.gserviceaccount.com", UTILIZATION_HINT="0.3", NVIDIA_DRIVER="580",
                  DISK_SIZE_GB="500")
    assert result.returncode == 0, result.stdout + result.stderr
    launch = launch_request(recorder)
    for name, value in HOSTILE.items():
        assert launch["parameters"][name] == value, name
    assert launch["parameters"]["max_in_flight"] == "32" and launch["parameters"]["length_bucketing"] == "true"
    assert "answer_bucket_boundaries" not in launch["parameters"]  # null: left to the template's default
    assert launch["environment"]["serviceAccountEmail"] == "llm-worker@proj-123456.iam.gserviceaccount.com"
    assert launch["environment"]["additionalExperiments"] == [
        "worker_accelerator=type:nvidia-l4;count:1;install-nvidia-driver:580", "worker_utilization_hint=0.3"]
    assert launch["environment"]["additionalPipelineOptions"] == ["disk_size_gb=500"]


def test_extra_parameters_keep_spaces_commas_and_equals_inside_values(recorder, env_file):
    result = make("run", recorder, env_file, EXTRA_PARAMETERS="system_prompt=You are terse, and kind.,"
                  "vllm_args=--max-num-seqs 128,lora_adapters=a=gs://bkt-test/a,b=org/b,bucket_boundaries=64,128")
    assert result.returncode == 0, result.stdout + result.stderr
    parameters = launch_request(recorder)["parameters"]
    assert parameters["system_prompt"] == "You are terse, and kind."
    assert parameters["vllm_args"] == "--max-num-seqs 128"
    assert parameters["lora_adapters"] == "a=gs://bkt-test/a,b=org/b"
    assert parameters["bucket_boundaries"] == "64,128"


@pytest.mark.parametrize("variables, message", [
    ({"EXTRA_PARAMETERS": "max_inflight=3"}, "'max_inflight' is not a template parameter"),
    ({"EXTRA_PARAMETERS": "input_subscription=projects/proj-123456/subscriptions/other"},
     "input_subscription is set by the Makefile settings and by EXTRA_PARAMETERS"),
    ({"EXTRA_PARAMETERS": "max_in_flight=0"}, "--max_in_flight must be at least 1"),
    ({"PARAMETERS_FILE": "/nonexistent/params.json"}, "PARAMETERS_FILE=/nonexistent/params.json"),
    ({"JOB_NAME": "Bad_Name"}, "Dataflow job names are lower-case"),
    ({"INPUT_SUBSCRIPTION": "", "DEAD_LETTER_TOPIC": ""}, "--input_subscription is required"),
    ({"INPUT_SUBSCRIPTION": "projects/my-project/subscriptions/prompts-sub"},
     "INPUT_SUBSCRIPTION=projects/my-project/subscriptions/prompts-sub is in project my-project, not PROJECT=proj-123456"),
    ({"DEAD_LETTER_TOPIC": "projects/other-proj/topics/letters"}, "is in project other-proj, not PROJECT"),
])
def test_a_bad_setting_stops_the_launch_by_name_before_gcloud_runs(recorder, env_file, variables, message):
    result = make("run", recorder, env_file, **variables)
    assert result.returncode != 0 and message in result.stderr, result.stderr
    assert not recorder.requests


def test_a_launch_after_a_new_commit_says_its_spec_is_not_built_yet(recorder, env_file):
    """TAG follows the checkout's commit: after a commit, make run names a spec make template has not built."""
    del recorder.objects[TEMPLATE_PATH.removeprefix("gs://")]
    result = make("run", recorder, env_file)
    assert result.returncode != 0 and f"the template spec {TEMPLATE_PATH} does not exist" in result.stderr, \
        result.stderr
    assert "make template" in result.stderr and "gcloud storage ls gs://bkt-test/templates/" in result.stderr
    assert not recorder.find("POST", r"/flexTemplates:launch$"), "nothing launched"


def test_a_launch_names_each_resource_it_needs_that_does_not_exist(recorder, env_file):
    """The job's account (new since make setup creates it: a project set up before must run make setup again), its
    subscription and an output topic, all missing: make run names each and what makes it, and launches nothing."""
    recorder.missing |= {"/v1/projects/-/serviceAccounts/" + ACCOUNT,  # how gcloud names an account by email
                         "/v1/projects/proj-123456/subscriptions/prompts-sub",
                         "/v1/projects/proj-123456/topics/llm-dead-letters"}
    result = make("run", recorder, env_file)
    assert result.returncode != 0, result.stdout
    for what in (f"the job's service account {ACCOUNT} does not exist: make setup creates it",
                 "the subscription projects/proj-123456/subscriptions/prompts-sub does not exist: make setup",
                 "the topic projects/proj-123456/topics/llm-dead-letters does not exist: make setup"):
        assert what in result.stderr, result.stderr
    assert "llm-completions does not exist" not in result.stderr and "template spec" not in result.stderr
    assert not recorder.find("POST", r"/flexTemplates:launch$"), "nothing launched"


def test_each_target_asks_only_for_the_settings_it_uses(recorder):
    run = make("run", recorder, None, PROJECT="", BUCKET="")
    assert run.returncode != 0 and "Set PROJECT BUCKET (in .env" in run.stderr  # REGION has its default
    drain = make("drain", recorder, None, PROJECT="proj-123456", JOB_NAME="")
    assert drain.returncode != 0 and "Set JOB_NAME" in drain.stderr and "BUCKET" not in drain.stderr
    assert not recorder.requests


def test_an_image_is_not_tagged_with_a_commit_it_does_not_hold(tmp_path):
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True)
    shutil.copy(REPO / "Makefile", clone / "Makefile")  # this checkout's Makefile, committed in the clone
    subprocess.run(["git", "-c", "user.name=test", "-c", "user.email=test@example.com", "commit", "--quiet", "--allow-empty", "-am",
                    "this Makefile"], cwd=clone, check=True)
    clean = subprocess.run(["make", "--no-print-directory", "-n", "image", "PROJECT=proj-123456", "BUCKET=bkt-test"],
                           cwd=clone, capture_output=True, text=True, timeout=60)
    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=clone, capture_output=True, text=True)
    assert f"streaming-llm-worker:{commit.stdout.strip()}" in clean.stdout
    (clone / "README.md").write_text("changed\n")
    result = subprocess.run(["make", "--no-print-directory", "image", "PROJECT=proj-123456", "BUCKET=bkt-test"],
                            cwd=clone, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "uncommitted changes" in result.stderr


def test_make_run_dataflow_hands_beam_every_value_as_one_argument(env_file, tmp_path):
    parameters = tmp_path / "params.json"
    parameters.write_text(json.dumps(HOSTILE))
    result = make("run-dataflow", None, env_file, PARAMETERS_FILE=str(parameters), DRY_RUN="1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "--runner=DataflowRunner" in result.stdout and f"--sdk_container_image={WORKER_IMAGE}" in result.stdout


def beam_values(settings: dict[str, str]) -> PipelineConfig:
    """What the template's own option parsing makes of the argv make run-dataflow builds."""
    argv = deploy.dataflow_runner(deploy.Settings(settings))
    return PipelineConfig.from_options(PipelineOptions(argv[argv.index("template.main") + 1:]))


BASE = {"PROJECT": "proj-123456", "REGION": "us-central1", "BUCKET": "bkt-test", "WORKER_IMAGE": WORKER_IMAGE,
        "MACHINE_TYPE": "g2-standard-8", "NUM_WORKERS": "1", "MAX_WORKERS": "4", "DISK_SIZE_GB": "200",
        "GPU_TYPE": "nvidia-l4", "GPU_COUNT": "1", "INPUT_SUBSCRIPTION": "projects/proj-123456/subscriptions/prompts-sub",
        "DEAD_LETTER_TOPIC": "projects/proj-123456/topics/dead", "CHUNKS_TOPIC": "projects/proj-123456/topics/chunks"}


def test_beams_option_parser_gets_hostile_values_intact(tmp_path):
    parameters = tmp_path / "params.json"
    parameters.write_text(json.dumps(HOSTILE))
    config = beam_values({**BASE, "PARAMETERS_FILE": str(parameters)})
    for name, value in HOSTILE.items():
        assert getattr(config, name) == value, name


free_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=1,
                    max_size=200).filter(lambda text: text.strip() == text and text.strip())


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=free_text)
def test_fuzz_any_system_prompt_survives_beams_option_parser(prompt, tmp_path):
    parameters = tmp_path / "params.json"
    parameters.write_text(json.dumps({"system_prompt": prompt}))
    assert beam_values({**BASE, "PARAMETERS_FILE": str(parameters)}).system_prompt == prompt


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=free_text)
def test_fuzz_any_system_prompt_survives_gcloud(prompt, tmp_path):
    """The real gcloud reads the flags file the launch targets write; drawn values come out unchanged."""
    recording = Recorder(str(tmp_path / "gcloud-config"))
    try:
        parameters = tmp_path / "params.json"
        parameters.write_text(json.dumps({"system_prompt": prompt}))
        environment = {**BASE, "TEMPLATE_PATH": TEMPLATE_PATH, "PARAMETERS_FILE": str(parameters)}
        argv, flags = deploy.flex_template_run(deploy.Settings(environment), update=False)
        flags_file = tmp_path / "flags.json"
        flags_file.write_text(deploy.flags_file_text(flags), encoding="utf-8")
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("CLOUDSDK_")}, **recording.env()}
        result = subprocess.run([*argv, f"--flags-file={flags_file}"], env=env, capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0, result.stderr
        assert launch_request(recording)["parameters"]["system_prompt"] == prompt
    finally:
        recording.close()


def test_extra_parameters_split_only_before_a_parameter_name():
    assert deploy.split_extra_parameters("a_b=1") == [("a_b", "1")]
    assert deploy.split_extra_parameters("system_prompt=x,y=z,model=m") == [("system_prompt", "x,y=z"),
                                                                          ("model", "m")]
    with pytest.raises(deploy.DeployError, match="is not name=value"):
        deploy.split_extra_parameters("justtext")



def test_the_structured_output_pages_launch_example_is_a_valid_launch(tmp_path):
    page = (REPO / "docs" / "structured-output.md").read_text()
    example = page.split("<!-- example:tickets", 1)[1].split("```json", 1)[1].split("```", 1)[0]
    parameters = tmp_path / "tickets.json"
    parameters.write_text(example)
    settings = {**BASE, "PARAMETERS_FILE": str(parameters), "CHUNKS_TOPIC": "",
                "INPUT_SUBSCRIPTION": "tickets-sub"}  # as the page's make run names it: an ID in PROJECT
    launched = deploy.template_parameters(deploy.Settings(settings))
    assert launched["input_subscription"] == "projects/proj-123456/subscriptions/tickets-sub"
    assert json.loads(launched["response_schema"])["required"] == ["category", "urgency", "summary"]
    assert launched["prompt_template"] == "Classify this support ticket: {text}"


def test_the_makefile_exports_exactly_the_settings_the_deploy_command_reads():
    """... and the monitoring command (make dashboard, make alerts)."""
    makefile = (REPO / "Makefile").read_text()
    declared = re.search(r"^DEPLOY_SETTINGS := ((?:.*\\\n)*.*)$", makefile, re.MULTILINE).group(1)
    exported = set(declared.replace("\\", " ").split())
    read = set(re.findall(r"""(?:get|require|secret)\(\s*['"]([A-Z_]+)['"]""", (REPO / "ops" / "deploy.py").read_text()
                          + (REPO / "ops" / "monitoring.py").read_text() + (REPO / "ops" / "setup_project.py").read_text()
                          + (REPO / "ops" / "backfill.py").read_text()))
    read |= set(monitoring.THRESHOLDS)
    read |= set(re.findall(r"""['"]([A-Z_]+)['"],?""", re.search(
        r"settings\.require\(([^)]*)\)", (REPO / "ops" / "deploy.py").read_text(), re.DOTALL).group(1)))
    read |= set(deploy.NAMED_SETTINGS) | {"EXTRA_PARAMETERS"}  # read through the mapping and .values
    read |= set(PUBSUB_SETTINGS)  # read through Settings.pubsub_path
    read |= {"SERVICE_ACCOUNT"}  # read through Settings.service_account
    assert exported == read, (sorted(exported - read), sorted(read - exported))


def test_make_run_runs_the_launchers_checks_before_anything_is_submitted(env_file, recorder):
    """The launcher's own checks, in the terminal, before gcloud is called: a gated model without a token warns, a
    GPU the machine type cannot have or the image cannot run stops the launch, naming what would work."""
    gated = make("run", recorder, env_file, DRY_RUN="1", MODEL="google/gemma-2-2b-it")
    assert gated.returncode == 0, gated.stderr
    assert "warning:" in gated.stderr and "gated on Hugging Face" in gated.stderr and "hf_token_secret" in gated.stderr
    t4 = make("run", recorder, env_file, GPU_TYPE="nvidia-tesla-t4")
    assert t4.returncode != 0 and "machine type g2-standard-8 comes with 1 nvidia-l4" in t4.stderr
    two = make("run", recorder, env_file, GPU_COUNT="2")
    assert two.returncode != 0 and "GPU_COUNT=1" in two.stderr
    v100 = make("run", recorder, env_file, GPU_TYPE="nvidia-tesla-v100", MACHINE_TYPE="n1-standard-8")
    assert v100.returncode != 0 and "nvidia-tesla-v100 (compute capability 7.0) cannot run vLLM" in v100.stderr
    cuda = make("run-dataflow", None, env_file, DRY_RUN="1", CUDA="11")
    assert cuda.returncode != 0 and "CUDA=11" in cuda.stderr
    assert not recorder.requests, "nothing reached Dataflow"


def test_a_worker_zone_reaches_dataflow_through_gcloud(recorder, env_file):
    """WORKER_ZONE, for a GPU out of stock where Dataflow would place the workers: gcloud's --worker-zone, in the
    launch and in the spec's defaults (flex-template build takes it too)."""
    result = make("run", recorder, env_file, WORKER_ZONE="us-central1-b")
    assert result.returncode == 0, result.stdout + result.stderr
    (launch,) = recorder.find("POST", r"/flexTemplates:launch$")
    assert launch.json()["launchParameter"]["environment"]["workerZone"] == "us-central1-b"
    template = make("template", recorder, env_file, WORKER_ZONE="us-central1-b")
    assert template.returncode == 0, template.stdout + template.stderr
    assert json.loads(recorder.objects[TEMPLATE_PATH.removeprefix("gs://")])["defaultEnvironment"][
        "workerZone"] == "us-central1-b"


# A company project's VPC: a subnetwork of the job's region in a Shared VPC host project, no public IPs.
SHARED_SUBNET = "https://www.googleapis.com/compute/v1/projects/host-proj-1/regions/us-central1/subnetworks/dataflow"


def test_a_company_vpc_reaches_the_launch_the_spec_and_beam(recorder, env_file):
    """NETWORK, SUBNETWORK and PUBLIC_IPS=false, as gcloud 528's own flags put them into the launch request and the
    spec's default environment (Dataflow's WorkerIPAddressConfiguration), and as Beam's worker options for
    make run-dataflow; a Hub model without public IPs is warned about (it needs Cloud NAT)."""
    vpc = {"SUBNETWORK": SHARED_SUBNET, "PUBLIC_IPS": "false"}
    run = make("run", recorder, env_file, **vpc)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "warning: workers without public IPs" in run.stderr and "Cloud NAT" in run.stderr
    environment = launch_request(recorder)["environment"]
    assert (environment["subnetwork"], environment["ipConfiguration"]) == (SHARED_SUBNET, "WORKER_IP_PRIVATE")
    assert "network" not in environment  # Dataflow picks the subnetwork's network
    template = make("template", recorder, env_file, NETWORK="corp-vpc", SUBNETWORK="dataflow", PUBLIC_IPS="false")
    assert template.returncode == 0, template.stdout + template.stderr
    defaults = json.loads(recorder.objects[TEMPLATE_PATH.removeprefix("gs://")])["defaultEnvironment"]
    assert (defaults["network"], defaults["subnetwork"], defaults["ipConfiguration"]) == (
        "corp-vpc", "regions/us-central1/subnetworks/dataflow", "WORKER_IP_PRIVATE")
    beam = deploy.dataflow_runner(deploy.Settings({**BASE, "NETWORK": "corp-vpc", "SUBNETWORK": "dataflow",
                                                   "PUBLIC_IPS": "false"}))
    options = PipelineOptions(beam[beam.index("template.main") + 1:]).get_all_options()
    assert (options["network"], options["subnetwork"], options["use_public_ips"]) == (
        "corp-vpc", "regions/us-central1/subnetworks/dataflow", False)


@pytest.mark.parametrize("variables, message", [
    ({"NETWORK": "projects/p/global/networks/corp"}, "Dataflow takes a network by its name only"),
    ({"SUBNETWORK": "regions/europe-west4/subnetworks/dataflow"}, "is in europe-west4, but the job runs in"),
    ({"SUBNETWORK": "projects/p/subnetworks/x"}, "give a name, regions/REGION/subnetworks/NAME"),
    ({"PUBLIC_IPS": "no"}, "PUBLIC_IPS='no': true (the default) or false"),
])
def test_a_network_dataflow_would_refuse_stops_the_launch_by_name(recorder, env_file, variables, message):
    result = make("run", recorder, env_file, **variables)
    assert result.returncode != 0 and message in result.stderr, result.stderr
    assert not recorder.requests


def test_env_example_states_every_cost_setting_with_the_makefiles_default():
    """The settings that decide cost or quota are listed in .env.example, each with the value the Makefile would
    use without it (one default, stated twice: this keeps them one)."""
    example = dict(line.split("=", 1) for line in (REPO / ".env.example").read_text().splitlines()
                   if "=" in line and not line.startswith("#"))
    defaults = dict(re.findall(r"^([A-Z_]+) \?= ?(.*)$", (REPO / "Makefile").read_text(), re.MULTILINE))
    cost = ["MACHINE_TYPE", "GPU_TYPE", "GPU_COUNT", "NUM_WORKERS", "MAX_WORKERS", "WORKER_ZONE", "DISK_SIZE_GB",
            "REGION", "CUDA"]
    assert set(cost) <= set(example), sorted(set(cost) - set(example))
    assert {name: example[name] for name in cost} == {name: defaults[name] for name in cost}


def test_builds_for_each_cuda_major_never_share_a_tag():
    """A CUDA 12 build must not overwrite the images and spec a CUDA 13 job runs from (nor the other way)."""
    named = {}
    for cuda in ("12", "13"):
        printed = subprocess.run(["make", "--no-print-directory", "-n", "image", "template", "ENV_FILE=/dev/null",
                                  "PROJECT=proj-123456", "BUCKET=bkt-test", f"TAG={TAG}", f"CUDA={cuda}"],
                                 cwd=REPO, capture_output=True, text=True, timeout=60).stdout
        named[cuda] = set(re.findall(r"streaming-llm-(?:worker|launcher):\S+?(?=[\s'\"|]|$)|streaming-llm-\S+?\.json",
                                     printed))
        assert f"streaming-llm-worker:{TAG}-cu{cuda}" in named[cuda], printed
    assert not named["12"] & named["13"]


def test_the_token_secret_setting_is_the_jobs_hf_token_secret_and_set_in_one_place():
    """HF_TOKEN_SECRET is what make setup lets the job's account read and what the job is given; the same parameter
    from EXTRA_PARAMETERS as well is refused, so the two cannot name different secrets."""
    secret = "projects/proj-123456/secrets/hf-token/versions/latest"
    base = {**SETTINGS, "INPUT_SUBSCRIPTION": "prompts-sub", "DEAD_LETTER_TOPIC": "letters",
            "COMPLETIONS_TOPIC": "answers"}
    launched = deploy.template_parameters(deploy.Settings({**base, "HF_TOKEN_SECRET": secret}))
    assert launched["hf_token_secret"] == secret
    with pytest.raises(deploy.DeployError, match="hf_token_secret is set by the Makefile settings and by "
                                                 "EXTRA_PARAMETERS"):
        deploy.template_parameters(deploy.Settings({**base, "HF_TOKEN_SECRET": secret,
                                                    "EXTRA_PARAMETERS": f"hf_token_secret={secret}"}))
    with pytest.raises(deploy.DeployError, match="hf_token_secret"):
        deploy.template_parameters(deploy.Settings({**base, "HF_TOKEN_SECRET": "hf-token"}))


def test_a_bulk_subscription_setting_is_launched_as_the_jobs_bulk_lane_and_checked_before_the_launch():
    base = {**SETTINGS, "INPUT_SUBSCRIPTION": "prompts-sub", "DEAD_LETTER_TOPIC": "letters",
            "COMPLETIONS_TOPIC": "answers"}
    assert "bulk_subscription" not in deploy.template_parameters(deploy.Settings(base))
    settings = deploy.Settings({**base, "BULK_SUBSCRIPTION": "bulk-prompts-sub"})
    launched = deploy.template_parameters(settings)
    assert launched["bulk_subscription"] == "projects/proj-123456/subscriptions/bulk-prompts-sub"
    described = [" ".join(command) for _, command, _ in deploy.launch_resources(settings, launched)]
    assert any("pubsub subscriptions describe bulk-prompts-sub --project proj-123456" in c for c in described)
    with pytest.raises(deploy.DeployError, match="BULK_SUBSCRIPTION=projects/other"):
        deploy.template_parameters(deploy.Settings({**base, "BULK_SUBSCRIPTION":
                                                    "projects/other/subscriptions/bulk-prompts-sub"}))
