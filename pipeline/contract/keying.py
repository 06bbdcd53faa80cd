"""How requests are keyed, and so how they reach workers.

On Dataflow a key's state, timers and bundles live on one worker at a time;
the key space is split into ranges of the keys' hashes over the workers. Two
steps of the template are keyed:

* ``BatchRequests``: ``"bucket:shard"`` with ``shard_of(id, num_shards)`` (the bucket is
  ``"prompt.answer"`` with answer buckets, see :mod:`pipeline.flow.batching`).
  Few keys per bucket let batches fill within ``max_batch_delay_ms``.
* ``StreamingGenerate``: ``generate_key(id, generate_shards)``. Its worker's
  engine serves the request, so these keys decide each GPU's share of the
  work: with K keys over W workers the busiest worker holds more than the mean
  (balls into bins), and the job runs at the pace of its hottest GPU.
  ``make bench-scale`` measures that share; ``generate_shards`` defaults to
  the fewest keys with which it is about what per-request keys give
  (docs/benchmarks.md#scale-out).

A request's length bucket (:func:`bucket_index`) is also its vLLM priority when
shorter prompts go first, so the engine reads it from here, not from the batcher.

Both keys are a stable hash of the request id, the same in every process, so every
copy of an id meets at one key (which is what de-duplication relies on).
"""

from __future__ import annotations

import bisect
import hashlib


def bucket_index(boundaries: tuple[int, ...], prompt_tokens: int) -> int:
    """Bucket i holds lengths in (boundaries[i-1], boundaries[i]]; the last is open."""
    return bisect.bisect_left(boundaries, prompt_tokens)


def shard_of(request_id: str, num_shards: int) -> int:
    """A stable shard for a request id, in ``range(num_shards)``, the same in every process."""
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=4).digest(), "big") % num_shards


def generate_key(request_id: str, generate_shards: int) -> int:
    """The generate step's key for a request: which worker's engine serves it."""
    return shard_of(request_id, generate_shards)
