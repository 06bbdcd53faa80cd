"""From per-request timings to the figures: percentiles, hop breakdowns, medians and ranges, ratios.

Every time is measured at the client from the moment the request was sent
(published, for the pipelines). A request that streamed no text (the model
may answer some questions with nothing) counts its end as its first chunk.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

HOPS = ("publish → intake", "intake → first token", "token → chunk cut", "cut → subscriber")


@dataclass(frozen=True)
class RequestTiming:
    id: str
    kind: str
    sent: float
    first: float  # first text at the client (its end when there was none)
    done: float  # completion at the client
    tokens: int  # output tokens
    hops: tuple[float, float, float, float] | None = None  # seconds, in HOPS order (the template only)
    accelerator_s: float | None = None  # the completion's accelerator_seconds (the template only)


@dataclass
class RunResult:
    """One system, one load shape, one repetition."""

    system: str
    shape: str
    rep: int
    cores: str
    timings: list[RequestTiming]
    expected: int
    cpu_s: float | None = None  # the system's own processes (the client, for raw vLLM), server excluded
    peak_rss_mib: float | None = None
    notes: list[str] = field(default_factory=list)
    padded_share: float | None = None  # static engine: padding / token positions computed, from its batches
    model_cpu_s: float | None = None  # the vLLM server's CPU time during the run (None: the model is in cpu_s)
    requested_tokens: int | None = None  # fixed answer lengths: the output tokens the run must generate

    @property
    def output_tokens(self) -> int:
        return sum(t.tokens for t in self.timings)

    @property
    def off_request(self) -> bool:
        """Fixed lengths only: the run did not generate exactly the tokens it asked for."""
        return self.requested_tokens is not None and self.output_tokens != self.requested_tokens


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    if not 0 <= q <= 1:
        raise ValueError(f"q must be within [0, 1], got {q}")
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(run: RunResult) -> dict[str, float]:
    """The figures of one run."""
    timings = run.timings
    first = [t.first - t.sent for t in timings]
    done = [t.done - t.sent for t in timings]
    tokens = run.output_tokens
    wall = max(t.done for t in timings) - min(t.sent for t in timings) if timings else math.nan
    figures = {
        "finished": len(timings), "expected": run.expected,
        "first_p50": percentile(first, 0.5), "first_p95": percentile(first, 0.95), "first_p99": percentile(first, 0.99),
        "done_p50": percentile(done, 0.5), "done_p95": percentile(done, 0.95),
        "tokens": tokens, "tok_s": tokens / wall if wall and wall > 0 else math.nan,
        # Fixed lengths: tokens generated beyond (+) or short of (-) the request; 0 when the work was as asked.
        "token_surplus": tokens - run.requested_tokens if run.requested_tokens is not None else math.nan,
        "cpu_s_per_1k_tokens": run.cpu_s / tokens * 1000 if run.cpu_s is not None and tokens else math.nan,
        "all_cpu_s_per_1k_tokens": ((run.cpu_s + (run.model_cpu_s or 0.0)) / tokens * 1000
                                    if run.cpu_s is not None and tokens else math.nan),
        "padded_pct": 100 * run.padded_share if run.padded_share is not None else math.nan,
        # The model's busy time as the template apportions it to the answers, per 1k of their tokens.
        "accel_s_per_1k_tokens": (sum(t.accelerator_s for t in timings) / tokens * 1000
                                  if timings and tokens and all(t.accelerator_s is not None for t in timings)
                                  else math.nan),
        "peak_rss_mib": run.peak_rss_mib if run.peak_rss_mib is not None else math.nan,
    }
    for index, name in enumerate(HOPS):
        values = [t.hops[index] for t in timings if t.hops is not None]
        figures[f"hop_p50:{name}"] = percentile(values, 0.5)
        figures[f"hop_p95:{name}"] = percentile(values, 0.95)
    return figures


@dataclass(frozen=True)
class Spread:
    """A figure over repetitions: the median and the range."""

    median: float
    low: float
    high: float
    count: int

    @classmethod
    def of(cls, values: Iterable[float]) -> Spread:
        finite = [v for v in values if not math.isnan(v)]
        if not finite:
            return cls(math.nan, math.nan, math.nan, 0)
        return cls(statistics.median(finite), min(finite), max(finite), len(finite))


def across_reps(runs: Sequence[RunResult]) -> dict[tuple[str, str, str], dict[str, Spread]]:
    """(cores, shape, system) → figure → its spread over the repetitions."""
    grouped: dict[tuple[str, str, str], list[dict[str, float]]] = {}
    for run in runs:
        grouped.setdefault((run.cores, run.shape, run.system), []).append(summarize(run))
    return {key: {name: Spread.of(s[name] for s in summaries) for name in summaries[0]}
            for key, summaries in grouped.items()}


def ratio(numerator: Spread, denominator: Spread) -> float:
    """The ratio of two medians (NaN when either is missing or the denominator is 0)."""
    if math.isnan(numerator.median) or math.isnan(denominator.median) or denominator.median == 0:
        return math.nan
    return numerator.median / denominator.median
