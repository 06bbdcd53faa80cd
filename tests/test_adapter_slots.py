"""The policy of which root adapters a server holds (pipeline/engines/adapter_slots.py), on its own event loop.

The server's side is a record of the load and unload calls the policy makes, each taking a moment as an HTTP
call would: what is tested is the policy (one load per adapter, the bound, the order of eviction, waiting,
cancellation), not vLLM, which tests/test_lora_e2e.py serves the same policy with.
"""

from __future__ import annotations

import asyncio

import pytest

from pipeline.engines.adapter_slots import AdapterSlots
from pipeline.serving.adapter_root import AdapterUnavailable


class Server:
    """What the policy asked of the server, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def fetch(self, name: str) -> str:
        if name.startswith("bad"):
            raise AdapterUnavailable(f"adapter {name!r}: no adapter")
        return f"/copies/{name}"

    async def load(self, name: str, path: str) -> None:
        await asyncio.sleep(0.02)
        self.calls.append(("load", name))

    async def unload(self, name: str) -> None:
        await asyncio.sleep(0.02)
        self.calls.append(("unload", name))


def slots(server: Server, capacity: int = 1) -> AdapterSlots:
    return AdapterSlots(capacity, server.fetch, server.load, server.unload)


def test_many_first_uses_at_once_load_once():
    async def run() -> list[tuple[str, str]]:
        server = Server()
        held = slots(server)
        await asyncio.gather(*(held.acquire("a") for _ in range(5)))
        assert held.loaded() == ["a"]
        return server.calls

    assert asyncio.run(run()) == [("load", "a")]


def test_past_the_bound_the_least_recently_used_idle_adapter_goes_and_one_in_use_never_does():
    async def run() -> None:
        server = Server()
        held = slots(server, capacity=2)
        await held.acquire("a")
        await held.acquire("b")
        held.release("b")
        await held.acquire("c")  # a is in use: b, idle, goes
        assert server.calls[-2:] == [("unload", "b"), ("load", "c")] and held.loaded() == ["a", "c"]
        waiting = asyncio.create_task(held.acquire("d"))  # both in use: it waits for a stream to end
        await asyncio.sleep(0.1)
        assert not waiting.done() and ("load", "d") not in server.calls
        held.release("a")
        await asyncio.wait_for(waiting, 1)
        assert server.calls[-2:] == [("unload", "a"), ("load", "d")] and held.loaded() == ["c", "d"]

    asyncio.run(run())


def test_a_name_that_cannot_be_served_unloads_nothing_and_every_asker_gets_the_reason():
    async def run() -> None:
        server = Server()
        held = slots(server)
        await held.acquire("a")
        held.release("a")
        outcomes = await asyncio.gather(held.acquire("bad"), held.acquire("bad"), return_exceptions=True)
        assert all(isinstance(outcome, AdapterUnavailable) for outcome in outcomes), outcomes
        assert server.calls == [("load", "a")] and held.loaded() == ["a"]

    asyncio.run(run())


def test_a_first_asker_cancelled_mid_load_leaves_the_load_to_the_next():
    async def run() -> None:
        server = Server()
        held = slots(server)
        first = asyncio.create_task(held.acquire("a"))
        second = asyncio.create_task(held.acquire("a"))
        await asyncio.sleep(0.005)  # the first is loading, the second waits for it
        first.cancel()
        await asyncio.wait_for(second, 1)  # not cancelled with it
        with pytest.raises(asyncio.CancelledError):
            await first
        assert held.loaded() == ["a"]

    asyncio.run(run())


def test_a_restarted_server_has_forgotten_them_and_each_is_loaded_again_on_its_next_use():
    async def run() -> list[tuple[str, str]]:
        server = Server()
        held = slots(server)
        await held.acquire("a")
        held.release("a")
        held.forget()
        assert held.loaded() == []
        await held.acquire("a")
        return server.calls

    assert asyncio.run(run()) == [("load", "a"), ("load", "a")]
