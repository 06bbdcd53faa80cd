"""Drives an engine to the end the way the generate step does: one loop for the tests and benchmarks.

The generate step submits requests (again later, while the engine is full), polls each stream
from the number of outputs it has taken, and releases a finished stream by polling once more
past its last output. Tests and benchmarks that call an engine directly need the same loop;
:func:`drive_to_end` is it, so that they all exercise the engine's contract the same way.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pipeline.contract.messages import InferenceRequest
from pipeline.engines.engine import COMPLETION, DEAD_LETTER, Engine


@dataclass
class Drive:
    """What a drive collected: each request's outputs in order, when its first output and its outcome arrived."""

    outputs: dict[str, list[tuple[str, dict]]]
    finished_at: dict[str, float] = field(default_factory=dict)
    first_at: dict[str, float] = field(default_factory=dict)

    def completions(self) -> list[dict]:
        return [record for items in self.outputs.values() for kind, record in items if kind == COMPLETION]

    def dead_letters(self) -> list[dict]:
        return [record for items in self.outputs.values() for kind, record in items if kind == DEAD_LETTER]


def drive_to_end(engine: Engine, requests: list[InferenceRequest], *, batches: Sequence[int] = (),
                 timeout_s: float = 180.0, poll_s: float = 0.05,
                 each_poll: Callable[[], None] | None = None) -> Drive:
    """Submits ``requests`` (one by one, or in consecutive ``batches`` of these sizes: units the engine must take
    whole, as the batcher's batches reach a static engine) and polls until each has its completion or dead letter;
    then releases every stream and checks the engine let go of it.

    ``each_poll`` runs after every poll (a test's invariant). Raises TimeoutError naming what had no outcome.
    """
    by_key: dict[str, InferenceRequest] = {}
    unsent = list(requests)
    if batches:
        if sum(batches) != len(requests) or min(batches) < 1:
            raise ValueError(f"batches of {list(batches)} do not split {len(requests)} requests")
        for size in batches:
            batch, unsent = unsent[:size], unsent[size:]
            keys = engine.submit_batch([r.to_json() for r in batch], [1] * len(batch))
            if None in keys:
                raise RuntimeError("the engine did not take a batch whole")
            by_key.update(zip(keys, batch, strict=True))
    drive = Drive({r.id: [] for r in requests})
    taken = dict.fromkeys(by_key, 0)  # outputs taken per stream: a poll hands over the rest
    pending = set(by_key)
    deadline = time.monotonic() + timeout_s
    while (pending or unsent) and time.monotonic() < deadline:
        while unsent and (key := engine.submit_batch([unsent[0].to_json()], [1])[0]) is not None:
            by_key[key] = unsent.pop(0)
            taken[key] = 0
            pending.add(key)
        for key, items in engine.poll({k: taken[k] for k in pending}).items():
            taken[key] += len(items)
            for kind, payload in items:
                drive.first_at.setdefault(by_key[key].id, time.time())
                drive.outputs[by_key[key].id].append((kind, json.loads(payload)))
                if kind in (COMPLETION, DEAD_LETTER):
                    pending.discard(key)
                    drive.finished_at[by_key[key].id] = time.time()
        if each_poll is not None:
            each_poll()
        if poll_s:
            time.sleep(poll_s)
    if pending or unsent:
        raise TimeoutError(f"{len(pending) + len(unsent)} requests without an outcome within {timeout_s:g} s: "
                           f"{sorted(by_key[k].id for k in pending)[:5]}, never sent: {[r.id for r in unsent][:5]}")
    released = engine.poll(taken)
    if released != dict.fromkeys(taken, []):
        raise AssertionError(f"the engine still holds streams whose every output was taken: {released}")
    return drive
