"""What a GPU worker checks before vLLM starts: the driver against the CUDA build, and how the server uses the GPUs.

No GPU here: the checks are pure functions of what the worker reads (the driver's version, torch's CUDA version, the
visible devices), fed every pair that can occur on Dataflow's workers.
"""

from __future__ import annotations

import pytest

from pipeline.serving.server_platform import GpuInfo, ServerStartError, check_platform, driver_problem
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
