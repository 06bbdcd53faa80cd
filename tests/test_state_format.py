"""Every state cell the template writes can be read after an update, or becomes a dead letter or a logged reset.

A Dataflow update hands the new job the old job's state as the old code wrote it; a cell that raised
on read would fail its work item on every retry and wedge its key. Here each stateful step's real
reader meets cells of the previous version, of this version, damaged ones and fuzzed ones. The
generate step's entries meet the real engine in tests/test_runner_semantics.py.
"""

from __future__ import annotations

import json

from apache_beam import pvalue
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.contract.messages import STAGE_BATCH, InferenceRequest
from pipeline.contract.state_format import StateFormatError, read_cell
from pipeline.flow.batching import BatchingConfig, BucketCounters, _BatchFn
from pipeline.contract.stream_progress import KeyProgress
from pipeline.generation.dedupe import IdEntry, encode_ids, holder, read_ids
from pipeline.generation.key_state import RequestEntry, encode_progress, read_progress
from tests.state_stand_in import Cell, Timer

_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                     max_leaves=10)
_texts = st.one_of(st.text(max_size=40), _json.map(json.dumps))


def a_request(i: int) -> InferenceRequest:
    return InferenceRequest(id=f"r{i}", prompt="hello", max_tokens=4, prompt_tokens=2)


def test_the_batcher_flushes_what_it_can_read_and_letters_the_rest():
    old = json.dumps({"request": a_request(1).to_json(), "arrived_at": 1.0})  # version 1: no "v"
    batcher = _BatchFn(BatchingConfig(max_batch_delay_ms=10, batch_size_target=8, num_shards=1))
    buffer, counters = Cell(), Cell("[2, 4]")
    list(batcher.process(("b0:0", a_request(2)), window=None, buffer=buffer, counters=counters, flush=Timer(),
                         window_end=_WindowEnd()))
    newer = json.dumps({"request": a_request(3).to_json().replace('"prompt"', '"sketch"'), "arrived_at": 2.0})
    buffer.value = [old, *buffer.value, "{damaged", newer]
    out = list(batcher.on_flush(key="b0:0", buffer=buffer, counters=counters))
    letters = [o.value for o in out if isinstance(o, pvalue.TaggedOutput)]
    [(shard, requests)] = [o for o in out if not isinstance(o, pvalue.TaggedOutput)]
    assert (shard, [r.id for r in requests]) == (0, ["r1", "r2"])
    assert [(d["stage"], d["payload"]) for d in letters] == [(STAGE_BATCH, "{damaged"), (STAGE_BATCH, newer)]
    assert "does not know: sketch" in letters[1]["reason"]
    assert buffer.value is None and counters.value is None


class _WindowEnd:
    def max_timestamp(self):
        return 0


@settings(max_examples=200, deadline=None)
@given(_texts)
def test_no_cell_text_makes_a_reader_raise_anything_but_its_format_error(text):
    assert isinstance(BucketCounters.from_json(text), BucketCounters)
    assert isinstance(read_ids(text)[0], dict)
    streams = read_progress(text)
    assert all(isinstance(n, int) for n in [*streams.taken.values(), *streams.release.values()])
    for read in (RequestEntry.decode, lambda t: read_cell(t, (1,), {"request": (str,)})):
        try:
            read(text)
        except StateFormatError:
            pass
    try:
        InferenceRequest.from_json(text)
    except ValueError:
        pass


def test_the_record_of_ids_reads_the_previous_version_and_writes_a_versioned_one():
    old = json.dumps({"v": ["fp-v", None], "a": ["fp-a", 9e9]})  # version 1, with a request named "v"
    ids, problem = read_ids(old)
    assert problem is None and holder(ids, "v", 0.0) == "fp-v" and holder(ids, "a", 0.0) == "fp-a"
    ids["b"] = IdEntry("fp-b", None)
    written = encode_ids(ids)
    assert json.loads(written)["v"] == 2
    again, _ = read_ids(written)
    assert holder(again, "b", 0.0) == "fp-b" and holder(again, "v", 0.0) == "fp-v"
    later, problem = read_ids('{"v": 9, "ids": {}}')
    assert later == {} and "starts afresh" in problem, "a later version's cell starts afresh, and says why"


def test_progress_reads_the_previous_version_and_refuses_positions_that_are_not_counts():
    assert read_progress('{"taken": {"k": 3}, "release": {}}').taken == {"k": 3}
    assert read_progress('{"taken": {"k": "3"}, "release": {}}').taken == {}
    written = encode_progress(KeyProgress({"k": 1}, {}))  # a poll emitted the stream's first output
    assert json.loads(written) == {"taken": {"k": 1}, "release": {}, "v": 1}
    assert encode_progress(KeyProgress()) is None, "an empty progress clears its cell"


def test_the_batchers_counters_read_the_previous_version_and_write_a_versioned_one():
    assert BucketCounters.from_json("[2, 4]") == BucketCounters(2, 4), "version 1: a bare list"
    written = BucketCounters(3, 9).to_json()
    assert json.loads(written)["v"] == 2 and BucketCounters.from_json(written) == BucketCounters(3, 9)
    later = json.dumps({"count": 1, "tokens": 2, "v": 3})
    assert BucketCounters.from_json(later) == BucketCounters(), "a later version's cell: counted from zero"


def test_the_timer_cells_keep_beams_standard_integer_coder_and_read_what_it_wrote():
    """The generate step's timer cells are versioned by name under VarIntCoder (pipeline/contract/state_format.py):
    changing their coder would fail Dataflow's update check, so a change of meaning must take a new name."""
    from apache_beam.coders import VarIntCoder

    from pipeline.generation.generate import StreamingGenerateFn

    for spec in (StreamingGenerateFn.POLL_AT_MS, StreamingGenerateFn.WAIT_MS):
        assert type(spec.coder) is VarIntCoder, spec.name
        written_before = VarIntCoder().encode(1_764_000_000_000)  # what the previous version wrote: epoch ms
        assert spec.coder.decode(written_before) == 1_764_000_000_000


def test_an_entry_decodes_the_same_from_the_cache_and_a_long_one_is_not_kept():
    """Entries are decoded once per text (a key's bags are read back at every work item), up to a size: a long
    prompt's entry is decoded afresh each time, so the cache stays small however long prompts are."""
    from pipeline.generation import key_state

    short = RequestEntry(InferenceRequest(id="s", prompt="hi").to_json(), "fp-s", attempt=2, key="k", lost=1)
    long = RequestEntry(InferenceRequest(id="l", prompt="x" * key_state.CACHED_TEXT_MAX).to_json(), "fp-l")
    for entry in (short, long):
        assert RequestEntry.decode(entry.encode()) == entry == RequestEntry.decode(entry.encode())
        assert entry.request_id == InferenceRequest.from_json(entry.request).id
    before = key_state._decoded.cache_info()
    RequestEntry.decode(long.encode())
    after = key_state._decoded.cache_info()
    assert (after.hits, after.misses) == (before.hits, before.misses), "a long entry does not go through the cache"
    RequestEntry.decode(short.encode())
    assert key_state._decoded.cache_info().hits == after.hits + 1, "a short one is decoded once"


def test_the_record_of_ids_writes_the_bytes_versions_before_typed_entries_wrote():
    """Typed entries (IdEntry) write each id as the list ``[fingerprint, until]``, as the lists before them did:
    a cell written by either version reads the same, and is written back byte for byte."""
    written_before = '{"ids":{"a":["fp-a",null],"b":["fp-b",12.5]},"v":2}'
    assert encode_ids({"a": IdEntry("fp-a", None), "b": IdEntry("fp-b", 12.5)}) == written_before
    ids, problem = read_ids(written_before)
    assert problem is None and encode_ids(ids) == written_before


_cell_values = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=40),
                         st.binary(max_size=20), st.lists(st.integers(), max_size=3))


@settings(max_examples=300, deadline=None)
@given(_cell_values, _cell_values, _cell_values, _cell_values)
def test_a_value_cell_that_holds_anything_reads_as_its_value_or_as_unset(progress, seen, poll_at_ms, wait_ms):
    """Beam's state gives value cells untyped; the read checks them once, so no step reads a timer that is not a
    whole number of milliseconds or a record that is not text."""
    from types import SimpleNamespace

    from pipeline.generation.key_state import read_cells

    cells = SimpleNamespace(waiting=Cell([]), inflight=Cell([]), progress=Cell(progress), seen=Cell(seen),
                            poll_at_ms=Cell(poll_at_ms), wait_ms=Cell(wait_ms))
    state = read_cells(cells)
    for value, loaded in ((poll_at_ms, state.poll_at_ms), (wait_ms, state.wait_ms)):
        whole = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        assert loaded == (value if whole else None) and (loaded is None or type(loaded) is int)
    assert state.seen.text == (seen if isinstance(seen, str) else None)
    assert isinstance(state.progress, KeyProgress)


def test_a_value_cell_the_load_refuses_is_cleared_with_the_work_item():
    """A value the load refuses would be refused, and logged, at every callback were it left: a step that leaves
    the value unset writes nothing. So the read clears it (committed with the work item, as every write is)."""
    from types import SimpleNamespace

    from pipeline.generation.key_state import read_cells

    cells = SimpleNamespace(waiting=Cell([]), inflight=Cell([]), progress=Cell(b"\x00"), seen=Cell(7),
                            poll_at_ms=Cell(-1), wait_ms=Cell(-250))
    state = read_cells(cells)
    assert (state.poll_at_ms, state.wait_ms, state.seen.text, state.progress) == (None, None, None, KeyProgress())
    assert [cells.progress.value, cells.seen.value, cells.poll_at_ms.value, cells.wait_ms.value] == [None] * 4
    kept = SimpleNamespace(waiting=Cell([]), inflight=Cell([]), progress=Cell(), seen=Cell(),
                           poll_at_ms=Cell(1_764_000_000_000), wait_ms=Cell(0))
    assert read_cells(kept).poll_at_ms == kept.poll_at_ms.value == 1_764_000_000_000 and kept.wait_ms.value == 0
