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


def test_a_stream_cancelled_while_the_server_loads_its_adapter_leaves_it_counted_and_let_go_in_turn():
    """The server takes an adapter whose stream was cancelled mid-load: the slots count it (unused), so a load of
    another first lets it go, and the server never holds more than the slots."""
    class SlowServer(Server):
        def __init__(self) -> None:
            super().__init__()
            self.loading = asyncio.Event()

        async def load(self, name: str, path: str) -> None:
            self.loading.set()
            await asyncio.sleep(0.2)
            self.calls.append(("load", name))

    async def run() -> list[tuple[str, str]]:
        server = SlowServer()
        held = slots(server)
        first = asyncio.ensure_future(held.acquire("a"))
        await server.loading.wait()
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        await asyncio.sleep(0.4)  # the server finishes loading it
        assert held.loaded() == ["a"] and held.needing_copies() == {"a"}, "loaded: vLLM may read its copy again"
        await asyncio.wait_for(held.acquire("b"), 5)
        return server.calls

    assert asyncio.run(run()) == [("load", "a"), ("unload", "a"), ("load", "b")]


def test_the_streams_of_a_forgotten_load_neither_free_nor_forget_the_load_that_replaced_it():
    """A restart forgets the adapter while a stream of it runs; a new stream loads it again. The old stream's end
    must not count as the new one's (the one slot would then look free, and the adapter in use be unloaded for
    another), nor may the 404 an old stream met drop the new load."""
    async def run() -> list[tuple[str, str]]:
        server = Server()
        held = slots(server)
        old = await held.acquire("a")
        held.forget()  # the server restarted under the old stream
        new = await held.acquire("a")  # loaded again, in use by the new stream
        assert new != old
        held.release("a", old)  # the old stream ends
        held.forget_one("a", old)  # and reports the 404 it met from the restarted server
        assert held.loaded() == ["a"]
        with pytest.raises(TimeoutError):  # "a" is still in use: "b" waits, nothing is unloaded
            await asyncio.wait_for(held.acquire("b"), 0.3)
        held.release("a", new)
        assert await asyncio.wait_for(held.acquire("b"), 5) > new
        return server.calls

    assert asyncio.run(run()) == [("load", "a"), ("load", "a"), ("unload", "a"), ("load", "b")]


def test_a_backfill_on_one_adapter_lets_a_live_request_for_another_through():
    """One slot, adapter a busy with a backfill's streams that keep coming: a live request for b waits only for
    a's streams in progress, since no bulk stream joins a while b waits; the backfill's next stream of a waits
    in turn for b's."""
    async def run() -> list[tuple[str, str]]:
        server = Server()
        held = slots(server)
        await held.acquire("a", bulk=True)
        live = asyncio.ensure_future(held.acquire("b"))
        await asyncio.sleep(0.05)
        joining = asyncio.ensure_future(held.acquire("a", bulk=True))
        await asyncio.sleep(0.05)
        assert not joining.done(), "a bulk stream joins no adapter while a live request waits for a slot"
        held.release("a")  # the stream in progress ends
        await asyncio.wait_for(live, 1.0)
        assert held.loaded() == ["b"] and not joining.done()
        held.release("b")
        await asyncio.wait_for(joining, 2.0)
        return server.calls

    assert asyncio.run(run()) == [("load", "a"), ("unload", "a"), ("load", "b"), ("unload", "b"), ("load", "a")]


def test_a_live_request_waits_for_a_slot_no_longer_than_the_patience_and_the_streams_in_progress(monkeypatch):
    """Live streams of a loaded adapter keep joining it while a live request for another waits, until it has
    waited PATIENCE_S: then none joins, and the one in progress ending gives the slot up."""
    monkeypatch.setattr("pipeline.engines.adapter_slots.PATIENCE_S", 0.3)

    async def run() -> None:
        server = Server()
        held = slots(server)
        await held.acquire("a")
        other = asyncio.ensure_future(held.acquire("b"))
        await asyncio.sleep(0.05)
        await asyncio.wait_for(held.acquire("a"), 0.5)  # within its patience: a live stream joins a
        held.release("a")
        await asyncio.sleep(0.4)
        late = asyncio.ensure_future(held.acquire("a"))
        await asyncio.sleep(0.05)
        assert not late.done(), "past its patience, no stream joins a"
        held.release("a")
        await asyncio.wait_for(other, 1.0)
        assert held.loaded() == ["b"]
        held.release("b")
        await asyncio.wait_for(late, 2.0)

    asyncio.run(run())


def test_a_bulk_request_waiting_for_a_slot_lets_a_live_one_go_first():
    async def run() -> list[str]:
        server = Server()
        held = slots(server)
        await held.acquire("a")
        bulk = asyncio.ensure_future(held.acquire("c", bulk=True))
        await asyncio.sleep(0.05)
        live = asyncio.ensure_future(held.acquire("b"))
        await asyncio.sleep(0.05)
        held.release("a")
        await asyncio.wait_for(live, 1.0)
        assert not bulk.done()
        held.release("b")
        await asyncio.wait_for(bulk, 2.0)
        return [name for call, name in server.calls if call == "load"]

    assert asyncio.run(run()) == ["a", "b", "c"]


def test_bulk_requests_for_several_adapters_at_once_are_each_served_and_none_is_loaded_for_nothing():
    """A backfill with an adapter per customer: with one slot, bulk requests for a, b and c at once are served one
    adapter after another as each one's stream ends; no adapter is unloaded before the request that loaded it
    used it (the review's livelock: 121 loads in 5 s, none served)."""
    async def run() -> list[tuple[str, str]]:
        server = Server()
        held = slots(server)
        asked = {name: asyncio.ensure_future(held.acquire(name, bulk=True)) for name in "abc"}
        served: list[str] = []
        for _ in range(3):
            done, _ = await asyncio.wait([f for f in asked.values() if not f.done()] or [asyncio.sleep(0)],
                                         timeout=3.0, return_when=asyncio.FIRST_COMPLETED)
            name = next(n for n, f in asked.items() if f.done() and n not in served)
            served.append(name)
            held.release(name)
        assert sorted(served) == ["a", "b", "c"]
        return server.calls

    calls = asyncio.run(run())
    assert [call for call, _ in calls].count("load") == 3, calls


def test_a_bulk_request_waits_for_a_slot_no_longer_than_its_bound_beside_steady_live_traffic(monkeypatch):
    """One slot, live streams of adapter a that keep coming, and live requests for b now and then: a bulk request
    for c lets them go first, but once it has waited BULK_PATIENCE_S no new stream joins a, it goes before a live
    request for b that waits, and it gets the slot when a's streams in progress end."""
    monkeypatch.setattr("pipeline.engines.adapter_slots.PATIENCE_S", 10.0)
    monkeypatch.setattr("pipeline.engines.adapter_slots.BULK_PATIENCE_S", 0.4)

    async def run() -> list[str]:
        server = Server()
        held = slots(server)
        await held.acquire("a")
        bulk = asyncio.ensure_future(held.acquire("c", bulk=True))
        await asyncio.sleep(0.05)
        for _ in range(3):  # within the bulk bound: live streams keep joining a, one ending as the next starts
            await asyncio.wait_for(held.acquire("a"), 0.5)
            held.release("a")
            await asyncio.sleep(0.05)
        assert not bulk.done()
        await asyncio.sleep(0.3)  # past it
        late = asyncio.ensure_future(held.acquire("a"))
        live_b = asyncio.ensure_future(held.acquire("b"))
        await asyncio.sleep(0.05)
        assert not late.done(), "past a bulk request's bound, no live stream joins another adapter"
        held.release("a")  # the stream in progress ends
        await asyncio.wait_for(bulk, 1.0)
        assert held.loaded() == ["c"] and not live_b.done(), "the bulk request that waited its bound goes first"
        held.release("c")
        for _ in range(2):  # then the two live requests, one slot after the other
            done, _ = await asyncio.wait([f for f in (live_b, late) if not f.done()], timeout=2.0,
                                         return_when=asyncio.FIRST_COMPLETED)
            assert done, "a live request waited on after the bulk one was served"
            held.release("b" if live_b in done else "a")
        return [name for call, name in server.calls if call == "load"]

    loads = asyncio.run(run())
    assert loads[:2] == ["a", "c"] and sorted(loads[2:]) == ["a", "b"], loads


def test_a_bulk_request_whose_earlier_load_failed_waits_afresh_behind_live_ones(monkeypatch):
    """A bulk request's wait counts from when it asked: one whose adapter failed to load long ago does not come
    back past BULK_PATIENCE_S and go ahead of a live request waiting for another adapter."""
    monkeypatch.setattr("pipeline.engines.adapter_slots.BULK_PATIENCE_S", 0.3)

    class FailingOnce(Server):
        failed = False

        async def load(self, name: str, path: str) -> None:
            if name == "flaky" and not self.failed:
                self.failed = True
                raise RuntimeError("the server could not load it")
            await super().load(name, path)

    async def run() -> list[str]:
        server = FailingOnce()
        held = slots(server)
        with pytest.raises(RuntimeError):
            await held.acquire("flaky", bulk=True)
        await asyncio.sleep(0.4)  # past the bulk bound since that first ask
        await held.acquire("a")
        live = asyncio.ensure_future(held.acquire("b"))
        await asyncio.sleep(0.05)
        bulk = asyncio.ensure_future(held.acquire("flaky", bulk=True))
        await asyncio.sleep(0.05)
        held.release("a")
        await asyncio.wait_for(live, 1.0)
        assert not bulk.done(), "the bulk request waits behind the live one"
        held.release("b")
        await asyncio.wait_for(bulk, 2.0)
        return [name for call, name in server.calls if call == "load"]

    assert asyncio.run(run()) == ["a", "b", "flaky"]


def test_a_live_request_that_joins_a_bulk_requests_load_is_waited_for_as_live():
    """A bulk request fetches adapter c (its copy takes a while) when a live request for c arrives: c then waits
    for a slot as a live request's, so no new bulk stream joins adapter a, which holds the slot, meanwhile."""
    import time as clock

    class SlowCopies(Server):
        def fetch(self, name: str) -> str:
            clock.sleep(0.2)
            return super().fetch(name)

    async def run() -> list[str]:
        server = SlowCopies()
        held = slots(server)
        await held.acquire("a", bulk=True)
        fetching = asyncio.ensure_future(held.acquire("c", bulk=True))
        await asyncio.sleep(0.05)
        live = asyncio.ensure_future(held.acquire("c"))  # joins c's load while c is still being copied
        await asyncio.sleep(0.4)  # copied: c waits for the slot a holds
        joining = asyncio.ensure_future(held.acquire("a", bulk=True))
        await asyncio.sleep(0.1)
        assert not joining.done(), "a bulk stream joined a while a live request waited for c"
        held.release("a")
        await asyncio.wait_for(asyncio.gather(fetching, live), 2.0)
        held.release("c")
        held.release("c")
        await asyncio.wait_for(joining, 2.0)
        return [name for call, name in server.calls if call == "load"]

    assert asyncio.run(run()) == ["a", "c", "a"]


def test_a_copy_that_does_not_fit_beside_the_loaded_adapters_unloads_an_idle_one_first():
    """Two slots, a disk budget of two copies: a and b loaded, a idle. c's copy does not fit beside theirs, so the
    slots unload a (its copy may then go) and c is copied and loaded; with both in use, c waits instead."""
    from pipeline.serving.adapter_root import AdapterWaitsForRoom

    class Disk(Server):
        def __init__(self, held: AdapterSlots | None = None) -> None:
            super().__init__()
            self.slots = held

        def fetch(self, name: str) -> str:
            if self.slots is not None and len(self.slots.needing_copies() - {name}) >= 2:
                raise AdapterWaitsForRoom(f"adapter {name!r} does not fit now beside the adapters held")
            return super().fetch(name)

    async def run() -> list[tuple[str, str]]:
        server = Disk()
        held = AdapterSlots(2, server.fetch, server.load, server.unload)
        server.slots = held
        await held.acquire("a")
        await held.acquire("b")
        held.release("a")
        await asyncio.wait_for(held.acquire("c"), 2.0)
        assert held.loaded() == ["b", "c"]
        with pytest.raises(AdapterWaitsForRoom):  # b and c in use: nothing to unload, the request is tried again
            await asyncio.wait_for(held.acquire("d"), 2.0)
        return server.calls

    assert asyncio.run(run()) == [("load", "a"), ("load", "b"), ("unload", "a"), ("load", "c")]
