"""One key's state in the generate step: the frozen record the key machine steps, and its cells. Pure.

:class:`KeyState` is what :func:`pipeline.generation.key_machine.step` reads and returns; :func:`load` builds it
from the DoFn's state cells and :func:`changes` says which cells a step changed, so a callback writes only
those. The cells and their coders are a contract with every running job (Dataflow's update compares them), so
their names and encodings stay as they were; each cell's text carries a version (:data:`STATE_VERSION`,
:mod:`pipeline.contract.state_format`).

Cells, each written only when it changes:

* ``waiting``: requests the engine had no room for, admitted in arrival order as streams finish, the live lane's
  before the bulk lane's.
* ``inflight``: requests the engine is streaming. One whose stream is lost is sent again as a new ``attempt``.
* ``progress``: per stream, how many of its outputs were emitted (:class:`~pipeline.contract.stream_progress.
  KeyProgress`), written in the same commit as the outputs: what makes a poll safe to retry.
* ``seen``: the ids of requests waiting, in flight, or finished within ``dedupe_window_s``
  (:mod:`pipeline.generation.dedupe`).
* ``poll_at_ms`` and ``wait_ms``: when the poll timer is set for, and the backoff of a key whose requests only
  wait (integers under Beam's ``VarIntCoder``, versioned by name).

Beam's state gives value cells untyped: :func:`read_cells` checks each once, and clears one it refuses.

An entry that cannot be decoded (after an update changed the format) is kept aside as ``damaged``: the next
step turns it into a dead letter with its raw text, and the key goes on.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from pipeline.contract.messages import InferenceRequest
from pipeline.contract.state_format import StateFormatError, read_cell, write_cell
from pipeline.contract.stream_progress import KeyProgress, RequestProgress
from pipeline.generation.dedupe import IdRecord, encode_ids
from pipeline.generation.key_events import Submission

LOGGER = logging.getLogger(__name__)
# Version 1: entries without "v" (commit 41b0859); 2 adds "v" and moves progress to its own cell.
STATE_VERSION = 2
PROGRESS_VERSION = 1  # cells written before versions have none: the same fields
_ENTRY_FIELDS = {"request": (str,), "fp": (str,), "attempt": (int,), "key": (str, type(None)),
                 "deadline_at": (int, float, type(None))}


@dataclass(frozen=True)
class RequestEntry:
    """One request this key holds, waiting for room or in flight: an entry of the ``waiting`` or ``inflight`` bag."""

    request: str  # the request as JSON (InferenceRequest.to_json)
    fp: str  # its fingerprint: two requests that share an id are told apart by it
    attempt: int = 1  # the attempt its stream runs as (a lost stream is sent again as the next)
    key: str | None = None  # its stream at the engine; None while waiting, or lost while the engine was full
    deadline_at: float | None = None  # when its own deadline_ms passes (epoch seconds), if it has one
    batch: str | None = None  # the batcher's batch it came in: a static-batching engine takes a batch whole
    lost: int = 0  # how many of its streams were lost (bounded apart from attempts)
    bulk: bool = False  # of the bulk lane: it waits behind every live request of its key

    @property
    def request_id(self) -> str:
        if len(self.request) > CACHED_TEXT_MAX:
            return InferenceRequest.from_json(self.request).id
        return _request_id(self.request)

    @property
    def progress(self) -> RequestProgress:
        return RequestProgress(self.key, 0, self.attempt, self.lost)

    def encode(self) -> str:
        return write_cell({name: getattr(self, name) for name in _ENTRY_ORDER}, STATE_VERSION)

    @classmethod
    def decode(cls, text: str) -> RequestEntry:
        """An entry, upgraded from any version this code knows; raises StateFormatError.

        A key's bags are read back at every work item, mostly unchanged: an entry (all plain values, so one
        instance can be shared) is decoded once per text, not once per read."""
        return _decoded(text) if len(text) <= CACHED_TEXT_MAX else cls._decode(text)

    @classmethod
    def _decode(cls, text: str) -> RequestEntry:
        data = read_cell(text, (1, STATE_VERSION), _ENTRY_FIELDS)
        try:
            InferenceRequest.from_json(data["request"])
        except ValueError as exc:
            raise StateFormatError(f"its request does not decode: {exc}") from None
        lost = data.get("lost", 0)  # absent before streams lost were counted apart from attempts: none known
        if not isinstance(lost, int) or isinstance(lost, bool) or lost < 0:
            raise StateFormatError("field 'lost' of the wrong type")
        batch = data.get("batch")  # absent before batches were kept whole: each entry its own
        if batch is not None and not isinstance(batch, str):
            raise StateFormatError("field 'batch' of the wrong type")
        bulk = data.get("bulk", False)  # absent before the bulk lane: live
        if not isinstance(bulk, bool):
            raise StateFormatError("field 'bulk' of the wrong type")
        return cls(data["request"], data["fp"], data["attempt"], data["key"], data["deadline_at"], batch, lost, bulk)


# Entries decoded once are kept by their text, in each SDK process: this many, of texts up to this many characters
# (a request of a classification stream is far shorter; a long prompt is decoded at each read instead), so the
# two caches hold at most about 32 MB of text.
CACHED_ENTRIES = 2048
CACHED_TEXT_MAX = 8192


@functools.lru_cache(maxsize=CACHED_ENTRIES)
def _decoded(text: str) -> RequestEntry:
    return RequestEntry._decode(text)


@functools.lru_cache(maxsize=CACHED_ENTRIES)
def _request_id(request: str) -> str:
    return InferenceRequest.from_json(request).id


# The entry's fields in order (all plain values): its cell, as ``dataclasses.asdict`` wrote it without the copy.
_ENTRY_ORDER = tuple(f.name for f in fields(RequestEntry))


@dataclass(frozen=True)
class Damaged:
    """A state entry that could not be decoded: its raw text and why."""

    text: str
    reason: str


# What a step waits for the engine to answer (pipeline.generation.key_machine): one of these phases -----------

@dataclass(frozen=True)
class Arriving:
    """A bundle's accepted requests, offered to the engine as ``submission`` (None: they queue behind others)."""

    accepted: tuple[RequestEntry, ...]
    already: int  # requests waiting before these came
    arrived: tuple[str, ...]
    submission: Submission | None


@dataclass(frozen=True)
class Polling:
    """The key's streams asked for from these positions (``asked``; empty: nothing to ask), and what waits."""

    entries: tuple[RequestEntry, ...]
    waiting: tuple[RequestEntry, ...]
    asked: Mapping[str, int]


@dataclass(frozen=True)
class Resending:
    """After a poll: lost streams sent again and waiting batches offered, one submission each, in that order."""

    remaining: tuple[RequestEntry, ...]  # in flight after the poll; resends among them, streamless
    resends: tuple[tuple[int, Submission], ...]  # (index into remaining, its submission)
    groups: tuple[tuple[tuple[RequestEntry, ...], Submission], ...]  # waiting batches, each with its submission
    progress: KeyProgress


@dataclass(frozen=True)
class Draining:
    """A drain's passes over the key's streams, from the positions committed before it, until ``deadline``."""

    entries: tuple[RequestEntry, ...]
    progress: KeyProgress
    committed: Mapping[str, int]
    deadline: float
    asked: Mapping[str, int]
    abandoned: tuple[str, ...] = ()  # streams given up on a failed poll: cancelled with the rest at the end


Phase = Arriving | Polling | Resending | Draining


@dataclass(frozen=True)
class KeyState:
    """Everything the generate step keeps for one key (see the module docstring)."""

    waiting: tuple[RequestEntry, ...] = ()
    inflight: tuple[RequestEntry, ...] = ()
    progress: KeyProgress = field(default_factory=KeyProgress)
    seen: IdRecord = field(default_factory=IdRecord)
    poll_at_ms: int | None = None
    wait_ms: int | None = None
    damaged: tuple[Damaged, ...] = ()
    # What a step is waiting for the engine to answer; never committed.
    pending: Phase | None = None

    @property
    def holds_work(self) -> bool:
        """Whether the key holds a request or a finished stream to release (a poll must come)."""
        return bool(self.waiting or self.inflight or self.progress.release)


def _positions(value: dict[str, object]) -> dict[str, int]:
    positions = {}
    for key, n in value.items():
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise StateFormatError("a position is not a whole number")
        positions[str(key)] = n
    return positions


def read_progress(text: str | None) -> KeyProgress:
    """The key's progress cell; an unreadable one reads as empty: polled from their start, its streams are found
    released and sent again, so nothing is lost."""
    if not text:
        return KeyProgress()
    try:
        data = read_cell(text, (PROGRESS_VERSION,), {"taken": (dict,), "release": (dict,)})
        return KeyProgress(_positions(data["taken"]), _positions(data["release"]))
    except StateFormatError as exc:
        LOGGER.error("Unreadable progress state (%s); this key's streams will be sent again", exc)
        return KeyProgress()


def encode_progress(progress: KeyProgress) -> str | None:
    """The progress cell's text (None: cleared)."""
    if not (progress.taken or progress.release):
        return None
    return write_cell({"taken": dict(progress.taken), "release": dict(progress.release)}, PROGRESS_VERSION)


def _entries(texts: Iterable[str]) -> tuple[tuple[RequestEntry, ...], tuple[Damaged, ...]]:
    entries, damaged = [], []
    for text in texts:
        try:
            entries.append(RequestEntry.decode(text))
        except StateFormatError as exc:
            damaged.append(Damaged(text, str(exc)))
    return tuple(entries), tuple(damaged)


# The value cells' checks, by the cells' names: Beam's state gives value cells untyped (:func:`read_cells`).
# A timer cell holds a count of milliseconds; one that does not reads as unset: the key's next step sets its timer
# afresh, or backs off from its lane's cadence again, so nothing waits on it.
def _is_text(value: object) -> bool:
    return isinstance(value, str)


def _is_millis(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


_CHECKS: dict[str, Callable[[object], bool]] = {"progress": _is_text, "seen": _is_text, "poll_at_ms": _is_millis,
                                                "wait_ms": _is_millis}


def load(*, waiting: Iterable[str], inflight: Iterable[str], progress: str | None = None, seen: str | None = None,
         poll_at_ms: int | None = None, wait_ms: int | None = None) -> KeyState:
    """A key's state from its cells as committed (any version this code knows)."""
    in_flight, damaged_in_flight = _entries(inflight)
    queued, damaged_queued = _entries(waiting)
    return KeyState(queued, in_flight, read_progress(progress), IdRecord(seen), poll_at_ms, wait_ms,
                    damaged_in_flight + damaged_queued)


@dataclass(frozen=True)
class BagChange:
    """How a bag changed: entries appended to what it held, or (``rewrite``) its whole new content."""

    entries: tuple[str, ...]
    rewrite: bool


@dataclass(frozen=True)
class CellChanges:
    """The cells a step changed, as the DoFn writes them: None clears a value cell; unchanged ones are absent."""

    bags: dict[str, BagChange]
    values: dict[str, object]


def _bag(before: tuple[RequestEntry, ...], after: tuple[RequestEntry, ...], damaged: bool) -> BagChange | None:
    if after == before and not damaged:
        return None
    if not damaged and after[:len(before)] == before:
        return BagChange(tuple(e.encode() for e in after[len(before):]), rewrite=False)
    return BagChange(tuple(e.encode() for e in after), rewrite=True)


def changes(before: KeyState, after: KeyState) -> CellChanges:
    """The cell writes that turn ``before`` (as loaded) into ``after``."""
    if after.pending is not None:
        raise ValueError("a key is committed while it waits for the engine's answer")
    bags = {}
    damaged = bool(before.damaged)
    for name in ("waiting", "inflight"):
        change = _bag(getattr(before, name), getattr(after, name), damaged)
        if change is not None:
            bags[name] = change
    values: dict[str, object] = {}
    if after.progress != before.progress:
        values["progress"] = encode_progress(after.progress)
    if after.seen.changed and after.seen.ids is not None:
        values["seen"] = encode_ids(after.seen.ids)
    for name in ("poll_at_ms", "wait_ms"):
        if getattr(after, name) != getattr(before, name):
            values[name] = getattr(after, name)
    return CellChanges(bags, values)


class BagCell(Protocol):
    """A bag state cell, as Beam's user state gives one to a callback."""

    def read(self) -> Iterable[str]: ...
    def add(self, value: str) -> None: ...
    def clear(self) -> None: ...


class ValueCell(Protocol):
    """A value state cell, as Beam's user state gives one to a callback."""

    def read(self) -> Any: ...
    def write(self, value: Any) -> None: ...
    def clear(self) -> None: ...


class KeyCells(Protocol):
    """One key's state cells, by the names :func:`changes` writes: what the DoFn and the simulators both keep."""

    @property
    def waiting(self) -> BagCell: ...
    @property
    def inflight(self) -> BagCell: ...
    @property
    def progress(self) -> ValueCell: ...
    @property
    def seen(self) -> ValueCell: ...
    @property
    def poll_at_ms(self) -> ValueCell: ...
    @property
    def wait_ms(self) -> ValueCell: ...


def read_cells(cells: KeyCells) -> KeyState:
    """The key's state from its cells as committed, each value cell checked once (:data:`_CHECKS`). One the check
    refuses reads as unset and is cleared (with the work item's commit, as every write is): a step that leaves the
    value unset writes nothing, and it would be refused again at every callback."""
    values: dict[str, Any] = {}
    for name, check in _CHECKS.items():
        cell: ValueCell = getattr(cells, name)
        value = cell.read()
        if value is not None and not check(value):
            LOGGER.error("Unreadable %s state (%s); read as unset and cleared", name,
                         value if isinstance(value, int) else type(value).__name__)
            cell.clear()
            value = None
        values[name] = value
    return load(waiting=cells.waiting.read(), inflight=cells.inflight.read(), **values)


def write_cells(cells: KeyCells, before: KeyState, after: KeyState) -> None:
    """Writes the cells the step changed; a runner's failed commit discards them with the outputs."""
    changed = changes(before, after)
    for name, bag_change in changed.bags.items():
        bag: BagCell = getattr(cells, name)
        if bag_change.rewrite:
            bag.clear()
        for text in bag_change.entries:
            bag.add(text)
    for name, value in changed.values.items():
        cell: ValueCell = getattr(cells, name)
        if value is None:
            cell.clear()
        else:
            cell.write(value)
