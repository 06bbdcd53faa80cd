"""What produced an answer: the weights, the engine, the image, the settings and the sampling, on every completion.

A data team that finds a bad label in a table a month later must be able to tell what produced it, and produce it
again. A hub id or a ``gs://`` folder only names weights that may have changed since, so the worker records what
the name resolved to when it loaded them: a hub id's commit (from the Hugging Face cache the loader filled), a
``gs://`` folder's object generations (which the download keeps:
:func:`~pipeline.serving.model_weights.downloaded_generations`), and digests of the files that shape every
answer (the model's ``config.json`` and ``generation_config.json``, whose defaults apply to every sampling field a
request leaves out, the chat template, an adapter's files).

The serving part is read once per engine (:class:`ServingLineage`), the sampling part per request
(:meth:`ServingLineage.record`). A request that samples (temperature unset or above 0) and names no seed gets one
drawn from its id (:func:`seed_for`): a retried stream samples the same way, and the recorded seed, sent again with
the same request, gives the same text on the same engine and server settings as long as the batch it runs in does
not change what the model computes (docs/contract.md#lineage). A greedy request needs none and gets none.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.contract.messages import InferenceRequest
from pipeline.contract.request_fields import ENGINE_VLLM, recorded_in_lineage
from pipeline.serving.model_weights import GCS, HUB, downloaded_generations, location_kind

DIGEST_CHARS = 16  # hex characters of sha256 kept: enough to tell versions apart, short enough for every row
CHAT_TEMPLATE_FILE = "chat_template.jinja"
SEED_BITS = 31  # vLLM takes any int: 31 bits stay a positive 32-bit int in every client and column
DIGEST_BLOCK_BYTES = 1 << 20  # how much of a file a digest reads at once
# Per process: each folder's digest, with the signature (names, sizes, times) of the files it was computed over.
_FOLDER_DIGESTS: dict[str, tuple[tuple[tuple[str, int, int], ...], str]] = {}
_DIGESTS_LOCK = threading.Lock()


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()[:DIGEST_CHARS]


def file_digest(path: Path) -> str | None:
    try:
        return digest(path.read_bytes())
    except OSError:
        return None


def folder_digest(folder: Path) -> str | None:
    """One digest of every file under ``folder`` (names and contents; this code's markers left out): an adapter's
    identity. Files are read a block at a time (an adapter may be gigabytes), and a copy's digest is computed once:
    it is kept for as long as its files' names, sizes and times stay the same. Call it off an event loop."""
    if not folder.is_dir():
        return None
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith(".download"))
    try:
        signature = tuple((str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    except OSError:
        return None
    with _DIGESTS_LOCK:
        known = _FOLDER_DIGESTS.get(str(folder))
    if known is not None and known[0] == signature:
        return known[1]
    hasher = hashlib.sha256()
    try:
        for path in files:
            hasher.update(str(path.relative_to(folder)).encode() + b"\0")
            with path.open("rb") as data:
                while block := data.read(DIGEST_BLOCK_BYTES):
                    hasher.update(block)
    except OSError:  # a file went while it was read: no digest, rather than an adapter loaded and not counted
        return None
    found = "sha256:" + hasher.hexdigest()[:DIGEST_CHARS]
    with _DIGESTS_LOCK:
        _FOLDER_DIGESTS[str(folder)] = (signature, found)
    return found


@dataclass(frozen=True)
class WeightsLineage:
    """A model's or an adapter's weights as this worker loaded them."""

    source: str  # as configured: a hub id, a gs:// folder, a folder on the worker
    revision: str | None  # a hub id's commit; a gs:// folder's generations digest; None for a local folder
    config: str | None  # the digest of config.json (a model) or of every file (an adapter)
    generation_config: str | None = None  # a model's sampling defaults (generation_config.json)

    def to_dict(self) -> dict[str, Any]:
        return {name: value for name, value in dataclasses.asdict(self).items() if value is not None}


def _hub_snapshot(repo_id: str, revision: str | None = None) -> Path | None:
    """The cached snapshot folder a hub id resolved to at ``revision`` (a commit, branch or tag; None: main), whose
    name is the commit, or None when it is not cached."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "config.json", revision=revision)
        if not isinstance(found, str):
            found = try_to_load_from_cache(repo_id, "adapter_config.json", revision=revision)
    except ValueError:  # not a hub id at all (a server_url's served name, say)
        return None
    return Path(found).parent if isinstance(found, str) else None


def weights_folder(location: str, loaded_from: str | None,
                   revision: str | None = None) -> tuple[Path | None, str | None]:
    """The folder the weights were read from on this worker, and their revision (see :class:`WeightsLineage`); a
    hub id's at the ``revision`` its server loaded (None: main)."""
    kind = location_kind(location)
    if kind == HUB:
        snapshot = _hub_snapshot(location, revision)
        return snapshot, snapshot.name if snapshot is not None else None
    folder = Path(loaded_from or location).expanduser()
    if kind == GCS:
        generations = downloaded_generations(folder)
        revision = None if generations is None else digest(json.dumps(sorted(generations.items())).encode())
        return folder, revision
    return folder, None


def model_lineage(location: str, loaded_from: str | None, pinned: str | None = None) -> WeightsLineage:
    folder, revision = weights_folder(location, loaded_from, pinned)
    if folder is None:
        return WeightsLineage(location, revision, None)
    return WeightsLineage(location, revision, file_digest(folder / "config.json"),
                          file_digest(folder / "generation_config.json"))


def adapter_lineage(location: str, loaded_from: str | None) -> WeightsLineage:
    folder, revision = weights_folder(location, loaded_from)
    return WeightsLineage(location, revision, None if folder is None else folder_digest(folder))


def chat_template_digest(model_location: str, loaded_from: str | None, revision: str | None = None,
                         template_file: str | None = None) -> str | None:
    """The digest of the chat template the server formats chat requests with: the file its ``--chat-template``
    names (``template_file``), else the model's (at ``revision``) ``chat_template.jinja``, else the
    ``chat_template`` of its ``tokenizer_config.json``."""
    if template_file is not None:  # a file's path, or (as vLLM takes it too) the template itself
        with contextlib.suppress(OSError):
            if Path(template_file).is_file():
                return file_digest(Path(template_file))
        return digest(template_file.encode())
    folder, _ = weights_folder(model_location, loaded_from, revision)
    if folder is None:
        return None
    found = file_digest(folder / CHAT_TEMPLATE_FILE)
    if found is not None:
        return found
    try:
        template = json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None
    return digest(json.dumps(template).encode()) if template else None


def seed_for(request: InferenceRequest) -> int | None:
    """The seed a request is sampled with: its own, else (when it samples at all) one drawn from its id."""
    if request.seed is not None:
        return request.seed
    if request.temperature is not None and request.temperature <= 0:
        return None
    return int.from_bytes(hashlib.sha256(request.id.encode()).digest()[:8], "big") % (1 << SEED_BITS)


@dataclass(frozen=True)
class ServingLineage:
    """What every answer of one engine shares; :meth:`record` adds a request's own part."""

    model: WeightsLineage
    engine: str  # the engine and its version as it reports itself: "vllm 0.32.0", "transformers 5.19.0"
    image: str | None  # the worker image the job runs (sdk_container_image); None on a local run
    settings: Mapping[str, Any]  # the server settings that change answers
    adapters: dict[str, WeightsLineage] = field(default_factory=dict)  # grows as a root's adapters are loaded
    kind: str = ENGINE_VLLM  # which engine: its lineage records only the request fields it applies

    def cache_salt(self, adapter: str | None) -> str | None:
        """What a request of ``adapter`` salts its cached prefix blocks with: the digest of its files. vLLM keys the
        blocks by an adapter's name and path, not its weights, and a root's adapter copied again after it changed
        loads under the same name and path (vllm/v1/core/kv_cache_utils.py)."""
        found = self.adapters.get(adapter) if adapter else None
        return found.config if found is not None else None

    def record(self, request: InferenceRequest) -> dict[str, Any]:
        """The completion's ``lineage``: this engine's part, the request's adapter and its sampling as applied
        (None: the model's default from generation_config.json)."""
        sampling: dict[str, Any] = {}
        for name in recorded_in_lineage(self.kind):  # the table's, as this engine applies them
            value = getattr(request, name)
            if name == "stop":
                value = list(value) if value else None
            elif name == "seed":
                value = seed_for(request)
            elif name == "response_format" and value is not None:
                value = digest(json.dumps(value, sort_keys=True).encode())
            sampling[name] = value
        adapter = self.adapters.get(request.adapter) if request.adapter else None
        return {"model": self.model.to_dict(),
                "adapter": None if request.adapter is None else
                {"name": request.adapter, **(adapter.to_dict() if adapter else {})},
                "engine": self.engine, "image": self.image,
                "settings": {name: value for name, value in self.settings.items() if value is not None},
                "sampling": {name: value for name, value in sampling.items() if value is not None}}


# What a managed vLLM's engine says it runs with that changes answers (its configuration line): the numeric path
# (dtype, quantization, KV cache dtype, eager or compiled, the device: cpu or cuda, the build that runs), how the
# model is split (tensor_parallel_size) and whether prefixes are computed once and reused.
LOADED_SETTINGS = ("dtype", "quantization", "kv_cache_dtype", "enforce_eager", "device_config", "tensor_parallel_size",
                   "enable_prefix_caching")
# The template's own server arguments that change answers and are not read from the engine's configuration line:
# the KV cache's share of GPU memory (how many requests share a step, and vLLM's answers depend on their company),
# and the LoRA slots (on the CPU build a request's answer depends on the last slot: pipeline.serving.vllm_server).
TEMPLATE_ANSWER_FLAGS = ("--gpu-memory-utilization", "--enable-lora", "--max-lora-rank", "--max-loras")
# Server arguments whose values are secrets, never recorded.
_SECRET_FLAG = re.compile(r"api[-_]?key|secret|password|hf[-_]token|access[-_]token", re.IGNORECASE)


def server_lineage(cards: Mapping[str, Mapping[str, Any]], model_name: str, version: Any, *, model: str | None,
                   adapters: Mapping[str, str], prompt_format: str, image: str | None,
                   server_args: Sequence[str] = (), loaded: Mapping[str, str] | None = None,
                   command: Sequence[str] = ()) -> ServingLineage:
    """An OpenAI-compatible server's lineage from what it says itself: ``cards`` (``/v1/models`` by id: the folder
    or hub id each model and adapter was read from), ``version`` (``/version``), and for a managed vLLM what its
    engine logged it loaded (``loaded``: the revision, the dtype it resolved, quantization, KV cache dtype:
    :func:`~pipeline.serving.vllm_server.loaded_config`) and the arguments beyond the template's own that it was
    started with (``server_args``: ``vllm_args``, and the structured-output defaults the template adds; secrets left
    out). ``model`` and ``adapters`` (name -> location) are a managed server's configured sources; ``command``, the
    server's command line, says the dtype and revision asked for where its engine's line was not seen, and the
    template's own arguments that change answers (:data:`TEMPLATE_ANSWER_FLAGS`)."""
    base = cards.get(model_name) or next(iter(cards.values()), {})
    root = base.get("root") if isinstance(base.get("root"), str) else None
    source = model or root or model_name
    asked = {name: value for name in ("dtype", "revision") if (value := _flag(command, f"--{name}")) is not None}
    found = {name: value for name, value in {**asked, **(loaded or {})}.items() if value not in ("None", "auto")}
    served_adapters = {}
    for name, card in cards.items():
        path = card.get("root") if isinstance(card.get("root"), str) else None
        if card.get("parent") and (name in adapters or path):
            served_adapters[name] = adapter_lineage(adapters.get(name) or path or "", path)
    # vLLM formats chats with its tokenizer's template: the model's, unless --tokenizer names another.
    tokenizer = _flag(server_args, "--tokenizer")
    template = chat_template_digest(tokenizer, None, _flag(server_args, "--tokenizer-revision"),
                                    _flag(server_args, "--chat-template")) if tokenizer else \
        chat_template_digest(source, root, found.get("revision"), _flag(server_args, "--chat-template"))
    settings: dict[str, Any] = {"max_model_len": base.get("max_model_len"), "chat_template": template,
                                "prompt_format": prompt_format}
    settings.update({name: found[name] for name in LOADED_SETTINGS if name in found})
    own = {flag: True if flag == "--enable-lora" else _flag(command, flag)
           for flag in TEMPLATE_ANSWER_FLAGS if flag in command or _flag(command, flag) is not None}
    if own:
        settings["template_args"] = own
    if server_args:
        settings["server_args"] = [_unsecret(before, arg) for before, arg in zip(["", *server_args], server_args,
                                                                                 strict=False)]
    engine = f"vllm {version}" if isinstance(version, str) else "an OpenAI-compatible server without /version"
    return ServingLineage(model=model_lineage(source, root, found.get("revision")), engine=engine, image=image,
                          settings=settings, adapters=served_adapters)


def after_restart(fresh: ServingLineage, before: ServingLineage, static: frozenset[str]) -> ServingLineage:
    """``fresh`` (read from a restarted server) with the root's adapters as the engine recorded them when it
    loaded each: the server lists a root adapter by the folder it was loaded from (a copy on the worker), not the
    root's source it was copied from, so only the ``static`` ones (``lora_adapters``) are taken from ``fresh``."""
    adapters = {name: found for name, found in fresh.adapters.items() if name in static}
    adapters.update({name: found for name, found in before.adapters.items() if name not in static})
    return dataclasses.replace(fresh, adapters=adapters)


def _unsecret(before: str, arg: str) -> str:
    """``arg`` as lineage records it: the value of a secret's flag (``--api-key k``, ``--api-key=k``) left out."""
    if before.startswith("-") and _SECRET_FLAG.search(before) and not arg.startswith("-"):
        return "(secret)"
    flag, equals, _ = arg.partition("=")
    return f"{flag}=(secret)" if equals and flag.startswith("-") and _SECRET_FLAG.search(flag) else arg


def _flag(args: Sequence[str], flag: str) -> str | None:
    """The value the last ``flag`` in ``args`` gives (``--flag v`` or ``--flag=v``), or None."""
    found = None
    for before, arg in zip(["", *args], args, strict=False):
        if before == flag:
            found = arg
        elif arg.startswith(flag + "="):
            found = arg.split("=", 1)[1]
    return found
