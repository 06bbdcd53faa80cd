"""Stream leases: when the engine may give up a stream its key no longer polls, and why a pause is not a move.

A key's streams live on the worker that serves the key. When Dataflow moves the key, the old worker's streams
are never polled again and must be cancelled, or they hold KV cache for nothing; when the worker is merely
paused (a long GC, a stopped or live-migrated VM, a clock step) or its timers are late, they must be kept, or
every request in flight is generated again. The two look alike on a wall clock. The evidence that tells them
apart is whether the worker went on polling other streams meanwhile, so the lease runs on two clocks that
the engine's janitor advances tick by tick on the monotonic clock:

* ``awake_s``: time the process was awake; a tick that overslept (the process was paused) counts as two ticks
  at most;
* ``alive_s``: the part of it in which the generate step polled anything at all on this worker.

A running stream expires when the worker polled others for ``lease_s`` of alive time and not it, or when no
stream of the worker was polled for ``ABANDONED_LEASES`` leases of awake time (every key left). A finished
stream holds only its outputs: it is kept for ``finished_s`` of awake time, so a late poll collects it.
"""

from __future__ import annotations

from dataclasses import dataclass

ABANDONED_LEASES = 3

Stamp = tuple[float, float]  # (awake_s, alive_s) when a stream was last polled, submitted or joined


@dataclass
class LeaseClocks:
    """The two lease clocks of one engine, and the rule that reads them. Not thread-safe: the engine locks."""

    lease_s: float
    finished_s: float
    awake_s: float = 0.0
    alive_s: float = 0.0
    polled: bool = False  # a poll arrived since the last tick

    def stamp(self) -> Stamp:
        return self.awake_s, self.alive_s

    def tick(self, elapsed_s: float, tick_s: float) -> None:
        """One janitor tick that took ``elapsed_s`` of monotonic time, for a tick of ``tick_s``."""
        step = min(max(elapsed_s, 0.0), 2 * tick_s)
        self.awake_s += step
        if self.polled:
            self.alive_s += step
        self.polled = False

    def expired(self, stamp: Stamp, done: bool) -> bool:
        awake_at, alive_at = stamp
        if done:
            return self.awake_s - awake_at >= max(self.lease_s, self.finished_s)
        return (self.alive_s - alive_at >= self.lease_s
                or self.awake_s - awake_at >= ABANDONED_LEASES * self.lease_s)
