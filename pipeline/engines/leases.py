"""Stream leases: when the engine may give up a stream its key no longer polls, and why a pause is not a move.

A key's streams live on the worker that serves the key. When Dataflow moves the key, the old worker's streams
are never polled again and must be cancelled, or they hold KV cache for nothing; when the process that polls
them is merely paused (a long GC, memory pressure, a stopped or live-migrated VM, a clock step) or its timers
are late, they must be kept, or every request in flight is generated again. The two look alike on a wall clock.
The evidence that tells them apart is whether that process went on polling other streams meanwhile. A worker
VM runs several SDK processes that share one engine, and one of them can pause while the others poll, so the
evidence is kept per calling process (a *client*), on clocks the engine's janitor advances tick by tick on the
monotonic clock:

* the host's ``awake_s``: time the engine's own process was awake; a tick that overslept (the process was
  paused) counts as two ticks at most;
* per client, its ``awake_s``: the part of that in which the client was heard (it polled, submitted, or sent
  the heartbeat every live SDK process sends, :mod:`pipeline.worker.runtime`): a paused client's stops;
* per client, its ``alive_s``: the part in which its generate step polled anything at all.

A running stream expires when the client that last polled it polled others for ``lease_s`` of its alive time
and not it, or polled none for ``ABANDONED_LEASES`` leases of its awake time (every key left it), or was not
heard at all for ``finished_s`` of the host's awake time (the process is gone, not paused). A finished stream
holds only its outputs: it is kept for ``finished_s`` of the host's awake time, so a late poll collects it, and
at most :func:`finished_kept` of them are kept (a completion holds its prompt: up to 200,000 characters), the
longest-kept forgotten first (:func:`overflowing`).

A drain holds every running stream (:meth:`LeaseClocks.hold`): its keys are drained one work item at a time,
each polling only its own streams for up to ``drain_timeout_s``, which would read to the lease as every other
key having moved away; each pass of a drain asks again, so the hold lasts until ``drain_timeout_s`` after
the last (a finished stream is kept for ``finished_s`` all the same). Keys do not move while a job drains, and
the job ends after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ABANDONED_LEASES = 3
# The client of callers in the engine's own process (or that name none): heard whenever the host is awake.
IN_PROCESS = ""

# (host awake_s, client, the client's awake_s, the client's alive_s) when a stream was last polled, submitted or
# joined by that client.
Stamp = tuple[float, str, float, float]


def finished_kept(max_in_flight: int) -> int:
    """How many finished streams an engine keeps for a late poll: four times what it runs at once, at least 64."""
    return max(4 * max_in_flight, 64)


def overflowing(finished: list[tuple[str, Stamp]], most: int) -> list[str]:
    """Of the finished streams (key, last stamp), those past the ``most`` kept: the longest-kept first."""
    if len(finished) <= most:
        return []
    return [key for _, key in sorted((stamp, key) for key, stamp in finished)[:len(finished) - most]]


@dataclass
class ClientClocks:
    """One calling process's clocks (see the module docstring), and what it did since the last tick."""

    awake_s: float = 0.0
    alive_s: float = 0.0
    unheard_s: float = 0.0  # host awake time since it was last heard
    heard: bool = False
    polled: bool = False


@dataclass
class LeaseClocks:
    """The lease clocks of one engine, and the rule that reads them. Not thread-safe: the engine locks."""

    lease_s: float
    finished_s: float
    awake_s: float = 0.0
    clients: dict[str, ClientClocks] = field(default_factory=dict)
    held_until: float = 0.0  # host awake time before which no running stream expires (a drain)

    def heard(self, client: str, *, polled: bool = False) -> None:
        """The client called (``polled``: its generate step polled streams)."""
        clocks = self.clients.setdefault(client, ClientClocks())
        clocks.heard = True
        clocks.polled = clocks.polled or polled

    def stamp(self, client: str) -> Stamp:
        clocks = self.clients.setdefault(client, ClientClocks())
        return self.awake_s, client, clocks.awake_s, clocks.alive_s

    def tick(self, elapsed_s: float, tick_s: float) -> None:
        """One janitor tick that took ``elapsed_s`` of monotonic time, for a tick of ``tick_s``."""
        step = min(max(elapsed_s, 0.0), 2 * tick_s)
        self.awake_s += step
        for client, clocks in self.clients.items():
            if clocks.heard or client == IN_PROCESS:
                clocks.awake_s += step
                clocks.unheard_s = 0.0
            else:
                clocks.unheard_s += step
            if clocks.polled:
                clocks.alive_s += step
            clocks.heard = clocks.polled = False

    def hold(self, for_s: float) -> None:
        """No running stream expires for the next ``for_s`` of awake time (a drain); a later hold extends it."""
        self.held_until = max(self.held_until, self.awake_s + for_s)

    def expired(self, stamp: Stamp, done: bool) -> bool:
        host_awake_at, client, awake_at, alive_at = stamp
        if done:
            return self.awake_s - host_awake_at >= max(self.lease_s, self.finished_s)
        if self.awake_s < self.held_until:
            return False
        clocks = self.clients.get(client, ClientClocks())
        return (clocks.alive_s - alive_at >= self.lease_s
                or clocks.awake_s - awake_at >= ABANDONED_LEASES * self.lease_s
                or clocks.unheard_s >= max(self.finished_s, ABANDONED_LEASES * self.lease_s))

    def forget_silent(self) -> None:
        """Drops the clocks of clients not heard for twice ``finished_s`` (their streams expired at ``finished_s``)."""
        for client in [c for c, clocks in self.clients.items() if clocks.unheard_s > 2 * self.finished_s
                       and c != IN_PROCESS]:
            del self.clients[client]
