"""LoRA adapters a job serves: named in ``lora_adapters``, checked at launch, copied to each worker.

vLLM serves many LoRA adapters on one base model at once and picks one per
request by the name it is given as the request's ``model``; the template lets a
request name one in its ``adapter`` field. The set is fixed for the life of a
job and handed to vLLM at start (``--lora-modules``): a server the model manager
restarts gets the same set back, which vLLM's runtime loading would not give.

An adapter's location is read like the base model's: a ``gs://`` folder is
copied to the worker's disk once (:mod:`pipeline.serving.model_weights`), a folder on
the worker is checked, a Hugging Face hub id is left to vLLM to download. What
can be read before a job exists (the launcher runs the template's image, so a
folder in the image is there too) is checked at launch: above all each
adapter's rank against ``max_lora_rank``, which vLLM would otherwise refuse only
on every worker, after the server's start.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from google.api_core.exceptions import GoogleAPIError
from google.auth.exceptions import DefaultCredentialsError

from pipeline.contract.request_parsing import ADAPTER_NAME
from pipeline.serving.model_weights import (
    LOCAL_FOLDER_PREFIXES,
    WeightsError,
    local_weights,
    location_kind,
    parse_gcs_uri,
    storage_client,
)

LOGGER = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
# vLLM 0.32's accepted --max-lora-rank values (vllm/config/lora.py, MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# How long the launch check tries to read an adapter's config in Cloud Storage before it leaves the check to the
# worker: Storage's own retry goes on for 120 s, which stalled a launch whose Storage endpoint did not answer.
LAUNCH_READ_TIMEOUT_S = 15.0
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*$")


class AdapterError(ValueError):
    """An adapter that cannot be served as configured; the message says what to change."""


@dataclass(frozen=True)
class Adapter:
    """One adapter the job serves: the name requests use, and where its files are."""

    name: str
    location: str

    @property
    def kind(self) -> str:
        """'gcs', 'local' (a folder on the worker) or 'hub' (a Hugging Face hub id): see model_weights."""
        return location_kind(self.location)


def parse_adapters(text: str) -> tuple[Adapter, ...]:
    """``name=location,...`` as adapters; raises :class:`AdapterError` naming every problem at once."""
    adapters: list[Adapter] = []
    problems: list[str] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, equals, location = (piece.strip() for piece in item.partition("="))
        if not equals or not name or not location:
            problems.append(f"{item!r} is not name=location")
            continue
        if not ADAPTER_NAME.match(name):
            problems.append(f"adapter name {name!r} must be 1-64 letters, digits, '_', '.' or '-', "
                            "starting with a letter or digit")
        if any(existing.name == name for existing in adapters):
            problems.append(f"adapter name {name!r} is given twice")
        problems.extend(_location_problems(name, location))
        adapters.append(Adapter(name, location))
    if problems:
        raise AdapterError("; ".join(f"--lora_adapters: {problem}" for problem in problems))
    return tuple(adapters)


def _location_problems(name: str, location: str) -> list[str]:
    if "://" in location:
        if not location.startswith("gs://") or len(location) <= 5:
            scheme = location.split("://", 1)[0]
            return [f"adapter {name!r}: {scheme}:// is not a location the workers can read; use a gs:// folder, "
                    "a folder on the worker (/...) or a Hugging Face hub id (org/name)"]
        return []
    if location.startswith(LOCAL_FOLDER_PREFIXES) or _HUB_ID.match(location):
        return []
    return [f"adapter {name!r}: {location!r} is neither a gs:// folder, a folder on the worker (/...) "
            "nor a Hugging Face hub id (org/name)"]


def adapter_rank(config: dict) -> int:
    """The largest LoRA rank in a peft ``adapter_config.json`` (its ``r``, or a per-module rank above it)."""
    ranks = [config.get("r") or 0, *(config.get("rank_pattern") or {}).values()]
    return max(int(rank) for rank in ranks)


def rank_problem(adapter: Adapter, config: dict, max_lora_rank: int) -> str | None:
    rank = adapter_rank(config)
    if rank > max_lora_rank:
        return (f"adapter {adapter.name!r} has rank {rank}, above --max_lora_rank={max_lora_rank}: raise max_lora_rank "
                f"to {min(r for r in VLLM_LORA_RANKS if r >= rank)} (it reserves memory for that rank in every slot)")
    return None


def read_adapter_config(adapter: Adapter) -> dict | None:
    """The adapter's ``adapter_config.json`` where it can be read from here, else None (a hub id, say); a Cloud
    Storage read gives up after :data:`LAUNCH_READ_TIMEOUT_S`."""
    if adapter.kind == "local":
        path = Path(adapter.location).expanduser() / ADAPTER_CONFIG
        if not path.is_file():
            return None
        return json.loads(path.read_text(encoding="utf-8"))
    if adapter.kind == "gcs":
        from google.cloud.storage.retry import DEFAULT_RETRY

        bucket, prefix = parse_gcs_uri(adapter.location)
        blob = storage_client().bucket(bucket).blob(prefix + ADAPTER_CONFIG)
        bounded = {"timeout": LAUNCH_READ_TIMEOUT_S, "retry": DEFAULT_RETRY.with_timeout(LAUNCH_READ_TIMEOUT_S)}
        if not blob.exists(**bounded):
            raise AdapterError(f"adapter {adapter.name!r}: {adapter.location} has no {ADAPTER_CONFIG} at its top "
                               "level; point it at a folder saved by peft (save_pretrained)")
        return json.loads(blob.download_as_text(**bounded))
    return None


def launch_problems(adapters: tuple[Adapter, ...], max_lora_rank: int) -> list[str]:
    """What would stop every worker's server, read before the job exists; a location not readable here is skipped."""
    problems = []
    for adapter in adapters:
        try:
            config = read_adapter_config(adapter)
        except AdapterError as exc:
            problems.append(str(exc))
            continue
        except (DefaultCredentialsError, GoogleAPIError, OSError) as exc:  # no credentials or no network here
            LOGGER.warning("Adapter %r: %s cannot be read from here (%s); the worker checks it when it starts",
                           adapter.name, adapter.location, type(exc).__name__)
            continue
        if config is None:
            if adapter.kind == "local":
                LOGGER.warning("Adapter %r: %s is not on this machine; the worker checks it when it starts",
                               adapter.name, adapter.location)
            continue
        problem = rank_problem(adapter, config, max_lora_rank)
        if problem:
            problems.append(problem)
    return problems


def resolve_adapter(adapter: Adapter, max_lora_rank: int, cache_dir: str | None = None) -> str:
    """A location vLLM can load on this worker (a gs:// folder copied down), checked where it can be read."""
    try:
        location = local_weights(adapter.location, ADAPTER_CONFIG, cache_dir)
    except WeightsError as exc:
        raise AdapterError(f"adapter {adapter.name!r}: {exc}; point it at a folder saved by peft "
                           "(save_pretrained)") from None
    if adapter.kind != "hub":
        problem = rank_problem(adapter, json.loads((Path(location) / ADAPTER_CONFIG).read_text("utf-8")),
                               max_lora_rank)
        if problem:
            raise AdapterError(problem)
    return location
