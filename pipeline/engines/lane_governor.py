"""How many bulk streams the engine runs beside live traffic: as many as keep live first tokens within the objective.

A bulk lane's streams share every step of the model server with live ones, so a live request beside a saturated
lane waits for the step in progress and then decodes in steps made longer by the lane's rows and the prompt chunks
of each new bulk request. vLLM's priority scheduling orders its queue; it does not bound what running bulk rows
cost each step (docs/operations.md#the-bulk-lane). So the engine bounds them itself, from what live requests see:
each live stream's time from the server taking it to its first token (:meth:`LaneGovernor.first_token`), the
interference the lane causes and nothing else (not the queue in front of the engine, which admission bounds).

The rule is additive increase, multiplicative decrease on the bulk lane's stream cap, adjusted once a second from
the 90th percentile of the live first tokens of the last ``WINDOW_S``:

* above ``live_first_token_slo_ms``, the cap halves (it shrinks within seconds), and halves again only on first
  tokens that came after (a halving stops new bulk streams; what came before it cannot show its effect);
* below ``HEADROOM`` of it, the cap grows by one, while the lane runs as many streams as its cap (a cap it does
  not use tells nothing of what more would cost);
* between, it stays;
* with no live stream running and none sent for ``IDLE_S``, the cap is the lane's whole share (``bulk_streams``):
  the lane takes everything while no live request is there to slow.

It never goes below one stream, and a lane that live traffic alone keeps from running for ``BULK_STARVED_S``
starts one where the engine has any room (the live reserve included), so a backlog always moves (no starvation:
the lane's rate is at worst one stream's).
An objective of 0 turns the governor off: the cap is ``bulk_streams``, the fixed share ``live_reserve`` leaves.
The cap and the percentile it acts on are the worker's load gauges ``bulk_cap`` and ``live_first_token_p90_ms``;
its counters (what the dashboard charts) ``live_first_tokens``, ``live_first_tokens_over_objective`` and
``bulk_lane_halvings``.
"""

from __future__ import annotations

import collections
import math

# Live first tokens older than this are not counted.
WINDOW_S = 10.0
# How often the cap is adjusted.
ADJUST_S = 1.0
# The cap grows only while the percentile is below this share of the objective.
HEADROOM = 0.7
# With no live stream sent for this long, the lane takes its whole share.
IDLE_S = 5.0
# What the rule acts on: a high percentile of a short window (a few live requests a second are enough).
PERCENTILE = 0.9
# A bulk lane with no stream running and a request refused for this long starts one wherever the engine has room,
# the live reserve included (pipeline.engines.stream_registry.StreamRegistry.room).
BULK_STARVED_S = 30.0


class LaneGovernor:
    """The bulk lane's stream cap (module docstring); not thread-safe (the engine calls it under its lock)."""

    def __init__(self, objective_ms: float, most: int) -> None:
        self.objective_ms, self.most = objective_ms, most
        self.cap = most
        self._first_tokens: collections.deque[tuple[float, float]] = collections.deque()  # (at, ms)
        self._live_sent_at = float("-inf")
        self._adjusted_at = float("-inf")
        self._halved_at = float("-inf")  # first tokens before this cannot show the last halving's effect
        # Totals since the engine started, which the worker's steps count as Beam counters (pipeline.worker.load).
        self.live_first_tokens = self.live_over_objective = self.halvings = 0

    def live_sent(self, now: float) -> None:
        """A live stream was sent to the server."""
        self._live_sent_at = now

    def first_token(self, now: float, ms: float) -> None:
        """A live stream's first token came ``ms`` after the server took it."""
        self._first_tokens.append((now, ms))
        self.live_first_tokens += 1
        self.live_over_objective += 0 < self.objective_ms < ms

    def percentile_ms(self, now: float, since: float = float("-inf")) -> float | None:
        """The window's live first-token percentile (of those after ``since``), or None with none."""
        while self._first_tokens and now - self._first_tokens[0][0] > WINDOW_S:
            self._first_tokens.popleft()
        ordered = sorted(ms for at, ms in self._first_tokens if at > since)
        if not ordered:
            return None
        return ordered[min(len(ordered) - 1, math.ceil(PERCENTILE * len(ordered)) - 1)]

    def bulk_cap(self, now: float, live_running: int = 0, bulk_running: int = 0) -> int:
        """How many bulk streams may run now (at least one), beside ``live_running`` live and ``bulk_running`` bulk
        streams."""
        if self.objective_ms <= 0:
            return self.most
        if now - self._adjusted_at >= ADJUST_S:
            self._adjusted_at = now
            self.cap = self._adjusted(now, live_running, bulk_running)
        return self.cap

    def _adjusted(self, now: float, live_running: int, bulk_running: int) -> int:
        if not live_running and now - self._live_sent_at > IDLE_S:
            return self.most
        if (fresh := self.percentile_ms(now, since=self._halved_at)) is not None and fresh > self.objective_ms:
            self.halvings += self.cap > 1
            self._halved_at = now
            return max(1, self.cap // 2)
        seen = self.percentile_ms(now)
        if seen is not None and seen < HEADROOM * self.objective_ms and bulk_running >= self.cap:
            return min(self.most, self.cap + 1)
        return self.cap
