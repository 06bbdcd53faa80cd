"""The element guard: all of an element's outputs, or exactly one dead letter, never an exception."""

from __future__ import annotations

from apache_beam import pvalue
from apache_beam.io.gcp.pubsub import PubsubMessage

from pipeline.contract.element_guard import TAG_DEAD_LETTERS, guarded, guarded_value
from pipeline.contract.messages import InferenceRequest


def test_outputs_pass_through_whole_or_not_at_all():
    assert list(guarded("parse", b"x", lambda: iter([1, 2]))) == [1, 2]

    def half_then_fail():
        yield "partial"
        raise TypeError("tokenizer says no")

    forgotten = []
    (letter,) = list(guarded("measure", InferenceRequest(id="r1", prompt="p"), half_then_fail,
                             on_failure=lambda: forgotten.append(True)))
    assert isinstance(letter, pvalue.TaggedOutput) and letter.tag == TAG_DEAD_LETTERS and forgotten == [True]
    record = letter.value
    assert record["stage"] == "measure" and record["id"] == "r1"
    assert "TypeError: tokenizer says no" in record["reason"] and '"prompt":"p"' in record["payload"]


def test_a_raw_message_keeps_its_bytes_and_attributes_in_its_dead_letter():
    message = PubsubMessage(b"\xff\x00raw", {"id": "m-7", "source": "app"})
    (letter,) = list(guarded("parse", message, lambda: [1 / 0]))
    assert letter.value["payload_encoding"] == "base64" and letter.value["attributes"]["source"] == "app"


def test_guarded_value_returns_the_value_or_the_dead_letter():
    assert guarded_value("sink", {"id": "a"}, lambda: 42) == (42, None)
    value, letter = guarded_value("sink", {"id": "a"}, lambda: {}["missing"])
    assert value is None and letter.value["id"] == "a" and "KeyError" in letter.value["reason"]
