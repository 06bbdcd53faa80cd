"""Every dead letter of the job counted by the stage that made it, on its way to the sinks.

All dead letters meet in one flatten before they are written, so one step there counts them whatever
made them (parsing, prompt length, the batcher, generation, a drain, a sink): Beam counters
``dead_letters_<stage>`` in namespace :data:`NAMESPACE`. The dashboard and the dead-letter alert in
``ops/`` read them beside ``streaming_generate/completions``; counters rather than the topic's own
metrics, because dead letters may go to a table only.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import apache_beam as beam
from apache_beam.metrics import Metrics

NAMESPACE = "dead_letters"


class CountDeadLetters(beam.DoFn):
    """Passes each dead letter on, counting it under its stage."""

    def process(self, letter: dict[str, Any]) -> Iterator[dict[str, Any]]:
        Metrics.counter(NAMESPACE, f"dead_letters_{letter.get('stage')}").inc()
        yield letter
