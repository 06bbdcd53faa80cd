"""Model weights from gs://, against a local Cloud Storage emulator; and a managed server's start from them, with
the Hugging Face token."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from google.api_core.exceptions import RetryError
from hypothesis import given, settings
from hypothesis import strategies as st

from local.emulators import GcsEmulator
from pipeline.serving import model_weights
from pipeline.serving.lineage import model_lineage
from pipeline.serving.model_access import HF_TOKEN_ENV, install_hf_token
from pipeline.serving.model_weights import (
    WeightsError,
    copy_path,
    download_gcs_folder,
    downloaded_generations,
    parse_gcs_uri,
    storage_client,
)
from pipeline.serving.vllm_server import VLLMServer, free_port
from tests.conftest import activated, chat, local_server_spec, process_tree, started
from tests.secret_manager_stand_in import SECRET, TOKEN


@pytest.fixture(scope="module")
def gcs():
    with GcsEmulator() as emulator, activated(emulator):
        yield emulator


@pytest.mark.parametrize("uri, expected", [
    ("gs://bucket/models/m", ("bucket", "models/m/")),
    ("gs://bucket/models/m/", ("bucket", "models/m/")),
    ("gs://bucket", ("bucket", "")),
])
def test_gcs_uris_are_split_into_bucket_and_folder(uri, expected):
    assert parse_gcs_uri(uri) == expected


@pytest.mark.parametrize("uri", ["s3://bucket/x", "gs://", "bucket/x", "gs://../x", "gs://Bucket/x", "gs://b/x",
                                 "gs://bucket/a/../../x", "gs://bucket/a//b", "gs://bucket/./a", "gs://bucket/a\nb"])
def test_other_uris_are_refused(uri):
    with pytest.raises(ValueError):
        parse_gcs_uri(uri)


# Object names and folders as hostile as Cloud Storage allows: any text, weighted towards the parts that matter.
_PARTS = st.sampled_from(["..", ".", "", "a", "config.json", ".download-complete", ".download.lock", "\\", "\x00",
                          "~", "b c", "\n"])
_NAMES = st.one_of(st.text(max_size=40), st.lists(st.one_of(_PARTS, st.text(max_size=6)), max_size=6).map("/".join))


def _inside(path: os.PathLike[str], folder: os.PathLike[str]) -> bool:
    path, folder = os.path.normpath(path), os.path.normpath(folder)
    return os.path.commonpath([path, folder]) == folder and path != folder


@settings(max_examples=2000, deadline=None)
@given(name=_NAMES)
def test_no_object_name_is_copied_outside_its_folder_or_over_the_copys_records(tmp_path_factory, name):
    copy = tmp_path_factory.getbasetemp() / "copy"
    try:
        path = copy_path(copy, name)
    except WeightsError:
        return
    assert _inside(path, copy), name
    assert os.path.relpath(os.path.normpath(path), copy) not in (".download-complete", ".download.lock"), name
    assert path == copy / name, "a name that is refused nowhere is copied as it is named"


@settings(max_examples=2000, deadline=None)
@given(rest=_NAMES)
def test_no_gs_uri_names_a_copy_outside_the_cache(tmp_path_factory, rest):
    cache = tmp_path_factory.getbasetemp() / "cache"
    try:
        bucket, prefix = parse_gcs_uri(f"gs://{rest}")
    except ValueError:
        return
    assert _inside(cache / bucket / prefix, cache), rest
    assert prefix == "" or (prefix.endswith("/") and not prefix.startswith("/")), prefix


def test_a_folder_is_copied_once_with_its_structure_and_again_when_its_objects_change(gcs, tmp_path):
    source = tmp_path / "src"
    (source / "sub").mkdir(parents=True)
    (source / "config.json").write_text('{"model_type": "llama"}')
    (source / "sub" / "weights.bin").write_bytes(os.urandom(300_000))
    (source / "extra.txt").write_text("removed later")
    uri = gcs.upload_folder(source, "weights", "models/tiny")
    local = download_gcs_folder(uri, tmp_path / "cache")
    assert (local / "config.json").read_text() == '{"model_type": "llama"}'
    assert (local / "sub" / "weights.bin").read_bytes() == (source / "sub" / "weights.bin").read_bytes()
    # Another worker process finds the complete copy of the same objects and does not copy them again.
    (local / "config.json").write_text("the copy made earlier")
    assert download_gcs_folder(uri, tmp_path / "cache") == local
    assert (local / "config.json").read_text() == "the copy made earlier"
    # The folder rewritten in place: the next start copies what it holds now, and what it no longer holds goes.
    bucket = storage_client().bucket("weights")
    bucket.blob("models/tiny/config.json").upload_from_string('{"model_type": "qwen2"}')
    bucket.blob("models/tiny/extra.txt").delete()
    assert download_gcs_folder(uri, tmp_path / "cache") == local
    assert (local / "config.json").read_text() == '{"model_type": "qwen2"}'
    assert not (local / "extra.txt").exists()


def test_a_folder_that_cannot_be_listed_is_served_from_the_copy_made_earlier(gcs, tmp_path, monkeypatch):
    source = tmp_path / "src"
    source.mkdir()
    (source / "config.json").write_text("{}")
    uri = gcs.upload_folder(source, "weights", "models/unlisted")
    local = download_gcs_folder(uri, tmp_path / "cache")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{free_port()}")  # nothing answers there
    monkeypatch.setattr(model_weights, "LISTING_DEADLINE_S", 2.0)
    assert download_gcs_folder(uri, tmp_path / "cache") == local
    with pytest.raises(RetryError, match="Timeout of 2.0s"):  # no copy to serve: the listing's own error
        download_gcs_folder(uri, tmp_path / "no-copy")


def test_a_copied_folder_is_named_by_the_generations_of_the_objects_it_was_copied_from(gcs, tmp_path):
    """Rewriting an object gives it a new generation: a worker that copies the folder after the rewrite records
    another revision, though the folder's name is the same (pipeline.serving.lineage)."""
    source = tmp_path / "src"
    source.mkdir()
    (source / "config.json").write_text('{"model_type": "llama"}')
    (source / "model.safetensors").write_bytes(b"\0" * 1000)
    uri = gcs.upload_folder(source, "weights", "models/versioned")
    first = download_gcs_folder(uri, tmp_path / "cache-1")
    blobs = {blob.name: blob.generation for blob in storage_client().list_blobs("weights", prefix="models/versioned/")}
    assert downloaded_generations(first) == {name.removeprefix("models/versioned/"): generation
                                             for name, generation in blobs.items()}
    before = model_lineage(uri, str(first))
    assert before.revision is not None and before.config is not None

    storage_client().bucket("weights").blob("models/versioned/model.safetensors").upload_from_string(b"\1" * 1000)
    after = model_lineage(uri, str(download_gcs_folder(uri, tmp_path / "cache-2")))
    assert after.revision != before.revision, "same name, new weights: another revision"
    assert after.config == before.config, "config.json did not change"
    assert downloaded_generations(tmp_path) is None, "not a folder the download copied"


def test_a_folder_without_a_checkpoint_is_reported(gcs, tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    (source / "README.md").write_text("not a model")
    uri = gcs.upload_folder(source, "weights", "models/not-a-model")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        download_gcs_folder(uri, tmp_path / "cache")
    with pytest.raises(FileNotFoundError, match="no objects under"):
        download_gcs_folder("gs://weights/models/missing", tmp_path / "cache")


def test_a_folder_with_an_object_named_to_climb_out_of_it_is_refused_and_nothing_is_copied(gcs, tmp_path):
    """Object names are any string. 'models/evil//<an absolute path>' is, below the folder, an absolute path: joined
    to the copy's folder it names that path itself, so the copy would write wherever the name says. ('..' parts
    climb out as well; the emulator cannot store them, the fuzzer above covers them.)"""
    source = tmp_path / "src"
    source.mkdir()
    (source / "config.json").write_text("{}")
    uri = gcs.upload_folder(source, "weights", "models/evil")
    outside = tmp_path / "outside" / "escape.txt"
    storage_client().bucket("weights").blob(f"models/evil/{outside}").upload_from_string(b"written outside")
    with pytest.raises(WeightsError, match="escape.txt"):
        download_gcs_folder(uri, tmp_path / "cache")
    assert not outside.exists()
    assert [p.name for p in (tmp_path / "cache").rglob("*") if p.is_file()] == [".download.lock"], "nothing copied"


@pytest.mark.engine
def test_the_managed_vllm_server_serves_weights_from_gcs_with_the_token_in_its_environment_never_its_log(
        gcs, secret_manager, checkpoint, tmp_path, caplog):
    """A worker's start, as on Dataflow: the token read once from Secret Manager (tests/test_model_access.py
    proves the read), the weights copied from gs://, and every process of the server given the token while
    neither its log nor ours shows it."""
    caplog.set_level(logging.DEBUG)
    install_hf_token(SECRET, secret_manager.client())  # as the worker's first reader does, once per process
    uri = gcs.upload_folder(checkpoint, "models", "smollm2-135m")
    lines: list[str] = []
    spec = local_server_spec(checkpoint, model=uri, model_cache_dir=str(tmp_path / "cache"), hf_token_secret=SECRET)
    with started(VLLMServer(spec, log_sink=lines.append)) as server:
        environments = [Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") for pid in process_tree(server)]
        assert all(f"{HF_TOKEN_ENV}={TOKEN}".encode() in environment for environment in environments)
        answer = chat(server.base_url, "What is the capital of France?", temperature=0, max_tokens=20)
        assert "Paris" in answer["choices"][0]["message"]["content"]
        assert (tmp_path / "cache" / "models" / "smollm2-135m" / "model.safetensors").is_file()
    assert secret_manager.requests == [SECRET]  # the server's start read nothing again
    assert lines and not any(TOKEN in line for line in lines) and TOKEN not in caplog.text
