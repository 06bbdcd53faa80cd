"""The engine's chunk clock: text that waits past ``chunk_interval_ms`` becomes a chunk on the engine's own thread,
with no poll, so ``poll`` only reads and a chunk published straight to Pub/Sub never waits for one.

The registry is the real :class:`~pipeline.engines.engine.EngineBase`; its backend here types two pieces of text
and then nothing for a second (a model step slower than the interval), which a real server cannot be made to do
on cue. The engines' own chunking with the real models: ``tests/test_engine.py``, ``tests/test_transformers_engine.py``.
"""

from __future__ import annotations

import json
import threading
import time

from pipeline.contract.chunking import ChunkAssembler, ChunkPolicy
from pipeline.contract.messages import InferenceRequest
from pipeline.contract.stream_progress import CHUNK
from pipeline.engines.engine import EngineBase
from pipeline.engines.engine_settings import EngineSettings
from pipeline.engines.stream_registry import Stream
from pipeline.serving.vllm_server import ServerSpec


class _SlowTypist(EngineBase):
    """A backend whose stream says "a", then "b" 10 ms later, then nothing for a second."""

    def _start(self, streams: list[Stream]) -> None:
        for stream in streams:
            threading.Thread(target=self._type, args=(stream,), daemon=True).start()

    def _type(self, stream: Stream) -> None:
        assembler = ChunkAssembler(stream.request.id, stream.attempt, self.settings.chunk_policy, time.time())
        stream.assembler = assembler
        self._cut(stream, lambda: assembler.add("a", 1, time.time()))
        time.sleep(0.01)
        self._cut(stream, lambda: assembler.add("b", 2, time.time()))


def test_text_that_waits_past_the_interval_is_cut_into_a_chunk_without_any_poll() -> None:
    engine = _SlowTypist(EngineSettings(server=ServerSpec(model="unused"), engine="vllm", max_in_flight=1,
                                        chunk_policy=ChunkPolicy(chunk_tokens=1000, interval_ms=100)))
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
