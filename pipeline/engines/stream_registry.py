"""The engine's registry of streams: plain logic, no threads, no lock, no clock of its own, no I/O.

Everything an engine knows about its streams lives here: each stream's request, attempt and window of outputs
not yet released, the one ``max_in_flight`` rule (:meth:`StreamRegistry.room`), the lease clocks
(:mod:`pipeline.engines.leases`), what each stream cost of the model's time
(:mod:`pipeline.engines.accelerator_time`), which streams a poll, a cancel or an expiry takes out, and which bulk
streams the lane sheds to start over (:meth:`StreamRegistry.shed`). The engine
(:mod:`pipeline.engines.engine`) holds one behind its lock and around it the I/O: its backend starts and cancels
streams at the model, its chunk clock and publisher send chunks on. Every call here is given the time it acts at,
so the same registry runs under a simulated clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.contract.chunking import ChunkAssembler
from pipeline.contract.messages import InferenceRequest
from pipeline.contract.stream_progress import UNKNOWN, OutputWindow
from pipeline.engines.accelerator_time import BusyShares
from pipeline.engines.engine_settings import EngineSettings
from pipeline.engines.lane_governor import BULK_STARVED_S, LaneGovernor
from pipeline.engines.leases import LeaseClocks, Stamp, finished_kept, overflowing
from pipeline.intake.prompt_length import estimate_tokens

# A stream the lane shed that has not asked to run again for this long (a retry's back-off) is passed over.
SHED_ASKING_S = 1.0


@dataclass
class Stream:
    key: str
    request: InferenceRequest
    attempt: int
    window: OutputWindow = field(default_factory=OutputWindow)  # outputs not yet released by the caller
    assembler: ChunkAssembler | None = None
    done: bool = False
    lease: Stamp = (0.0, "", 0.0, 0.0)  # the lease clocks when this stream was last polled, submitted or joined
    sent_at: float | None = None  # when the model first took it (wall clock): what it waited before is its queue
    taken_mono: float | None = None  # when the model took its first attempt (monotonic), until its first token
    last_token: tuple[float, int] | None = None  # (when, tokens so far) of its last text, from its first token on
    accelerator_s: float = 0.0  # its share of the model's busy time, every attempt (pipeline.engines.accelerator_time)
    running_since: float = 0.0  # when it started (monotonic): the lane sheds the youngest first
    spared: bool = False  # shed once and started over beside live traffic: never shed again, so it ends


class StreamRegistry:
    """One engine's streams; not thread-safe (the engine calls it under its lock).

    ``instance`` names the engine in every stream's key; ``whole_batches``: a batch is taken whole or not at all
    (static batching), else any of it that fits; ``preempts``: the backend can stop a running stream's attempt and
    start it over later (:meth:`shed`), else a lane shrinks only as its running streams end.
    """

    def __init__(self, settings: EngineSettings, instance: str, *, whole_batches: bool = False,
                 preempts: bool = False) -> None:
        self.settings, self.instance, self.whole_batches, self.preempts = settings, instance, whole_batches, preempts
        self.streams: dict[str, Stream] = {}
        self.unfinished = 0  # streams not yet done: what max_in_flight bounds
        self.bulk_unfinished = 0  # of them, the bulk lane's: what the lane's cap bounds (the shed ones included)
        self.shed_streams: dict[str, Stream] = {}  # bulk streams the lane shed, in order: they run again first
        self._shed_asked: dict[str, float] = {}  # when each last asked to run again
        self._bulk_refused_since: float | None = None  # a bulk request found no room, none running, since then
        self.busy = BusyShares()
        self.leases = LeaseClocks(settings.stream_lease_s, finished_s=settings.request_timeout_s)
        self.finished_kept = finished_kept(settings.max_in_flight)
        self.lane = LaneGovernor(settings.live_first_token_slo_ms, settings.bulk_stream_ceiling,
                                 settings.live_inter_token_slo_ms)
        # How often the lease clocks tick (:meth:`expire`): several times a lease, at most once a second.
        self.tick_s = min(max(settings.stream_lease_s / 4, 0.05), 1.0)

    def submit(self, requests: list[InferenceRequest], attempts: list[int], client: str,
               now_mono: float) -> tuple[list[str | None], list[Stream]]:
        """Registers what fits of a batch at ``now_mono`` (the monotonic clock): each request's key (None where
        there was no room) and the streams new here, which the engine's backend must start. A request already
        registered joins its stream."""
        asked = [f"{r.id}#{r.fingerprint()}#{a}@{self.instance}" for r, a in zip(requests, attempts, strict=True)]
        keys: list[str | None] = list(asked)
        started: list[Stream] = []
        self.leases.heard(client)
        for key in asked:
            if key in self.streams:  # joined again: a retried submission renews the lease
                self._renew(self.streams[key], client)
        new = [i for i, key in enumerate(asked) if key not in self.streams]
        bulk = any(requests[i].bulk for i in new)
        room = self.room(len(new), now_mono, bulk=bulk, prompts=[prompt_tokens(requests[i]) for i in new])
        for n, i in enumerate(new):
            if n >= room:
                keys[i] = None
                continue
            stream = Stream(asked[i], requests[i], attempts[i], running_since=now_mono)
            self._renew(stream, client)
            self.streams[stream.key] = stream
            started.append(stream)
        self.unfinished += len(started)
        for stream in started:
            if stream.request.bulk:
                self.bulk_unfinished += 1
                self._bulk_refused_since = None
                self.lane.bulk_started(now_mono, prompt_tokens(stream.request))
        return keys, started

    def room(self, new: int, now: float, bulk: bool = False, prompts: list[int] | None = None) -> int:
        """How many of ``new`` requests to take now, under ``max_in_flight``; a bulk lane's only beside fewer than
        ``bulk_streams`` unfinished streams (so live requests always find room), fewer bulk ones than the lane's
        cap, and as many of their ``prompts`` (tokens each, in order) as its prompt budget lets start
        (:mod:`.lane_governor`), except that one starts, where any room is left, once the lane has had none
        running for ``BULK_STARVED_S``: a backlog always moves.

        With whole batches none of a batch that does not fit is taken, except when idle or, for a bulk batch,
        starved as above, so no batch waits forever (the launch refuses batches larger than ``max_in_flight`` for
        that engine)."""
        if not bulk:
            return self._fitting(new, max(self.settings.max_in_flight - self.unfinished, 0))
        if any(self._asking(key, now) for key in self.shed_streams):
            return 0  # the streams the lane shed start over first (:meth:`resume`), those still asking
        under_cap = self.bulk_cap(now) - self.bulk_unfinished
        if new > under_cap:
            self.lane.wanted()
        free = max(min(self.settings.bulk_streams - self.unfinished, under_cap), 0)
        if free and prompts:
            free = min(free, self.lane.prompts_fitting(now, prompts[:new if self.whole_batches else free],
                                                       whole=self.whole_batches))
        taken = self._fitting(new, free)
        if self.bulk_unfinished or taken:
            self._bulk_refused_since = None  # the lane moves
        elif new and self.unfinished < self.settings.max_in_flight:
            if self._bulk_refused_since is None:
                self._bulk_refused_since = now
            elif now - self._bulk_refused_since >= BULK_STARVED_S:
                room = self.settings.max_in_flight - self.unfinished
                taken = 1 if not self.whole_batches else self._fitting(new, room)
                if taken:
                    self.lane.starved_start()
        return taken

    def _fitting(self, new: int, free: int) -> int:
        """How many of ``new`` requests ``free`` places take: as many as fit, or with whole batches all or none,
        and all where any place is free on an idle engine (a batch larger than the room would wait for ever)."""
        if not self.whole_batches:
            return min(new, free)
        return new if free > 0 and (new <= free or self.unfinished == 0) else 0

    def bulk_cap(self, now: float) -> int:
        """How many bulk streams the lane may run now, beside the live and bulk streams running
        (:class:`.lane_governor.LaneGovernor`)."""
        return self.lane.bulk_cap(now, self.unfinished - self.bulk_unfinished,
                                  self.bulk_unfinished - len(self.shed_streams))

    def shed(self, now: float) -> list[Stream]:
        """The bulk streams running past the lane's cap, the youngest first (they have generated least), now
        shed: the backend stops their attempts and each waits in :meth:`resume` to start over. A halving, or live
        traffic back after an idle spell to the cap it left, thus shrinks the lane at once, not as its streams
        end; a shed stream keeps its place in ``max_in_flight`` and runs again before any new bulk request.

        A stream shed once and started over beside live traffic is spared (it runs to its end: each bulk request
        costs one resend at most beside live, and a long answer always ends); one started over while live was idle
        may be shed again, as it ran on what live left idle. Never one whose answer is whole (its last chunks wait
        for Pub/Sub: it holds no row at the server). None where the backend cannot stop an attempt or the lane is
        not governed."""
        if not self.preempts or not self.lane.governed or not self.bulk_unfinished:
            return []
        running = [s for s in self.streams.values() if s.request.bulk and not s.done and s.key not in self.shed_streams]
        excess = len(running) - self.bulk_cap(now)
        sheddable = [s for s in running if not s.spared and not (s.assembler is not None and s.assembler.finished)]
        if excess <= 0 or not sheddable:
            return []
        youngest = sorted(sheddable, key=lambda s: s.running_since, reverse=True)[:excess]
        for stream in reversed(youngest):  # queued oldest first: the one nearest its deadline starts over first
            self.shed_streams[stream.key] = stream
            self._shed_asked[stream.key] = now
        self.lane.shed(len(youngest), now)
        return youngest

    def resume(self, stream: Stream, now: float) -> bool:
        """Whether the stream may run (again) now: one not shed, or the first shed stream still asking (one that
        asked within ``SHED_ASKING_S``: a stream in its retry's back-off holds no other up), while the lane runs
        fewer streams than its cap and its prompt fits the lane's prompt budget (counted as a bulk prompt
        started); started over beside live traffic, it is spared from then on (:meth:`shed`)."""
        if stream.key not in self.shed_streams:
            return self.holds(stream)  # one cancelled meanwhile does not start
        self._shed_asked[stream.key] = now
        first = next(key for key in self.shed_streams if self._asking(key, now))
        if not self.holds(stream) or first != stream.key or \
                self.bulk_unfinished - len(self.shed_streams) >= self.bulk_cap(now) or \
                not self.lane.prompts_fitting(now, [prompt_tokens(stream.request)]):
            return False
        del self.shed_streams[stream.key]
        self._shed_asked.pop(stream.key, None)
        self.lane.bulk_started(now, prompt_tokens(stream.request))
        stream.spared = not self.lane.idle_open
        return True

    def _asking(self, key: str, now: float) -> bool:
        """Whether a shed stream asked to run again within ``SHED_ASKING_S`` (one in a retry's back-off does not)."""
        return now - self._shed_asked.get(key, now) <= SHED_ASKING_S

    def poll(self, positions: dict[str, int], client: str) -> dict[str, list[tuple[str, str]]]:
        """For each key, its outputs from ``positions[key]`` on (see :meth:`.engine.Engine.poll`)."""
        ready: dict[str, list[tuple[str, str]]] = {}
        self.leases.heard(client, polled=bool(positions))
        for key, position in positions.items():
            stream = self.streams.get(key)
            if stream is None or stream.window.read(position) is None:
                ready[key] = [(UNKNOWN, "")]  # not this stream's committed position: never splice
                continue
            self._renew(stream, client)
            if stream.done and not len(stream.window):
                del self.streams[key]
                ready[key] = []
                continue
            ready[key] = list(stream.window.outputs)
        return ready

    def take(self, keys: list[str]) -> list[Stream]:
        """Takes these streams out (a cancel): the engine stops them (:meth:`stop`)."""
        return [self.streams.pop(key) for key in keys if key in self.streams]

    def expire(self, elapsed_s: float) -> list[Stream]:
        """Advances the lease clocks by one tick (``elapsed_s`` since the last, ``tick_s`` when on time) and
        takes out the streams whose lease ran out, and the finished ones past those kept (see
        :mod:`pipeline.engines.leases`): the engine stops them."""
        self.leases.tick(elapsed_s, self.tick_s)
        self.leases.forget_silent()
        stale = [key for key, stream in self.streams.items() if self.leases.expired(stream.lease, stream.done)]
        stale += overflowing([(key, stream.lease) for key, stream in self.streams.items()
                              if stream.done and key not in stale], self.finished_kept)
        return [self.streams.pop(key) for key in stale]

    def stop(self, streams: list[Stream], now_mono: float) -> list[Stream]:
        """Ends streams already taken out: their model time closed, counted as finished; returns those that were
        still running, which the backend must cancel."""
        running = []
        for stream in streams:
            stream.accelerator_s += self.busy.end(stream.key, now_mono)
            if not stream.done:
                self._finished(stream)
                running.append(stream)
        return running

    def holds(self, stream: Stream) -> bool:
        """Whether ``stream`` is still registered (not cancelled, expired or released)."""
        return self.streams.get(stream.key) is stream

    def emit(self, stream: Stream, output: tuple[str, str], *, final: bool = False) -> None:
        """Adds an output to the stream's window; ``final`` ends the stream."""
        stream.window.add(output)
        if final and not stream.done:
            self._finished(stream)

    def _finished(self, stream: Stream) -> None:
        stream.done = True
        self.unfinished -= 1
        self.bulk_unfinished -= stream.request.bulk
        self.shed_streams.pop(stream.key, None)
        self._shed_asked.pop(stream.key, None)

    def began(self, stream: Stream, now: float, now_mono: float) -> None:
        """The model took the stream (an attempt of it) at ``now``: it shares the model's time from here."""
        if stream.sent_at is None:
            stream.sent_at = now
        stream.taken_mono = now_mono  # each attempt's first token is measured from its own start
        stream.last_token = None
        if not stream.request.bulk:
            self.lane.live_sent(now_mono)
        self.busy.begin(stream.key, now_mono)

    def first_chunk(self, stream: Stream, now: float, now_mono: float) -> None:
        """A chunk of the stream went out at ``now`` (wall clock): its first, a live stream's, tells the lane how
        long live first chunks take beside it (:mod:`.lane_governor`): from the pipeline's read of the request
        (``received_at``, stamped where it was read), so what the lane costs it before the server takes it (the
        generate step's work items its keys' polls share) counts with what it costs at the server. A request the
        pipeline did not read (no stamp) counts from the server taking it. A later attempt's (the key machine's
        resend after a lost stream, or the engine's restart once chunks went out) says nothing: that wait is a
        fault's cost, not the lane's."""
        if stream.taken_mono is not None:
            if not stream.request.bulk and stream.attempt == 1:
                read_at = stream.request.received_at
                waited_s = now - read_at if read_at > 0 else now_mono - stream.taken_mono
                self.lane.first_token(now_mono, max(waited_s, 0.0) * 1000.0)
            stream.taken_mono = None

    def tokens(self, stream: Stream, now_mono: float, tokens: int) -> None:
        """The stream's text has ``tokens`` tokens now: a live stream's tokens after its first tell the lane how
        long live tokens take beside it (:mod:`.lane_governor`). Each attempt counts from its own first token."""
        if stream.request.bulk or not tokens:
            return
        last = stream.last_token
        if last is not None and tokens > last[1]:
            self.lane.inter_tokens(now_mono, (now_mono - last[0]) * 1000.0, tokens - last[1])
        if last is None or tokens != last[1]:
            stream.last_token = (now_mono, tokens)

    def ended(self, stream: Stream, now_mono: float) -> None:
        """The model no longer works on the stream (finished, failed or cancelled); idempotent."""
        stream.accelerator_s += self.busy.end(stream.key, now_mono)

    def _renew(self, stream: Stream, client: str) -> None:
        """The stream's lease starts again now, on the clocks of the client that called."""
        stream.lease = self.leases.stamp(client)


def prompt_tokens(request: InferenceRequest) -> int:
    """The request's prompt tokens as measured at intake, or estimated where it was not (a request restored from
    state written before the count, or built outside the pipeline's measure step)."""
    return request.prompt_tokens if request.prompt_tokens is not None else estimate_tokens(request.prompt_text())
