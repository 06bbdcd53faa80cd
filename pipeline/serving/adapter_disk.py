"""The copies of a root's adapters on one worker, kept within a disk budget (``lora_adapter_disk_gb``).

A root with one adapter per customer would otherwise fill the worker's boot disk one first use at a time, and a full
disk fails the model's own files too. Before an adapter of a ``gs://`` root is copied, its size (from the bucket's
listing) is made room for: copies are deleted least recently loaded first, never one that a stream or a load of the
adapter slots, or a fetch, is using (vLLM reads an adapter's files when it loads it, and holds its weights in memory
from then on; a deleted copy is copied again when it is next loaded). Only the root's own copies count and go: a
folder of the copy cache whose marker says another source (the model's weights, a ``lora_adapters`` adapter from the
same bucket) is never touched. An adapter larger than the whole budget, or than the disk has free for copies even
with every other copy gone, is refused, as its request's dead letter; one that does not fit beside those in use now
waits (its request is tried again). Adapters of a root on the worker's own disk are read where they are and take no
budget. Only the runtime's host copies adapters (one process a VM), so the budget is kept by this object alone; what
earlier hosts copied is found on disk.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from pipeline.serving.model_weights import copied_from

LOGGER = logging.getLogger(__name__)
# The default budget: this share of the disk the copies are on (the model's weights, the image and the logs share
# it; docs/operations.md#disk).
DEFAULT_DISK_SHARE = 0.25
# ... and never more than the disk has free beside the copies held, less this share of it: a disk the model's
# weights already fill leaves the copies what is left, not a quarter it does not have.
FREE_KEPT_SHARE = 0.05
# Touched each time a copy is fetched for a load, so the least recently loaded is known after a restart of the
# host. Its name starts as the copy's own markers do, which an adapter's digest leaves out (pipeline.serving.lineage).
USED_MARKER = ".download-used"


class AdapterTooLarge(Exception):
    """An adapter that cannot fit within the budget even alone; the message is the dead letter's reason."""


class AdapterNoRoom(Exception):
    """An adapter that does not fit beside the copies held now: its request is tried again once one is let go."""


class AdapterDisk:
    """The budget of one root's copies under ``folder`` (where the root's adapters are copied, one sub-folder each;
    ``source_of(name)`` is where each is copied from). ``budget_bytes`` None: :data:`DEFAULT_DISK_SHARE` of the disk
    ``folder`` is on; either way within what it has free (:data:`FREE_KEPT_SHARE`). ``in_use``: the names whose
    copies the adapter slots need now (:meth:`~pipeline.engines.adapter_slots.AdapterSlots.needing_copies`).
    ``keep``: folders the model server reads at every start (the model's, ``lora_adapters``'), never counted or
    deleted even under the root."""

    def __init__(self, folder: Path, budget_bytes: int | None, in_use: Callable[[], set[str]],
                 source_of: Callable[[str], str], keep: frozenset[str] = frozenset()) -> None:
        self.folder = folder
        self._keep = {str(Path(path).resolve()) for path in keep}
        self._budget = budget_bytes
        self._in_use = in_use
        self._source_of = source_of
        self._lock = threading.Lock()
        self._fetching: dict[str, int] = {}  # name -> how many fetches of it are under way
        self._reserved: dict[str, int] = {}  # name -> the bytes a copy under way will take

    @property
    def budget_bytes(self) -> int:
        """What the copies may take now: the budget, or by default the least of a quarter of the disk and what it
        has free beside them."""
        return self._budget_beside(sum(size for size, _ in self.copies().values()))

    def _budget_beside(self, held: int) -> int:
        """:attr:`budget_bytes` with the copies taking ``held`` bytes: the budget (by default a quarter of the disk),
        and never more than the disk has free beside them, less :data:`FREE_KEPT_SHARE` of it, so that no budget
        fills the disk the model's own files and logs need."""
        self.folder.mkdir(parents=True, exist_ok=True)
        total, _, free = shutil.disk_usage(self.folder)
        budget = int(total * DEFAULT_DISK_SHARE) if self._budget is None else self._budget
        return max(0, min(budget, free + held - int(total * FREE_KEPT_SHARE)))

    def _largest_bytes(self) -> int:
        """The most the copies could ever take, whatever the disk has free now: an adapter larger is a dead letter
        however the disk empties."""
        if self._budget is not None:
            return self._budget
        self.folder.mkdir(parents=True, exist_ok=True)
        return int(shutil.disk_usage(self.folder).total * DEFAULT_DISK_SHARE)

    @contextlib.contextmanager
    def fetching(self, name: str) -> Iterator[None]:
        """While adapter ``name`` is copied, checked and loaded: its copy is not deleted, and the bytes a copy of it
        will take are counted (:meth:`room_for`) until the fetch ends."""
        with self._lock:
            self._fetching[name] = self._fetching.get(name, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._fetching[name] -= 1
                if not self._fetching[name]:
                    del self._fetching[name]
                    self._reserved.pop(name, None)

    def room_for(self, name: str, size: int) -> None:
        """Makes room for adapter ``name`` of ``size`` bytes (its copy, if there is one, already counts), deleting
        the least recently loaded copies no stream, load or fetch needs; raises :class:`AdapterTooLarge` when it
        cannot fit even with every other copy gone, :class:`AdapterNoRoom` when it cannot now."""
        if size > (largest := self._largest_bytes()):
            raise AdapterTooLarge(f"adapter {name!r} is {size / 1e9:.2f} GB, more than the {largest / 1e9:.2f} GB "
                                  "this worker keeps for adapter copies (lora_adapter_disk_gb)")
        with self._lock:
            copies = self.copies()
            # Copies under way have taken some of the free space already: their reservations count as held.
            under_way = sum(bytes_ for other, bytes_ in self._reserved.items() if other not in copies and other != name)
            budget = self._budget_beside(sum(size for size, _ in copies.values()) + under_way)
            held = self._in_use() | set(self._fetching) | {name}
            sizes = {other: bytes_ for other, (bytes_, _) in copies.items()}
            sizes.update({other: max(sizes.get(other, 0), bytes_) for other, bytes_ in self._reserved.items()})
            sizes.pop(name, None)
            used = sum(sizes.values())
            if size > budget:  # not even with every other copy gone: nothing to wait for
                raise AdapterTooLarge(f"adapter {name!r} is {size / 1e9:.2f} GB, more than the {budget / 1e9:.2f} "
                                      "GB this worker's disk has free for adapter copies now (docs/operations.md#disk)")
            evictable = [other for other, _ in sorted(copies.items(), key=lambda item: item[1][1])
                         if other not in held and other in sizes]
            if used - sum(sizes[other] for other in evictable) + size > budget:  # deleting would not make room
                raise AdapterNoRoom(f"adapter {name!r} ({size / 1e9:.2f} GB) does not fit now beside the adapters "
                                    f"held ({used / 1e9:.2f} GB of {budget / 1e9:.2f} GB, lora_adapter_disk_gb)")
            for other in evictable:
                if used + size <= budget:
                    break
                shutil.rmtree(self.folder / other, ignore_errors=True)
                used -= sizes.pop(other)
                LOGGER.info("Deleted the copy of adapter %r, the least recently loaded, to make room for %r within "
                            "lora_adapter_disk_gb", other, name)
            self._reserved[name] = size

    def used(self, name: str) -> None:
        """Adapter ``name``'s copy was used now."""
        with contextlib.suppress(OSError):  # deleted meanwhile: its next use copies it again
            (self.folder / name / USED_MARKER).touch()

    def copies(self) -> dict[str, tuple[int, float]]:
        """Each copy of the root's under the folder: (its bytes, when it was last used)."""
        found: dict[str, tuple[int, float]] = {}
        if not self.folder.is_dir():
            return found
        for copy in self.folder.iterdir():
            if not copy.is_dir() or copied_from(copy) != self._source_of(copy.name) or \
                    str(copy.resolve()) in self._keep:
                continue
            try:
                size = sum(path.stat().st_size for path in copy.rglob("*") if path.is_file())
                marker = copy / USED_MARKER
                found[copy.name] = (size, marker.stat().st_mtime if marker.exists() else copy.stat().st_mtime)
            except OSError:  # deleted while it was read
                continue
        return found


def budget_bytes(gigabytes: float) -> int | None:
    """The budget a ``lora_adapter_disk_gb`` value sets: None for 0 (:data:`DEFAULT_DISK_SHARE` of the disk)."""
    return int(gigabytes * 1e9) if gigabytes > 0 else None
