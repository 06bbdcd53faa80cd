"""The engine's chunk clock: text that waits past ``chunk_interval_ms`` becomes a chunk on the engine's own thread,
with no poll, so ``poll`` only reads and a chunk published straight to Pub/Sub never waits for one.

The engine is the real :class:`~pipeline.engines.engine.Engine`; its backend here (the
:class:`~pipeline.engines.backend.Backend` interface, nothing else) types two pieces of text and then nothing for a
second (a model step slower than the interval), which a real server cannot be made to do on cue. The engines' own chunking with the real models: ``tests/test_engine.py``, ``tests/test_transformers_engine.py``.
"""

from __future__ import annotations

import json
import threading
import time

from pipeline.contract.chunking import ChunkAssembler, ChunkPolicy
from pipeline.contract.messages import InferenceRequest
from pipeline.contract.stream_progress import CHUNK
from pipeline.engines.backend import ServerLoad, StreamEvents
from pipeline.engines.engine import Engine
from pipeline.engines.engine_settings import EngineSettings
from pipeline.engines.stream_registry import Stream
from pipeline.serving.lineage import ServingLineage, WeightsLineage
from pipeline.serving.vllm_server import ServerSpec


class _SlowTypist:
    """A backend whose stream says "a", then "b" 10 ms later, then nothing for a second."""

    whole_batches = False
    preempts = False
    model_name = "typist"
    lineage = ServingLineage(model=WeightsLineage("typist", None, None), engine="a typist", image=None, settings={})

    def __init__(self, settings: EngineSettings, events: StreamEvents) -> None:
        self.settings, self.events = settings, events

    def start(self, streams: list[Stream]) -> None:
        for stream in streams:
            threading.Thread(target=self._type, args=(stream,), daemon=True).start()

    def _type(self, stream: Stream) -> None:
        assembler = ChunkAssembler(stream.request.id, stream.attempt, self.settings.chunk_policy, time.time())
        self.events.attach(stream, assembler)
        self.events.cut(stream, lambda: assembler.add("a", 1, time.time()))
        time.sleep(0.01)
        self.events.cut(stream, lambda: assembler.add("b", 2, time.time()))

    def cancel(self, streams: list[Stream]) -> None:
        pass

    def preempt(self, streams: list[Stream]) -> None:
        pass

    def load(self) -> ServerLoad:
        return None, None

    def restarts(self) -> int:
        return 0

    def stats(self) -> dict[str, int | None]:
        return {}

    def close(self) -> None:
        pass


def test_text_that_waits_past_the_interval_is_cut_into_a_chunk_without_any_poll() -> None:
    engine = Engine(EngineSettings(server=ServerSpec(model="unused"), engine="vllm", max_in_flight=1,
                                   chunk_policy=ChunkPolicy(chunk_tokens=1000, interval_ms=100)), _SlowTypist)
    try:
        started = time.time()
        (key,) = engine.submit_batch([InferenceRequest(id="slow", prompt="p").to_json()], [1])
        time.sleep(0.6)  # no poll meanwhile
        chunks = [json.loads(payload) for kind, payload in engine.poll({key: 0})[key] if kind == CHUNK]
        assert [c["text"] for c in chunks] == ["a", "b"], chunks
        waited = chunks[1]["emitted_at"] - started
        assert 0.1 <= waited < 0.4, f"cut {waited:.3f} s after the text began, by the clock, not by the poll"
        assert engine.poll({key: 0})[key] == engine.poll({key: 0})[key], "polls only read"
    finally:
        engine.close()
