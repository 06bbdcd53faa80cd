"""Which GPUs each worker image runs (pipeline/serving/gpus.py): at launch, by make run and the launcher alike, and
on the worker from nvidia-smi's own output."""

from __future__ import annotations

import os
import stat

import pytest
from apache_beam.options.pipeline_options import PipelineOptions

from pipeline.config.launch_checks import WORKER_CUDA_ENV, dataflow_launch_problems, image_cuda_major
from pipeline.config.options import PipelineConfig
from pipeline.serving.gpus import (
    DEFAULT_CUDA_MAJOR,
    FIXED_SHAPES,
    GPUS,
    GPUS_BY_TYPE,
    N1_COUNTS,
    gpu_type_problem,
    gpus_problem,
    machine_problem,
    visible_gpu_capabilities,
)
from pipeline.serving.server_platform import ServerStartError, check_platform

# Compute Engine's GPU types for compute (its "GPU machine types" page; the virtual workstation variants, which
# Dataflow does not offer, left out), and what each image must do with each: run it, or refuse it.
COMPUTE_ENGINE_GPUS = {
    "nvidia-tesla-p4": {12: False, 13: False}, "nvidia-tesla-p100": {12: False, 13: False},
    "nvidia-tesla-v100": {12: False, 13: False}, "nvidia-tesla-t4": {12: True, 13: True},
    "nvidia-l4": {12: True, 13: True}, "nvidia-tesla-a100": {12: True, 13: True},
    "nvidia-a100-80gb": {12: True, 13: True}, "nvidia-h100-80gb": {12: True, 13: True},
    "nvidia-h100-mega-80gb": {12: True, 13: True}, "nvidia-h200-141gb": {12: True, 13: True},
    "nvidia-b200": {12: True, 13: True}, "nvidia-rtx-pro-6000": {12: True, 13: True},
}
DATAFLOW = ["--runner=DataflowRunner", "--project=p", "--region=us-central1", "--temp_location=gs://b/tmp",
            "--input_subscription=projects/my-project/subscriptions/prompts-sub",
            "--output_completions_topic=projects/my-project/topics/llm-completions",
            "--dead_letter_topic=projects/my-project/topics/llm-dead-letters", "--sdk_container_image=us-docker.pkg.dev/p/r/worker:1"]
# As nvidia-smi 580.159.04 prints `--query-gpu=name,compute_cap --format=csv,noheader` on an H100 (run on the
# GPU machine lent to this project, 2026-11-25); other GPUs print their names the same way.
H100_LINE = "NVIDIA H100 80GB HBM3, 9.0"


def test_every_compute_engine_gpu_is_classified_for_each_image():
    assert set(GPUS_BY_TYPE) == set(COMPUTE_ENGINE_GPUS), "the table covers exactly Compute Engine's GPUs"
    for gpu_type, runs in COMPUTE_ENGINE_GPUS.items():
        for major, ok in runs.items():
            problem = gpu_type_problem(gpu_type, major)
            assert (problem is None) == ok, (gpu_type, major, problem)
    v100 = gpu_type_problem("nvidia-tesla-v100", 13)
    assert "cannot run vLLM" in v100 and "nvidia-tesla-t4" in v100, "names the GPUs that run this image"
    p4 = gpu_type_problem("nvidia-tesla-p4", 12)
    assert "compute capability 7.5 or higher" in p4 and "nvidia-l4" in p4 and "nvidia-tesla-v100" not in p4
    typo = gpu_type_problem("nvidia-l4x", 13)
    assert "not one of Compute Engine's GPU types" in typo and "nvidia-l4," in typo, "refused, naming the known"



def test_a_gpu_only_the_other_images_cuda_builds_for_is_sent_to_that_image(monkeypatch):
    """Were vLLM's floor below CUDA 13's (it was 7.0 before vLLM 0.10), a V100 would need the CUDA 12 image."""
    from pipeline.serving import gpus

    monkeypatch.setattr(gpus, "VLLM_MIN_CAPABILITY", (7, 0))
    problem = gpus.gpu_type_problem("nvidia-tesla-v100", 13)
    assert "make image CUDA=12" in problem and "builds code for compute capability 7.5 and newer" in problem
    assert gpus.gpu_type_problem("nvidia-tesla-v100", 12) is None


def test_machine_shapes_follow_compute_engine():
    for machine, (gpu_type, count) in FIXED_SHAPES.items():
        assert gpu_type in GPUS_BY_TYPE and machine_problem(machine, gpu_type, count) is None
        assert machine_problem(machine, None, None) is None, "a machine that brings its GPUs needs none asked"
    t4 = machine_problem("g2-standard-8", "nvidia-tesla-t4", 1)
    assert "comes with 1 nvidia-l4" in t4 and "for 1 nvidia-tesla-t4, set MACHINE_TYPE=n1-standard-8" in t4
    two = machine_problem("g2-standard-8", "nvidia-l4", 2)
    assert "for 2 nvidia-l4, set MACHINE_TYPE=g2-standard-24;" in two and "GPU_COUNT=1" in two
    h100 = machine_problem("n1-standard-8", "nvidia-h100-80gb", None)
    assert "set MACHINE_TYPE=a3-highgpu-1g (or a3-highgpu-2g, a3-highgpu-4g," in h100, "smallest first, all named"
    assert "set MACHINE_TYPE=a2-megagpu-16g" in machine_problem("n1-standard-8", "nvidia-tesla-a100", 16)
    assert "comes 1, 2, 4, 8 to a machine, not 3" in machine_problem("e2-standard-4", "nvidia-l4", 3)
    assert machine_problem("g2-standard-24", "nvidia-l4", 2) is None
    assert "comes only with its own machine types" in machine_problem("n1-standard-8", "nvidia-l4", 1)
    assert "takes 1, 2, 4 nvidia-tesla-t4, not 3" in machine_problem("n1-standard-8", "nvidia-tesla-t4", 3)
    assert machine_problem("n1-standard-8", "nvidia-tesla-v100", 8) is None
    assert "takes no GPU" in machine_problem("e2-standard-4", "nvidia-tesla-t4", 1)
    assert machine_problem("custom-8-32768", "nvidia-tesla-t4", 1) is None
    for gpu in GPUS:
        assert gpu.machines[0] == "n1" and gpu.type in N1_COUNTS or gpu.type in {t for t, _ in FIXED_SHAPES.values()}


@pytest.mark.parametrize("gpu_option, machine, cuda, refused", [
    ("worker_accelerator=type:nvidia-tesla-v100;count:1;install-nvidia-driver", "n1-standard-8", 13, "cannot run vLLM"),
    ("worker_accelerator=type:nvidia-tesla-v100;count:1;install-nvidia-driver", "n1-standard-8", 12, "cannot run vLLM"),
    ("worker_accelerator=type:nvidia-tesla-t4;count:1;install-nvidia-driver", "n1-standard-8", 12, None),
    ("worker_accelerator=type:nvidia-tesla-p4;count:1;install-nvidia-driver", "n1-standard-8", 12, "cannot run vLLM"),
    ("worker_accelerator=type:nvidia-tesla-t4;count:1;install-nvidia-driver", "g2-standard-8", 13, "comes with 1"),
    ("worker_accelerator=type:nvidia-l4;count:2;install-nvidia-driver", "g2-standard-8", 13, "GPU_COUNT=1"),
    ("worker_accelerator=type:nvidia-l4;count:1;install-nvidia-driver", "g2-standard-8", 13, None),
])
def test_the_launch_refuses_gpus_the_image_or_machine_cannot_have(gpu_option, machine, cuda, refused):
    options = PipelineOptions(DATAFLOW + [f"--dataflow_service_options={gpu_option}", f"--machine_type={machine}"])
    problems, _ = dataflow_launch_problems(options, PipelineConfig.from_options(options), cuda)
    assert (refused is None and problems == []) or any(refused in p for p in problems), problems


def test_the_launcher_reads_its_workers_cuda_major():
    assert image_cuda_major({}) == DEFAULT_CUDA_MAJOR == 12
    assert image_cuda_major({WORKER_CUDA_ENV: "13"}) == 13
    assert image_cuda_major({WORKER_CUDA_ENV: "11"}) == 12, "not an image this template builds: the default"


def nvidia_smi(tmp_path, monkeypatch, lines: list[str], driver: str = "580.159.04") -> None:
    """A stand-in nvidia-smi first on PATH, answering the two queries the worker makes in the real format."""
    script = tmp_path / "nvidia-smi"
    script.write_text("#!/bin/sh\n"
                      'case "$*" in\n'
                      f'  *name,compute_cap*) printf "%s\\n" {" ".join(repr(line) for line in lines)} ;;\n'
                      f'  *driver_version*) echo {driver} ;;\n'
                      '  *) exit 9 ;;\n'
                      "esac\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def test_the_worker_reads_its_gpus_from_nvidia_smi_and_refuses_what_its_image_cannot_run(tmp_path, monkeypatch):
    nvidia_smi(tmp_path, monkeypatch, [H100_LINE, H100_LINE])
    assert visible_gpu_capabilities() == [("NVIDIA H100 80GB HBM3", (9, 0))] * 2
    assert gpus_problem(13) is None and gpus_problem(12) is None
    check_platform("cuda", has_gpu=True, driver="580.159.04", cuda="13.0")  # starts

    nvidia_smi(tmp_path, monkeypatch, ["Tesla V100-SXM2-16GB, 7.0"])
    with pytest.raises(ServerStartError, match=r"Tesla V100-SXM2-16GB \(compute capability 7.0\) cannot run vLLM"):
        check_platform("cuda", has_gpu=True, driver="580.159.04", cuda="13.0")
    nvidia_smi(tmp_path, monkeypatch, ["Tesla T4, 7.5"])
    check_platform("cuda", has_gpu=True, driver="535.230.02", cuda="12.9")  # the CUDA 12 image on a 535 driver

    nvidia_smi(tmp_path, monkeypatch, ["Tesla P4, 6.1"])
    with pytest.raises(ServerStartError, match="cannot run vLLM"):
        check_platform("cuda", has_gpu=True, driver="580.159.04", cuda="12.9")

    nvidia_smi(tmp_path, monkeypatch, ["garbled"])
    assert visible_gpu_capabilities() is None and gpus_problem(13) is None, "what it cannot read, it does not judge"
