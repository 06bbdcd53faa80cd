"""Where weights are (a model's, a LoRA adapter's), and a worker-local place to load them from.

One location type for both: a hub id, a folder on the worker, or a ``gs://``
folder (:func:`location_kind`); :func:`local_weights` is the one resolver.
vLLM loads a checkpoint from a local directory; a ``gs://`` folder is
downloaded into the cache first. Several SDK processes on one VM may ask at
once, so the copy is guarded by an inter-process lock and marked complete only
when every file has arrived.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import fasteners

LOGGER = logging.getLogger(__name__)
_COMPLETE_MARKER = ".download-complete"
# How a location names a folder on the worker (the model's, an adapter's); gs:// is copied down, the rest is a hub id.
LOCAL_FOLDER_PREFIXES = ("/", "./", "../", "~")


GCS, LOCAL, HUB = "gcs", "local", "hub"


class WeightsError(ValueError):
    """A weights folder that cannot be used; the message says which and what it lacks."""


def location_kind(location: str) -> str:
    """``gcs`` (copied down), ``local`` (a folder on the worker) or ``hub`` (a Hugging Face id the loader fetches)."""
    if location.startswith("gs://"):
        return GCS
    return LOCAL if location.startswith(LOCAL_FOLDER_PREFIXES) else HUB


def local_weights(location: str, required_file: str, cache_dir: str | os.PathLike[str] | None = None) -> str:
    """What a loader reads on this worker: a ``gs://`` folder copied down (once), a local folder checked for
    ``required_file`` and made absolute, a hub id as it is."""
    kind = location_kind(location)
    if kind == GCS:
        return str(download_gcs_folder(location, cache_dir, required_file=required_file))
    if kind == LOCAL:
        path = Path(location).expanduser()
        if not (path / required_file).is_file():
            raise WeightsError(f"{path} has no {required_file}")
        return str(path.resolve())
    return location


def cache_root() -> Path:
    """Where downloaded weights (and, locally, the embedded model and compile caches) live: ``$STREAMING_LLM_CACHE``."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "streaming-llm-template"
    return Path(os.environ.get("STREAMING_LLM_CACHE", default))


def parse_gcs_uri(uri: str) -> tuple[str, str]:
    """'gs://bucket/a/b' -> ('bucket', 'a/b/'); the prefix always ends in '/' (or is empty)."""
    if not uri.startswith("gs://") or len(uri) <= 5:
        raise ValueError(f"not a gs:// folder: {uri!r}")
    bucket, _, prefix = uri[5:].partition("/")
    if not bucket:
        raise ValueError(f"no bucket in {uri!r}")
    prefix = prefix.strip("/")
    return bucket, f"{prefix}/" if prefix else ""


def storage_client():
    """Google's Storage client (which, like Pub/Sub's, goes to an emulator by itself where one is named)."""
    import google.cloud.storage as storage

    return storage.Client()


def download_gcs_folder(uri: str, cache_dir: str | os.PathLike[str] | None = None, *,
                        required_file: str = "config.json") -> Path:
    """Copies a folder (a checkpoint, or a LoRA adapter with ``required_file``) to ``<cache>/gcs/<bucket>/<prefix>``
    once, and returns that path."""
    bucket_name, prefix = parse_gcs_uri(uri)
    base = Path(cache_dir) if cache_dir else cache_root() / "gcs"
    target = base / bucket_name / prefix
    target.mkdir(parents=True, exist_ok=True)
    with fasteners.InterProcessLock(str(target / ".download.lock")):
        if (target / _COMPLETE_MARKER).exists():
            return target
        client = storage_client()
        blobs = [b for b in client.list_blobs(bucket_name, prefix=prefix) if not b.name.endswith("/")]
        names = {b.name[len(prefix):] for b in blobs}
        if not blobs:
            raise FileNotFoundError(f"no objects under {uri}; point it at a folder with a Hugging Face checkpoint "
                                    "(or a peft adapter)")
        if required_file not in names:
            raise FileNotFoundError(f"{uri} has no {required_file} at its top level; found: {sorted(names)[:10]}")
        total = sum(b.size or 0 for b in blobs)
        LOGGER.info("Downloading %d files (%.1f MB) from %s to %s", len(blobs), total / 1e6, uri, target)
        started, done, next_report = time.monotonic(), 0, 0.1
        for blob in blobs:
            destination = target / blob.name[len(prefix):]
            destination.parent.mkdir(parents=True, exist_ok=True)
            blob.download_to_filename(str(destination))
            done += blob.size or 0
            if total and done / total >= next_report:
                LOGGER.info("  %3.0f%% of %s (%.0f s)", 100 * done / total, uri, time.monotonic() - started)
                next_report += 0.1
        (target / _COMPLETE_MARKER).write_text(uri + "\n")
        LOGGER.info("Downloaded %s in %.0f s", uri, time.monotonic() - started)
    return target
