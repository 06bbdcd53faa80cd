"""Getting at the weights: a Hugging Face token from Secret Manager, and what a failed fetch means.

Gated models (Gemma, Llama, ...) download only with a token from an account that accepted the model's
licence. ``hf_token_secret`` names a Secret Manager secret version holding one; each worker process reads
it once and puts it in its own environment as ``HF_TOKEN``, which the tokenizer (``huggingface_hub``) and
the vLLM server it starts (a child, so it inherits the environment) read. The token is never logged and
never written to disk or into the job's options: only the secret's name travels.

A fetch that fails (no token, a token without access, no route to the hub, a misspelt id) surfaces as a
library's exception text or a vLLM log tail; :func:`fetch_failure` turns that into one sentence naming
the cause and the fix, so a worker's log says why it serves nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
from collections.abc import Iterator
from typing import Any

from pipeline.serving.model_weights import WeightsError, local_weights

LOGGER = logging.getLogger(__name__)
HF_TOKEN_ENV = "HF_TOKEN"

# Model families whose Hugging Face repositories are gated (a licence to accept before any download).
GATED_FAMILIES = ("google/gemma", "meta-llama/", "mistralai/", "google/medgemma", "google/codegemma")

# Per process: the token secret versions already read into this process's environment (read once; a cache).
_installed: dict[str, bool] = {}
_lock = threading.Lock()


def read_secret(version: str, client: Any = None) -> str:
    """The text of a Secret Manager secret version (``projects/P/secrets/S/versions/V``)."""
    if client is None:
        from google.cloud import secretmanager

        client = secretmanager.SecretManagerServiceClient()
    return client.access_secret_version(name=version).payload.data.decode("utf-8").strip()


def install_hf_token(version: str | None, client: Any = None) -> None:
    """Reads the token once per process and sets ``HF_TOKEN`` for this process and what it starts.

    Raises :class:`ModelAccessError` naming the secret (never its value) when it cannot be read.
    """
    if not version:
        return
    with _lock:
        if _installed.get(version):
            return
        try:
            token = read_secret(version, client)
        except Exception as exc:  # the client's own error types vary by transport; the message says which
            raise ModelAccessError(
                f"the Hugging Face token in {version} could not be read ({type(exc).__name__}: {exc}); give the "
                "workers' service account roles/secretmanager.secretAccessor on that secret, and check the name"
            ) from None
        if not token:
            raise ModelAccessError(f"the secret {version} is empty: add a version holding the Hugging Face token")
        os.environ[HF_TOKEN_ENV] = token
        _installed[version] = True
        LOGGER.info("Hugging Face token read from %s", version)


class ModelAccessError(RuntimeError):
    """The weights cannot be fetched; the message names the cause and the fix."""


# (pattern in an exception text or log tail, cause and fix); the first that matches wins.
_FAILURES = (
    (r"GatedRepoError|\b401\b|Unauthorized|Access to model .* is restricted|must be authenticated",
     "the model is gated on Hugging Face and no accepted token reached the worker: set hf_token_secret to a "
     "Secret Manager secret version holding a token of an account that accepted the model's licence, or serve a "
     "copy from model_gcs_folder"),
    (r"\b403\b|Forbidden|not in the authorized list|awaiting a review",
     "the Hugging Face token has no access to this model: accept the model's licence on huggingface.co with the "
     "token's account (approval can take a while), or use a token of an account that has"),
    (r"RepositoryNotFoundError|\b404\b|is not a valid model identifier|does not appear to have a file named config",
     "no model by that id on Hugging Face (check the spelling; a private repository also needs hf_token_secret)"),
    (r"LocalEntryNotFoundError|ConnectionError|ConnectTimeout|NameResolutionError|Temporary failure in name "
     r"resolution|Max retries exceeded|Network is unreachable|offline mode",
     "the worker cannot reach huggingface.co: workers without external IP addresses need Cloud NAT on their "
     "subnetwork for hub downloads; or copy the checkpoint to Cloud Storage and set model_gcs_folder, or bake it "
     "into the image (BAKE_MODEL)"),
)


def fetch_failure(text: str) -> str | None:
    """The cause and fix of a failed model fetch, read from an error or log text; None when it is not one."""
    for pattern, explanation in _FAILURES:
        if re.search(pattern, text):
            return explanation
    return None


@contextlib.contextmanager
def explained_fetch(model: str) -> Iterator[None]:
    """Re-raises a failed fetch of ``model`` as :class:`ModelAccessError` with its cause and fix, where known."""
    try:
        yield
    except ModelAccessError:
        raise
    except Exception as exc:
        cause = fetch_failure(f"{type(exc).__name__}: {exc}")
        if cause is None:
            raise
        raise ModelAccessError(f"{model} could not be fetched: {cause} ({type(exc).__name__}: {exc})") from exc


def resolve_model(model: str, cache_dir: str | None = None, hf_token_secret: str | None = None) -> str:
    """A path or hub id the tokenizer, transformers and vLLM can load: the token installed, a local folder checked,
    a gs:// folder copied down (once per worker)."""
    install_hf_token(hf_token_secret)
    try:
        return local_weights(model, "config.json", cache_dir)
    except WeightsError as exc:
        raise ModelAccessError(f"model directory {exc}; point --model at a Hugging Face checkpoint folder") from None


def gated_model_warning(model: str, model_gcs_folder: str | None, hf_token_secret: str | None) -> str | None:
    """A launch warning for a known gated family fetched from the hub without a token."""
    if model_gcs_folder or hf_token_secret or model.startswith(("gs://", "/", "./", "~")):
        return None
    if model.lower().startswith(GATED_FAMILIES):
        return (f"{model} is gated on Hugging Face and no hf_token_secret is set: the workers' download will be "
                "refused (401). Set hf_token_secret=projects/P/secrets/S/versions/latest (a token of an account that "
                "accepted the licence), or model_gcs_folder=gs://... with a copy of the checkpoint")
    return None
