"""Which of a root's LoRA adapters the worker's server holds now: loaded on first use, once, and a bounded few.

vLLM loads an adapter while it runs (``POST /v1/load_lora_adapter``) and forgets it when it restarts. The engine
asks :class:`AdapterSlots` for an adapter before it sends a request that names one of ``lora_adapter_root``'s
(:mod:`pipeline.serving.adapter_root`): the first ask fetches, checks and loads it, and every ask that comes
meanwhile waits for that one load instead of starting its own. At most ``capacity`` are loaded at once: on the
CPU build that keeps the last of vLLM's adapter slots empty (vllm-project/vllm#48421, see ``ServerSpec.command``),
and on a GPU it bounds the memory adapters take. Past it, the least recently used adapter that no stream is
using is unloaded (``/v1/unload_lora_adapter``): its next request pays the load again, the copy on disk kept. When
every loaded adapter is in use, a request for another waits until a stream ends. A server that restarted has
forgotten them all (:meth:`AdapterSlots.forget`). Each load is a generation of its adapter: a stream's use, and a
404 it met, count against the load it was sent under, so that the streams of a load forgotten since never take a
use from, or forget, the load that replaced it.

Live first, and no request waits without bound: while a live request waits for a slot, no bulk stream joins
another adapter that is loaded (a backfill on adapter A would otherwise keep A in use for ever), a bulk request
waiting for a slot lets a live one waiting go first, and once any request has waited ``PATIENCE_S`` (its first
wait, kept however often it loses a slot), no new bulk stream joins the adapters in use, nor, for a live one, a
live stream: their streams end and one of them gives its slot up. A bulk request's own bound is
``BULK_PATIENCE_S``: waited that long, it goes before live requests waiting for other adapters and no new stream
of either lane joins the adapters in use, so steady live traffic on adapter A delays a backfill on adapter B by
that bound and the streams in progress, not for ever. The request that loads an adapter takes its
use of it in the same step, so no other waiter's room-making unloads it before it is used.

Everything here runs on the engine's event loop, so its bookkeeping needs no lock; fetching (a copy from Cloud
Storage, a check of files) runs on the loop's executor.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import itertools
import logging
from collections.abc import Awaitable, Callable

from pipeline.serving.adapter_root import AdapterWaitsForRoom

LOGGER = logging.getLogger(__name__)

# How long a live request waits for a slot before the streams of the loaded adapters stop taking new ones.
PATIENCE_S = 30.0
# ... and a bulk request, before it goes ahead of live requests for other adapters (live first, but not for ever).
BULK_PATIENCE_S = 4 * PATIENCE_S


class AdapterSlots:
    """``fetch(name)`` -> where the adapter lies on this worker (raises with the reason it cannot be served);
    ``load(name, path)`` and ``unload(name)`` ask the server."""

    def __init__(self, capacity: int, fetch: Callable[[str], str], load: Callable[[str, str], Awaitable[None]],
                 unload: Callable[[str], Awaitable[None]]) -> None:
        if capacity < 1:
            raise ValueError(f"a root's adapters need at least one slot, got {capacity}")
        self.capacity = capacity
        self._fetch, self._load, self._unload = fetch, load, unload
        self._loaded: collections.OrderedDict[str, int] = collections.OrderedDict()  # name -> streams using it
        self._generation: dict[str, int] = {}  # name -> its latest load
        self._loads = itertools.count(1)
        self._loading: dict[str, asyncio.Future[None]] = {}
        self._unloading: dict[str, asyncio.Future[None]] = {}  # still holding its slot at the server
        self._placing: set[str] = set()  # fetched and checked, a slot taken for it, being loaded
        self._waiting: dict[str, tuple[bool, float]] = {}  # waiting for a slot: name -> (for a live one, since)
        self._first_wait: dict[str, float] = {}  # when each name not yet loaded first waited for a slot
        self._live_asks: collections.Counter[str] = collections.Counter()  # live requests asking for each now
        self._asks: collections.Counter[str] = collections.Counter()  # requests of either lane asking for each now
        self._changed = asyncio.Event()

    def loaded(self) -> list[str]:
        """The adapters loaded now, least recently used first."""
        return list(self._loaded)

    def needing_copies(self) -> set[str]:
        """The adapters whose copies on disk stay: loaded, or being fetched or loaded. vLLM reads an adapter's files
        as it loads it, and may read them again while it holds it (an adapter its CPU cache let go of); one it is
        unloading needs them no more. A copy that does not fit beside these makes the slots unload an idle adapter
        first (:meth:`_fetched_with_room`). Read on the fetch's thread while the loop may change them: tried again
        until a read is whole."""
        while True:
            try:
                return set(self._loaded) | set(self._loading) | set(self._placing)
            except RuntimeError:  # changed size during the read
                continue

    async def acquire(self, name: str, bulk: bool = False) -> int:
        """Returns the load of ``name`` the stream is sent under, once loaded, counted as used by one more stream
        until :meth:`release`; a ``bulk`` request's stream goes after live ones (module docstring)."""
        self._asks[name] += 1
        self._live_asks[name] += not bulk
        try:
            return await self._acquire(name, bulk)
        finally:
            self._asks[name] -= 1
            self._live_asks[name] -= not bulk
            if not self._asks[name]:
                del self._asks[name]
                self._first_wait.pop(name, None)  # nobody waits for it any more: a later ask waits afresh
            if not self._live_asks[name]:
                del self._live_asks[name]

    async def _acquire(self, name: str, bulk: bool) -> int:
        while True:
            if name in self._loaded:
                if self._holds_back(name, bulk):
                    await self._wait_for_change()
                    continue
                self._loaded[name] += 1
                self._loaded.move_to_end(name)
                return self._generation[name]
            if name in self._loading:
                if not bulk and name in self._waiting and self._waiting[name][0] is False:
                    self._waiting[name] = (True, self._now())  # a live request waits for it now
                await asyncio.shield(self._loading[name])  # the one load under way: its outcome is ours
                continue
            if name in self._unloading:  # loaded again only once the server has let it go
                await asyncio.shield(self._unloading[name])
                continue
            await self._load_once(name, bulk)  # loaded with this stream's use counted
            return self._generation[name]

    def release(self, name: str, load: int | None = None) -> None:
        """One stream no longer uses ``name``: of its ``load`` (:meth:`acquire`'s; None: the latest)."""
        if load is not None and load != self._generation.get(name):
            return  # that load was forgotten, its uses with it: the one loaded since is not this stream's
        if self._loaded.get(name, 0) > 0:
            self._loaded[name] -= 1
            self._wake()

    def forget(self) -> None:
        """The server restarted and holds none of them: each is loaded again on its next use."""
        if self._loaded:
            LOGGER.warning("The model server restarted: adapters %s are loaded again on their next use",
                           list(self._loaded))
        self._loaded.clear()
        self._wake()

    def forget_one(self, name: str, load: int | None = None) -> None:
        """The server no longer knows ``name`` as ``load`` had it (it answered that it does not; None: the
        latest): loaded again on its next use. A load made since is left: the server answered of an older one."""
        if load is not None and load != self._generation.get(name):
            return
        self._loaded.pop(name, None)
        self._wake()

    async def _load_once(self, name: str, bulk: bool) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._loading[name] = future
        handed_over = False  # the stream was cancelled while the server loaded it: the load settles on its own
        try:
            # Fetched and checked first: a name that cannot be served never unloads one that can.
            path = await self._fetched_with_room(name)
            # Live if any live request asks for it now, though the request loading it be bulk.
            self._waiting[name] = (self._live_asks[name] > 0, self._first_wait.setdefault(name, self._now()))
            self._wake()  # the streams that would join a loaded adapter now ask whether to hold back
            while len(self._loaded) + len(self._unloading) + len(self._placing) >= self.capacity:
                if self._behind(name) or not await self._make_room():
                    await self._wait_for_change()
            self._waiting.pop(name, None)
            self._placing.add(name)
            load = asyncio.ensure_future(self._load(name, path))
            try:
                await asyncio.shield(load)  # begun, the server may take it whatever becomes of this stream
            except asyncio.CancelledError:
                handed_over = True
                if load.done():  # it ended just as the stream was cancelled (a shed, a lease): settled now
                    self._settle(name, future, load)
                else:
                    load.add_done_callback(functools.partial(self._settle, name, future))
                raise
        except asyncio.CancelledError:
            if not handed_over:
                future.set_result(None)  # its stream was cancelled, not theirs: a waiter loads it in its place
            raise
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: the waiters raise it themselves
            raise
        else:
            self._loaded[name] = 1  # the loader's own use, taken with the load: nothing unloads it unused
            self._generation[name] = next(self._loads)
            self._first_wait.pop(name, None)
            future.set_result(None)
        finally:
            self._waiting.pop(name, None)
            if not handed_over:
                self._placing.discard(name)
                del self._loading[name]
            self._wake()

    async def _fetched_with_room(self, name: str) -> str:
        """Where ``name`` lies on this worker (the fetch), unloading the least recently used idle adapter, one at a
        time, while its copy does not fit beside the copies of those loaded: otherwise idle adapters would hold the
        disk budget, and the request would wait for room nothing frees."""
        while True:
            try:
                return await asyncio.get_running_loop().run_in_executor(None, self._fetch, name)
            except AdapterWaitsForRoom:
                if not await self._make_room():
                    raise

    def _settle(self, name: str, future: asyncio.Future[None], load: asyncio.Future[None]) -> None:
        """A load whose stream was cancelled has ended: loaded, it counts with no use (let go as any idle one is),
        so the server never holds an adapter the slots do not count; failed, the next asker loads it."""
        if not load.cancelled() and load.exception() is None:
            self._loaded[name] = 0
            self._generation[name] = next(self._loads)
            self._first_wait.pop(name, None)
        self._placing.discard(name)
        del self._loading[name]
        future.set_result(None)  # the waiters go on: they join it, or load it themselves
        self._wake()

    async def _make_room(self) -> bool:
        """Unloads the least recently used adapter no stream uses; False when every one is in use."""
        victim = next((name for name, users in self._loaded.items() if users == 0), None)
        if victim is None:
            return False
        del self._loaded[victim]
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._unloading[victim] = done
        try:
            await self._unload(victim)
        except Exception as exc:  # it counts as gone either way: a later load of it says what the server thinks
            LOGGER.warning("Unloading adapter %s failed (%s)", victim, exc)
        finally:
            del self._unloading[victim]
            done.set_result(None)
            self._wake()
        return True

    def _holds_back(self, name: str, bulk: bool) -> bool:
        """Whether a new stream of loaded adapter ``name`` waits: a bulk one while a live request waits for another
        adapter's slot, or any request has waited for one ``PATIENCE_S``; a live one while a live request has, or
        a bulk one ``BULK_PATIENCE_S``."""
        now = self._now()
        others = [(live, now - since) for waiting, (live, since) in self._waiting.items() if waiting != name]
        if bulk:
            return any(live or waited >= PATIENCE_S for live, waited in others)
        return any(waited >= (PATIENCE_S if live else BULK_PATIENCE_S) for live, waited in others)

    def _behind(self, name: str) -> bool:
        """Whether ``name``, waiting for a slot, lets another adapter go first: for bulk requests only, a live
        request's, until it has waited ``BULK_PATIENCE_S``; for a live one, a bulk request's that has waited that
        long."""
        now = self._now()
        live, since = self._waiting.get(name, (True, now))
        others = [(other_live, now - other_since) for waiting, (other_live, other_since) in self._waiting.items()
                  if waiting != name]
        if live:  # behind only a bulk request that has waited past its bound
            return any(not other_live and waited >= BULK_PATIENCE_S for other_live, waited in others)
        return now - since < BULK_PATIENCE_S and any(other_live for other_live, _ in others)

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    async def _wait_for_change(self) -> None:
        """Until the slots change, or a second passes (a live request's patience runs out on the clock)."""
        event = self._changed
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout=1.0)

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
