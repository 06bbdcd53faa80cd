"""Chunk policy: how streamed token deltas are grouped into output chunks.

Publishing every token as its own Pub/Sub message is wasteful; holding text
back hurts time to first token. The policy emits the first text at once, then
a chunk whenever ``chunk_tokens`` new tokens have arrived or ``interval_ms``
has passed with text waiting, and always a final chunk that carries the finish
reason. Each assembler is one stream with an identity of its own (a random
``stream`` id); sequence numbers are gapless from 0 per stream.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from pipeline.contract.messages import Chunk
from pipeline.contract.parameters import default


@dataclass(frozen=True)
class ChunkPolicy:
    chunk_tokens: int = default("chunk_tokens")
    interval_ms: float = float(default("chunk_interval_ms"))

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be at least 1, got {self.chunk_tokens}")
        if self.interval_ms <= 0:
            raise ValueError(f"interval_ms must be positive, got {self.interval_ms}")


class ChunkAssembler:
    """Accumulates the deltas of one request attempt and cuts chunks per the policy.

    Times are wall-clock seconds; ``started_at`` is when the request was
    received, so chunk timings include queueing, as users experience them.
    """

    def __init__(self, request_id: str, attempt: int, policy: ChunkPolicy, started_at: float) -> None:
        self.request_id = request_id
        self.attempt = attempt
        self.stream = uuid.uuid4().hex
        self.policy = policy
        self.started_at = started_at
        self.first_token_at: float | None = None
        self.text = ""
        self.tokens = 0
        self._pending = ""
        self._pending_tokens = 0
        self._last_emit_at = started_at
        self._seq = 0
        self.finished = False

    def add(self, delta: str, tokens_total: int, now: float) -> list[Chunk]:
        """Records a delta; ``tokens_total`` is the cumulative completion token count."""
        if self.finished:
            raise RuntimeError(f"request {self.request_id} already finished")
        new_tokens = max(tokens_total - self.tokens, 0)
        self.tokens = max(tokens_total, self.tokens)
        if not delta:
            self._pending_tokens += new_tokens
            return []
        if self.first_token_at is None:
            self.first_token_at = now
        self.text += delta
        self._pending += delta
        self._pending_tokens += new_tokens
        first_text = self._seq == 0
        if first_text or self._pending_tokens >= self.policy.chunk_tokens or self._interval_passed(now):
            return [self._emit(now, final=False, finish_reason=None)]
        return []

    def due(self, now: float) -> list[Chunk]:
        """A chunk for text that has waited past the interval, if any."""
        if self._pending and not self.finished and self._interval_passed(now):
            return [self._emit(now, final=False, finish_reason=None)]
        return []

    def finish(self, finish_reason: str | None, tokens_total: int, now: float) -> Chunk:
        """The final chunk: whatever text is left (possibly none) and the finish reason."""
        self.tokens = max(tokens_total, self.tokens)
        self.finished = True
        return self._emit(now, final=True, finish_reason=finish_reason)

    def _interval_passed(self, now: float) -> bool:
        return (now - self._last_emit_at) * 1000.0 >= self.policy.interval_ms

    def _emit(self, now: float, *, final: bool, finish_reason: str | None) -> Chunk:
        chunk = Chunk(
            id=self.request_id, attempt=self.attempt, stream=self.stream, seq=self._seq, text=self._pending,
            tokens=self.tokens,
            final=final, finish_reason=finish_reason, time_to_first_token_ms=self.time_to_first_token_ms,
            elapsed_ms=round((now - self.started_at) * 1000.0, 3), emitted_at=now)
        self._seq += 1
        self._pending = ""
        self._pending_tokens = 0
        self._last_emit_at = now
        return chunk

    @property
    def chunks_emitted(self) -> int:
        return self._seq

    @property
    def time_to_first_token_ms(self) -> float | None:
        if self.first_token_at is None:
            return None
        return round((self.first_token_at - self.started_at) * 1000.0, 3)
