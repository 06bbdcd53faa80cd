"""How a request crosses a shuffle: a versioned encoding, registered with Beam for :class:`InferenceRequest`.

Requests cross two shuffles (into the batcher, keyed by bucket and shard; into the generate step, in batches).
Without a coder of its own an element falls back to Beam's pickling, whose bytes depend on the class's
layout: a job updated with a changed ``InferenceRequest`` could not read what was in flight. The request's JSON
(:meth:`InferenceRequest.to_json`, which later fields extend without breaking earlier readers) behind a version
byte is what crosses instead; a version this code does not know fails loudly rather than being misread.
"""

from __future__ import annotations

from apache_beam import coders

from pipeline.contract.messages import InferenceRequest

REQUEST_CODER_VERSION = 1


class InferenceRequestCoder(coders.Coder):
    """A version byte, then the request's JSON in UTF-8."""

    def encode(self, value: InferenceRequest) -> bytes:
        return bytes([REQUEST_CODER_VERSION]) + value.to_json().encode("utf-8")

    def decode(self, encoded: bytes) -> InferenceRequest:
        version = encoded[0] if encoded else None
        if version != REQUEST_CODER_VERSION:
            raise ValueError(f"a request encoded as version {version!r}; this code reads {REQUEST_CODER_VERSION}")
        return InferenceRequest.from_json(encoded[1:].decode("utf-8"))

    def is_deterministic(self) -> bool:
        return False  # never a key

    def to_type_hint(self):
        return InferenceRequest


coders.registry.register_coder(InferenceRequest, InferenceRequestCoder)
