"""Where weights are (a model's, a LoRA adapter's), and a worker-local place to load them from.

One location type for both: a hub id, a folder on the worker, or a ``gs://``
folder (:func:`location_kind`); :func:`local_weights` is the one resolver.
vLLM loads a checkpoint from a local directory; a ``gs://`` folder is
downloaded into the cache first. Several SDK processes on one VM may ask at
once, so the copy is guarded by an inter-process lock and marked complete only
when every file has arrived; the mark keeps each object's generation, so a copy
is reused only while the folder holds the same objects.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import fasteners

from pipeline.contract.parameters import GCS_BUCKET_PATTERN

LOGGER = logging.getLogger(__name__)
_COMPLETE_MARKER = ".download-complete"
_LOCK_FILE = ".download.lock"
# How long a worker retries listing a gs:// folder before it serves the copy it made earlier (if it has one).
LISTING_DEADLINE_S = 60.0
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


def local_weights(location: str, required_file: str, cache_dir: str | os.PathLike[str] | None = None,
                  room_for: Callable[[int], None] | None = None) -> str:
    """What a loader reads on this worker: a ``gs://`` folder copied down (again only once it changed), a local
    folder checked for ``required_file`` and made absolute, a hub id as it is. ``room_for``: see
    :func:`download_gcs_folder`."""
    kind = location_kind(location)
    if kind == GCS:
        return str(download_gcs_folder(location, cache_dir, required_file=required_file, room_for=room_for))
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
    """'gs://bucket/a/b' -> ('bucket', 'a/b/'); the prefix always ends in '/' (or is empty). The folder becomes a
    path in the worker's cache, so a bucket that is not a bucket's name, or a folder with an empty, '.' or '..'
    part, is refused."""
    if not uri.startswith("gs://") or len(uri) <= 5:
        raise ValueError(f"not a gs:// folder: {uri!r}")
    bucket, _, prefix = uri[5:].partition("/")
    if not bucket:
        raise ValueError(f"no bucket in {uri!r}")
    if not re.fullmatch(GCS_BUCKET_PATTERN, bucket) or ".." in bucket:
        raise ValueError(f"{bucket!r} in {uri!r} is not a Cloud Storage bucket name")
    prefix = prefix.strip("/")
    if prefix and not _plain_path(prefix):
        raise ValueError(f"{uri!r} names a folder with an empty, '.' or '..' part, or a control character")
    return bucket, f"{prefix}/" if prefix else ""


def _plain_path(name: str) -> bool:
    """Whether a '/'-separated name stays where it is joined: no empty, '.' or '..' part, no control character."""
    return all(part not in ("", ".", "..") for part in name.split("/")) and \
        not any(ord(c) < 32 or c == "\x7f" for c in name)


def copy_path(copy: Path, name: str) -> Path:
    """Where the folder's object ``name`` (relative to the folder) is copied: inside ``copy``, never over the files
    the copy keeps for itself. An object's name is almost any string (Cloud Storage's naming page,
    https://cloud.google.com/storage/docs/naming-objects, refuses only '.' and '..' as whole names, carriage
    returns and line feeds); one that would climb out of the folder ('..'), start at the root, or overwrite the
    copy's marker cannot be a checkpoint's file, and is refused with the folder (:class:`WeightsError`)."""
    if not _plain_path(name) or name in (_COMPLETE_MARKER, _LOCK_FILE):
        raise WeightsError(f"the object {name!r} of the folder would be copied outside it, or over the copy's own "
                           "records: rename or remove it")
    return copy / name


def storage_client():
    """Google's Storage client (which, like Pub/Sub's, goes to an emulator by itself where one is named)."""
    import google.cloud.storage as storage

    return storage.Client()


def gcs_copy_folder(uri: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where :func:`download_gcs_folder` copies the ``gs://`` folder ``uri``: ``<cache>/gcs/<bucket>/<prefix>``."""
    bucket_name, prefix = parse_gcs_uri(uri)
    return (Path(cache_dir) if cache_dir else cache_root() / "gcs") / bucket_name / prefix


def download_gcs_folder(uri: str, cache_dir: str | os.PathLike[str] | None = None, *,
                        required_file: str = "config.json", room_for: Callable[[int], None] | None = None) -> Path:
    """Copies a folder (a checkpoint, or a LoRA adapter with ``required_file``) to ``<cache>/gcs/<bucket>/<prefix>``
    and returns that path. A copy made earlier is used as long as the folder's objects are the ones it was made
    from (same names, same generations): a folder rewritten in place is copied again, so what a worker serves is
    what the folder holds now, and what its answers' lineage names (:mod:`pipeline.serving.lineage`). When the
    folder cannot be listed, an earlier complete copy is used, with a warning. ``room_for(bytes)`` is called with
    the folder's size before a copy is made, and may refuse it by raising (a disk budget)."""
    from google.api_core.exceptions import GoogleAPIError
    from google.cloud.storage.retry import DEFAULT_RETRY

    bucket_name, prefix = parse_gcs_uri(uri)
    target = gcs_copy_folder(uri, cache_dir)
    target.mkdir(parents=True, exist_ok=True)
    with fasteners.InterProcessLock(str(target / _LOCK_FILE)):
        copied = downloaded_generations(target)
        try:
            listing = storage_client().list_blobs(bucket_name, prefix=prefix,
                                                  retry=DEFAULT_RETRY.with_deadline(LISTING_DEADLINE_S))
            blobs = [b for b in listing if not b.name.endswith("/")]
        except (GoogleAPIError, OSError) as exc:
            if not (target / _COMPLETE_MARKER).exists():
                raise
            LOGGER.warning("Could not list %s (%s: %s); serving the copy made earlier", uri, type(exc).__name__, exc)
            return target
        relative = {b.name: b.name[len(prefix):] for b in blobs}
        destinations = {name: copy_path(target, below) for name, below in relative.items()}  # refused before a copy
        names = set(relative.values())
        if not blobs:
            raise FileNotFoundError(f"no objects under {uri}; point it at a folder with a Hugging Face checkpoint "
                                    "(or a peft adapter)")
        if required_file not in names:
            raise FileNotFoundError(f"{uri} has no {required_file} at its top level; found: {sorted(names)[:10]}")
        # Read from the listing: a download may refresh a blob's properties from headers that lack the generation.
        generations = {relative[b.name]: b.generation for b in blobs}
        if copied == generations:
            return target
        total = sum(b.size or 0 for b in blobs)
        if room_for is not None:
            room_for(total)
        if (target / _COMPLETE_MARKER).exists():
            LOGGER.info("%s changed since it was copied to %s: copying it again", uri, target)
            (target / _COMPLETE_MARKER).unlink()
            for gone in set(copied or ()) - names:
                with contextlib.suppress(WeightsError):
                    copy_path(target, gone).unlink(missing_ok=True)
        LOGGER.info("Downloading %d files (%.1f MB) from %s to %s", len(blobs), total / 1e6, uri, target)
        started, done, next_report = time.monotonic(), 0, 0.1
        for blob in blobs:
            destination = destinations[blob.name]
            destination.parent.mkdir(parents=True, exist_ok=True)
            blob.download_to_filename(str(destination))
            done += blob.size or 0
            if total and done / total >= next_report:
                LOGGER.info("  %3.0f%% of %s (%.0f s)", 100 * done / total, uri, time.monotonic() - started)
                next_report += 0.1
        # The marker keeps what was copied, by object generation: the weights' revision (pipeline.serving.lineage).
        (target / _COMPLETE_MARKER).write_text(json.dumps({"uri": uri, "generations": generations}) + "\n")
        LOGGER.info("Downloaded %s in %.0f s", uri, time.monotonic() - started)
    return target


def _marker(folder: str | os.PathLike[str]) -> dict:
    """What download_gcs_folder wrote into ``folder``'s completion marker ({} for none, or an unreadable one)."""
    try:
        found = json.loads((Path(folder) / _COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def copied_from(folder: str | os.PathLike[str]) -> str | None:
    """The ``gs://`` folder :func:`download_gcs_folder` copied into ``folder`` whole, or None."""
    uri = _marker(folder).get("uri")
    return uri if isinstance(uri, str) else None


def downloaded_generations(folder: str | os.PathLike[str]) -> dict[str, int] | None:
    """The object generation of each file :func:`download_gcs_folder` copied into ``folder``; None when it was not
    copied by it, or by a version that did not keep them."""
    generations = _marker(folder).get("generations")
    return dict(generations) if isinstance(generations, dict) else None
