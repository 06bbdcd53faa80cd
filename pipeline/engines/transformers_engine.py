"""A static-batching engine: the model in-process, each batch padded to its longest prompt.

This is the engine the length-bucketing argument is about, and the baseline
vLLM is measured against. Each worker loads the model once, in a process of its
own that its SDK processes reach through Beam's ``MultiProcessShared`` (see
:func:`pipeline.worker.runtime.acquire_runtime`), takes each batch the batcher formed
as one unit, left-pads it to its longest prompt and runs transformers'
``generate`` over the whole batch. A finished sequence's record goes out at
once, but its row is computed on until the longest one ends, so one long prompt
or long answer pads a batch of short ones: :class:`BatchPadding` counts those
padded token positions from the real tensors, and every batch logs them.

Per-request ``max_tokens``, ``min_tokens``, ``temperature``, ``top_p`` and
``stop`` hold within a batch: logits processors keep a row's end token out
until its ``min_tokens`` and sample each row with its own settings
(temperature 0 keeps only the row's best token), and a stopping criterion ends
each row on its own limit, stop string or end-of-sequence token. The fields the
request table (:mod:`pipeline.contract.request_fields`) marks vLLM's alone
(``seed``, the penalties, ``response_format``) this engine does not have; a
request that sets one is served without it, and its lineage does not record it
(``response_format``: the request becomes a dead letter, since its answer could
not be trusted as data).

Text streams per decoding step. transformers' own streamers refuse batches of
more than one, so a small streamer of ours receives each step's tokens for the
whole batch, decodes each row's new text and hands it to that request's chunk
assembler: the first chunk leaves after the batch's first step, not when the
batch ends. Batches run one at a time on one thread: a batch waits for the one
before it, which is the head-of-line blocking continuous batching removes. Of
the batches waiting, one that holds a live request goes before every bulk-lane
batch (then in arrival order): a bulk backlog queued here delays a live request
by the batch in progress, never by the backlog.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from pipeline.contract.chunking import ChunkAssembler
from pipeline.contract.messages import InferenceRequest
from pipeline.contract.request_fields import ENGINE_TRANSFORMERS, refused_by
from pipeline.engines.backend import ServerLoad, StreamEvents
from pipeline.engines.engine import Engine
from pipeline.engines.engine_settings import EngineSettings
from pipeline.engines.stream_registry import Stream
from pipeline.serving.lineage import ServingLineage, chat_template_digest, model_lineage
from pipeline.serving.model_access import explained_fetch, resolve_model

LOGGER = logging.getLogger(__name__)
REFUSED = refused_by(ENGINE_TRANSFORMERS)  # a request that sets one is a dead letter here: the table's

# What each batch cost in padding, one line per batch for the operator (and parseable: make bench reads it).
BATCH_LOG = ("Static batch: %d requests, %d token positions computed, %d of them padding (%.1f %%): "
             "prompt %d/%d padded, decode %d/%d padded; %.2f s")


@dataclass
class BatchPadding:
    """Token positions a batch computed, and how many were padding (from the real tensors)."""

    requests: int = 0
    prompt_positions: int = 0  # rows × longest prompt
    prompt_padding: int = 0
    decode_positions: int = 0  # rows × decoding steps the batch ran
    decode_padding: int = 0  # steps a row ran after its own sequence had ended

    @property
    def positions(self) -> int:
        return self.prompt_positions + self.decode_positions

    @property
    def padding(self) -> int:
        return self.prompt_padding + self.decode_padding

    @property
    def share(self) -> float:
        return self.padding / self.positions if self.positions else 0.0

    def add(self, other: BatchPadding) -> None:
        for name in ("requests", "prompt_positions", "prompt_padding", "decode_positions", "decode_padding"):
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class _Row:
    """One request's sequence within a batch."""

    stream: Stream
    assembler: ChunkAssembler
    prompt_tokens: int
    max_tokens: int
    min_tokens: int
    stop: tuple[str, ...]
    token_ids: list[int] = field(default_factory=list)
    sent: int = 0  # characters of text handed to the assembler
    stop_from: int | None = None  # where stop strings are looked for: after the text of its first min_tokens
    steps: int = 0  # decoding steps that computed this row's own tokens (the end token's included)
    finish_reason: str | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


def transformers_engine(settings: EngineSettings) -> Engine:
    """The engine over the model in this process, batch by batch (``engine=transformers``)."""
    return Engine(settings, TransformersBackend)


class TransformersBackend:
    """Loads the model in-process and generates each submitted batch together, one batch at a time."""

    whole_batches = True  # a batch the batcher formed is generated as one
    preempts = False  # a batch runs to its end: a bulk lane shrinks as its batches end

    def __init__(self, settings: EngineSettings, events: StreamEvents) -> None:
        self.settings = settings
        self._events = events
        self._closed = False
        self._lock = threading.Lock()  # the padding figures, read by stats() from another thread
        import torch  # here, not at module level: the vLLM path never needs transformers loaded
        from transformers import AutoModelForCausalLM, AutoTokenizer

        spec = settings.server
        assert spec is not None, "EngineSettings refuses engine 'transformers' without a model spec"
        self._torch = torch
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cpu" and hasattr(os, "sched_getaffinity"):
            # One core left to the pipeline's own threads: OpenMP threads spin-wait on each other, so one
            # that is descheduled stalls every step. torch would otherwise count the machine's cores, not
            # this process's.
            torch.set_num_threads(max(len(os.sched_getaffinity(0)) - 1, 1))
        path = resolve_model(spec.model, spec.model_cache_dir, spec.hf_token_secret)
        dtype = "auto" if spec.dtype == "auto" else getattr(torch, spec.dtype)
        started = time.monotonic()
        with explained_fetch(spec.model):
            # Typed as Any: transformers' stubs type neither chat messages nor decode's str as this code uses them.
            self._tokenizer: Any = AutoTokenizer.from_pretrained(path)
            model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
            self._model: Any = model.to(self.device).eval()
        self._tokenizer.padding_side = "left"  # generation continues from the right end of every row
        if self._tokenizer.pad_token_id is None:
            self._tokenizer.pad_token = self._tokenizer.eos_token
        eos = self._model.generation_config.eos_token_id
        self._eos_ids = set(eos if isinstance(eos, list) else [eos if eos is not None else
                                                                self._tokenizer.eos_token_id])
        self.model_name = spec.model_name
        import transformers

        self.lineage = ServingLineage(
            model=model_lineage(spec.model, path), engine=f"transformers {transformers.__version__}",
            image=settings.image, kind=ENGINE_TRANSFORMERS,  # no seeds, no penalties: the table's engines
            settings={"dtype": str(self._model.dtype).removeprefix("torch."), "max_model_len": spec.max_model_len,
                      "chat_template": chat_template_digest(spec.model, path), "prompt_format": settings.prompt_format})
        self.padding = BatchPadding()
        LOGGER.info("Static engine: %s loaded on %s (%s) in %.1f s", path, self.device,
                    self._model.dtype, time.monotonic() - started)
        # (lane, arrival, batch): live batches (0) before bulk ones (1), each lane in arrival order; None (2) ends.
        self._batches: queue.PriorityQueue[tuple[int, int, list[Stream] | None]] = queue.PriorityQueue()
        self._arrivals = itertools.count()
        self._finished: queue.Queue[tuple[_Row, float] | None] = queue.Queue()
        for target, name in ((self._serve, "static-engine"), (self._complete_finished, "static-engine-completions")):
            threading.Thread(target=target, name=name, daemon=True).start()
        atexit.register(self.close)

    def stats(self) -> dict[str, int | None]:
        """The token positions its batches computed so far, and how many were padding."""
        with self._lock:
            padding = dict(self.padding.__dict__)
        return {"batch_requests": padding.pop("requests"), **padding}

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._batches.put((2, next(self._arrivals), None))
            self._finished.put(None)

    # Backend ---------------------------------------------------------------------------

    def start(self, streams: list[Stream]) -> None:
        bulk = all(stream.request.bulk for stream in streams)
        self._batches.put((int(bulk), next(self._arrivals), streams))

    def cancel(self, streams: list[Stream]) -> None:
        """Nothing to stop: a batch runs to its end, and a cancelled stream's outputs are not kept."""

    def preempt(self, streams: list[Stream]) -> None:
        """Never asked (``preempts`` is False)."""

    def load(self) -> ServerLoad:
        return None, None

    def restarts(self) -> int:
        return 0

    # Generation ------------------------------------------------------------------------

    def _serve(self) -> None:
        while (batch := self._batches.get()[2]) is not None:
            try:
                self._generate(batch)
            except Exception as exc:  # a bug or a broken batch must not leave requests without an outcome
                LOGGER.exception("Static batch of %d requests failed", len(batch))
                for stream in batch:
                    if not stream.done and not (stream.assembler and stream.assembler.finished):
                        self._events.dead_letter(stream, f"internal error: {type(exc).__name__}: {exc}")

    def _generate(self, batch: list[Stream]) -> None:
        torch = self._torch
        from transformers import LogitsProcessorList, StoppingCriteriaList

        served, now = [], time.time()
        for stream in batch:
            request = stream.request
            if refused := [name for name in REFUSED if getattr(request, name) is not None]:
                self._events.dead_letter(stream, f"engine 'transformers' cannot apply {', '.join(refused)}; run "
                                                 "this request with engine=vllm")
            elif request.deadline_ms is not None and now > request.received_at + request.deadline_ms / 1000:
                self._events.dead_letter(stream, f"its deadline_ms={request.deadline_ms} passed while it waited "
                                                 "for the batches before it")
            else:
                served.append(stream)
        if not served:
            return
        started = time.time()
        encoded = self._tokenizer([self._prompt_text(s.request) for s in served], return_tensors="pt",
                                  padding=True, add_special_tokens=self.settings.prompt_format != "chat")
        lengths = encoded["attention_mask"].sum(dim=1).tolist()
        rows = []
        for stream, length in zip(served, lengths, strict=True):
            request = stream.request
            assembler = ChunkAssembler(request.id, stream.attempt, self.settings.chunk_policy, request.received_at)
            self._events.attach(stream, assembler)
            max_tokens = request.max_tokens or 16  # the completions API's default, as vLLM has it
            rows.append(_Row(stream, assembler, int(length), max_tokens, request.min_tokens or 0,
                             tuple(request.stop or ())))
        steps = _Steps(self, rows)
        temperature = torch.tensor([[_or(s.request.temperature, 1.0)] for s in served], device=self.device)
        top_p = torch.tensor([[_or(s.request.top_p, 1.0)] for s in served], device=self.device)
        processors: list[Any] = [_PerRowSampling(temperature, top_p)]
        if any(row.min_tokens for row in rows):
            min_tokens = torch.tensor([[row.min_tokens] for row in rows], device=self.device)
            processors.insert(0, _NoEndBefore(min_tokens, encoded["input_ids"].shape[1], sorted(self._eos_ids)))
        for row in rows:  # each shares the model's time until its own end; the batch's padded rest is the others'
            self._events.began(row.stream)
        with torch.inference_mode():
            self._model.generate(
                **{name: tensor.to(self.device) for name, tensor in encoded.items()},
                do_sample=True, temperature=1.0, top_p=1.0, top_k=0,  # per row, in _PerRowSampling
                max_new_tokens=max(row.max_tokens for row in rows),
                pad_token_id=self._tokenizer.pad_token_id, eos_token_id=sorted(self._eos_ids),
                logits_processor=LogitsProcessorList(processors),
                stopping_criteria=StoppingCriteriaList([_RowsDone(steps)]), streamer=steps)
        now = time.time()
        longest = max(lengths)
        padding = BatchPadding(
            requests=len(rows), prompt_positions=len(rows) * longest, prompt_padding=sum(longest - n for n in lengths),
            decode_positions=len(rows) * steps.count,
            decode_padding=sum(steps.count - row.steps for row in rows))
        with self._lock:
            self.padding.add(padding)
        LOGGER.info(BATCH_LOG, padding.requests, padding.positions, padding.padding, 100 * padding.share,
                    padding.prompt_padding, padding.prompt_positions, padding.decode_padding,
                    padding.decode_positions, now - started)
        for row in rows:
            if not row.done:  # generate stopped before the row's own limit (the model's context is full)
                row.finish_reason = "length"
                self._send_text(row, now)

    def _prompt_text(self, request: InferenceRequest) -> str:
        if request.messages is not None or self.settings.prompt_format == "chat":
            messages = list(request.messages or [{"role": "user", "content": request.prompt}])
            return self._tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return request.prompt_text()  # no messages: the prompt

    def step(self, rows: list[_Row], token_ids: list[int]) -> None:
        """One decoding step's tokens for the batch: each live row's new text goes to its assembler."""
        now = time.time()
        for row, token_id in zip(rows, token_ids, strict=True):
            if row.done:
                continue
            row.steps += 1
            if token_id in self._eos_ids:
                row.finish_reason = "stop"
            else:
                row.token_ids.append(token_id)
            self._send_text(row, now)

    def _send_text(self, row: _Row, now: float) -> None:
        """Hands the row's new text to its assembler, ending the row at a stop string or its max_tokens."""
        text = self._tokenizer.decode(row.token_ids, skip_special_tokens=True)
        if row.stop_from is None and len(row.token_ids) >= row.min_tokens:  # as vLLM: no stop before min_tokens
            row.stop_from = len(self._tokenizer.decode(row.token_ids[:row.min_tokens], skip_special_tokens=True))
        hit = -1 if row.stop_from is None else \
            min((i for i in (text.find(s, row.stop_from) for s in row.stop) if i >= 0), default=-1)
        if hit >= 0:
            text, row.finish_reason = text[:hit], "stop"
        elif not row.done and len(row.token_ids) >= row.max_tokens:
            row.finish_reason = "length"
        ready = len(text)
        if not row.done:  # hold back a character split across tokens, and what could begin a stop string
            held = max((len(s) - 1 for s in row.stop), default=0)
            ready = max(min(len(text.rstrip("\ufffd")), len(text) - held), row.sent)
        delta, row.sent = text[row.sent:ready], max(ready, row.sent)
        self._events.cut(row.stream, lambda: row.assembler.add(delta, len(row.token_ids), now))
        if row.done:  # its record goes now, while the batch computes on (its row padded) for the others
            self._events.ended(row.stream)
            self._events.cut(row.stream, lambda: [row.assembler.finish(row.finish_reason, len(row.token_ids), now)])
            self._finished.put((row, now))

    def _complete_finished(self) -> None:
        """Hands each finished row's completion to poll() once Pub/Sub has confirmed its chunks.

        Its own thread, so that waiting for confirmations never holds up the batch's decoding.
        """
        while (item := self._finished.get()) is not None:
            row, now = item
            while self._events.chunks_pending(row.stream):
                time.sleep(0.002)
            self._events.complete(row.stream, row.assembler, row.finish_reason, row.prompt_tokens, now)


def _or(value: float | None, default: float) -> float:
    return default if value is None else float(value)


class _Steps:
    """The streamer ``generate`` feeds: the prompt once, then each step's new token for every row."""

    def __init__(self, engine: TransformersBackend, rows: list[_Row]) -> None:
        self._engine, self.rows = engine, rows
        self.count = 0  # decoding steps run
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.count += 1
        self._engine.step(self.rows, value.reshape(-1).tolist())

    def end(self) -> None:
        pass


class _RowsDone:
    """Stopping criterion: a row is done once its own limit, stop string or end token was reached."""

    def __init__(self, steps: _Steps) -> None:
        self._steps = steps

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        return input_ids.new_tensor([row.done for row in self._steps.rows]).bool()


class _NoEndBefore:
    """Logits processor: a row's end tokens are out until it has its ``min_tokens`` ((rows, 1) tensor).

    Live rows decode in step, so every row has as many new tokens as the batch has run steps.
    """

    def __init__(self, min_tokens: Any, prompt_width: int, end_ids: list[int]) -> None:
        self._min_tokens, self._prompt_width, self._end_ids = min_tokens, prompt_width, end_ids

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        early = self._min_tokens > input_ids.shape[1] - self._prompt_width  # (rows, 1)
        if bool(early.any()):
            scores = scores.clone()
            scores[:, self._end_ids] = scores[:, self._end_ids].masked_fill(early, float("-inf"))
        return scores


class _PerRowSampling:
    """Logits processor: each row sampled with its own temperature and top_p; temperature 0 is greedy.

    ``temperature`` and ``top_p`` are (rows, 1) tensors on the model's device.
    """

    def __init__(self, temperature: Any, top_p: Any) -> None:
        self._greedy = temperature <= 0
        self._divisor = temperature.masked_fill(self._greedy, 1.0)
        self._top_p = top_p

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        scores = scores.float() / self._divisor
        ordered, order = scores.sort(dim=-1, descending=True)
        probabilities = ordered.softmax(dim=-1)
        before = probabilities.cumsum(dim=-1) - probabilities  # mass above each token
        drop_sorted = before >= self._top_p  # the first token always stays
        drop_sorted[:, 1:] |= self._greedy.expand_as(drop_sorted[:, 1:])  # greedy rows keep only their best
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        return scores.masked_fill(drop, float("-inf"))
