"""The element boundary of every stage: an element that raises becomes a dead letter; the bundle goes on.

A streaming bundle that raises is retried forever on Dataflow (and ends the
DirectRunner), so one poison message would stall its keys or stop the job.
Each stage therefore runs its per-element work through :func:`guarded`: the
work's outputs are held until it returns, so an element yields either all of
its outputs or, if anything raised, exactly one dead letter with the stage,
a reason and the element's raw payload. Input the contract expects to refuse
is refused by the stage itself with a precise reason; this guard is for what
nobody listed (a tokenizer's own exception on odd text, a bug), and it logs
the stack trace with the element's id, never its text.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from apache_beam import pvalue
from apache_beam.metrics import Metrics

from pipeline.contract.messages import LANE_LIVE, DeadLetter, InferenceRequest, lane_marked

LOGGER = logging.getLogger(__name__)
TAG_DEAD_LETTERS = "dead_letters"


def describe(element: Any) -> tuple[str | None, bytes | str, Mapping[str, str]]:
    """(id, raw payload, attributes) of an element at any stage, for its dead letter."""
    if isinstance(element, tuple) and len(element) == 2 and not isinstance(element[1], (bytes, str)):
        element = element[1]  # (key, value) pairs of keyed stages
    if isinstance(element, InferenceRequest):
        return element.id, element.to_json(), {}
    if isinstance(element, Mapping):
        element_id = element.get("id")
        return (None if element_id is None else str(element_id)), json.dumps(element, default=repr), {}
    data = getattr(element, "data", element)  # a PubsubMessage
    attributes = dict(getattr(element, "attributes", None) or {})
    if isinstance(data, (bytes, str)):
        return None, data, attributes
    return None, repr(element), attributes


def lane_of(element: Any) -> str:
    """The lane of an element at any stage: a request's own, a message's attribute, else live."""
    if isinstance(element, tuple) and len(element) == 2:
        element = element[1]
    if isinstance(element, InferenceRequest):
        return element.lane_name()
    attributes = getattr(element, "attributes", None)
    return (isinstance(attributes, Mapping) and lane_marked(attributes)) or LANE_LIVE


def dead_letter_for(stage: str, element: Any, reason: str) -> dict[str, Any]:
    """A dead-letter record (a JSON-ready dict, as every stage emits them) for ``element``."""
    try:
        element_id, payload, attributes = describe(element)
        lane = lane_of(element)
    except Exception:  # the element cannot even be described; keep what can be
        element_id, payload, attributes, lane = None, repr(element)[:100_000], {}, LANE_LIVE
    if isinstance(payload, bytes):
        letter = DeadLetter.from_bytes(stage, reason, payload, id=element_id, attributes=attributes, lane=lane)
    else:
        letter = DeadLetter(stage, reason, payload, id=element_id, attributes=attributes, at=time.time(), lane=lane)
    return letter.to_record()


def guarded(stage: str, element: Any, work: Callable[[], Iterable[Any]],
            on_failure: Callable[[], None] | None = None) -> Iterator[Any]:
    """Runs ``work()`` for one element: all of its outputs, or one dead letter if it raised.

    ``on_failure`` lets a stateful stage forget the element, whose outcome is now that dead letter.
    """
    try:
        outputs = list(work())
    except Exception as exc:  # any element-caused failure must not fail the bundle
        if on_failure is not None:
            on_failure()
        element_id = _safe_id(element)
        Metrics.counter("element_guard", f"failed_{stage}").inc()
        LOGGER.error("Stage %s failed on element %s; it goes to the dead letters", stage, element_id,
                     exc_info=True)
        reason = (f"the {stage} stage failed on this message: {type(exc).__name__}: {_short(exc)} "
                  "(the worker log has the stack trace under this id)")
        yield pvalue.TaggedOutput(TAG_DEAD_LETTERS, dead_letter_for(stage, element, reason))
        return
    yield from outputs


def guarded_value(stage: str, element: Any, compute: Callable[[], Any]) -> tuple[Any, pvalue.TaggedOutput | None]:
    """``(compute(), None)``, or ``(None, dead letter)`` if it raised: for a step whose one risky part is a value."""
    value = None

    def work() -> list[Any]:
        nonlocal value
        value = compute()
        return []

    failed = list(guarded(stage, element, work))
    return (None, failed[0]) if failed else (value, None)


def _safe_id(element: Any) -> str | None:
    try:
        return describe(element)[0]
    except Exception:
        return None


def _short(exc: BaseException, limit: int = 300) -> str:
    text = str(exc) or "no message"
    return text if len(text) <= limit else text[:limit] + "…"
