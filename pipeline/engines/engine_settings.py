"""What a worker's engine is built from: one frozen record, picklable into every DoFn that reaches it.

The engine (:mod:`pipeline.engines.engine` and its two kinds) reads its settings from :class:`EngineSettings`;
the worker's runtime adds admission's and the call policy's beside it
(:class:`~pipeline.worker.runtime_settings.RuntimeSettings`). The job's settings (:mod:`pipeline.config.settings`)
build it from the template's parameters; it checks its own values as it is built, so a pipeline of one's own that
builds it directly (docs/architecture.md) gets the same errors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pipeline.contract.chunking import ChunkPolicy
from pipeline.contract.keying import bucket_index
from pipeline.contract.messages import InferenceRequest
from pipeline.contract.parameter_checks import ParameterProblems, check_parameters, not_with_transformers
from pipeline.contract.parameters import default
from pipeline.serving.vllm_server import ServerSpec


@dataclass(frozen=True)
class EngineSettings:
    """Everything a worker's engine needs to serve requests; picklable into the DoFn."""

    server: ServerSpec | None  # None: use server_url (with engine "transformers": the model to load)
    server_url: str | None = None
    # "vllm": the model manager's server (or server_url); "transformers": the model in-process,
    # each batch generated together (pipeline.engines.transformers_engine).
    engine: str = default("engine")
    served_model_name: str | None = None
    prompt_format: str = default("prompt_format")
    max_in_flight: int = default("max_in_flight")
    # How long one request may take once sent, retries included (its own deadline_ms may be shorter).
    request_timeout_s: float = float(default("request_timeout_s"))
    chunk_policy: ChunkPolicy = field(default_factory=ChunkPolicy)
    # A stream that sends nothing for this long is treated as broken and retried.
    stall_timeout_s: float = 120.0
    # With these length-bucket bounds, each request carries its bucket as vLLM priority
    # (the server must run --scheduling-policy priority); None sends no priority.
    priority_boundaries: tuple[int, ...] | None = None
    # Whether the job reads a bulk lane (its bulk_subscription), and the share of the worker that lane never takes.
    bulk_lane: bool = False
    live_reserve: float = default("live_reserve")
    max_bulk_streams: int = default("max_bulk_streams")  # the lane's stream cap at most; 0: what live_reserve leaves
    # The live objectives the bulk lane's cap and prompt budget follow (pipeline.engines.lane_governor); 0: not this.
    live_first_token_slo_ms: float = default("live_first_token_slo_ms")
    live_inter_token_slo_ms: float = default("live_inter_token_slo_ms")
    # Publish chunks to this Pub/Sub topic from the engine the moment they are cut ...
    chunk_topic: str | None = None
    # ... and hand them to the pipeline through poll() as well (always, without a chunk_topic).
    chunks_to_pipeline: bool = True
    # How long a finished request waits for Pub/Sub to confirm its chunks before its completion goes anyway.
    chunk_publish_patience_s: float = 300.0
    # A stream nobody polls for this long is cancelled at the server and forgotten.
    stream_lease_s: float = float(default("stream_lease_s"))
    # The worker image the job runs (its sdk_container_image), recorded in every completion's lineage; None: local.
    image: str | None = None

    def __post_init__(self) -> None:
        if (self.server is None) == (self.server_url is None):
            raise ValueError("give exactly one of a server spec or a server_url")
        check_parameters({"engine": self.engine, "max_in_flight": self.max_in_flight,
                          "stream_lease_s": self.stream_lease_s, "live_reserve": self.live_reserve,
                          **({} if self.server_url is None else {"server_url": self.server_url})})
        if self.engine == "transformers" and self.server is None:
            raise ParameterProblems(not_with_transformers("server_url"))
        if self.chunk_topic is None and not self.chunks_to_pipeline:
            raise ValueError("chunks must go somewhere: give a chunk_topic or keep chunks_to_pipeline")

    @property
    def bulk_streams(self) -> int:
        """The most unfinished streams the engine starts a bulk request beside: what ``live_reserve`` leaves of
        ``max_in_flight``."""
        return left_by(self.live_reserve, self.max_in_flight)

    @property
    def bulk_stream_ceiling(self) -> int:
        """The most bulk streams the engine runs at once: ``max_bulk_streams``, within ``bulk_streams``."""
        return min(self.bulk_streams, self.max_bulk_streams) if self.max_bulk_streams else self.bulk_streams

    @property
    def priority_scheduling(self) -> bool:
        """Whether requests carry a vLLM priority (:func:`priority_scheduling`)."""
        return priority_scheduling(self.engine, self.server is not None, self.priority_boundaries, self.bulk_lane)

    def priority_of(self, request: InferenceRequest) -> int | None:
        """vLLM's priority for ``request`` (lower is served first, and preempts higher when memory runs short): its
        length bucket (the first when it was not measured), after every live bucket when it is of the bulk lane;
        None (the server's default, the first) without priority scheduling, or for a live request not measured."""
        if not self.priority_scheduling or (request.prompt_tokens is None and not request.bulk):
            return None
        bounds = self.priority_boundaries or ()
        bucket = bucket_index(bounds, request.prompt_tokens) if bounds and request.prompt_tokens is not None else 0
        return bucket + (len(bounds) + 1 if request.bulk else 0)


def priority_scheduling(engine: str, own_server: bool, priority_boundaries: tuple[int, ...] | None,
                        bulk_lane: bool) -> bool:
    """Whether the worker's server runs vLLM's priority scheduling, and requests carry a priority: for shorter
    prompts first (``priority_boundaries``, set only for a server the worker starts) or for the live lane first.
    Never with a server of one's own, whose policy is unknown: vLLM refuses a priority its policy does not use."""
    return priority_boundaries is not None or (bulk_lane and own_server and engine == "vllm")


def left_by(reserve: float, total: int) -> int:
    """What a reserve of ``reserve`` of ``total`` leaves, at least one: a bulk lane always moves."""
    return max(1, total - math.ceil(reserve * total))
