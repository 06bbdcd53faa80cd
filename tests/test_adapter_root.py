"""A folder of LoRA adapters (lora_adapter_root): configured, named by requests, fetched and checked by a worker.

The adapters here are real peft adapters (local/toy_adapters.py, and one built on a smaller Llama than the model,
which is what an adapter trained on another base model looks like); the Cloud Storage root is the Storage
emulator. Serving them through vLLM is tests/test_lora_root_e2e.py.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from local.emulators import GcsEmulator
from local.toy_adapters import TARGET_MODULES, build_adapter
from pipeline.config.options import ConfigError
from pipeline.config.settings import JobSettings
from pipeline.contract.messages import DeadLetter
from pipeline.contract.request_parsing import RequestLimits, parse_request
from pipeline.serving.adapter_disk import (
    DEFAULT_DISK_SHARE,
    FREE_KEPT_SHARE,
    AdapterDisk,
    AdapterTooLarge,
    budget_bytes,
)
from pipeline.serving.adapter_root import (
    AdapterRoot,
    AdapterUnavailable,
    AdapterUnreadable,
    base_problem,
    fetch_adapter,
    root_fetch,
    root_problem,
    safetensors_shapes,
)
from pipeline.serving.lineage import folder_digest
from pipeline.serving.model_weights import local_weights
from tests.conftest import activated
from tests.test_lora_adapters import BASE_CONFIG, saved_adapter


@pytest.mark.parametrize("values, problem", [
    ({"lora_adapter_root": "/adapters", "engine": "transformers"},
     "--lora_adapter_root does not go with --engine=transformers"),
    ({"lora_adapter_root": "/adapters", "server_url": "http://vllm:8000"},
     "--lora_adapter_root does not go with --server_url"),
    ({"lora_adapter_root": "/adapters", "lora_adapters": "a=/x,b=/y", "max_loras": "2"},
     r"needs --max_loras above the number of --lora_adapters \(2\)"),
    ({"lora_adapter_root": "s3://bucket/adapters"}, "lora_adapter_root"),
    ({"lora_adapter_root": "gs://Not_A_Bucket/adapters"}, "lora_adapter_root"),
])
def test_a_root_no_worker_could_serve_from_is_refused(values, problem):
    with pytest.raises(ConfigError, match=problem):
        JobSettings.from_mapping({**BASE_CONFIG, **values})


def test_the_server_may_load_adapters_while_it_runs_and_keeps_what_max_loras_leaves():
    settings = JobSettings.from_mapping({**BASE_CONFIG, "lora_adapter_root": "gs://bucket/adapters/",
                                         "lora_adapters": "a=/x/a", "max_loras": "3"})
    spec = settings.engine.server
    assert spec.adapter_root == AdapterRoot("gs://bucket/adapters/") and spec.root_adapters == 2
    command = spec.command("/weights", 8000, adapter_paths=("/local/a",))
    start = command.index("--enable-lora")
    assert command[start:start + 7] == ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "3",
                                        "--lora-modules", "a=/local/a"]
    assert spec.environment()["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    # Only a root: LoRA on, nothing listed; on the CPU build one slot more, which stays empty.
    alone = JobSettings.from_mapping({**BASE_CONFIG, "lora_adapter_root": "/adapters", "max_loras": "2"}).engine.server
    on_cpu = alone.command("/weights", 8000, on_cpu=True)
    assert "--lora-modules" not in on_cpu and on_cpu[on_cpu.index("--max-loras") + 1] == "3"
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in JobSettings.from_mapping(
        {**BASE_CONFIG, "lora_adapters": "a=/x"}).engine.server.environment()


def test_a_request_may_name_any_folder_of_the_root_and_nothing_outside_it():
    def parsed(name: str, limits: RequestLimits = RequestLimits(adapters=("listed",), adapter_root=True)):
        return parse_request(json.dumps({"id": "r", "prompt": "p", "adapter": name}).encode(), limits=limits)

    assert parsed("listed").adapter == "listed" and parsed("customer-17.v2").adapter == "customer-17.v2"
    for hostile in ("../secrets", "a/b", ".hidden", "", "x" * 65, "a b", "a\nb"):
        letter = parsed(hostile)
        assert isinstance(letter, DeadLetter), hostile
    letter = parsed("other", RequestLimits(adapters=("listed",)))
    assert isinstance(letter, DeadLetter) and "is not served by this job" in letter.reason


@pytest.fixture(scope="module")
def root(checkpoint, tmp_path_factory) -> Path:
    """A root of one adapter for the model, one for a smaller Llama, one for modules the model does not have, one
    of too high a rank, one whose config is not JSON, and a folder without a config."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("adapter-root")
    build_adapter(checkpoint, folder / "good", seed=1)
    torch.manual_seed(0)
    small = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256))
    get_peft_model(small, LoraConfig(r=8, target_modules=list(TARGET_MODULES))).save_pretrained(folder / "other-model")
    saved_adapter(folder / "high-rank", 64)
    saved_adapter(folder / "other-architecture", 8, target_modules=["q_proj", "c_attn"])  # c_attn: GPT-2's
    (folder / "garbled").mkdir()
    (folder / "garbled" / "adapter_config.json").write_text("{not json")
    (folder / "empty").mkdir()
    return folder


def test_a_worker_fetches_a_good_adapter_and_says_why_it_cannot_serve_each_bad_one(root, checkpoint):
    found = AdapterRoot(str(root))
    assert fetch_adapter(found, "good", str(checkpoint), 16) == str((root / "good").resolve())
    reasons = {}
    for name in ("other-model", "other-architecture", "high-rank", "garbled", "empty", "missing", "../good"):
        with pytest.raises(AdapterUnavailable) as raised:
            fetch_adapter(found, name, str(checkpoint), 16)
        reasons[name] = str(raised.value)
    assert "does not fit the model" in reasons["other-model"] and "intermediate_size is 1536" in reasons["other-model"]
    assert "targets c_attn, which the model does not have" in reasons["other-architecture"]
    assert "rank 64, above --max_lora_rank=16" in reasons["high-rank"]
    assert "adapter_config.json cannot be read" in reasons["garbled"]
    assert "no adapter at" in reasons["empty"] and "no adapter at" in reasons["missing"]
    assert "not a folder name" in reasons["../good"]
    # Without the model's files to compare with (a hub id), the shapes are left to vLLM.
    assert fetch_adapter(found, "other-model", None, 16)


def test_an_adapter_trained_for_another_model_of_the_same_shape_is_refused_naming_both(root, checkpoint, tmp_path):
    """Shapes cannot tell two models of one architecture apart; the base model peft recorded can. An adapter whose
    adapter_config.json names another model is refused, whatever the served model is called (a hub id whose files
    are not on disk here, a local folder), unless lora_base_model_check is off; one trained on a copy of the model
    (a folder of the same name) is served."""
    other = tmp_path / "other-base"
    build_adapter(checkpoint, other, seed=2)
    config = json.loads((other / "adapter_config.json").read_text())
    assert Path(config["base_model_name_or_path"]).name == checkpoint.name, "peft records what it was trained on"
    config["base_model_name_or_path"] = "Qwen/Qwen2.5-0.5B-Instruct"
    (other / "adapter_config.json").write_text(json.dumps(config))
    found = AdapterRoot(str(tmp_path))
    for served, folder in ((str(checkpoint), str(checkpoint)), (f"HuggingFaceTB/{checkpoint.name}", None)):
        with pytest.raises(AdapterUnavailable) as raised:
            fetch_adapter(found, "other-base", folder, 16, base_model=served)
        assert "was trained for 'Qwen/Qwen2.5-0.5B-Instruct'" in str(raised.value) and served in str(raised.value)
        assert "lora_base_model_check=false" in str(raised.value)
        assert fetch_adapter(AdapterRoot(str(root)), "good", folder, 16, base_model=served)
    assert fetch_adapter(found, "other-base", str(checkpoint), 16, base_model=None), "the check off: shapes fit"
    assert JobSettings.from_mapping({**BASE_CONFIG, "lora_adapter_root": str(tmp_path),
                                     "lora_base_model_check": "false"}).engine.server.lora_base_model_check is False


def test_a_root_in_cloud_storage_is_copied_down_once_an_adapter_is_named(root, checkpoint, tmp_path):
    with GcsEmulator() as gcs, activated(gcs):
        gcs.upload_folder(root / "good", "adapters", "team/good")
        gcs.upload_folder(root / "other-model", "adapters", "team/other-model")
        found = AdapterRoot("gs://adapters/team/")
        cache = str(tmp_path / "cache")
        path = fetch_adapter(found, "good", str(checkpoint), 16, cache)
        assert Path(path, "adapter_model.safetensors").read_bytes() == (root / "good" / "adapter_model.safetensors"
                                                                        ).read_bytes()
        with pytest.raises(AdapterUnavailable, match="does not fit the model"):
            fetch_adapter(found, "other-model", str(checkpoint), 16, cache)
        with pytest.raises(AdapterUnavailable, match="no adapter at gs://adapters/team/missing"):
            fetch_adapter(found, "missing", str(checkpoint), 16, cache)
        assert root_problem(found, 15) == (None, None)
        problem, warning = root_problem(AdapterRoot("gs://adapters/nobody-here/"), 15)
        assert problem is None and "holds no adapter yet" in warning
    # make run checks on the user's machine, where a folder of the worker image is not: a warning, not a refusal
    problem, warning = root_problem(AdapterRoot(str(root / "good" / "adapter_config.json")), 15)
    assert problem is None and "is not a folder here" in warning


def test_a_cloud_storage_roots_copies_stay_within_their_disk_budget_least_recently_used_out_first(
        root, checkpoint, tmp_path):
    """Three adapters of one root, a budget that holds two: the third's copy deletes the least recently used
    copy that no slot holds (one a slot holds stays, even if older: the request waits and is tried again), a
    deleted one is copied again on its next use, and an adapter larger than the whole budget is a dead letter's
    reason, not a full disk. The sizes are the bucket's, read before anything is copied. What the server reads at
    every start (a lora_adapters adapter copied from under the same folder) is never counted or deleted, and
    neither is a folder copied from elsewhere; the used marker leaves the adapter's digest as it was."""
    size = sum(path.stat().st_size for path in (root / "good").iterdir())
    held: set[str] = set()
    with GcsEmulator() as gcs, activated(gcs):
        for name in ("a", "b", "c", "static"):
            gcs.upload_folder(root / "good", "adapters", f"team/{name}")
        cache = str(tmp_path / "cache")
        static = local_weights("gs://adapters/team/static", "adapter_config.json", cache)  # as lora_adapters copies
        foreign = Path(cache, "adapters", "team", "notes")
        foreign.mkdir(parents=True)
        (foreign / "big.bin").write_bytes(b"\0" * 10 * size)  # not the root's copy: neither counted nor deleted
        fetch = root_fetch(AdapterRoot("gs://adapters/team/"), model_folder=str(checkpoint), max_lora_rank=16,
                           cache_dir=cache, base_model=None, disk_gb=2.5 * size / 1e9, in_use=lambda: set(held),
                           keep=frozenset({static}))
        copies = Path(cache, "adapters", "team")

        def on_disk() -> set[str]:
            return {folder.name for folder in copies.iterdir() if (folder / "adapter_config.json").exists()} - {
                "static"}

        assert folder_digest(Path(fetch("a"))) == folder_digest(Path(static)), "the used marker is not the adapter's"
        time.sleep(0.05)
        fetch("b")
        assert on_disk() == {"a", "b"}
        time.sleep(0.05)
        fetch("a")  # used again: b is now the least recently used
        fetch("c")
        assert on_disk() == {"a", "c"}, "b, least recently used, made room"
        held.update({"a", "c"})  # both in slots now: the next copy may delete neither, and waits
        with pytest.raises(AdapterUnreadable, match="does not fit now beside the adapters held"):
            fetch("b")
        assert on_disk() == {"a", "c"}
        held.discard("a")
        assert Path(fetch("b"), "adapter_model.safetensors").is_file() and on_disk() == {"b", "c"}, "copied again"
        assert Path(static, "adapter_model.safetensors").is_file() and (foreign / "big.bin").is_file()
        big = tmp_path / "big"
        shutil.copytree(root / "good", big)
        (big / "padding.bin").write_bytes(b"\0" * int(0.7 * size))
        gcs.upload_folder(big, "adapters", "team/big")
        with pytest.raises(AdapterUnreadable, match="does not fit now beside the adapters held"):
            fetch("big")  # 1.7 copies beside c (held): deleting b, the one idle copy, would not make room
        assert on_disk() == {"b", "c"}, "no copy is deleted for an adapter that waits all the same"
        small = root_fetch(AdapterRoot("gs://adapters/team/"), model_folder=str(checkpoint), max_lora_rank=16,
                           cache_dir=str(tmp_path / "small"), base_model=None, disk_gb=size / 2e9,
                           in_use=lambda: set())
        with pytest.raises(AdapterUnavailable, match="more than the .* GB this worker keeps .*lora_adapter_disk_gb"):
            small("a")
        assert not Path(tmp_path, "small", "adapters", "team", "a", "adapter_model.safetensors").exists()


@pytest.fixture
def small_disk(tmp_path):
    """A 64 MB file system of its own (tmpfs), so that what is free on it is what the test writes."""
    folder = tmp_path / "disk"
    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64M", "tmpfs", str(folder)], capture_output=True).returncode:
        pytest.skip("this machine lets no test mount a file system of its own (tmpfs)")
    yield folder
    subprocess.run(["umount", str(folder)], check=True)


def test_without_a_budget_a_quarter_of_the_disk_is_kept_for_adapter_copies_within_what_it_has_free(small_disk):
    disk = AdapterDisk(small_disk / "copies", budget_bytes(0), in_use=set, source_of=str)
    total = shutil.disk_usage(small_disk).total
    assert disk.budget_bytes == int(total * DEFAULT_DISK_SHARE), "an empty disk: a quarter of it"
    (small_disk / "model.safetensors").write_bytes(bytes(50 * 2**20))  # the model's weights take most of it
    free = shutil.disk_usage(small_disk).free
    assert disk.budget_bytes == free - int(total * FREE_KEPT_SHARE) < int(total * DEFAULT_DISK_SHARE)
    # No copy to wait for: what the disk has free decides at once (a dead letter, never a wait to time out).
    with pytest.raises(AdapterTooLarge, match="this worker's disk has free for adapter copies now"):
        disk.room_for("big", int(total * DEFAULT_DISK_SHARE) - 1)
    disk.room_for("small", 2**20)  # what fits is taken
    (small_disk / "more.safetensors").write_bytes(bytes(free - 2**20))
    assert disk.budget_bytes == 0, "a disk with nothing to spare keeps nothing for copies"
    with pytest.raises(AdapterTooLarge, match="keeps for adapter copies"):  # more than a quarter of the disk: never
        disk.room_for("bigger", int(total * DEFAULT_DISK_SHARE) + 1)
    assert AdapterDisk(small_disk, budget_bytes(3), in_use=set, source_of=str).budget_bytes == 0, \
        "a budget stated larger than the disk has free is kept within what it has free"
    (small_disk / "more.safetensors").unlink()
    stated = AdapterDisk(small_disk / "stated", budget_bytes(0.01), in_use=set, source_of=str)
    assert stated.budget_bytes == 10**7, "a stated budget the disk has room for"
    assert AdapterDisk(small_disk / "stated", budget_bytes(3), in_use=set, source_of=str).budget_bytes == \
        shutil.disk_usage(small_disk).free - int(total * FREE_KEPT_SHARE)
    assert JobSettings.from_mapping({**BASE_CONFIG, "lora_adapter_root": "gs://my-bucket/adapters/",
                                     "lora_adapter_disk_gb": "40"}).engine.server.adapter_disk_gb == 40.0


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header=st.one_of(
    st.binary(max_size=64),
    st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                 lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                 max_leaves=12).map(lambda value: json.dumps(value).encode())),
       declared=st.one_of(st.none(), st.integers(0, 2**64 - 1)))
def test_any_weights_file_is_read_or_refused_with_a_reason(tmp_path, header, declared):
    """A hostile adapter folder cannot make the worker read a huge header or raise anything but a refusal."""
    path = tmp_path / "adapter_model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header) if declared is None else declared) + header)
    try:
        shapes = safetensors_shapes(path)
    except ValueError:
        return
    assert all(isinstance(size, int) for shape in shapes.values() for size in shape)


@pytest.mark.parametrize("base, served, matches", [
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", True),
    ("/home/me/models/SmolLM2-135M-Instruct/", "HuggingFaceTB/SmolLM2-135M-Instruct", True),  # trained on a copy
    ("/root/.cache/huggingface/hub/models--HuggingFaceTB--SmolLM2-135M-Instruct/snapshots/0a1b2c3d4e5f60718293",
     "HuggingFaceTB/SmolLM2-135M-Instruct", True),  # peft records the hub cache's folder
    ("gs://my-bucket/models/smollm2-135m-instruct", "gs://my-bucket/models/SmolLM2-135M-Instruct", True),
    ("Qwen/Qwen2.5-0.5B-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", False),
    ("someone-else/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", False),  # another org's model
    ("someone-else/SmolLM2-135M-Instruct", "/models/SmolLM2-135M-Instruct", True),  # a copy named by its folder
    ("./SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", True),  # relative paths peft records
    ("../SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", True),
    ("/data/model", "/models/model", False),  # a folder called 'model' says nothing of which
    ("/runs/7/checkpoint-500", "/models/checkpoint-500", False),
    ("/cache/snapshots/0a1b2c3d4e5f60718293", "/other/snapshots/0a1b2c3d4e5f60718293", False),
])
def test_the_base_an_adapter_names_is_matched_by_hub_id_cache_folder_or_a_models_folder_name(tmp_path, base,
                                                                                             served, matches):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": base}))
    problem = base_problem("a", adapter, served, None)
    assert (problem is None) is matches, problem


@pytest.mark.parametrize("config", [{}, {"base_model_name_or_path": None}, {"base_model_name_or_path": " "},
                                    {"base_model_name_or_path": 7}])
def test_an_adapter_that_names_no_base_model_is_refused_saying_how_to_serve_it(tmp_path, config):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 8, **config}))
    problem = base_problem("a", adapter, "HuggingFaceTB/SmolLM2-135M-Instruct", None)
    assert problem is not None and "names no base model" in problem and "lora_base_model_check=false" in problem


def test_a_copy_of_a_hub_model_in_cloud_storage_serves_adapters_trained_on_the_hub_id_once_lora_base_model_says_so(
        tmp_path):
    """Adapters trained on meta-llama/Llama-3.1-8B-Instruct, the job serving the bucket's copy of it: refused while
    nothing says the copy is that model (a config.json naming it, as older transformers wrote, is no proof: a
    fine-tune's names the model it was loaded from), served once lora_base_model names the hub id, whose org
    stays part of the name."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path":
                                                             "meta-llama/Llama-3.1-8B-Instruct"}))
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "config.json").write_text(json.dumps({"_name_or_path": "meta-llama/Llama-3.1-8B-Instruct"}))
    served = "gs://my-bucket/models/llama8b"
    refused = base_problem("a", adapter, served, str(copy))
    assert refused is not None and "set lora_base_model" in refused
    assert base_problem("a", adapter, served, str(copy), "meta-llama/Llama-3.1-8B-Instruct") is None
    assert base_problem("a", adapter, served, str(copy), "someone-else/Llama-3.1-8B-Instruct") is not None
    spec = JobSettings.from_mapping({**BASE_CONFIG, "model_gcs_folder": served, "lora_adapter_root": str(tmp_path),
                                     "lora_base_model": "meta-llama/Llama-3.1-8B-Instruct"}).engine.server
    assert (spec.model, spec.lora_base_model) == (served, "meta-llama/Llama-3.1-8B-Instruct")
