"""Prompt length in tokens, for length bucketing and the context check.

The model's own tokenizer gives the length the server will see (chat prompts
through the model's chat template); it is loaded once per worker process. A
cheap character-based estimate is the fallback for models whose tokenizer is
not available where the pipeline runs.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import apache_beam as beam
from apache_beam import pvalue
from apache_beam.metrics import Metrics
from apache_beam.utils.shared import Shared

from pipeline.contract.element_guard import TAG_DEAD_LETTERS, guarded
from pipeline.contract.messages import STAGE_MEASURE, STAGE_VALIDATE, DeadLetter, InferenceRequest
from pipeline.contract.parameters import default
from pipeline.serving.model_access import explained_fetch, resolve_model

ESTIMATOR_TOKENIZER, ESTIMATOR_CHARS = "tokenizer", "chars"


def estimate_tokens(text: str) -> int:
    """About four characters a token for English BPE vocabularies."""
    return max(1, (len(text) + 3) // 4)


class TokenizerMeter:
    """Counts tokens as the server will: chat requests through the chat template."""

    def __init__(self, model: str, prompt_format: str) -> None:
        from transformers import AutoTokenizer

        with explained_fetch(model):
            self._tokenizer: Any = AutoTokenizer.from_pretrained(model)  # its typed API does not fit chat messages
        self._chat = prompt_format == "chat"

    def __call__(self, request: InferenceRequest) -> int:
        if request.messages is not None or (self._chat and self._tokenizer.chat_template):
            messages = list(request.messages or [{"role": "user", "content": request.prompt}])
            encoded = self._tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
            if isinstance(encoded, dict) or hasattr(encoded, "keys"):
                encoded = encoded["input_ids"]
            return len(encoded)
        return len(self._tokenizer.encode(request.prompt))


class _Holder:
    """Shared() needs a weak-referenceable object."""

    def __init__(self, meter: TokenizerMeter) -> None:
        self.meter = meter


class MeasureFn(beam.DoFn):
    """The measure step's DoFn (:class:`MeasurePromptLength`): each request, guarded, with its prompt's tokens."""

    def __init__(self, estimator: str, model: str, prompt_format: str, max_model_len: int,
                 hf_token_secret: str | None) -> None:
        self._estimator = estimator
        self._model = model
        self._hf_token_secret = hf_token_secret
        self._prompt_format = prompt_format
        self._max_model_len = max_model_len
        self._shared = Shared()
        self._meter: Callable[[InferenceRequest], int] | None = None  # from setup
        self.too_long = Metrics.counter("prompt_length", "longer_than_context")
        self.tokens = Metrics.distribution("prompt_length", "prompt_tokens")

    def setup(self) -> None:
        if self._estimator == ESTIMATOR_TOKENIZER:
            path = resolve_model(self._model, hf_token_secret=self._hf_token_secret)
            holder = self._shared.acquire(lambda: _Holder(TokenizerMeter(path, self._prompt_format)),
                                          tag=f"{path}|{self._prompt_format}")
            self._meter = holder.meter
        else:
            self._meter = lambda request: estimate_tokens(request.prompt_text())

    def process(self, request: InferenceRequest) -> Iterator[Any]:
        return guarded(STAGE_MEASURE, request, lambda: self._measure(request))

    def _measure(self, request: InferenceRequest) -> Iterator[Any]:
        assert self._meter is not None, "setup() runs first"
        tokens = self._meter(request)
        self.tokens.update(tokens)
        # Only the tokenizer's count is exact enough to refuse a request on.
        if self._estimator == ESTIMATOR_TOKENIZER and tokens + (request.max_tokens or 1) > self._max_model_len:
            self.too_long.inc()
            reason = (f"the prompt has {tokens} tokens and max_tokens is {request.max_tokens}; together they exceed "
                      f"the model's context of {self._max_model_len} tokens")
            letter = DeadLetter.of_request(STAGE_VALIDATE, reason, request, at=time.time())
            yield pvalue.TaggedOutput(TAG_DEAD_LETTERS, letter.to_record())
            return
        yield dataclasses.replace(request, prompt_tokens=tokens)


@dataclass(frozen=True)
class PromptLength:
    """How :class:`MeasurePromptLength` counts a prompt's tokens; validated once, here."""

    estimator: str = ESTIMATOR_CHARS  # "tokenizer" or "chars"
    model: str = ""  # the model whose tokenizer counts (the tokenizer estimator's)
    prompt_format: str = default("prompt_format")
    max_model_len: int = default("max_model_len")
    hf_token_secret: str | None = None

    def __post_init__(self) -> None:
        if self.estimator not in (ESTIMATOR_TOKENIZER, ESTIMATOR_CHARS):
            raise ValueError(f"estimator must be {ESTIMATOR_TOKENIZER} or {ESTIMATOR_CHARS}, got {self.estimator!r}")
        if self.estimator == ESTIMATOR_TOKENIZER and not self.model:
            raise ValueError("the tokenizer estimator needs the model")


class MeasurePromptLength(beam.PTransform):
    """Requests in; ``requests`` (with ``prompt_tokens`` set) and ``dead_letters`` out.

    With the tokenizer, a request whose prompt plus ``max_tokens`` exceeds the
    model's context becomes a dead letter here instead of occupying a bucket.
    """

    def __init__(self, settings: PromptLength = PromptLength()) -> None:
        super().__init__()
        self._settings = settings

    def expand(self, requests):
        s = self._settings
        return requests | "Measure" >> beam.ParDo(MeasureFn(
            s.estimator, s.model, s.prompt_format, s.max_model_len, s.hf_token_secret)).with_outputs(
            TAG_DEAD_LETTERS, main="requests")
