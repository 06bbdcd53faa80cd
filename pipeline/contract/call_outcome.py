"""What became of one call from a harness thread to the worker's runtime: the one call policy, as a value.

The generate step's key machine (:mod:`pipeline.generation.key_machine`) decides what each outcome means for a
request; the runtime client (:mod:`pipeline.worker.runtime_client`) is the one place that turns a call into one.
"""

from __future__ import annotations

from enum import Enum


class Call(Enum):
    ANSWERED = "answered"  # the engine answered
    UNREACHABLE = "unreachable"  # the runtime's host could not be reached: nothing is known, so nothing is lost
    FAILED = "failed"  # the engine raised: the streams asked about count as lost, within their bound
