"""The bulk lane (docs/operations.md#the-bulk-lane): live first at every queue a worker has.

The parts a lane passes through, each driven directly: parsing (the read's mark), the request record and the
generate step's state (update compatibility), the admission ledger (the room live keeps), the key machine (the
generate step's queue), the engine's priority for vLLM, and the options. The engine's own room is proved against
the real vLLM in tests/test_engine.py and the whole lane end to end in tests/test_pipeline_e2e.py.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.config.options import ConfigError, PipelineConfig
from pipeline.config.settings import JobSettings
from pipeline.contract.call_outcome import Call
from pipeline.contract.messages import LANE_ATTRIBUTE, DeadLetter, InferenceRequest
from pipeline.contract.request_parsing import parse_request
from pipeline.contract.stream_progress import COMPLETION
from pipeline.engines.engine_settings import EngineSettings
from pipeline.engines.lane_governor import BULK_STARVED_S
from pipeline.generation.generate import StreamingGenerateFn
from pipeline.generation.key_driver import submit_in_order
from pipeline.generation.key_events import (
    BULK_POLL_S,
    Arrived,
    Effects,
    PollDue,
    Polled,
    Rules,
    SubmitResult,
    Submitted,
)
from pipeline.generation.key_machine import step
from pipeline.generation.key_state import KeyState, RequestEntry
from pipeline.serving.vllm_server import ServerSpec
from pipeline.worker import read_places
from pipeline.worker.admission_ledger import BULK_QUEUED_MIN, AdmissionLedger
from pipeline.worker.runtime import SharedRuntime
from pipeline.worker.runtime_settings import AdmissionSettings, RuntimeSettings

RULES = Rules(poll_interval_s=0.05, dedupe_window_s=600.0, drain_timeout_s=30.0, waiting_cap=1000)


def test_the_bulk_reads_mark_makes_a_bulk_request_and_a_bulk_dead_letter_whatever_else_it_holds():
    bulk = parse_request(b'{"id": "a", "prompt": "hi"}', {LANE_ATTRIBUTE: "bulk"})
    assert isinstance(bulk, InferenceRequest) and bulk.bulk and bulk.lane_name() == "bulk"
    letter = parse_request(b'{"id": "b", "prompt": 3}', {LANE_ATTRIBUTE: "bulk"})
    assert isinstance(letter, DeadLetter) and letter.lane == "bulk"
    for attributes in ({}, {LANE_ATTRIBUTE: "live"}, {LANE_ATTRIBUTE: "BULK"}, {LANE_ATTRIBUTE: ""}):
        live = parse_request(b'{"id": "c", "prompt": "hi"}', attributes)
        assert isinstance(live, InferenceRequest) and not live.bulk and live.lane_name() == "live"
    field = parse_request(b'{"id": "d", "prompt": "hi", "lane": "bulk"}')
    assert isinstance(field, DeadLetter) and "unknown field" in field.reason, "the read sets the lane, not a field"


def test_the_lane_leaves_a_requests_fingerprint_and_republished_payload_as_they_were():
    """A request's fingerprint is what versions before the lane stored (an update finds its dedupe record), on
    either lane; a redrive publishes to the topic of the lane it names, so the payload does not carry it."""
    live = InferenceRequest(id="a", prompt="hi", max_tokens=4)
    bulk = InferenceRequest(id="a", prompt="hi", max_tokens=4, lane="bulk")
    assert "lane" not in json.loads(live.to_payload()) and "lane" not in json.loads(bulk.to_payload())
    assert InferenceRequest.from_json(bulk.to_json()) == bulk
    assert live.fingerprint() == bulk.fingerprint(), "one request on both lanes is one request: a copy is dropped"
    stored = json.loads(live.to_json())
    assert "lane" not in stored, "unset, written as a version before the lane wrote it"
    assert InferenceRequest.from_json(json.dumps(stored)).fingerprint() == live.fingerprint()
    assert DeadLetter.of_request("inference", "x", bulk).lane == "bulk"
    assert DeadLetter.from_json(DeadLetter.of_request("inference", "x", bulk).to_json()).lane == "bulk"


def test_a_waiting_entry_written_before_the_lane_reads_as_live():
    entry = RequestEntry(InferenceRequest(id="a", prompt="hi").to_json(), "fp", batch="b1")
    text = json.loads(entry.encode())
    text.pop("bulk")
    assert RequestEntry.decode(json.dumps(text)) == entry
    bulk = RequestEntry(InferenceRequest(id="a", prompt="hi", lane="bulk").to_json(), "fp", bulk=True)
    assert RequestEntry.decode(bulk.encode()).bulk


def _settings(worker_queue: int = 8, **engine) -> RuntimeSettings:
    values = dict(server=None, server_url="http://unused", max_in_flight=8, bulk_lane=True, live_reserve=0.25)
    return RuntimeSettings(EngineSettings(**{**values, **engine}), AdmissionSettings(worker_queue=worker_queue))


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 64), st.integers(1, 256), st.floats(0.0, 0.9))
def test_the_bulk_lane_always_leaves_the_reserve_and_always_has_room_to_move(max_in_flight, queue, reserve):
    held = _settings(max_in_flight=max_in_flight, worker_queue=queue, live_reserve=reserve)
    assert 1 <= held.engine.bulk_streams <= max_in_flight and 1 <= held.bulk_held <= held.max_held
    if held.engine.bulk_streams > 1:
        assert max_in_flight - held.engine.bulk_streams >= reserve * max_in_flight - 1e-9
    if held.bulk_held > 1:
        assert held.max_held - held.bulk_held >= reserve * held.max_held - 1e-9


def test_bulk_reads_stop_where_the_live_reserve_begins_and_live_reads_take_it():
    settings_ = _settings()  # holds 16; bulk up to 12
    ledger = AdmissionLedger(settings_, lambda: 0, clock=lambda: 0.0)
    assert ledger.admit([f"b{i}" for i in range(20)], (), True) == 12
    assert ledger.admit(["b-more"], (), True) == 0, "the bulk lane is at its bound"
    assert ledger.admit([f"l{i}" for i in range(20)]) == 4, "live reads take the reserve"
    assert ledger.admit(["l-more"]) == 0


def test_bulk_reads_keep_only_the_lanes_next_wave_beyond_its_running_streams():
    """A governed lane's backlog stays in Pub/Sub: bulk reads fill the hold up to the streams running and as many
    again as the lane may run now (at least BULK_QUEUED_MIN), within the bulk bound; what waits counts live too,
    and the room follows the governor's cap as it moves."""
    settings_ = _settings(max_in_flight=16, worker_queue=48)  # holds 64; bulk up to 48
    running, cap = [0], [1]
    ledger = AdmissionLedger(settings_, lambda: running[0], clock=lambda: 0.0, bulk_cap=lambda: cap[0])
    assert ledger.admit([f"b{i}" for i in range(20)], (), True) == BULK_QUEUED_MIN, "a lane of one: a batch at hand"
    assert ledger.full(bulk=True) and not ledger.full()
    running[0] = 2  # two of them started (the hold counts them as running, no longer as waiting or on their way)
    ledger.report_waiting("k", BULK_QUEUED_MIN - 2, arrived=[f"b{i}" for i in range(BULK_QUEUED_MIN)])
    assert ledger.admit(["b20", "b21", "b22"], (), True) == 2, "two more wait behind the running streams"
    cap[0] = 10  # live went quiet: the governor lets the lane grow
    assert ledger.admit([f"b{i}" for i in range(30, 60)], (), True) == 10 - BULK_QUEUED_MIN
    assert ledger.admit(["l0", "l1"]) == 2, "live reads still find their room"
    cap[0] = 1
    assert ledger.admit(["b60"], (), True) == 0, "the cap shrank: no bulk read until what waits runs"
    assert ledger.full(bulk=True), "and the bulk readers are told the worker is full (read_deferred)"
    cap[0] = 100
    assert ledger.admit([f"b{i}" for i in range(100, 200)], (), True) == \
        settings_.bulk_held - running[0] - 12, "never past the bulk bound"


def test_a_live_pulls_open_places_are_room_for_the_bulk_lanes_wave_and_a_bulk_pulls_are_its_work():
    """Places a live read holds through a long pull on a quiet subscription are room, not work: they leave the
    lane's next wave to bulk reads. A bulk read's places for its pull under way are the lane's work: a second
    bulk read (another SDK process's) finds the wave taken. Once the live pull filled its places, its requests
    wait, and they count."""
    settings_ = _settings(max_in_flight=16, worker_queue=48)
    ledger = AdmissionLedger(settings_, lambda: 1, clock=lambda: 0.0, bulk_cap=lambda: 2)
    live = read_places.reserve(ledger, 4, name="live-pull")
    assert len(live) == 4 and not ledger.full(bulk=True)
    bulk = read_places.reserve(ledger, 32, bulk=True, name="bulk-pull")
    assert len(bulk) == BULK_QUEUED_MIN, "the live pull's open places took nothing from the wave"
    assert read_places.reserve(ledger, 32, bulk=True, name="other-process") == []
    assert ledger.full(bulk=True), "full as admit sees it: the bulk feed counts read_deferred"
    ledger.settled([], bulk)  # the bulk pull came back empty: its places no longer count
    ledger.settled(live[:3], live[3:])  # the live pull brought three requests: work now
    assert len(read_places.reserve(ledger, 32, bulk=True, name="bulk-pull-2")) == BULK_QUEUED_MIN - 3


def test_a_bulk_lane_that_live_traffic_kept_out_for_bulk_starved_s_takes_one_place_in_the_reserve():
    """Live reads hold the whole bulk bound: bulk reads find no room, but after BULK_STARVED_S with no bulk read
    or request admitted, no bulk stream at the engine and room there for one, one place within the whole bound
    (the engine's own rule then starts its request within BULK_STARVED_S); not while a bulk stream runs, not while
    the engine is full (it could not start it: places would creep into the live reserve for nothing), not another
    until a bulk stream ran since the last, never past the whole bound."""
    now, running, bulk_running = [0.0], [8], [0]  # the engine runs max_in_flight (8) live streams
    ledger = AdmissionLedger(_settings(), lambda: running[0], clock=lambda: now[0],
                             bulk_unfinished=lambda: bulk_running[0])
    assert ledger.admit([f"l{i}" for i in range(5)]) == 5, "live holds past the bulk bound (12): 13 of 16"
    assert ledger.admit(["b0"], (), True) == 0, "the lane's wait begins"
    now[0] = BULK_STARVED_S - 0.1
    assert ledger.admit(["b1"], (), True) == 0
    now[0] = BULK_STARVED_S
    bulk_running[0] = 1
    assert ledger.admit(["b2"], (), True) == 0, "a bulk stream runs at the engine: the lane moves"
    bulk_running[0], running[0] = 0, 8
    assert ledger.admit(["b2"], (), True) == 0, "the engine is full (max_in_flight 8): it could not start one"
    running[0] = 7  # a live stream ended: 12 held, the bulk bound
    assert ledger.admit(["b3", "b4"], (), True) == 1, "starved: one place in the reserve"
    assert ledger.admit(["b5"], (), True) == 0, "and the wait begins again"
    now[0] = 2 * BULK_STARVED_S + 1
    assert ledger.admit(["b6"], (), True) == 0, "one at a time: no bulk stream ran since the last"
    bulk_running[0] = 1
    assert ledger.admit(["b6"], (), True) == 0, "its request runs at the engine: the lane moves"
    bulk_running[0] = 0
    now[0] = 3 * BULK_STARVED_S + 2
    assert ledger.admit(["b6"], (), True) == 1, "it ended, and the lane starved again: one more"
    assert ledger.admit(["l13", "l14", "l15"]) == 2, "live takes what is left (16 in all)"
    now[0] = 10 * BULK_STARVED_S
    assert ledger.admit(["b7"], (), True) == 0, "the whole bound is held: nothing, starved or not"


def _request(n: int, bulk: bool) -> InferenceRequest:
    return InferenceRequest(id=f"{'bulk' if bulk else 'live'}-{n}", prompt="hi", max_tokens=4,
                            lane="bulk" if bulk else None)


def _carry(state: KeyState, effects: Effects, now: float, room: list[int], started: list[str]) -> KeyState:
    """Carries out the key's effects against an engine with ``room[0]`` free streams (live and bulk alike, so the
    key's own order is what is tested), until it asks nothing more."""
    while True:
        if effects.submit:
            def submit(submission):
                keys = []
                for text in submission.requests:
                    if room[0] > 0:
                        room[0] -= 1
                        request = InferenceRequest.from_json(text)
                        started.append(request.id)
                        keys.append(f"{request.id}@engine")
                    else:
                        keys.append(None)
                return SubmitResult(submission, Call.ANSWERED, tuple(keys))
            state, effects = step(RULES, state, Submitted(now, submit_in_order(effects.submit, submit)))
        elif effects.poll is not None:
            state, effects = step(RULES, state, Polled(now, Call.ANSWERED, {key: [] for key in effects.poll}))
        else:
            return state


_key_ops = st.lists(st.one_of(
    st.tuples(st.just("arrive"), st.booleans(), st.integers(1, 6)),  # a batch of one lane
    st.tuples(st.just("room"), st.booleans(), st.integers(1, 8))), min_size=1, max_size=40)  # streams end


@settings(max_examples=300, deadline=None)
@given(_key_ops)
def test_a_key_never_starts_a_bulk_request_while_a_live_one_waits(ops):
    """Batches of either lane arrive, in any order, while the engine's room comes and goes: the key's queue keeps
    live requests before bulk ones, a live request is offered to the engine at once even while bulk ones wait, and
    no step starts a bulk request while a live one is left waiting."""
    state, room, now, serial = KeyState(), [0], 0.0, 0
    for operation, bulk, count in ops:
        now += 0.1
        started: list[str] = []
        live_waited = not all(entry.bulk for entry in state.waiting)
        if operation == "arrive":
            requests = tuple(_request(serial + n, bulk) for n in range(count))
            serial += count
            state, effects = step(RULES, state, Arrived(now, requests, f"batch-{serial}"))
        elif bulk:  # streams of other keys end: this key learns of it at its next poll, or when a request arrives
            room[0] += count
            continue
        else:  # ... or its own streams: its poll timer fires
            room[0] += count
            state, effects = step(RULES, state, PollDue(now))
        state = _carry(state, effects, now, room, started)
        lanes = [entry.bulk for entry in state.waiting]
        assert lanes == sorted(lanes), "live requests wait before bulk ones"
        if room[0] and operation == "arrive" and not live_waited:  # (a live request queues behind live ones)
            assert all(lanes), "a live request waits behind bulk ones though the engine has room"
        if any(i.startswith("bulk") for i in started):
            assert not any(not entry.bulk for entry in state.waiting), "a bulk request started while live waited"


def test_vllm_serves_every_live_request_before_any_bulk_one_and_shorter_first_within_a_lane():
    spec = ServerSpec(model="m")
    settings_ = _settings(server=spec, server_url=None, priority_boundaries=(16, 64)).engine
    assert settings_.priority_scheduling
    priorities = {(bulk, tokens): settings_.priority_of(InferenceRequest(
        id="a", prompt="x", prompt_tokens=tokens, lane="bulk" if bulk else None))
        for bulk in (False, True) for tokens in (4, 32, 500)}
    assert max(p for (bulk, _), p in priorities.items() if not bulk) < \
        min(p for (bulk, _), p in priorities.items() if bulk)
    assert priorities[(False, 4)] < priorities[(False, 32)] < priorities[(False, 500)]
    assert priorities[(True, 4)] < priorities[(True, 500)]
    lanes_only = _settings(server=spec, server_url=None).engine
    assert [lanes_only.priority_of(_request(0, bulk)) for bulk in (False, True)] == [None, 1], \
        "live: the server's default (0); bulk after it"
    assert _settings().engine.priority_of(_request(0, True)) is None, "a server of one's own: its policy is unknown"
    assert _settings(server=spec, server_url=None, bulk_lane=False).engine.priority_of(_request(0, True)) is None


REQUIRED = {"input_subscription": "projects/my-project/subscriptions/live",
            "output_completions_topic": "projects/my-project/topics/completions",
            "dead_letter_topic": "projects/my-project/topics/dead-letters"}


def test_the_options_refuse_one_subscription_for_both_lanes_and_a_reserve_out_of_range():
    config = PipelineConfig.from_mapping({**REQUIRED, "bulk_subscription": "projects/my-project/subscriptions/bulk"})
    assert config.bulk_subscription == "projects/my-project/subscriptions/bulk" and config.live_reserve == 0.25
    with pytest.raises(ConfigError, match="bulk_subscription is the input_subscription"):
        PipelineConfig.from_mapping({**REQUIRED, "bulk_subscription": REQUIRED["input_subscription"]})
    with pytest.raises(ConfigError, match="live_reserve must be at most 0.9"):
        JobSettings.from_mapping({**REQUIRED, "live_reserve": "0.95"})
    with pytest.raises(ConfigError, match="bulk_subscription"):
        PipelineConfig.from_mapping({**REQUIRED, "bulk_subscription": "bulk-sub"})


def test_the_same_request_on_both_lanes_is_served_once():
    """A backfill row also published live (or a live request redriven as bulk): the copy is dropped, not lettered."""
    state, room = KeyState(), [4]
    live = InferenceRequest(id="row-7", prompt="hi", max_tokens=4)
    bulk = InferenceRequest(id="row-7", prompt="hi", max_tokens=4, lane="bulk")
    started: list[str] = []
    state, effects = step(RULES, state, Arrived(0.0, (live,), "b1"))
    state = _carry(state, effects, 0.0, room, started)
    state, effects = step(RULES, state, Arrived(0.1, (bulk,), "b2"))
    assert effects.counts.get("duplicates_dropped") == 1 and not effects.outputs
    state = _carry(state, effects, 0.1, room, started)
    assert started == ["row-7"] and not state.waiting and len(state.inflight) == 1


def test_admission_takes_a_bulk_requests_flag_to_the_ledger_so_a_lapsed_place_takes_no_live_room():
    """AdmitFn admits each request with its lane: a bulk request whose read's place lapsed passes uncounted once the
    bulk lane's share is used, where a live one at the same load is counted in the room live_reserve keeps. The
    engine is the template's vLLM engine on a server that is never asked (admission sends nothing)."""
    from local.runner_semantics import in_process
    from pipeline.engines.vllm_engine import vllm_engine
    from pipeline.flow.admission import AdmitFn

    engine = vllm_engine(EngineSettings(server=None, server_url="http://127.0.0.1:9", served_model_name="m",
                                        max_in_flight=2, request_timeout_s=60))
    source = in_process(engine, "admission-lanes", AdmissionSettings(worker_queue=2, transit_s=0.5))
    admit = AdmitFn(source)
    admit.setup()
    try:
        held = source.settings
        assert held.bulk_held < held.max_held, "the premise: live_reserve keeps room"
        source.runtime.report_waiting("other-key", held.bulk_held)  # the bulk lane's share is used
        admit.start_bundle()
        assert [r.id for r in admit.process(_request(1, bulk=True))] == ["bulk-1"]
        assert source.runtime.load()["on_the_way"] == 0, "a bulk request takes no live room"
        assert [r.id for r in admit.process(_request(2, bulk=False))] == ["live-2"]
        assert source.runtime.load()["on_the_way"] == 1, "a live one does"
        admit.finish_bundle()
    finally:
        engine.close()


def test_a_key_holding_only_bulk_requests_polls_at_the_bulk_cadence_and_a_live_arrival_pulls_it_in():
    """A bulk stream's tokens wait for nobody, and each poll is a work item live ones queue behind: a key holding
    only bulk requests polls every bulk_poll_interval_s, and on at that cadence; a live request arriving sets its
    timer at the chunk cadence."""
    rules = dataclasses.replace(RULES, bulk_poll_interval_s=1.0)

    def carried(state: KeyState, effects: Effects, now: float, rules: Rules = rules) -> tuple[KeyState, float | None]:
        armed = effects.arm_at
        while effects.submit or effects.poll is not None:
            if effects.submit:
                results = submit_in_order(effects.submit, lambda s: SubmitResult(
                    s, Call.ANSWERED, tuple(f"{InferenceRequest.from_json(t).id}@engine" for t in s.requests)))
                state, effects = step(rules, state, Submitted(now, results))
            else:
                state, effects = step(rules, state, Polled(now, Call.ANSWERED, {key: [] for key in effects.poll}))
            armed = effects.arm_at if effects.arm_at is not None else armed
        return state, armed

    bulk, _ = carried(*step(rules, KeyState(), Arrived(0.0, (_request(0, True), _request(1, True)), "b")), 0.0)
    assert bulk.poll_at_ms == 1000, "only bulk in flight: the bulk cadence"
    bulk, armed = carried(*step(rules, bulk, PollDue(1.0)), 1.0)
    assert armed == pytest.approx(2.0) and bulk.poll_at_ms == 2000, "and on at it"
    both, armed = carried(*step(rules, bulk, Arrived(1.2, (_request(2, False),), "l")), 1.2)
    assert armed == pytest.approx(1.25) and both.poll_at_ms == 1250, "a live request: the chunk cadence, sooner"
    both, armed = carried(*step(rules, both, PollDue(1.25)), 1.25)
    assert armed == pytest.approx(1.30)
    unset, _ = carried(*step(RULES, KeyState(), Arrived(0.0, (_request(3, True),), "c")), 0.0, RULES)
    assert unset.poll_at_ms == 50, "no bulk cadence set: the chunk cadence"


def test_a_bulk_key_waiting_for_room_polls_at_the_bulk_cadence_a_release_at_the_chunk_cadence_within_the_lease():
    """Bulk requests waiting for room are polls nobody waits on: their key keeps the bulk cadence, and one whose
    requests only wait backs off from it (to 2 s). A key's own stream ending is its waiting request's room at once;
    the finished stream waits at the engine until its key releases it, so that poll comes at the chunk cadence. The
    generate step sets the bulk cadence at half a second, at most an eighth of stream_lease_s."""
    rules = dataclasses.replace(RULES, bulk_poll_interval_s=1.0)

    def answered(effects: Effects, *streams: str | None) -> tuple[SubmitResult, ...]:
        return submit_in_order(effects.submit, lambda s: SubmitResult(s, Call.ANSWERED, streams))

    state, effects = step(rules, KeyState(), Arrived(0.0, (_request(0, True), _request(1, True)), "b"))
    state, effects = step(rules, state, Submitted(0.0, answered(effects, "bulk-0@engine", None)))
    assert [e.request_id for e in state.waiting] == ["bulk-1"] and state.poll_at_ms == 1000, \
        "one runs and one waits: the bulk cadence"
    state, effects = step(rules, state, PollDue(1.0))
    ended = json.dumps({"id": "bulk-0", "attempt": 0, "text": "x", "tokens": 1, "chunks": 0, "output_error": None,
                        "time_to_first_token_ms": None, "finish_reason": "length", "accelerator_seconds": 0.0})
    state, effects = step(rules, state, Polled(1.0, Call.ANSWERED, {"bulk-0@engine": [(COMPLETION, ended)]}))
    state, effects = step(rules, state, Submitted(1.0, answered(effects, "bulk-1@engine")))
    assert state.progress.release and state.poll_at_ms == 1050, "a finished stream to release: the chunk cadence"
    state, effects = step(rules, state, PollDue(1.05))
    state, effects = step(rules, state, Polled(1.05, Call.ANSWERED, {"bulk-1@engine": []}))
    assert not state.progress.release and state.poll_at_ms == 2050, "released: the bulk cadence again"
    state, effects = step(rules, state, Arrived(1.2, (_request(2, False),), "l"))
    state, effects = step(rules, state, Submitted(1.2, answered(effects, None)))
    assert [e.request_id for e in state.waiting] == ["live-2"] and state.poll_at_ms == 1250, \
        "a live request waiting: the chunk cadence, sooner"

    waits, effects = step(rules, KeyState(), Arrived(0.0, (_request(3, True),), "c"))
    waits, effects = step(rules, waits, Submitted(0.0, answered(effects, None)))
    polls = [waits.poll_at_ms]
    for now in (1.0, 2.0, 4.0):
        waits, effects = step(rules, waits, PollDue(now))
        waits, effects = step(rules, waits, Submitted(now, answered(effects, None)))
        polls.append(waits.poll_at_ms)
    assert polls == [1000, 2000, 4000, 6000], "only waiting: backs off from the bulk cadence to 2 s"
    for lease, cadence in ((10.0, BULK_POLL_S), (2.0, 0.25)):
        settings_ = _settings(stream_lease_s=lease)
        fn = StreamingGenerateFn(SharedRuntime(settings_, "unused"), 50.0)
        assert fn._rules.bulk_poll_interval_s == pytest.approx(cadence) and cadence <= lease / 8
