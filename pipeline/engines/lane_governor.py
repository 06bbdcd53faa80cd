"""How much of the model server the bulk lane may use beside live traffic: what keeps live latency within objectives.

A bulk lane's streams share every step of the model server with live ones, so a live request beside a saturated
lane waits for the step in progress and then decodes in steps made longer by the lane's rows and the prompt chunks
of each new bulk request. vLLM's priority scheduling orders its queue; it does not bound what running bulk rows
cost each step (docs/operations.md#the-bulk-lane). So the engine bounds them itself, from what live requests see:

* each live request's time from the pipeline's read of it to its first token (:meth:`LaneGovernor.first_token`),
  against ``live_first_token_slo_ms``: what the generate step's work items the lane's keys share, the steps in
  progress and the bulk prompts read beside it cost, beside what the request takes alone;
* each live stream's time between tokens (:meth:`LaneGovernor.inter_tokens`), against
  ``live_inter_token_slo_ms``: what every bulk row adds to each of its steps.

Both are what live traffic waits for where the lane shares a worker with it: the first token counts from the read
because the lane costs live requests before the server takes them too (its keys' polls share the generate step's
work items, which a runner that serves a step one bundle at a time queues: docs/architecture.md). The governor
sets two things, by additive increase and multiplicative decrease once a second, from the 95th percentile of each
of the last ``WINDOW_S`` (of the latencies begun since the last change: one begun before it cannot show its
effect):

* **the bulk stream cap**, how many bulk streams may run: the rows each step carries;
* **the bulk prompt budget**, how many bulk prompt tokens may start within a second: the prompt chunks each wave
  of new bulk streams puts into the steps live first tokens wait for. Unbounded until the first breach, which
  halves the lower of the budget and the rate the lane started prompts at over the window.

The rule, either objective counting (0 follows none of that kind):

* at ``NEAR`` (90 %) of an objective, before it is passed, the cap and the budget halve, and halve again only on
  latencies begun after, and after the bulk streams running came within the cap (what came before cannot show
  its effect). The lane shrinks within a second: the engine sheds the youngest bulk streams past the cap (vLLM's
  backend stops their attempts; each starts over, before any new bulk request, once the lane has room:
  :meth:`pipeline.engines.stream_registry.StreamRegistry.shed`), at the cost of the tokens they had generated,
  each stream once at most beside live traffic. Where the backend cannot stop an attempt (the in-process static
  batches), or the streams were spared, running streams end on their own;
* below ``HEADROOM`` of every objective, the cap grows by one if the lane wanted it since the last adjustment:
  it ran as many streams as its cap at some moment (streams that end and start at once leave it one short at
  times), or a bulk request waited for the cap (:meth:`LaneGovernor.wanted`: a static batch larger than the cap
  runs nothing until it fits); and
  the budget by one bulk prompt (the window's mean) while a bulk request waited for it within the second (a limit
  the lane does not meet tells nothing of what more would cost);
* between, both stay;
* with no live stream running and none sent for ``IDLE_S``, the cap is the lane's whole share (``bulk_streams``)
  and the budget unbounded: the lane takes everything while no live request is there to slow; the next live
  request sent puts back the limits live traffic last left.

It never goes below one stream, and one bulk request starts whatever its prompt when none started within the
second; a lane that live traffic alone keeps from running for ``BULK_STARVED_S`` starts one where the engine has any
room (the live reserve included), so a backlog always moves where the engine has room (no starvation: the lane's
rate is at worst one stream's).
Both objectives 0 turns the governor off: the cap is ``bulk_streams``, the fixed share ``live_reserve`` leaves, and
no budget. The cap, the budget (-1: unbounded) and the percentiles are the worker's load gauges; its counters
(:data:`TOTALS`, what the dashboard charts, as Cloud Monitoring charts no gauges) count the live latencies, those
past their objective and their sum in ms (a rate of one over a rate of the other is a mean), each decision (the
halvings, the growths, the openings to the whole share while live is idle, the starved lane's starts, and the
bulk streams shed), the cap over time (its rate is the cap), the bulk prompt tokens started, and the time governed
with the percentiles it acted on integrated over it (the rate of one over the rate of the time governed is their
mean).

The inter-token time is what the engine can see: the server streams an event every ``chunk_tokens`` tokens
(vLLM's ``stream_interval``), so each is the mean time per token over one event. A single long step (a bulk
prompt read beside a live stream) shows diluted by the event's other tokens; the first-token objective is what
bounds those.
"""

from __future__ import annotations

import collections
import math

# Live latencies older than this are not counted.
WINDOW_S = 10.0
# The most latencies of one kind a window keeps (inter-token times come one per token of every live stream).
WINDOW_SAMPLES = 4096
# How often the cap and the budget are adjusted, and the span the budget counts bulk prompt tokens over.
ADJUST_S = 1.0
# The cap and the budget grow only while every percentile is below this share of its objective.
HEADROOM = 0.7
# With no live stream sent for this long, the lane takes its whole share.
IDLE_S = 5.0
# What the rule acts on: a high percentile of a short window, the one the objective is stated for.
PERCENTILE = 0.95
# The lane halves once that percentile nears its objective: at this share of it, before it is passed.
NEAR = 0.9
# A bulk lane with no stream running and a request refused for this long starts one wherever the engine has room,
# the live reserve included (pipeline.engines.stream_registry.StreamRegistry.room).
BULK_STARVED_S = 30.0
# The governor's running totals, by the names the worker counts them under (pipeline.worker.load).
TOTALS = ("live_first_tokens", "live_first_tokens_over_objective", "live_first_token_ms", "live_inter_tokens",
          "live_inter_tokens_over_objective", "live_inter_token_ms", "bulk_lane_halvings", "bulk_lane_growths",
          "bulk_lane_idle_openings", "bulk_lane_starved_starts", "bulk_streams_shed", "bulk_cap_ms",
          "bulk_prompt_tokens_started", "lane_governed_ms", "live_first_token_p95_ms_ms", "live_inter_token_p95_ms_ms")


class LatencyWindow:
    """One kind of live latency, as (when measured, ms), for the last ``WINDOW_S``."""

    def __init__(self) -> None:
        self._samples: collections.deque[tuple[float, float]] = collections.deque(maxlen=WINDOW_SAMPLES)

    def add(self, now: float, ms: float) -> None:
        self._samples.append((now, ms))

    def percentile_ms(self, now: float, since: float = float("-inf")) -> float | None:
        """The window's percentile (of those whose span began after ``since``: a latency measured after a change
        but begun before it says nothing of it), or None with none."""
        while self._samples and now - self._samples[0][0] > WINDOW_S:
            self._samples.popleft()
        ordered = sorted(ms for at, ms in self._samples if at - ms / 1000.0 > since)
        if not ordered:
            return None
        return ordered[min(len(ordered) - 1, math.ceil(PERCENTILE * len(ordered)) - 1)]


class LaneGovernor:
    """The bulk lane's stream cap and prompt budget (module docstring); not thread-safe (the engine calls it under
    its lock). ``most`` is the lane's whole share of streams."""

    def __init__(self, objective_ms: float, most: int, inter_token_objective_ms: float = 0.0) -> None:
        self.objective_ms, self.inter_token_objective_ms, self.most = objective_ms, inter_token_objective_ms, most
        self.cap = most
        self.prompt_budget: float | None = None  # bulk prompt tokens a second; None: unbounded
        self._first_tokens, self._inter_tokens = LatencyWindow(), LatencyWindow()
        self._bulk_prompts: collections.deque[tuple[float, int]] = collections.deque()  # (started at, tokens)
        self._live_sent_at = float("-inf")
        self._adjusted_at = float("-inf")
        self._halved_at = float("-inf")  # latencies before this cannot show the last halving's effect
        self._over_cap_at = float("-inf")  # nor those before this, when more bulk streams ran than the cap
        self._budget_waited_at = float("-inf")  # when a bulk request last waited for the budget
        self._wanted = False  # since the last adjustment, the lane ran at its cap or a bulk request waited for it
        self._before_idle: tuple[int, float | None] | None = None  # the limits live traffic last left, while idle
        # Totals since the engine started, which the worker's steps count as Beam counters (pipeline.worker.load).
        self.totals = dict.fromkeys(TOTALS, 0)
        self._counted_at = float("-inf")  # up to when the totals integrated over time count
        # The percentiles the last adjustment acted on (ms; None: none measured), integrated over the time governed.
        self._acted_on: tuple[float | None, float | None] = (None, None)
        # The totals that add fractions (ms, and values integrated over time), each counting its whole part.
        self._sums = dict.fromkeys(("live_first_token_ms", "live_inter_token_ms", "bulk_cap_ms", "lane_governed_ms",
                                    "live_first_token_p95_ms_ms", "live_inter_token_p95_ms_ms"), 0.0)

    @property
    def governed(self) -> bool:
        return self.objective_ms > 0 or self.inter_token_objective_ms > 0

    @property
    def idle_open(self) -> bool:
        """Whether the lane runs its whole share because live is idle (the limits live left wait to come back)."""
        return self._before_idle is not None and self.governed

    def live_sent(self, now: float) -> None:
        """A live stream was sent to the server: a lane opened while live was idle goes back at once to the limits
        live traffic last left it (what it learned is kept, not learned again from a burst at the whole share)."""
        self._live_sent_at = now
        if self._before_idle is not None:
            if self.governed:
                self.cap, self.prompt_budget = self._before_idle
            self._before_idle = None

    def first_token(self, now: float, ms: float) -> None:
        """A live request's first token came ``ms`` after the pipeline read it
        (:meth:`~pipeline.engines.stream_registry.StreamRegistry.first_chunk`)."""
        self._first_tokens.add(now, ms)
        self.totals["live_first_tokens"] += 1
        self._add("live_first_token_ms", ms)
        self.totals["live_first_tokens_over_objective"] += 0 < self.objective_ms < ms

    def inter_tokens(self, now: float, ms: float, tokens: int) -> None:
        """A live stream's next ``tokens`` came ``ms`` after its last (one time per token: ``ms / tokens``)."""
        if tokens < 1:
            return
        each = ms / tokens
        self._inter_tokens.add(now, each)
        self.totals["live_inter_tokens"] += tokens
        self._add("live_inter_token_ms", ms)
        self.totals["live_inter_tokens_over_objective"] += tokens * (0 < self.inter_token_objective_ms < each)

    def _add(self, total: str, ms: float) -> None:
        self._sums[total] += ms
        self.totals[total] = int(self._sums[total])

    def percentile_ms(self, now: float, since: float = float("-inf")) -> float | None:
        """The window's live first-token percentile (of those after ``since``), or None with none."""
        return self._first_tokens.percentile_ms(now, since)

    def inter_token_percentile_ms(self, now: float) -> float | None:
        """The window's live inter-token percentile, or None with none."""
        return self._inter_tokens.percentile_ms(now)

    def bulk_cap(self, now: float, live_running: int = 0, bulk_running: int = 0) -> int:
        """How many bulk streams may run now (at least one), beside ``live_running`` live and ``bulk_running`` bulk
        streams."""
        if self._counted_at > float("-inf"):
            elapsed_ms = max(now - self._counted_at, 0.0) * 1000.0
            self._add("bulk_cap_ms", self.cap * elapsed_ms)
            if self.governed:
                self._integrate(elapsed_ms)
        self._counted_at = now
        if bulk_running >= self.cap:
            self._wanted = True
        if not self.governed:
            self.cap = self.most
        elif now - self._adjusted_at >= ADJUST_S:
            self._adjust(now, live_running, bulk_running)
        return self.cap

    def prompts_fitting(self, now: float, prompts: list[int], whole: bool = False) -> int:
        """How many of these bulk prompts (their tokens, in order) may start now within the budget: those whose
        tokens, with what started within ``ADJUST_S``, fit it; and the first whatever its size when none started
        within it. ``whole``: all of them or none (a static batch), all when none started within it. A bulk
        request left out is one that waited for the budget (it may grow)."""
        if self.prompt_budget is None or not prompts:
            return len(prompts)
        recent = self._started(now, ADJUST_S)
        room, taken = self.prompt_budget - recent, 0
        if whole:
            if recent and sum(prompts) > room:
                self._budget_waited_at = now
                return 0
            return len(prompts)
        for tokens in prompts:
            if tokens > room and (taken or recent):
                self._budget_waited_at = now
                break
            room, taken = room - tokens, taken + 1
        return taken

    def bulk_started(self, now: float, prompt_tokens: int) -> None:
        """A bulk stream of ``prompt_tokens`` prompt tokens started."""
        self._bulk_prompts.append((now, prompt_tokens))
        self.totals["bulk_prompt_tokens_started"] += prompt_tokens

    def _started(self, now: float, span_s: float) -> int:
        """Bulk prompt tokens started within ``span_s`` (at most ``WINDOW_S``) before ``now``."""
        while self._bulk_prompts and now - self._bulk_prompts[0][0] > WINDOW_S:
            self._bulk_prompts.popleft()
        return sum(tokens for at, tokens in self._bulk_prompts if now - at < span_s)

    def _integrate(self, elapsed_ms: float) -> None:
        """The time governed, and the percentiles acted on over it (their rate over its rate is their mean: what the
        dashboard charts, as Cloud Monitoring charts counters, not gauges); a percentile with none measured counts
        as 0."""
        first, inter = self._acted_on
        for total, value in (("lane_governed_ms", 1.0), ("live_first_token_p95_ms_ms", first or 0.0),
                             ("live_inter_token_p95_ms_ms", inter or 0.0)):
            self._add(total, value * elapsed_ms)

    def wanted(self) -> None:
        """A bulk request waited for the cap: the lane would use more than it may (it may grow at the next
        adjustment)."""
        self._wanted = True

    def _adjust(self, now: float, live_running: int, bulk_running: int) -> None:
        self._adjusted_at = now
        wanted, self._wanted = self._wanted, False  # the lane's use since the last adjustment counts
        self._acted_on = (self._first_tokens.percentile_ms(now), self._inter_tokens.percentile_ms(now))
        if not live_running and now - self._live_sent_at > IDLE_S:
            if (self.cap, self.prompt_budget) != (self.most, None):
                self.totals["bulk_lane_idle_openings"] += 1
                self._before_idle = (self.cap, self.prompt_budget)
            self.cap, self.prompt_budget = self.most, None
            return
        if bulk_running > self.cap:  # rows started before a halving still run: what live meets now is theirs
            self._over_cap_at = now
        fresh = self._pressure(now, since=max(self._halved_at, self._over_cap_at))
        if fresh is not None and fresh > NEAR:
            self._halved_at = now
            before = (self.cap, self.prompt_budget)
            self.cap = max(1, self.cap // 2)
            # From the lower of the budget and the rate the lane started prompts at: a budget above what the lane
            # used would halve to no effect.
            rate = self._started(now, WINDOW_S) * ADJUST_S / WINDOW_S
            limits = [limit for limit in (self.prompt_budget, rate) if limit]
            if limits:
                self.prompt_budget = max(1.0, min(limits) / 2)
            self.totals["bulk_lane_halvings"] += (self.cap, self.prompt_budget) != before
            return
        seen = self._pressure(now)
        if seen is None or seen >= HEADROOM:
            return
        before = (self.cap, self.prompt_budget)
        if wanted:
            self.cap = min(self.most, self.cap + 1)
        if self.prompt_budget is not None and now - self._budget_waited_at <= ADJUST_S:
            self.prompt_budget += self._mean_prompt(now)
        self.totals["bulk_lane_growths"] += (self.cap, self.prompt_budget) != before

    def shed(self, streams: int, now: float) -> None:
        """The engine stopped ``streams`` bulk streams that ran past the cap, to start them over within it: live
        latencies begun before now met them, and say nothing of the cap."""
        self.totals["bulk_streams_shed"] += streams
        self._over_cap_at = now

    def starved_start(self) -> None:
        """A lane that live traffic kept from running for ``BULK_STARVED_S`` started a request where it could."""
        self.totals["bulk_lane_starved_starts"] += 1

    def _pressure(self, now: float, since: float = float("-inf")) -> float | None:
        """The highest of each followed percentile over its objective (those after ``since``); None with none."""
        shares = [p / objective for window, objective in ((self._first_tokens, self.objective_ms),
                                                         (self._inter_tokens, self.inter_token_objective_ms))
                  if objective > 0 and (p := window.percentile_ms(now, since)) is not None]
        return max(shares, default=None)

    def _mean_prompt(self, now: float) -> float:
        """The mean bulk prompt of the window (at least one token)."""
        self._started(now, WINDOW_S)  # forgets those past the window
        if not self._bulk_prompts:
            return 1.0
        return max(1.0, sum(tokens for _, tokens in self._bulk_prompts) / len(self._bulk_prompts))
