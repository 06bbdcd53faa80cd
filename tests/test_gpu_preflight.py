"""What a GPU worker checks before vLLM starts: the driver against the CUDA build, and how the server uses the GPUs.

No GPU here: the checks are pure functions of what the worker reads (the driver's version, torch's CUDA version, the
visible devices), fed every pair that can occur on Dataflow's workers.
"""

from __future__ import annotations

import pytest

from pipeline.serving.gpus import DEFAULT_CUDA_MAJOR
from pipeline.serving.server_platform import (GpuInfo, ServerStartError, check_platform, driver_in_nvidia_smi,
                                              driver_in_proc_version, driver_problem)
from pipeline.serving.vllm_server import ServerSpec


@pytest.mark.parametrize("driver, cuda, fits", [
    ("580.82.07", "13.0", True), ("590.48.01", "13.0", True), ("575.57.08", "13.0", False),
    ("570.172.08", "13.0", False), ("535.261.03", "13.0", False), ("525.147.05", "13.0", False),
    ("535.261.03", "12.8", True), ("525.60.13", "12.9", True), ("525.60.12", "12.9", False),
    ("470.256.02", "12.8", False), ("580.82.07", "12.8", True),
    (None, "13.0", True), ("580.82.07", None, True),  # unknown: nothing to say
])
def test_the_driver_fits_the_cuda_build_by_nvidias_minimum_driver_table(driver, cuda, fits):
    assert (driver_problem(driver, cuda) is None) is fits


def test_a_gpu_worker_with_too_old_a_driver_is_told_that_not_to_ask_for_a_gpu():
    with pytest.raises(ServerStartError) as excinfo:
        check_platform("cuda", has_gpu=False, driver="570.172.08", cuda="13.0")
    message = str(excinfo.value)
    assert "570.172.08" in message and "13.0" in message and "580" in message and "make image CUDA=12" in message
    assert "request one" not in message
    with pytest.raises(ServerStartError, match="ask Dataflow for a newer driver"):
        check_platform("cuda", has_gpu=False, driver="470.256.02", cuda="13.0")  # too old for either image
    with pytest.raises(ServerStartError, match="this worker has no GPU"):
        check_platform("cuda", has_gpu=False, driver=None, cuda="13.0")
    check_platform("cuda", has_gpu=True, driver="580.82.07", cuda="13.0")  # fits: nothing raised
    check_platform("cpu", has_gpu=False)


def flag(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


def test_the_server_runs_tensor_parallel_over_every_gpu_unless_vllm_args_say_otherwise():
    spec = ServerSpec(model="m")
    assert flag(spec.command("m", 8000, gpus=GpuInfo(count=2, bfloat16=True)), "--tensor-parallel-size") == "2"
    assert "--tensor-parallel-size" not in spec.command("m", 8000, gpus=GpuInfo(count=1, bfloat16=True))
    own = ServerSpec(model="m", extra_args=("--tensor-parallel-size", "1", "--pipeline-parallel-size", "2"))
    command = own.command("m", 8000, gpus=GpuInfo(count=2, bfloat16=True))
    assert command.count("--tensor-parallel-size") == 1 and flag(command, "--tensor-parallel-size") == "1"
    assert "--tensor-parallel-size" not in ServerSpec(model="m", extra_args=("-tp=4",)).command(
        "m", 8000, gpus=GpuInfo(count=4, bfloat16=True))


def test_the_dtype_follows_the_gpu_when_it_is_auto():
    t4 = GpuInfo(count=1, bfloat16=False)
    assert flag(ServerSpec(model="m").command("m", 8000, gpus=t4), "--dtype") == "float16"
    assert flag(ServerSpec(model="m").command("m", 8000, gpus=GpuInfo(count=1, bfloat16=True)), "--dtype") == "auto"
    assert flag(ServerSpec(model="m", dtype="float32").command("m", 8000, gpus=t4), "--dtype") == "float32"
    assert flag(ServerSpec(model="m").command("m", 8000, on_cpu=True), "--dtype") == "auto"


# What a worker's driver says of itself, as recorded from NVIDIA's tools: the proprietary and the open kernel
# module's /proc/driver/nvidia/version, nvidia-smi's query (a line per GPU) and its table's header.
PROC_PROPRIETARY = ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.133.20  Fri Mar 14 01:16:24 UTC 2025\n"
                    "GCC version:  gcc version 12.2.0 (GCC)\n")
PROC_OPEN = ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.82.07  Release Build  "
             "(dvs-builder@U16-I3-B03-4-3)  Wed Aug 27 02:07:16 UTC 2025\nGCC version:  gcc version 12.2.0 (GCC)\n")
SMI_QUERY = "535.261.03\n535.261.03\n"
SMI_TABLE = ("+-----------------------------------------------------------------------------------------+\n"
             "| NVIDIA-SMI 570.133.20             Driver Version: 570.133.20     CUDA Version: 12.8     |\n"
             "|-----------------------------------------+------------------------+----------------------+\n")
# Container-Optimized OS's GPU driver list labels the 570.133.20 production branch LATEST since 2025 (cos
# board-overlays, "scripts/gpu_driver_versions: Update policy to support New Feature Branch drivers"); Dataflow's
# GPU page says the driver depends on the COS version, and the template asks for install-nvidia-driver:latest.
COS_LATEST_DRIVER = "570.133.20"


def test_the_driver_is_read_from_each_of_its_recorded_outputs():
    assert driver_in_proc_version(PROC_PROPRIETARY) == "570.133.20"
    assert driver_in_proc_version(PROC_OPEN) == "580.82.07"
    assert driver_in_nvidia_smi(SMI_QUERY) == "535.261.03"
    assert driver_in_nvidia_smi(SMI_TABLE) == "570.133.20"
    for nothing in ("", "No devices were found\n", "NVIDIA-SMI has failed because it couldn't communicate"):
        assert driver_in_nvidia_smi(nothing) is None and driver_in_proc_version(nothing) is None


def test_the_default_image_runs_on_the_driver_container_optimized_os_labels_latest():
    """The default CUDA major's runtime fits COS's LATEST driver; CUDA 13 does not, and its worker says so in one
    sentence naming both versions and the setting, before vLLM starts."""
    cuda = {12: "12.9", 13: "13.0"}  # what torch.version.cuda says in each image (ops/image.py's wheels)
    driver = driver_in_proc_version(PROC_PROPRIETARY)
    assert driver == COS_LATEST_DRIVER
    check_platform("cuda", has_gpu=True, driver=driver, cuda=cuda[DEFAULT_CUDA_MAJOR])  # fits: nothing raised
    with pytest.raises(ServerStartError) as refused:
        check_platform("cuda", has_gpu=True, driver=driver, cuda=cuda[13])
    message = str(refused.value)
    assert "570.133.20" in message and "CUDA 13.0" in message and "make image CUDA=12" in message
    assert message.count(". ") == 0, "one sentence"
