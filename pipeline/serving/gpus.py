"""Which GPUs a worker image can run, from one table: each GPU's compute capability against the image's CUDA major.

A GPU the image cannot run must be refused before the job bills for it, at launch (the launcher and
``make run``, :mod:`pipeline.config.launch_checks`) and again on the worker before vLLM starts
(:func:`check_gpus`, reading ``nvidia-smi``), each naming the GPUs and the image that would work. The facts:

* vLLM (0.32, the version the image pins) needs "compute capability 7.5 or higher (e.g., T4, RTX20xx, A100, L4,
  H100, B200, etc.)" (vLLM's GPU installation page,
  https://docs.vllm.ai/en/latest/getting_started/installation/gpu.html; releases before 0.10 said 7.0), so
  Pascal (P100: 6.0, P4: 6.1) and Volta (V100: 7.0) GPUs run no image of it.
* CUDA 13 builds code for Turing (7.5) and newer only: its release notes remove the Maxwell, Pascal and Volta
  architectures (https://docs.nvidia.com/cuda/cuda-toolkit-release-notes/); CUDA 12 still builds for them. So
  today vLLM's own floor decides for both images; the CUDA 12 image (``CUDA=12``) is for older drivers.
* Blackwell GPUs (B200: 10.0, RTX PRO 6000: 12.0) need CUDA 12.8 or newer: the CUDA 12 image's torch and vLLM
  are built for 12.9 (https://docs.nvidia.com/cuda/blackwell-compatibility-guide/).
* Compute capabilities from NVIDIA's list (https://developer.nvidia.com/cuda-gpus); the types, their memory
  and the machine types they come with or attach to from Compute Engine's GPU pages
  (https://cloud.google.com/compute/docs/gpus), which Dataflow's GPU pages refer to.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

# The CUDA majors the worker image is built for (container/Dockerfile, make image CUDA=...). The default is 12: its
# runtime runs on every NVIDIA driver from 525.60.13 on (minor version compatibility), so on whatever branch
# Container-Optimized OS labels the driver Dataflow installs; CUDA 13 needs 580 (docs/operations.md#gpu-driver).
CUDA_MAJORS = (12, 13)
DEFAULT_CUDA_MAJOR = 12
VLLM_MIN_CAPABILITY = (7, 5)
# The oldest architecture each CUDA major builds code for.
CUDA_MIN_CAPABILITY = {12: (5, 0), 13: (7, 5)}


@dataclass(frozen=True)
class Gpu:
    """One of Compute Engine's GPU types, as ``worker_accelerator=type:...`` names it."""

    type: str
    name: str  # as nvidia-smi prints it (a prefix of its name)
    capability: tuple[int, int]
    memory_gb: int
    # Machine families it comes with (G2, A2, A3, A4: the GPU count is fixed by the machine type) or attaches to (N1).
    machines: tuple[str, ...]


GPUS = (
    Gpu("nvidia-tesla-p4", "Tesla P4", (6, 1), 8, ("n1",)),
    Gpu("nvidia-tesla-p100", "Tesla P100", (6, 0), 16, ("n1",)),
    Gpu("nvidia-tesla-v100", "Tesla V100", (7, 0), 16, ("n1",)),
    Gpu("nvidia-tesla-t4", "Tesla T4", (7, 5), 16, ("n1",)),
    Gpu("nvidia-l4", "NVIDIA L4", (8, 9), 24, ("g2",)),
    Gpu("nvidia-tesla-a100", "NVIDIA A100-SXM4-40GB", (8, 0), 40, ("a2",)),
    Gpu("nvidia-a100-80gb", "NVIDIA A100-SXM4-80GB", (8, 0), 80, ("a2",)),
    Gpu("nvidia-h100-80gb", "NVIDIA H100 80GB HBM3", (9, 0), 80, ("a3",)),
    Gpu("nvidia-h100-mega-80gb", "NVIDIA H100 80GB HBM3", (9, 0), 80, ("a3",)),
    Gpu("nvidia-h200-141gb", "NVIDIA H200", (9, 0), 141, ("a3",)),
    Gpu("nvidia-b200", "NVIDIA B200", (10, 0), 180, ("a4",)),
    Gpu("nvidia-rtx-pro-6000", "NVIDIA RTX PRO 6000 Blackwell Server Edition", (12, 0), 96, ("g4",)),
)
GPUS_BY_TYPE = {gpu.type: gpu for gpu in GPUS}


def runnable_cuda_majors(capability: tuple[int, int]) -> list[int]:
    """The image CUDA majors whose vLLM runs on a GPU of this compute capability."""
    if capability < VLLM_MIN_CAPABILITY:
        return []
    return [major for major in CUDA_MAJORS if capability >= CUDA_MIN_CAPABILITY[major]]


def runnable_types(cuda_major: int) -> list[str]:
    return [gpu.type for gpu in GPUS if cuda_major in runnable_cuda_majors(gpu.capability)]


def capability_problem(name: str, capability: tuple[int, int], cuda_major: int) -> str | None:
    """Why the image built for CUDA ``cuda_major`` cannot run vLLM on this GPU, naming what would; or None."""
    majors = runnable_cuda_majors(capability)
    if cuda_major in majors:
        return None
    have = f"{name} (compute capability {capability[0]}.{capability[1]})"
    if not majors:
        return (f"{have} cannot run vLLM, which needs compute capability {VLLM_MIN_CAPABILITY[0]}."
                f"{VLLM_MIN_CAPABILITY[1]} or higher, from any image: choose one of "
                f"{', '.join(runnable_types(cuda_major))} for this image (CUDA {cuda_major})")
    return (f"{have} cannot run this image's vLLM, built for CUDA {cuda_major}, which builds code for compute "
            f"capability {CUDA_MIN_CAPABILITY[cuda_major][0]}.{CUDA_MIN_CAPABILITY[cuda_major][1]} and newer: build "
            f"the worker image with CUDA={majors[0]} (make image CUDA={majors[0]}), or choose one of "
            f"{', '.join(runnable_types(cuda_major))}")


def gpu_type_problem(gpu_type: str, cuda_major: int) -> str | None:
    """:func:`capability_problem` for a ``worker_accelerator`` type; a type not in the table is refused (a typo, or
    a GPU Dataflow does not offer), naming the known ones."""
    gpu = GPUS_BY_TYPE.get(gpu_type)
    if gpu is None:
        return (f"{gpu_type} is not one of Compute Engine's GPU types for compute that this template knows: "
                f"{', '.join(GPUS_BY_TYPE)}")
    return capability_problem(gpu.type, gpu.capability, cuda_major)


# Machine types that come with their GPUs: the type and count are fixed by the machine (Compute Engine's
# accelerator-optimized machine family pages).
FIXED_SHAPES: dict[str, tuple[str, int]] = {
    **{f"g2-standard-{n}": ("nvidia-l4", 1) for n in (4, 8, 12, 16, 32)},
    "g2-standard-24": ("nvidia-l4", 2), "g2-standard-48": ("nvidia-l4", 4), "g2-standard-96": ("nvidia-l4", 8),
    **{f"a2-highgpu-{n}g": ("nvidia-tesla-a100", n) for n in (1, 2, 4, 8)},
    "a2-megagpu-16g": ("nvidia-tesla-a100", 16),
    **{f"a2-ultragpu-{n}g": ("nvidia-a100-80gb", n) for n in (1, 2, 4, 8)},
    **{f"a3-highgpu-{n}g": ("nvidia-h100-80gb", n) for n in (1, 2, 4, 8)},
    "a3-edgegpu-8g": ("nvidia-h100-80gb", 8), "a3-megagpu-8g": ("nvidia-h100-mega-80gb", 8),
    "a3-ultragpu-8g": ("nvidia-h200-141gb", 8), "a4-highgpu-8g": ("nvidia-b200", 8),
    "g4-standard-48": ("nvidia-rtx-pro-6000", 1), "g4-standard-96": ("nvidia-rtx-pro-6000", 2),
    "g4-standard-192": ("nvidia-rtx-pro-6000", 4), "g4-standard-384": ("nvidia-rtx-pro-6000", 8),
}
# GPUs attached to N1 machine types, and how many one machine may take.
N1_COUNTS = {"nvidia-tesla-t4": (1, 2, 4), "nvidia-tesla-v100": (1, 2, 4, 8), "nvidia-tesla-p100": (1, 2, 4),
             "nvidia-tesla-p4": (1, 2, 4)}


def _vcpus(machine_type: str) -> int:
    """The vCPUs a machine type's name states (g2-standard-24: 24; a2-highgpu-2g: its GPUs stand in for them)."""
    digits = "".join(ch for ch in machine_type.rsplit("-", 1)[-1] if ch.isdigit())
    return int(digits) if digits else 0


def shapes_with(gpu_type: str, count: int | None = None) -> list[str]:
    """The machine types that come with ``gpu_type`` (``count`` of them, if given), smallest first."""
    return sorted((name for name, (fixed, n) in FIXED_SHAPES.items() if fixed == gpu_type and count in (None, n)),
                  key=lambda name: (FIXED_SHAPES[name][1], _vcpus(name), name))


def machine_for(gpu_type: str, count: int | None) -> str:
    """What to set for ``count`` GPUs of ``gpu_type`` (a known type): the machine type first, smallest first."""
    if gpu_type in N1_COUNTS:
        if count and count not in N1_COUNTS[gpu_type]:
            return (f"an N1 machine type takes {', '.join(map(str, N1_COUNTS[gpu_type]))} {gpu_type}: set GPU_COUNT "
                    "to one of those with MACHINE_TYPE=n1-standard-8 (or a larger N1)")
        return f"set MACHINE_TYPE=n1-standard-8 (or a larger N1 machine type) to attach {count or 1} {gpu_type}"
    shapes = shapes_with(gpu_type, count)
    if shapes:
        return f"set MACHINE_TYPE={shapes[0]}" + (f" (or {', '.join(shapes[1:])})" if shapes[1:] else "")
    counts = sorted({n for fixed, n in FIXED_SHAPES.values() if fixed == gpu_type})
    return (f"{gpu_type} comes {', '.join(map(str, counts))} to a machine, not {count}: set GPU_COUNT to one of "
            f"those, with MACHINE_TYPE={shapes_with(gpu_type)[0]} for one")


def machine_problem(machine_type: str, gpu_type: str | None, count: int | None) -> str | None:
    """Why this machine type cannot have these GPUs (Compute Engine's shapes), naming first the machine type that
    has what was asked, smallest first; or None. Custom and unknown machine types are not judged."""
    family = machine_type.split("-")[0]
    if machine_type in FIXED_SHAPES:
        fixed_type, fixed_count = FIXED_SHAPES[machine_type]
        if (gpu_type and gpu_type != fixed_type) or (count and count != fixed_count):
            wanted_type, wanted_count = gpu_type or fixed_type, count or 1
            advice = (f"for {wanted_count} {wanted_type}, {machine_for(wanted_type, wanted_count)}; or "
                      if wanted_type in GPUS_BY_TYPE else "")
            return (f"machine type {machine_type} comes with {fixed_count} {fixed_type}: {advice}set "
                    f"GPU_TYPE={fixed_type} and GPU_COUNT={fixed_count} (worker_accelerator=type:{fixed_type};"
                    f"count:{fixed_count}) to keep it")
        return None
    if not gpu_type or family == "custom" or gpu_type not in GPUS_BY_TYPE:
        return None
    if family == "n1":
        if gpu_type not in N1_COUNTS:
            return f"{gpu_type} comes only with its own machine types, not with {machine_type}: " + \
                machine_for(gpu_type, count)
        if count and count not in N1_COUNTS[gpu_type]:
            return (f"an N1 machine takes {', '.join(map(str, N1_COUNTS[gpu_type]))} {gpu_type}, not {count}: "
                    "set GPU_COUNT to one of those")
        return None
    if family in ("g2", "a2", "a3", "a4", "g4"):
        return None  # a shape of these families not in the table: not judged
    return f"machine type {machine_type} takes no GPU: " + machine_for(gpu_type, count)


def visible_gpu_capabilities() -> list[tuple[str, tuple[int, int]]] | None:
    """Each GPU's name and compute capability as ``nvidia-smi`` reports them; None where it cannot tell."""
    try:
        result = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if result.returncode != 0:
        return None
    found = []
    for line in result.stdout.splitlines():
        name, _, capability = line.rpartition(",")
        major, _, minor = capability.strip().partition(".")
        if not name.strip() or not major.isdigit() or not minor.isdigit():
            return None
        found.append((name.strip(), (int(major), int(minor))))
    return found or None


def gpus_problem(cuda_major: int) -> str | None:
    """Why this worker's GPUs cannot run the image's vLLM (built for ``cuda_major``), or None."""
    for name, capability in visible_gpu_capabilities() or []:
        if problem := capability_problem(name, capability, cuda_major):
            return problem
    return None
