"""Getting at the weights: the Hugging Face token from Secret Manager (its stand-in:
tests/secret_manager_stand_in.py), and a failed fetch explained. The managed vLLM server's start with the token
is proved in tests/test_model_weights.py, on the start that fetches its weights from Cloud Storage.
"""

from __future__ import annotations

import logging
import os

import pytest

from pipeline.serving.model_access import (
    HF_TOKEN_ENV,
    ModelAccessError,
    explained_fetch,
    fetch_failure,
    install_hf_token,
)
from tests.secret_manager_stand_in import SECRET, TOKEN


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
