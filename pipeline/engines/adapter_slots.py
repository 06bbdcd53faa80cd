"""Which of a root's LoRA adapters the worker's server holds now: loaded on first use, once, and a bounded few.

vLLM loads an adapter while it runs (``POST /v1/load_lora_adapter``) and forgets it when it restarts. The engine
asks :class:`AdapterSlots` for an adapter before it sends a request that names one of ``lora_adapter_root``'s
(:mod:`pipeline.serving.adapter_root`): the first ask fetches, checks and loads it, and every ask that comes
meanwhile waits for that one load instead of starting its own. At most ``capacity`` are loaded at once: on the
CPU build that keeps the last of vLLM's adapter slots empty (vllm-project/vllm#48421, see ``ServerSpec.command``),
and on a GPU it bounds the memory adapters take. Past it, the least recently used adapter that no stream is
using is unloaded (``/v1/unload_lora_adapter``): its next request pays the load again, the copy on disk kept. When
every loaded adapter is in use, a request for another waits until a stream ends. A server that restarted has
forgotten them all (:meth:`AdapterSlots.forget`).

Everything here runs on the engine's event loop, so its bookkeeping needs no lock; fetching (a copy from Cloud
Storage, a check of files) runs on the loop's executor.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Awaitable, Callable

LOGGER = logging.getLogger(__name__)


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
        self._loading: dict[str, asyncio.Future[None]] = {}
        self._unloading: dict[str, asyncio.Future[None]] = {}  # still holding its slot at the server
        self._placing: set[str] = set()  # fetched and checked, a slot taken for it, being loaded
        self._changed = asyncio.Event()

    def loaded(self) -> list[str]:
        """The adapters loaded now, least recently used first."""
        return list(self._loaded)

    async def acquire(self, name: str) -> None:
        """Returns once ``name`` is loaded, counted as used by one more stream until :meth:`release`."""
        while True:
            if name in self._loaded:
                self._loaded[name] += 1
                self._loaded.move_to_end(name)
                return
            if name in self._loading:
                await asyncio.shield(self._loading[name])  # the one load under way: its outcome is ours
                continue
            if name in self._unloading:  # loaded again only once the server has let it go
                await asyncio.shield(self._unloading[name])
                continue
            await self._load_once(name)

    def release(self, name: str) -> None:
        """One stream no longer uses ``name``."""
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

    def forget_one(self, name: str) -> None:
        """The server no longer knows ``name`` (it answered that it does not): loaded again on its next use."""
        self._loaded.pop(name, None)
        self._wake()

    async def _load_once(self, name: str) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._loading[name] = future
        try:
            # Fetched and checked first: a name that cannot be served never unloads one that can.
            path = await asyncio.get_running_loop().run_in_executor(None, self._fetch, name)
            while len(self._loaded) + len(self._unloading) + len(self._placing) >= self.capacity:
                if not await self._make_room():
                    await self._wait_for_change()
            self._placing.add(name)
            await self._load(name, path)
        except asyncio.CancelledError:
            future.set_result(None)  # its stream was cancelled, not theirs: a waiter loads it in its place
            raise
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: the waiters raise it themselves
            raise
        else:
            self._loaded[name] = 0
            future.set_result(None)
        finally:
            self._placing.discard(name)
            del self._loading[name]
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

    async def _wait_for_change(self) -> None:
        event = self._changed
        await event.wait()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
