"""``make image``: the worker and launcher images of one commit, for the CUDA major the settings name.

The worker image's CUDA major decides which NVIDIA drivers run it (CUDA 13: 580 or newer; CUDA 12: 525.60.13 or
newer, NVIDIA's CUDA Compatibility guide) and is the one fact the launcher must know of its workers (the GPU
table, :mod:`pipeline.serving.gpus`). Each major is built from its own base, with torch and vLLM wheels built
for it:

* **CUDA 12** (the default: it runs on every driver from 525.60.13 on, the branch Container-Optimized OS labels
  ``latest`` included, docs/operations.md#gpu-driver): vLLM publishes a CUDA 12.9 build of each release beside
  PyPI's ("We only release cu129 and cu130 wheels", vLLM's maintainers, vllm-project/vllm#42756) on its wheel
  index, one folder a release and
  variant (``wheels.vllm.ai/<version>/cu129``, vllm-project/vllm#50822, #43847), and PyTorch publishes torch for
  CUDA 12.9 on its own index (vLLM's GPU installation page: ``--extra-index-url
  https://download.pytorch.org/whl/cu129``). Both are pinned with their local version label, so pip cannot fall
  back to PyPI's CUDA 13 wheels. These indexes cannot be reached from where this template is developed: the
  image's build checks its imports and ``pip check`` (container/Dockerfile), so a missing wheel fails the build.
* **CUDA 13**: vLLM 0.32 as published on PyPI is built for CUDA 13.0 and pulls torch 2.13 for CUDA 13.0, so the
  worker installs ``.[gpu]`` from PyPI alone; it needs driver 580 or newer.

The build runs as the build account make setup creates (``--service-account``), not a default account of the
project (ops/setup_project.py says why), and keeps its log in the build logs' bucket make setup creates
(``--gcs-log-dir``, :meth:`ops.settings.Settings.build_logs_bucket`), which ``gcloud builds submit`` streams to the
terminal while the build runs.

Cloud Build (``BUILDER=cloudbuild``, container/cloudbuild.yaml) and a local Docker (``BUILDER=docker``) get the same
build arguments; ``--dry-run`` prints the commands.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ops.settings import BUILD_SOURCE_PREFIX, Settings
from pipeline.serving.gpus import DEFAULT_CUDA_MAJOR

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"


@dataclass(frozen=True)
class WorkerBuild:
    """What the worker image of one CUDA major is built from."""

    base: str  # the CUDA base image (container/Dockerfile's CUDA_IMAGE)
    indexes: tuple[str, ...] = ()  # pip's extra indexes for the wheels below
    pins: tuple[str, ...] = ()  # requirements beside .[gpu] that pick the wheels built for this major


BUILDS = {
    13: WorkerBuild("nvidia/cuda:13.0.0-base-ubuntu22.04"),
    12: WorkerBuild("nvidia/cuda:12.9.1-base-ubuntu22.04",
                    indexes=(f"https://wheels.vllm.ai/{VLLM_VERSION}/cu129", "https://download.pytorch.org/whl/cu129"),
                    pins=(f"vllm=={VLLM_VERSION}+cu129", f"torch=={TORCH_VERSION}+cu129")),
}


class ImageError(ValueError):
    """A setting make image cannot build with; the message names it."""


def build_args(cuda: int, settings: Mapping[str, str]) -> dict[str, str]:
    """The worker stage's build arguments for CUDA ``cuda``."""
    build = BUILDS[cuda]
    return {"CUDA": str(cuda), "CUDA_IMAGE": build.base, "GPU_INDEXES": " ".join(build.indexes),
            "GPU_PINS": " ".join(build.pins), "BAKE_MODEL": settings.get("BAKE_MODEL", "")}


def commands(settings: Mapping[str, str]) -> list[list[str]]:
    """The commands that build (and push) both images."""
    get = lambda name: (settings.get(name) or "").strip()  # noqa: E731
    text = get("CUDA") or str(DEFAULT_CUDA_MAJOR)
    if not text.isdigit() or int(text) not in BUILDS:
        raise ImageError(f"CUDA={text}: the worker image is built for CUDA {' or '.join(map(str, sorted(BUILDS)))}")
    cuda = int(text)
    worker, launcher = get("WORKER_IMAGE"), get("LAUNCHER_IMAGE")
    args = build_args(cuda, settings)
    if get("BUILDER") == "docker":
        return [["docker", "build", "-f", "container/Dockerfile", "--target", "worker",
                 *[f"--build-arg={name}={value}" for name, value in args.items()],
                 "--secret", "id=hf_token,env=HF_TOKEN", "-t", worker, "."],
                ["docker", "build", "-f", "container/Dockerfile", "--target", "launcher",
                 f"--build-arg=WORKER_IMAGE={worker}", f"--build-arg=CUDA={cuda}", "-t", launcher, "."],
                ["docker", "push", worker], ["docker", "push", launcher]]
    substitutions = {"_WORKER_IMAGE": worker, "_LAUNCHER_IMAGE": launcher, "_CUDA": str(cuda),
                     "_CUDA_IMAGE": args["CUDA_IMAGE"], "_GPU_INDEXES": args["GPU_INDEXES"],
                     "_GPU_PINS": args["GPU_PINS"], "_BAKE_MODEL": args["BAKE_MODEL"],
                     "_BAKE_TOKEN_SECRET": get("BAKE_TOKEN_SECRET")}
    # gcloud's list flags split on commas; "^|^" makes | the separator (gcloud topic escaping).
    joined = "^|^" + "|".join(f"{name}={value}" for name, value in substitutions.items())
    builder = Settings(settings).build_service_account()
    return [["gcloud", "builds", "submit", "--project", get("PROJECT"), "--region", get("REGION"),
             "--gcs-source-staging-dir", f"gs://{get('BUCKET')}/{BUILD_SOURCE_PREFIX}",
             "--gcs-log-dir", f"gs://{Settings(settings).build_logs_bucket()}",
             "--service-account", f"projects/{get('PROJECT')}/serviceAccounts/{builder}", "--config",
             "container/cloudbuild.yaml", "--substitutions", joined, *shlex.split(get("IMAGE_BUILD_ARGS")), "."]]


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.image", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="print the commands; run nothing")
    args = parser.parse_args(argv)
    settings = dict(os.environ if environ is None else environ)
    try:
        found = commands(settings)
    except ImageError as exc:
        print(f"make image: {exc}", file=sys.stderr)
        return 2
    for command in found:
        print(f"==> {shlex.join(command)}", flush=True)
        if not args.dry_run:
            code = subprocess.run(command, check=False).returncode
            if code:
                return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
