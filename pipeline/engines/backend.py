"""What an engine runs over: a backend that generates, and an outlet that publishes chunks.

The engine (:class:`pipeline.engines.engine.Engine`) is a registry of streams over these two interfaces. A
backend starts a stream at its model server, cancels one, and says how loaded the server is; as a stream's text
arrives it tells the engine through :class:`StreamEvents`, and the engine cuts the chunks, keeps the outputs for
``poll`` and builds the completion. An outlet publishes each chunk the moment it is cut (Pub/Sub's, in
:mod:`pipeline.sinks.chunk_publisher`). Two backends exist: vLLM's (:mod:`pipeline.engines.vllm_engine`) and the
in-process static one (:mod:`pipeline.engines.transformers_engine`); a third (another server's API) implements
:class:`Backend` and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from pipeline.contract.chunking import Chunk, ChunkAssembler
from pipeline.engines.engine_settings import EngineSettings
from pipeline.engines.stream_registry import Stream
from pipeline.serving.lineage import ServingLineage

# Requests running and waiting at the model server, where the backend can tell (None where it cannot).
ServerLoad = tuple[int | None, int | None]


class StreamEvents(Protocol):
    """What a backend tells the engine about the streams it generates. Every call is safe from any thread."""

    def attach(self, stream: Stream, assembler: ChunkAssembler) -> None:
        """This attempt's text goes to this assembler (the chunk clock cuts what waits in it)."""

    def began(self, stream: Stream) -> None:
        """The model took the stream now: it shares the model's time from here."""

    def ended(self, stream: Stream) -> None:
        """The model no longer works on the stream (finished, failed or cancelled); idempotent."""

    def cut(self, stream: Stream, step: Callable[[], list[Chunk]]) -> None:
        """Runs a step of the stream's assembler (text arrived, or the stream finished) and sends its chunks on."""

    def restart(self, stream: Stream) -> None:
        """The stream's attempt ended without its answer; its next starts over (a new attempt where chunks went
        out)."""

    def may_run(self, stream: Stream) -> bool:
        """Whether the stream may start an attempt now (False while the bulk lane keeps it shed)."""

    def chunks_pending(self, stream: Stream) -> bool:
        """Whether the outlet has yet to confirm a chunk of the stream (its completion waits until it has)."""

    def complete(self, stream: Stream, assembler: ChunkAssembler, finish_reason: str | None, prompt_tokens: int,
                 now: float) -> None:
        """The stream's completion record (its final chunk already cut and confirmed)."""

    def dead_letter(self, stream: Stream, reason: str) -> None:
        """The stream cannot be answered, for this reason."""


class Backend(Protocol):
    """Generates the engine's streams: built with the engine's settings and the :class:`StreamEvents` to tell."""

    whole_batches: bool  # a batch is started whole or not at all (static batching): StreamRegistry.room
    preempts: bool  # it can stop a running stream's attempt to start it over later: StreamRegistry.shed
    model_name: str  # what completions name as their model
    lineage: ServingLineage  # what produced its answers (pipeline.serving.lineage)

    def start(self, streams: list[Stream]) -> None:
        """Begins generating these streams (registered, counted) without waiting for them."""

    def cancel(self, streams: list[Stream]) -> None:
        """Stops generating these streams, if it can; their outputs are discarded either way."""

    def preempt(self, streams: list[Stream]) -> None:
        """Stops these streams' attempts (with ``preempts``): each starts over once :meth:`StreamEvents.may_run`
        lets it."""

    def load(self) -> ServerLoad:
        """Requests running and waiting at the model server, without waiting on it."""

    def restarts(self) -> int:
        """How often the model server it manages was restarted."""

    def stats(self) -> dict[str, int | None]:
        """Figures of its own for the worker's load gauges ({} if none)."""

    def close(self) -> None:
        """Stops generating and lets go of the server; idempotent."""


BackendFactory = Callable[[EngineSettings, StreamEvents], Backend]


class ChunkOutlet(Protocol):
    """Publishes chunks as they are cut, and says which a stream still waits to have confirmed."""

    @property
    def published(self) -> int:
        """Chunks published so far."""

    def publish(self, stream_key: str, chunk: Chunk) -> None:
        """Sends the chunk without waiting; a failed send is retried by the outlet."""

    def settled(self, stream_key: str) -> bool:
        """Whether every chunk of the stream was confirmed."""

    def failing_since(self, stream_key: str) -> float | None:
        """Since when (epoch seconds) the stream's chunks keep failing, or None."""

    def forget(self, stream_key: str) -> None:
        """Nobody waits for the stream's chunks any more."""

    def unconfirmed(self) -> int:
        """Chunks published and not yet confirmed."""
