"""Getting at the weights: the Hugging Face token from Secret Manager, and a failed fetch explained.

Secret Manager has no emulator; its REST API is served here by a loopback stand-in that answers
``versions:access`` as the API reference documents it
(https://cloud.google.com/secret-manager/docs/reference/rest/v1/projects.secrets.versions/access), and the real
client library (``google-cloud-secret-manager``, REST transport) talks to it.
"""

from __future__ import annotations

import base64
import logging
import os
from pathlib import Path

import pytest
from google.auth.credentials import AnonymousCredentials
from google.cloud import secretmanager

from pipeline.serving import model_access
from pipeline.serving.model_access import (
    HF_TOKEN_ENV,
    ModelAccessError,
    explained_fetch,
    fetch_failure,
    install_hf_token,
)
from pipeline.serving.vllm_server import VLLMServer
from tests.conftest import local_server_spec, process_tree, started
from tests.loopback_api import LoopbackApi

TOKEN = "hf_streamingLLMtestToken0123456789"


class SecretManagerStandIn:
    """Answers GET .../versions/V:access with the payload set for that name; 404 otherwise."""

    def __init__(self, secrets: dict[str, str]) -> None:
        self.secrets = secrets
        self.requests: list[str] = []
        self.api = LoopbackApi(self.access)

    def access(self, method: str, path: str, headers, body: bytes) -> tuple[int, dict]:
        name = path.split("?")[0].removeprefix("/v1/").removesuffix(":access")
        self.requests.append(name)
        if method == "GET" and name in self.secrets:
            return 200, {"name": name, "payload": {"data": base64.b64encode(self.secrets[name].encode()).decode()}}
        return 404, {"error": {"code": 404, "message": f"Secret Version [{name}] not found.", "status": "NOT_FOUND"}}

    def client(self) -> secretmanager.SecretManagerServiceClient:
        return secretmanager.SecretManagerServiceClient(
            transport="rest", credentials=AnonymousCredentials(), client_options={"api_endpoint": self.api.url})

    def close(self) -> None:
        self.api.close()


SECRET = "projects/my-project/secrets/hf-token/versions/latest"


@pytest.fixture
def secret_manager(monkeypatch):
    monkeypatch.delenv(HF_TOKEN_ENV, raising=False)
    monkeypatch.setattr(model_access, "_installed", {})  # a fresh worker process: nothing read yet
    stand_in = SecretManagerStandIn({SECRET: TOKEN + "\n"})
    yield stand_in
    stand_in.close()


def test_the_token_is_read_once_per_process_into_the_environment_and_never_logged(secret_manager, caplog):
    caplog.set_level(logging.DEBUG)
    client = secret_manager.client()
    install_hf_token(SECRET, client)
    install_hf_token(SECRET, client)
    assert os.environ[HF_TOKEN_ENV] == TOKEN  # the trailing newline of `echo ... | gcloud secrets create` is gone
    assert secret_manager.requests == [SECRET]
    assert SECRET in caplog.text and TOKEN not in caplog.text


def test_an_unreadable_secret_names_the_secret_and_the_role_not_the_token(secret_manager, caplog):
    missing = "projects/my-project/secrets/nope/versions/1"
    with pytest.raises(ModelAccessError) as excinfo:
        install_hf_token(missing, secret_manager.client())
    assert missing in str(excinfo.value) and "roles/secretmanager.secretAccessor" in str(excinfo.value)
    assert HF_TOKEN_ENV not in os.environ


@pytest.mark.parametrize("error, cause", [
    ("GatedRepoError: 401 Client Error. Cannot access gated repo for url https://huggingface.co/google/gemma-2-2b-it",
     "set hf_token_secret"),
    ("OSError: You are trying to access a gated repo. Access to model google/gemma-2-2b-it is restricted.",
     "set hf_token_secret"),
    ("HTTPError: 403 Client Error: Forbidden for url: https://huggingface.co/meta-llama/Llama-3.1-8B",
     "accept the model's licence"),
    ("RepositoryNotFoundError: 404 Client Error. Repository Not Found for url: https://huggingface.co/api/models/x/y",
     "check the spelling"),
    ("OSError: qwen/nope is not a local folder and is not a valid model identifier listed on https://huggingface.co",
     "check the spelling"),
    ("ConnectionError: HTTPSConnectionPool(host='huggingface.co', port=443): Max retries exceeded with url",
     "Cloud NAT"),
    ("LocalEntryNotFoundError: An error happened while trying to locate the file on the Hub", "Cloud NAT"),
])
def test_each_fetch_failure_is_named_with_its_fix(error, cause):
    assert cause in fetch_failure(error)


def test_an_unrelated_error_is_not_dressed_as_a_fetch_failure():
    assert fetch_failure("ValueError: max_model_len (4096) is larger than the model's 2048") is None
    with pytest.raises(ValueError, match="larger than"):
        with explained_fetch("m"):
            raise ValueError("max_model_len (4096) is larger than the model's 2048")
    with pytest.raises(ModelAccessError, match="m could not be fetched: .*Cloud NAT"):
        with explained_fetch("m"):
            raise OSError("Temporary failure in name resolution")


def test_the_real_tokenizer_without_a_route_to_the_hub_says_so(monkeypatch):
    """transformers offline, as a worker without a route to huggingface.co ends up: the message names the fix."""
    from pipeline.intake.prompt_length import TokenizerMeter

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelAccessError, match="cannot reach huggingface.co.*Cloud NAT"):
        TokenizerMeter("streaming-llm-tests/not-in-any-cache", "chat")


@pytest.mark.engine
def test_the_managed_vllm_server_gets_the_token_in_its_environment_and_never_in_its_log(
        secret_manager, checkpoint: Path, caplog):
    caplog.set_level(logging.DEBUG)
    install_hf_token(SECRET, secret_manager.client())  # as the worker's first reader does, once per process
    lines: list[str] = []
    with started(VLLMServer(local_server_spec(checkpoint, hf_token_secret=SECRET), log_sink=lines.append)) as server:
        environments = [Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") for pid in process_tree(server)]
        assert all(f"{HF_TOKEN_ENV}={TOKEN}".encode() in environment for environment in environments)
    assert secret_manager.requests == [SECRET]  # the server's start read nothing again
    assert lines and not any(TOKEN in line for line in lines) and TOKEN not in caplog.text
