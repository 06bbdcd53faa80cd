"""The copies of a root's adapters on one worker, kept within a disk budget (``lora_adapter_disk_gb``).

A root with one adapter per customer would otherwise fill the worker's boot disk one first use at a time, and a
full disk fails the model's own files too. Before an adapter of a ``gs://`` root is copied, its size (from the
bucket's listing) is made room for: copies are deleted least recently used first, never one that an adapter slot
holds (vLLM reads an adapter's files when it loads it; a deleted copy is copied again on its next use). An adapter
larger than the whole budget is refused, as its request's dead letter, rather than filling the disk. Adapters of a
root on the worker's own disk are read where they are and take no budget. Only the runtime's host copies adapters
(one process a VM), so the budget is kept by this object alone; what earlier hosts copied is found on disk.
"""

from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path
from typing import Callable

LOGGER = logging.getLogger(__name__)
# The default budget: this share of the disk the copies are on (the model's weights, the image and the logs share
# it; docs/operations.md#disk).
DEFAULT_DISK_SHARE = 0.25
# Touched each time a copy is used, so the least recently used is known after a restart of the host.
USED_MARKER = ".adapter-used"


class AdapterTooLarge(Exception):
    """An adapter that cannot fit within the budget even alone; the message is the dead letter's reason."""


class AdapterDisk:
    """The budget of one root's copies under ``folder`` (where the root's adapters are copied, one sub-folder
    each). ``budget_bytes`` None: :data:`DEFAULT_DISK_SHARE` of the disk ``folder`` is on. ``in_use``: the names
    the adapter slots hold now."""

    def __init__(self, folder: Path, budget_bytes: int | None, in_use: Callable[[], set[str]]) -> None:
        self.folder = folder
        self._budget = budget_bytes
        self._in_use = in_use
        self._lock = threading.Lock()

    @property
    def budget_bytes(self) -> int:
        if self._budget is not None:
            return self._budget
        self.folder.mkdir(parents=True, exist_ok=True)
        return int(shutil.disk_usage(self.folder).total * DEFAULT_DISK_SHARE)

    def room_for(self, name: str, size: int) -> None:
        """Makes room for adapter ``name`` of ``size`` bytes (its copy, if there is one, already counts), deleting
        the least recently used copies no slot holds; raises :class:`AdapterTooLarge` when it cannot fit."""
        budget = self.budget_bytes
        if size > budget:
            raise AdapterTooLarge(f"adapter {name!r} is {size / 1e9:.2f} GB, more than the {budget / 1e9:.2f} GB "
                                  "this worker keeps for adapter copies (lora_adapter_disk_gb)")
        with self._lock:
            copies = self.copies()
            held = self._in_use() | {name}
            used = sum(bytes_ for other, (bytes_, _) in copies.items() if other != name)
            for other, (bytes_, _) in sorted(copies.items(), key=lambda item: item[1][1]):
                if used + size <= budget:
                    break
                if other in held:
                    continue
                shutil.rmtree(self.folder / other, ignore_errors=True)
                used -= bytes_
                LOGGER.info("Deleted the copy of adapter %r (%.2f GB), the least recently used, to make room for "
                            "%r within lora_adapter_disk_gb", other, bytes_ / 1e9, name)
            if used + size > budget:
                raise AdapterTooLarge(f"adapter {name!r} ({size / 1e9:.2f} GB) does not fit beside the adapters "
                                      f"loaded now ({used / 1e9:.2f} GB of {budget / 1e9:.2f} GB, "
                                      "lora_adapter_disk_gb): it is refused rather than fill the disk")

    def used(self, name: str) -> None:
        """Adapter ``name``'s copy was used now."""
        marker = self.folder / name / USED_MARKER
        if marker.parent.is_dir():
            marker.touch()

    def copies(self) -> dict[str, tuple[int, float]]:
        """Each copy under the folder: (its bytes, when it was last used)."""
        found: dict[str, tuple[int, float]] = {}
        if not self.folder.is_dir():
            return found
        for copy in self.folder.iterdir():
            if not copy.is_dir():
                continue
            size = sum(path.stat().st_size for path in copy.rglob("*") if path.is_file())
            marker = copy / USED_MARKER
            found[copy.name] = (size, marker.stat().st_mtime if marker.exists() else copy.stat().st_mtime)
        return found


def budget_bytes(gigabytes: float) -> int | None:
    """The budget a ``lora_adapter_disk_gb`` value sets: None for 0 (:data:`DEFAULT_DISK_SHARE` of the disk)."""
    return int(gigabytes * 1e9) if gigabytes > 0 else None
