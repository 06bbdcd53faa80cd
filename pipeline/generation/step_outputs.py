"""The generate step's outputs as Beam emits them, and the counters a job's dashboard reads from them.

The key machine (:mod:`pipeline.generation.key_machine`) hands over outputs as the engine does, ``(kind, JSON)``;
here each becomes a chunk on the main output or a completion or dead letter on its tagged output, counted. The
machine's own counts (requests sent, queued, resent, ...) are Beam counters under the same namespace.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from apache_beam import pvalue
from apache_beam.metrics.metric import Metrics

from pipeline.contract.stream_progress import CHUNK, COMPLETION, DEAD_LETTER, Output
from pipeline.generation.step_work import MACHINE_COUNTS

LOGGER = logging.getLogger(__name__)
NAMESPACE = "streaming_generate"
TAG_COMPLETIONS = "completions"
TAG_DEAD_LETTERS = "dead_letters"
# Bounds, in seconds, of the counters of answers whose first token took longer (``first_token_over_<b>s``).
# Cloud Monitoring charts Beam counters, not distributions' percentiles, so a percentile is read from them:
# the p95 of time to first token is over ``b`` exactly when more than 5 % of ``first_tokens`` are over ``b``.
FIRST_TOKEN_BOUNDS_S = (1, 2, 5, 10, 30)


def first_token_counter_name(bound_s: int) -> str:
    return f"first_token_over_{bound_s}s"


class StepOutputs:
    """Turns the machine's outputs into Beam's, counting them."""

    def __init__(self) -> None:
        self.chunks_out = Metrics.counter(NAMESPACE, "chunks")
        self.completions_out = Metrics.counter(NAMESPACE, "completions")
        self.dead_letters_out = Metrics.counter(NAMESPACE, "dead_letters")
        self.ttft = Metrics.distribution(NAMESPACE, "time_to_first_token_ms")
        self.first_tokens = Metrics.counter(NAMESPACE, "first_tokens")
        self.first_token_over = [(1000 * bound, Metrics.counter(NAMESPACE, first_token_counter_name(bound)))
                                 for bound in FIRST_TOKEN_BOUNDS_S]
        # The model's busy time as apportioned to what this step emits (answers and dead letters alike).
        self.accelerator_ms = Metrics.counter(NAMESPACE, "accelerator_ms")
        # Structured answers (a response_format) without a valid output_json, and those of them cut at max_tokens.
        self.structured_invalid = Metrics.counter(NAMESPACE, "structured_output_invalid")
        self.structured_cut = Metrics.counter(NAMESPACE, "structured_output_cut_at_max_tokens")
        # The key machine's own counts, by the names it gives them (pipeline.generation.key_machine).
        self.machine_counts = {name: Metrics.counter(NAMESPACE, name) for name in MACHINE_COUNTS}

    def emit(self, output: Output) -> Any:
        """One output as the step emits it, counted."""
        kind, payload = output
        if kind == CHUNK:
            self.chunks_out.inc()
            return json.loads(payload)
        record = json.loads(payload)
        self.accelerator_ms.inc(round(1000 * (record.get("accelerator_seconds") or 0.0)))
        if kind == DEAD_LETTER:
            self.dead_letters_out.inc()
            return pvalue.TaggedOutput(TAG_DEAD_LETTERS, record)
        assert kind == COMPLETION, kind
        self.completions_out.inc()
        if record["time_to_first_token_ms"] is not None:
            self.count_first_token(int(record["time_to_first_token_ms"]))
        if record["output_error"] is not None:
            self.structured_invalid.inc()
            if record["finish_reason"] == "length":
                self.structured_cut.inc()
        return pvalue.TaggedOutput(TAG_COMPLETIONS, record)

    def count_first_token(self, ttft_ms: int) -> None:
        self.ttft.update(ttft_ms)
        self.first_tokens.inc()
        for bound_ms, counter in self.first_token_over:
            if ttft_ms > bound_ms:
                counter.inc()

    def count(self, counts: Mapping[str, int], logs: tuple[tuple[int, str], ...]) -> None:
        """The machine's own counts, as counters; its log lines, logged."""
        for name, n in counts.items():
            if n:
                self.machine_counts[name].inc(n)
        for level, message in logs:
            LOGGER.log(level, message)
