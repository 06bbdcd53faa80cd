"""LoRA adapters found by name in a folder (``lora_adapter_root``), fetched by a worker on their first use.

``lora_adapters`` fixes a job's adapters at launch; a team that keeps one adapter per customer or per task would
have to update the job for each new one. With a root, a request whose ``adapter`` names a sub-folder of it is served
by that adapter: its worker copies the folder once (a ``gs://`` folder through the same copy as the model's weights,
under its inter-process lock; a folder on the worker is used where it is) and checks it before vLLM loads it at run
time (:mod:`pipeline.engines.adapter_slots`). The checks catch what vLLM would refuse only after the copy, or not at
all: a folder without peft's ``adapter_config.json``, a rank above ``max_lora_rank``, modules the model does not
have, and weights shaped for a model of another size (an adapter trained on another base model), read from the
safetensors header without loading a tensor. What fails is the reason of the request's dead letter.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from google.api_core.exceptions import GoogleAPIError, NotFound
from google.auth.exceptions import DefaultCredentialsError

from pipeline.contract.parameter_checks import check_parameters
from pipeline.contract.request_parsing import ADAPTER_NAME
from pipeline.serving.adapter_disk import AdapterDisk, AdapterNoRoom, AdapterTooLarge, budget_bytes
from pipeline.serving.lora_adapters import ADAPTER_CONFIG, Adapter, rank_problem
from pipeline.serving.model_weights import (
    GCS,
    LOCAL,
    WeightsError,
    gcs_copy_folder,
    local_weights,
    location_kind,
    parse_gcs_uri,
)

ADAPTER_WEIGHTS = "adapter_model.safetensors"
# A LoRA adapter's safetensors header lists a few hundred tensors; a header claiming more is not an adapter's.
MAX_HEADER_BYTES = 16 * 1024 * 1024
# Which side of each Llama-family projection has the model's hidden size, or its MLP's intermediate size: the
# shapes an adapter's lora_A ([rank, in]) and lora_B ([out, rank]) must have for this model.
_IN_FEATURES = {"q_proj": "hidden_size", "k_proj": "hidden_size", "v_proj": "hidden_size",
                "gate_proj": "hidden_size", "up_proj": "hidden_size", "down_proj": "intermediate_size"}
_OUT_FEATURES = {"o_proj": "hidden_size", "down_proj": "hidden_size", "gate_proj": "intermediate_size",
                 "up_proj": "intermediate_size"}


class AdapterUnavailable(Exception):
    """An adapter a request names that this worker cannot serve; the message is the dead letter's reason."""


class AdapterUnreadable(Exception):
    """An adapter that could not be read just now (Cloud Storage or the disk failed): its request is tried again."""


class AdapterWaitsForRoom(AdapterUnreadable):
    """An adapter whose copy does not fit now beside the copies the adapter slots hold: unloading an idle adapter
    frees its copy (:class:`~pipeline.engines.adapter_slots.AdapterSlots`), else its request is tried again."""


@dataclass(frozen=True)
class AdapterRoot:
    """A folder whose sub-folders are adapters, each named by its folder: ``gs://bucket/adapters/`` or a folder on
    the worker."""

    location: str

    def __post_init__(self) -> None:
        check_parameters({"lora_adapter_root": self.location})  # a gs:// folder or a folder on the worker
        if location_kind(self.location) == GCS:
            parse_gcs_uri(self.location)  # raises ValueError for a location no worker could copy

    def location_of(self, name: str) -> str:
        return f"{self.location.rstrip('/')}/{name}"


def root_fetch(root: AdapterRoot, *, model_folder: str | None, max_lora_rank: int, cache_dir: str | None,
               base_model: str | None, disk_gb: float, in_use: Callable[[], set[str]],
               keep: frozenset[str] = frozenset(), also_base: str | None = None) -> Callable[[str], str]:
    """How a worker's engine fetches ``root``'s adapters by name (:func:`fetch_adapter`), a ``gs://`` root's copies
    within ``disk_gb`` (:mod:`pipeline.serving.adapter_disk`; ``in_use``: the names its slots hold; ``keep``: the
    folders its server reads at every start)."""
    disk = AdapterDisk(gcs_copy_folder(root.location, cache_dir), budget_bytes(disk_gb), in_use, root.location_of,
                       keep) if location_kind(root.location) == GCS else None
    return functools.partial(fetch_adapter, root, model_folder=model_folder, max_lora_rank=max_lora_rank,
                             cache_dir=cache_dir, base_model=base_model, disk=disk, also_base=also_base)


def fetch_adapter(root: AdapterRoot, name: str, model_folder: str | None, max_lora_rank: int,
                  cache_dir: str | None = None, base_model: str | None = None, disk: AdapterDisk | None = None,
                  also_base: str | None = None) -> str:
    """Where adapter ``name`` of ``root`` lies on this worker, copied (within ``disk``'s budget) and checked against
    the model in ``model_folder`` (None: a model whose files are not on disk here, whose shapes go unchecked) and,
    with ``base_model`` (the served model as configured; ``also_base``: ``lora_base_model``), that it was trained
    for it (:func:`base_problem`). Raises :class:`AdapterUnavailable` with the reason."""
    if not ADAPTER_NAME.match(name):
        raise AdapterUnavailable(f"adapter {name[:80]!r}: not a folder name under lora_adapter_root")
    with disk.fetching(name) if disk is not None else contextlib.nullcontext():
        path = _fetched(root, name, model_folder, max_lora_rank, cache_dir, base_model, disk, also_base)
    if disk is not None:
        disk.used(name)
    return path


def _fetched(root: AdapterRoot, name: str, model_folder: str | None, max_lora_rank: int, cache_dir: str | None,
             base_model: str | None, disk: AdapterDisk | None, also_base: str | None = None) -> str:
    location = root.location_of(name)
    try:
        path = local_weights(location, ADAPTER_CONFIG, cache_dir,
                             room_for=None if disk is None else functools.partial(disk.room_for, name))
    except AdapterTooLarge as exc:
        raise AdapterUnavailable(str(exc)) from None
    except AdapterNoRoom as exc:
        raise AdapterWaitsForRoom(str(exc)) from None
    except (WeightsError, FileNotFoundError, NotFound) as exc:
        raise AdapterUnavailable(f"adapter {name!r}: no adapter at {location} ({exc}); an adapter is a folder "
                                 "saved by peft (save_pretrained)") from None
    except ValueError as exc:
        raise AdapterUnavailable(f"adapter {name!r}: {location} cannot be read ({type(exc).__name__}: "
                                 f"{str(exc)[:300]})") from None
    except (GoogleAPIError, DefaultCredentialsError, OSError) as exc:  # Cloud Storage or a disk, for now
        raise AdapterUnreadable(f"adapter {name!r}: {location} cannot be read now ({type(exc).__name__}: "
                                f"{str(exc)[:300]})") from exc
    problem = fit_problem(name, Path(path), model_folder, max_lora_rank)
    if problem is None and base_model is not None:
        problem = base_problem(name, Path(path), base_model, model_folder, also_base)
    if problem:
        raise AdapterUnavailable(problem)
    return path


def model_names(base_model: str, model_folder: str | None, also_base: str | None = None) -> set[str]:
    """What an adapter may name the served model by: as configured (a hub id, a gs:// or local folder), the folder
    it was loaded from, ``also_base`` (``lora_base_model``: the hub id a copy came from), each as its hub id where
    it is a Hugging Face cache folder, and each of their last path parts that is a model's name (an adapter trained
    on a copy of the model names the copy's folder), lowercased. Not the model a checkpoint's config.json names
    (``_name_or_path``): transformers no longer writes it, and where it does it names the model a fine-tune was
    loaded from, whose adapters do not fit the fine-tune."""
    names = {base_model, *([model_folder] if model_folder else []), *([also_base] if also_base else [])}
    identities = {_identity(name) for name in names}
    return identities | {part for name in identities if (part := _last_part(name))}


def base_problem(name: str, folder: Path, base_model: str, model_folder: str | None,
                 also_base: str | None = None) -> str | None:
    """Why the adapter in ``folder`` was not trained for the served model (``lora_base_model_check``), or None: the
    base model its adapter_config.json names (peft's ``base_model_name_or_path``) must be one of
    :func:`model_names`. An adapter that names none cannot show it was trained for this model, and is refused
    too: peft records the name whenever its base model had one."""
    try:
        base = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None  # fit_problem has said what is wrong with its config
    if not isinstance(base, str) or not base.strip():
        return (f"adapter {name!r} names no base model (its {ADAPTER_CONFIG} has no base_model_name_or_path), so "
                f"nothing shows it was trained for the served model {base_model!r}: set it to the model's hub id, "
                "or lora_base_model_check=false to serve adapters that do not say")
    known, named = model_names(base_model, model_folder, also_base), _identity(base)
    if named in known:
        return None
    # Two hub ids are compared whole: someone-else/NAME is another model than the served org/NAME.
    if not (_HUB_ID.match(named) and any(_HUB_ID.match(name) for name in known)) \
            and (_last_part(named) or named) in known:
        return None
    return (f"adapter {name!r} was trained for {base[:200]!r} (its {ADAPTER_CONFIG}'s base_model_name_or_path), "
            f"not for the served model {base_model!r}"
            f"{f' (lora_base_model {also_base!r})' if also_base else ''}: an adapter for another model answers "
            "nonsense; set lora_base_model to the name the served copy's adapters give it, or "
            "lora_base_model_check=false")


# Folder names that say nothing of which model a folder holds (and a cache snapshot's commit hash): never matched.
_GENERIC_PARTS = frozenset({"model", "models", "base", "final", "checkpoint", "weights", "main", "latest", "hf"})
# A Hugging Face hub id: ORG/NAME, neither a URI nor a path (./NAME and ../NAME are; a bare dir/NAME reads as an id).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w-]*(?:\.[\w-]+)*/[\w.-]+$")
# A Hugging Face cache folder: .../models--ORG--NAME/snapshots/COMMIT.
_HUB_CACHE = re.compile(r"models--([^/]+?)--([^/]+)/snapshots/[0-9a-f]+$")


def _identity(name: str) -> str:
    """A model's name as compared: lowercased, without a trailing slash; a hub cache folder as its hub id."""
    name = name.strip().rstrip("/")
    cached = _HUB_CACHE.search(name)
    return (f"{cached.group(1)}/{cached.group(2)}" if cached else name).lower()


def _last_part(name: str) -> str | None:
    """The last path part of a name, where it names a model (not a generic folder name or a commit hash)."""
    part = name.rsplit("/", 1)[-1]
    if part in _GENERIC_PARTS or re.fullmatch(r"[0-9a-f]{12,}", part) or re.fullmatch(r"(v|checkpoint-)?\d+", part):
        return None
    return part


def fit_problem(name: str, folder: Path, model_folder: str | None, max_lora_rank: int) -> str | None:
    """Why the adapter in ``folder`` cannot serve the model in ``model_folder``, or None."""
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
        rank = rank_problem(Adapter(name, str(folder)), config, max_lora_rank)
    except (OSError, ValueError, TypeError) as exc:
        return f"adapter {name!r}: its {ADAPTER_CONFIG} cannot be read ({str(exc)[:200]})"
    if rank:
        return rank
    if config.get("peft_type", "LORA") != "LORA":
        return f"adapter {name!r} is a {config.get('peft_type')} adapter; vLLM serves LoRA adapters only"
    targets = config.get("target_modules")
    modules = _model_modules(model_folder)
    if isinstance(targets, list) and modules:  # a pattern (a string) is peft's to match: vLLM checks it
        missing = sorted(str(target) for target in targets if str(target) not in modules)
        if missing:
            return (f"adapter {name!r} targets {', '.join(missing)[:200]}, which the model does not have (an adapter "
                    "for another architecture)")
    sizes = _model_sizes(model_folder)
    if not sizes or not (folder / ADAPTER_WEIGHTS).is_file():
        return None  # nothing to compare with here: vLLM checks what it loads
    try:
        shapes = safetensors_shapes(folder / ADAPTER_WEIGHTS)
    except (OSError, ValueError) as exc:
        return f"adapter {name!r}: its {ADAPTER_WEIGHTS} cannot be read ({str(exc)[:200]})"
    for tensor, shape in sorted(shapes.items()):
        module = next((part for part in tensor.split(".") if part in _IN_FEATURES or part in _OUT_FEATURES), None)
        if module is None or len(shape) != 2:
            continue
        if ".lora_A." in tensor and module in _IN_FEATURES:
            side, size_name, found = "input", _IN_FEATURES[module], shape[1]
        elif ".lora_B." in tensor and module in _OUT_FEATURES:
            side, size_name, found = "output", _OUT_FEATURES[module], shape[0]
        else:
            continue
        expected = sizes.get(size_name)
        if expected is not None and found != expected:
            return (f"adapter {name!r} does not fit the model: {tensor} has {found} {side} features where the "
                    f"model's {size_name} is {expected} (an adapter trained on another base model)")
    return None


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Each tensor's shape, from a safetensors file's header (its first 8 bytes give the header's length)."""
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) != 8:
            raise ValueError("shorter than a safetensors header")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES:
            raise ValueError(f"a header of {length} bytes is not a LoRA adapter's")
        header = json.loads(handle.read(length).decode("utf-8"))
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    shapes = {}
    for name, entry in header.items():
        shape = entry.get("shape") if isinstance(entry, dict) and name != "__metadata__" else None
        if isinstance(shape, list):
            if not all(isinstance(size, int) and not isinstance(size, bool) and size >= 0 for size in shape):
                raise ValueError(f"tensor {name[:80]!r} has the shape {str(shape)[:80]}")
            shapes[name] = list(shape)
    return shapes


def _model_modules(model_folder: str | None) -> set[str]:
    """The names a module of the model may be targeted by: every part of its weights' names (empty when its
    weights cannot be read here)."""
    if model_folder is None:
        return set()
    folder = Path(model_folder)
    try:
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            names = list(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
        else:
            names = list(safetensors_shapes(folder / "model.safetensors"))
    except (OSError, ValueError, KeyError, TypeError):
        return set()
    return {part for tensor in names for part in tensor.split(".")}


def _model_sizes(model_folder: str | None) -> dict[str, int]:
    if model_folder is None:
        return {}
    try:
        config = json.loads((Path(model_folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    config = config.get("text_config", config) if isinstance(config, dict) else {}
    return {name: config[name] for name in ("hidden_size", "intermediate_size") if isinstance(config.get(name), int)}


def root_problem(root: AdapterRoot, timeout_s: float) -> tuple[str | None, str | None]:
    """What a launch can say of the root without listing it whole: (a problem that stops the launch, a warning).
    A ``gs://`` root is asked for one object; a root not readable from the launcher is left to the workers."""
    if location_kind(root.location) == LOCAL:
        if not Path(root.location).expanduser().is_dir():  # here; the workers' image may hold it (make run)
            return None, (f"--lora_adapter_root {root.location} is not a folder here: unless the worker image "
                          "has it, every request that names one of its adapters becomes a dead letter")
        return None, None
    from google.cloud.storage.retry import DEFAULT_RETRY

    from pipeline.serving.model_weights import storage_client

    bucket, prefix = parse_gcs_uri(root.location)
    try:
        found = list(storage_client().list_blobs(bucket, prefix=prefix, max_results=1, timeout=timeout_s,
                                                 retry=DEFAULT_RETRY.with_timeout(timeout_s)))
    except (DefaultCredentialsError, GoogleAPIError, OSError) as exc:
        return None, (f"--lora_adapter_root {root.location} cannot be read from here ({type(exc).__name__}); "
                      "each worker reads it on an adapter's first use")
    if not found:
        return None, (f"--lora_adapter_root {root.location} holds no adapter yet: requests that name one get a "
                      "dead letter until its folder is there")
    return None, None
