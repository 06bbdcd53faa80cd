"""Every template parameter, declared once: name, console label, help, example, type, default and the checks on it.

:data:`PARAMETERS` is the single definition of the options the template accepts. It sits at the ground because
every stage takes its defaults from it (:func:`default`): the Beam options class and the validated configuration
(:mod:`pipeline.config.options`), ``metadata.json`` and the docs' parameter table (:mod:`local.template_docs`) and
the components' own settings are all derived from it, so they cannot drift apart.

Values may arrive as strings (the Flex Template launcher passes every value as one), so each parameter converts
and checks its own value.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# A Cloud Storage bucket's name (https://cloud.google.com/storage/docs/buckets#naming): lowercase letters, digits,
# '-', '_' and '.', beginning and ending with a letter or digit.
GCS_BUCKET_PATTERN = r"[a-z0-9][-_.a-z0-9]{1,220}[a-z0-9]"

GROUP_INPUT = "Input"
GROUP_OUTPUT = "Output"
GROUP_MODEL = "Model and engine"
GROUP_BATCHING = "Batching"
GROUP_STREAMING = "Streaming output"
GROUP_ENRICHMENT = "Prompt and structured output"
GROUP_WORKERS = "Workers"

TEMPLATE_NAME = "Streaming LLM inference (vLLM)"
TEMPLATE_DESCRIPTION = (
    "Reads prompts from Pub/Sub, serves them with a vLLM server that runs on each (GPU) worker, "
    "and streams the generated text back to Pub/Sub as incremental chunks, with a final record "
    "per request and a dead-letter output for anything that cannot be served.")

# A Secret Manager secret version, by its resource name (a name, never the secret itself).
SECRET_VERSION_REGEX = r"^projects/[^/\s]+/secrets/[A-Za-z0-9_-]{1,255}/versions/([0-9]+|latest)$"

# Project ids as Google Cloud (and Beam's Pub/Sub IO) accept them; names of 3-255 characters.
_PROJECT = r"[a-z][-a-z0-9:.]{4,61}[a-z0-9]"
SUBSCRIPTION_REGEX = rf"^projects/{_PROJECT}/subscriptions/[A-Za-z][-A-Za-z0-9_.~+%]{{2,254}}$"
TOPIC_REGEX = rf"^projects/{_PROJECT}/topics/[A-Za-z][-A-Za-z0-9_.~+%]{{2,254}}$"
TABLE_REGEX = rf"^{_PROJECT}[:.][A-Za-z0-9_]{{1,1024}}\.[A-Za-z0-9_$-]{{1,1024}}$"


# Generation keys on Dataflow: the fewest with which make bench-scale's usable share of the GPUs is about what
# per-request keys give at up to 100 workers (and poll timers cost the same: one per busy key).
DATAFLOW_GENERATE_SHARDS = 262144


def _to_bool(value: str | bool) -> bool:
    if isinstance(value, bool):
        return value
    lowered = str(value).strip().lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def _to_int(value: str | int) -> int:
    try:
        return int(str(value).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {value!r}") from None


def _to_float(value: str | float) -> float:
    try:
        return float(str(value).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None


@dataclass(frozen=True)
class Parameter:
    """One template parameter: what the console shows and how the pipeline reads it."""

    name: str
    label: str
    help_text: str
    example: str
    group: str
    param_type: str = "TEXT"  # Dataflow's paramType: TEXT, NUMBER, BOOLEAN, ENUM, PUBSUB_TOPIC, ...
    default: Any = None
    required: bool = False
    enum_options: tuple[str, ...] = ()
    regex: str | None = None
    parent: tuple[str, tuple[str, ...]] | None = None  # (parent name, values under which this one matters)
    minimum: float | None = None
    maximum: float | None = None

    @property
    def convert(self) -> Callable[[Any], Any]:
        if self.param_type == "BOOLEAN":
            return _to_bool
        if self.param_type == "NUMBER":
            return _to_float if isinstance(self.default, float) else _to_int
        return str

    def problems(self, value: Any) -> list[str]:
        """What is wrong with ``value`` (already converted) against this parameter's declared choices and bounds:
        the one check of them, made by the record that owns the value
        (:data:`~pipeline.contract.parameter_checks.CHECKED_BY_RECORDS`) or else by the options."""
        problems = []
        if self.enum_options and value not in self.enum_options:
            problems.append(f"--{self.name} must be one of {', '.join(self.enum_options)}, got {value!r}")
        if self.regex and isinstance(value, str) and not re.match(self.regex, value):
            problems.append(f"--{self.name}={value!r} is not valid; expected something like {self.example}")
        if self.minimum is not None and value < self.minimum:
            problems.append(f"--{self.name} must be at least {self.minimum:g}, got {value}")
        if self.maximum is not None and value > self.maximum:
            problems.append(f"--{self.name} must be at most {self.maximum:g}, got {value}")
        return problems

    @property
    def regexes(self) -> tuple[str, ...]:
        if self.regex:
            return (self.regex,)
        if self.param_type == "ENUM":
            return ("^(" + "|".join(map(re.escape, self.enum_options)) + ")$",)
        if self.param_type == "BOOLEAN":
            return ("^(true|false)$",)
        if self.param_type == "NUMBER":  # a sign only where the bounds allow a negative value
            sign = "" if self.minimum is not None and self.minimum >= 0 else "-?"
            return (rf"^{sign}[0-9]+(\.[0-9]+)?$",) if isinstance(self.default, float) else (rf"^{sign}[0-9]+$",)
        return ()


# Where answers and failures go: a launch needs one of each, which a console form cannot mark required, so the
# first field's help says so and the launch's refusal repeats it (pipeline/config/options.py).
OUTPUT_PARAMETERS = ("output_completions_topic", "output_completions_table", "output_chunks_topic",
                     "output_chunks_table")
DEAD_LETTER_PARAMETERS = ("dead_letter_topic", "dead_letter_table")
ALSO_REQUIRED = (f"Also required: where answers go (one or more of {', '.join(OUTPUT_PARAMETERS)}) and where what "
                 f"cannot be served goes ({' and/or '.join(DEAD_LETTER_PARAMETERS)}).")

PARAMETERS: tuple[Parameter, ...] = (
    # Input
    Parameter("input_subscription", "Input Pub/Sub subscription",
              "Subscription to read prompts from. Each message is a JSON object "
              '{"prompt" or "messages", "id", "max_tokens", "temperature", "top_p", "stop", "metadata", '
              '"deadline_ms", "response_format", "seed", "adapter", ...} '
              "or plain UTF-8 text. " + ALSO_REQUIRED,
              "projects/my-project/subscriptions/prompts-sub", GROUP_INPUT, "PUBSUB_SUBSCRIPTION",
              required=True, regex=SUBSCRIPTION_REGEX),
    Parameter("bulk_subscription", "Bulk Pub/Sub subscription",
              "A second subscription this job reads as its bulk lane (a backfill, a nightly re-run), in the same "
              "message format. Its requests get only what live traffic (input_subscription) leaves: room in each "
              "worker (see live_reserve), a place behind live requests in every queue, and a lower vLLM priority. "
              "Completions and dead letters record each request's lane. Empty: one lane, live.",
              "projects/my-project/subscriptions/prompts-bulk-sub", GROUP_INPUT, "PUBSUB_SUBSCRIPTION",
              regex=SUBSCRIPTION_REGEX),
    Parameter("live_reserve", "Room kept for live traffic",
              "With a bulk_subscription: the share of each worker's requests (max_in_flight + worker_queue) and of "
              "its server's streams (max_in_flight) that bulk requests never take, so that a live request that "
              "arrives while the bulk lane fills the worker is read and started at once. 0 keeps none: live "
              "requests still go first in every queue.",
              "0.25", GROUP_INPUT, "NUMBER", default=0.25, minimum=0, maximum=0.9),
    Parameter("max_bulk_streams", "Most bulk streams a worker runs",
              "With a bulk_subscription: the most bulk streams each worker's engine runs at once, whatever room "
              "live traffic leaves: the ceiling the live objectives' governor grows the lane's stream cap to, and "
              "with both objectives 0 a fixed share. 0: the share live_reserve leaves of max_in_flight.",
              "8", GROUP_INPUT, "NUMBER", default=0, minimum=0, maximum=4096),
    Parameter("live_first_token_slo_ms", "Live first-token objective (ms)",
              "With a bulk_subscription: how long a live request may wait from the pipeline's read of it to its "
              "first chunk (what it takes alone counts: set it above that). Each worker measures it as it runs "
              "and runs as many bulk streams as keep it there: half as many within a second when live first "
              "tokens near it, one more each second the lane wanted more while they stay well below it, all the "
              "lane's share while no live request comes, never fewer than one (a backlog always moves). 0 follows "
              "live_inter_token_slo_ms only; both 0: the lane's whole share, whatever it costs live requests.",
              "1000", GROUP_INPUT, "NUMBER", default=1000, minimum=0, maximum=600_000),
    Parameter("live_inter_token_slo_ms", "Live inter-token objective (ms)",
              "With a bulk_subscription: how long a live stream's tokens may take each at its worker's model "
              "server after its first (the mean over each streamed event of chunk_tokens tokens), where every "
              "running bulk stream adds a row to each step. Followed as "
              "live_first_token_slo_ms is, by the same bulk stream cap and bulk prompt budget: whichever objective "
              "is passed halves them. 0 follows first tokens only (both 0: the lane's whole share).",
              "200", GROUP_INPUT, "NUMBER", default=200, minimum=0, maximum=600_000),
    Parameter("id_attribute", "Request id attribute",
              "Message attribute that holds the request id when the payload has no 'id'. "
              "Without either, the Pub/Sub message id is used.",
              "request_id", GROUP_INPUT, default="id", regex=r"^[A-Za-z0-9_.\-]{1,256}$"),
    Parameter("dedupe_window_s", "De-duplication window (s)",
              "A request whose id was seen within this many seconds (in flight, or finished since) is not "
              "served again: an identical copy (a redelivery or publisher retry) is dropped, a different "
              "request reusing the id becomes a dead letter. 0 de-duplicates only while a request is in flight.",
              "600", GROUP_INPUT, "NUMBER", default=600, minimum=0, maximum=7 * 24 * 3600),
    # Output
    Parameter("output_chunks_topic", "Chunks topic",
              "Pub/Sub topic for streamed output chunks, published with the request id as ordering key.",
              "projects/my-project/topics/llm-chunks", GROUP_OUTPUT, "PUBSUB_TOPIC", regex=TOPIC_REGEX),
    Parameter("output_completions_topic", "Completions topic",
              "Pub/Sub topic for the final record of each request (full text, usage, timings).",
              "projects/my-project/topics/llm-completions", GROUP_OUTPUT, "PUBSUB_TOPIC", regex=TOPIC_REGEX),
    Parameter("output_completions_table", "Completions table",
              "BigQuery table for the final record of each request (schema in docs/contract.md).",
              "my-project:llm.completions", GROUP_OUTPUT, "BIGQUERY_TABLE", regex=TABLE_REGEX),
    Parameter("output_chunks_table", "Chunks table",
              "BigQuery table for every streamed chunk (optional; one row per chunk).",
              "my-project:llm.chunks", GROUP_OUTPUT, "BIGQUERY_TABLE", regex=TABLE_REGEX),
    Parameter("dead_letter_topic", "Dead-letter topic",
              "Pub/Sub topic for messages that could not be served, each with its stage and reason. "
              "A dead-letter topic or table (or both) is required, so that nothing is dropped silently.",
              "projects/my-project/topics/llm-dead-letters", GROUP_OUTPUT, "PUBSUB_TOPIC", regex=TOPIC_REGEX),
    Parameter("dead_letter_table", "Dead-letter table",
              "BigQuery table for dead letters. Rows it rejects go to the dead-letter topic, if one is set.",
              "my-project:llm.dead_letters", GROUP_OUTPUT, "BIGQUERY_TABLE", regex=TABLE_REGEX),
    Parameter("bigquery_create_tables", "Create BigQuery tables",
              "Create missing BigQuery tables at launch, partitioned by day (true), or require them to exist "
              "(false). The dataset must exist.",
              "true", GROUP_OUTPUT, "BOOLEAN", default=True),
    # Model and engine
    Parameter("model", "Model",
              "Hugging Face model id, a local directory on the worker, or a gs:// folder holding a "
              "Hugging Face checkpoint (the console's folder picker is the next parameter). The default is an "
              "ungated instruction model any project can download; gated ones (Gemma, Llama) need hf_token_secret.",
              "google/gemma-2-2b-it", GROUP_MODEL, default="Qwen/Qwen2.5-1.5B-Instruct", regex=r"^\S+$"),
    Parameter("hf_token_secret", "Hugging Face token secret",
              "A Secret Manager secret version holding a Hugging Face token, for gated models: each worker reads it "
              "once (its service account needs roles/secretmanager.secretAccessor) and hands it to the tokenizer and "
              "vLLM through the environment; the token is never logged. Hub downloads need outbound internet (Cloud "
              "NAT for workers without external IPs); a gs:// model folder needs neither.",
              "projects/my-project/secrets/hf-token/versions/latest", GROUP_MODEL, regex=SECRET_VERSION_REGEX),
    Parameter("engine", "Engine",
              "vllm: a vLLM server on each worker (or server_url) with continuous batching, the default. "
              "transformers: the model loaded in each worker's process and every batch from the batching step "
              "padded to its longest prompt and generated together (static batching): no vLLM needed, runs on "
              "CPU-only workers, no response_schema. docs/benchmarks.md compares the two.",
              "vllm", GROUP_MODEL, "ENUM", default="vllm", enum_options=("vllm", "transformers")),
    Parameter("model_gcs_folder", "Model folder in Cloud Storage",
              "A gs:// folder holding a Hugging Face checkpoint (config.json, weights, tokenizer). When set, "
              "it is used instead of the model parameter; each worker copies it to local disk once.",
              "gs://my-bucket/models/gemma-2-2b-it", GROUP_MODEL, "GCS_READ_FOLDER",
              regex=rf"^gs://{GCS_BUCKET_PATTERN}(/\S*)?$"),
    Parameter("server_url", "Existing OpenAI-compatible server",
              "Base URL of a vLLM (or other OpenAI-compatible) server you already run. When set, no "
              "server is started on the workers and the engine settings below are ignored.",
              "http://vllm.internal:8000", GROUP_MODEL, regex=r"^https?://\S+$"),
    Parameter("served_model_name", "Served model name",
              "Model name to send in requests; defaults to the model parameter (or, with an existing "
              "server, the first model it lists).",
              "smollm2", GROUP_MODEL, regex=r"^\S+$"),
    Parameter("prompt_format", "Prompt format",
              "chat: a 'prompt' is sent as one user message with the model's chat template; "
              "completion: it is sent as raw text to the completions API.",
              "chat", GROUP_MODEL, "ENUM", default="chat", enum_options=("chat", "completion")),
    Parameter("max_model_len", "Max model length",
              "Context length (prompt + output tokens) the server is started with.",
              "4096", GROUP_MODEL, "NUMBER", default=2048, minimum=16),
    Parameter("dtype", "Weights dtype", "Data type for weights and activations.",
              "bfloat16", GROUP_MODEL, "ENUM", default="auto",
              enum_options=("auto", "bfloat16", "float16", "float32")),
    Parameter("gpu_memory_utilization", "GPU memory utilization",
              "Fraction of GPU memory vLLM may use for weights and KV cache.",
              "0.9", GROUP_MODEL, "NUMBER", default=0.9, minimum=0.05, maximum=1.0),
    Parameter("vllm_args", "Extra vLLM arguments",
              "Further vLLM server flags, as on its command line.",
              "--enforce-eager --max-num-seqs 128", GROUP_MODEL, default=""),
    Parameter("lora_adapters", "LoRA adapters",
              "LoRA adapters served beside the model, as comma-separated name=location pairs; a location is a gs:// "
              "folder (each worker copies it to local disk once, as it does the model), a folder on the worker, or "
              "a Hugging Face hub id. A request names one in its 'adapter' field; a request without one gets the "
              "model itself, one naming an adapter neither listed here nor in lora_adapter_root becomes a dead letter. "
              "Fixed for the life of the job; engine=vllm with the model manager's own server only (a server_url "
              "server loads its own, and gets each request's adapter name as the model).",
              "support=gs://my-bucket/adapters/support,extract=my-org/smollm2-extract-lora", GROUP_MODEL,
              regex=r"^[^\s,=]+=[^\s,]+(\s*,\s*[^\s,=]+=[^\s,]+)*$"),
    Parameter("lora_adapter_root", "LoRA adapter folder",
              "A folder of LoRA adapters, one sub-folder each (a gs:// folder, or a folder on the worker): a request "
              "whose 'adapter' names a sub-folder not in lora_adapters is served by that adapter, which each worker "
              "copies and checks on its first use (peft's adapter_config.json, its rank, its modules and shapes "
              "against the model's) and loads into its server; one that is missing or does not fit the model "
              "becomes a dead letter. Each worker keeps max_loras less the number of lora_adapters of them "
              "loaded, the least recently used unloaded first. engine=vllm with the model manager's own server only.",
              "gs://my-bucket/adapters/", GROUP_MODEL,
              regex=r"^(gs://[a-z0-9][a-z0-9._-]*[a-z0-9](/\S*)?|(/|\./|\.\./|~)\S*)$"),
    Parameter("lora_base_model_check", "Check adapters' base model",
              "Serve an adapter of lora_adapter_root only if the base model its adapter_config.json names (peft's "
              "base_model_name_or_path) is the served model (its hub id or folder, lora_base_model, or a folder of "
              "that name); another, or none, is a dead letter naming both, since an adapter for another model of "
              "the same shape answers nonsense. false skips this check (the rank, module and shape checks stay).",
              "true", GROUP_MODEL, "BOOLEAN", default=True),
    Parameter("lora_base_model", "Base model the adapters name",
              "Another name lora_adapter_root's adapters may give the served model as their base: the hub id a "
              "model_gcs_folder was copied from, for adapters trained on the hub's model. Empty: none.",
              "meta-llama/Llama-3.1-8B-Instruct", GROUP_MODEL, default="",
              regex=r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$|^gs://\S+$|^(/|\./|\.\./|~)\S*$"),
    Parameter("lora_adapter_disk_gb", "Disk for adapter copies (GB)",
              "How much of each worker's disk the copies of a gs:// lora_adapter_root's adapters may take, within "
              "what it has free less 5 % (0: a quarter of the disk). The least recently loaded copies no stream or "
              "load needs are deleted to make room; an adapter larger than the budget is a dead letter, one that "
              "fits once another's stream ends waits. Adapters of a folder on the worker take none.",
              "20", GROUP_MODEL, "NUMBER", default=0, minimum=0, maximum=65536),
    Parameter("max_lora_rank", "Max LoRA rank",
              "The largest rank among lora_adapters (vLLM's --max-lora-rank: 8, 16, 32, 64, 128, 256, 320 or 512). "
              "vLLM reserves GPU memory for this rank in every adapter slot; an adapter of higher rank is refused "
              "at launch.",
              "16", GROUP_MODEL, "NUMBER", default=16, minimum=1, maximum=512),
    Parameter("max_loras", "Adapters per batch",
              "How many different adapters one batch of the server can mix (vLLM's --max-loras), each in a slot of "
              "GPU memory; a request for another adapter waits until a slot frees. Adapters beyond this stay in "
              "CPU memory.",
              "4", GROUP_MODEL, "NUMBER", default=4, minimum=1, maximum=64),
    Parameter("server_start_timeout_s", "Server start timeout (s)",
              "How long to wait for the vLLM server to become healthy (including weight download).",
              "3600", GROUP_MODEL, "NUMBER", default=1800, minimum=10),
    Parameter("default_max_tokens", "Default max tokens",
              "Output token limit for requests that do not set max_tokens.",
              "256", GROUP_MODEL, "NUMBER", default=256, minimum=1),
    Parameter("max_in_flight", "Max requests in flight per worker",
              "How many requests each worker keeps open against its server; vLLM batches them "
              "continuously, so this should exceed the server's max-num-seqs only slightly.",
              "64", GROUP_MODEL, "NUMBER", default=64, minimum=1, maximum=4096),
    Parameter("worker_queue", "Requests queued per worker",
              "How many requests a worker holds beyond max_in_flight (waiting for room at its server). A worker "
              "that holds that many pulls no more messages: the rest of a backlog stays in the subscription.",
              "64", GROUP_MODEL, "NUMBER", default=64, minimum=1, maximum=100000),
    Parameter("request_timeout_s", "Request timeout (s)",
              "A request not finished this long after it was sent to the server (retries while the server restarts "
              "included) goes to the dead letters. Time in a backlog does not count, nor a bulk request's time shed "
              "by its lane (the attempt thrown away included); a request can set its own limit with 'deadline_ms'.",
              "600", GROUP_MODEL, "NUMBER", default=600, minimum=1),
    Parameter("stream_lease_s", "Stream lease (s)",
              "A stream its key stops polling for this long while the worker goes on polling its other streams (the "
              "key moved to another worker, or the bundle that sent it was retried elsewhere) is cancelled at the "
              "model server, which frees its memory; so is every running stream of a worker that polls none for "
              "three times this long. Time in which the worker's process was paused does not count, and a finished "
              "stream's text is kept for request_timeout_s, so a paused or late worker collects its streams "
              "instead of generating them again.",
              "10", GROUP_MODEL, "NUMBER", default=10, minimum=1, maximum=600),
    Parameter("drain_timeout_s", "Drain timeout (s)",
              "When the job drains, requests already generating get this long to finish; those still "
              "generating then, and those waiting to be sent, become dead letters with stage 'drain' that "
              "carry the request, for the redrive command to republish to the next job's input.",
              "30", GROUP_MODEL, "NUMBER", default=30, minimum=0, maximum=300),
    # Prompt and structured output
    Parameter("system_prompt", "System prompt",
              "Sent as the system message of every request that has none (with prompt_format=completion, "
              "prepended to the prompt).",
              "You triage support tickets. Answer only with the requested JSON.", GROUP_ENRICHMENT),
    Parameter("prompt_template", "Prompt template",
              "Wraps every message in a prompt: {text} is a plain-text message (or a JSON request's prompt); "
              "other {name} placeholders come from a JSON request's metadata. A message that lacks a placeholder "
              "becomes a dead letter. Write {{ and }} for literal braces.",
              "Classify this support ticket: {text}", GROUP_ENRICHMENT),
    Parameter("response_schema", "Response JSON schema",
              "A JSON Schema that constrains the answer of every request that sets no response_format; the "
              "parsed answer lands in the completion's output_json (BigQuery: a JSON column).",
              '{"type": "object", "properties": {"category": {"enum": ["billing", "bug", "other"]}}, '
              '"required": ["category"]}', GROUP_ENRICHMENT),
    # Batching
    Parameter("length_bucketing", "Length bucketing",
              "Batch requests by prompt length (true) instead of in arrival order (false), so one long "
              "prompt does not pad a batch of short ones or make them wait; with engine=transformers also by "
              "answer budget (answer_bucket_boundaries).",
              "true", GROUP_BATCHING, "BOOLEAN", default=False),
    Parameter("bucket_boundaries", "Bucket boundaries (tokens)",
              "Comma-separated, increasing upper prompt lengths of the buckets; the last bucket is open. "
              "Empty: powers of two from 32 up to the max model length.",
              "64,128,256,512,1024", GROUP_BATCHING, default="", regex=r"^\s*\d+(\s*,\s*\d+)*\s*$",
              parent=("length_bucketing", ("true",))),
    Parameter("answer_bucket_boundaries", "Answer bucket boundaries (max_tokens)",
              "Comma-separated, increasing upper answer budgets (max_tokens): each prompt-length bucket is split "
              "by them, so a static batch does not run short answers on until a long one ends. Empty: with "
              "engine=transformers powers of two from 16 up to the max model length, with engine=vllm none "
              "(continuous batching pads nothing). none: answers are not bucketed.",
              "16,64,256", GROUP_BATCHING, default="", regex=r"^\s*(none|\d+(\s*,\s*\d+)*)\s*$",
              parent=("length_bucketing", ("true",))),
    Parameter("length_estimator", "Prompt length estimator",
              "How prompt length is measured: tokenizer (the model's own, exact; needs the model's "
              "tokenizer on the workers), chars (about four characters a token), or auto (tokenizer when "
              "the pipeline starts its own server, chars with an existing server).",
              "tokenizer", GROUP_BATCHING, "ENUM", default="auto", enum_options=("auto", "tokenizer", "chars")),
    Parameter("prioritize_short_prompts", "Shorter prompts first",
              "When the pipeline starts its own server: run vLLM's priority scheduling and send each request "
              "with its length bucket as priority, so that a saturated server starts short prompts first "
              "(long prompts later). Ignored with an existing server.",
              "true", GROUP_BATCHING, "BOOLEAN", default=True),
    Parameter("max_batch_delay_ms", "Max batch delay (ms)",
              "Longest time a request waits for its batch to fill before it is sent anyway.",
              "10", GROUP_BATCHING, "NUMBER", default=10, minimum=0),
    Parameter("batch_size_target", "Batch size target",
              "A batch is sent as soon as it holds this many requests.",
              "4", GROUP_BATCHING, "NUMBER", default=4, minimum=1),
    Parameter("batch_token_budget", "Batch token budget",
              "A batch is also sent once its prompts add up to this many tokens; empty means no budget.",
              "8192", GROUP_BATCHING, "NUMBER", minimum=1),
    Parameter("num_shards", "Batching shards",
              "Keys per length bucket in the batching step: few let batches fill within max_batch_delay_ms. "
              "With engine=transformers a batch is one worker's unit of work: about one key per worker.",
              "16", GROUP_BATCHING, "NUMBER", default=16, minimum=1, maximum=10000),
    Parameter("generate_shards", "Generation shards",
              "Keys of the generation step, which decide which worker's GPU serves a request: Dataflow spreads "
              "keys over workers by hash ranges, so many keys keep the busiest GPU close to the mean. Empty: "
              f"{DATAFLOW_GENERATE_SHARDS} on Dataflow (so hash ranges split evenly however many workers there are), "
              "num_shards on a local runner (one worker, where each busy key costs a timer).",
              "1024", GROUP_BATCHING, "NUMBER", minimum=1, maximum=4_194_304),
    # Streaming output
    Parameter("chunk_tokens", "Tokens per chunk",
              "A chunk is emitted once this many new tokens have arrived (the first token is always "
              "emitted at once). With vLLM the engine asks the server for one event per this many tokens "
              "(stream_interval), so neither side handles each token on its own.",
              "8", GROUP_STREAMING, "NUMBER", default=8, minimum=1),
    Parameter("chunk_interval_ms", "Chunk interval (ms)",
              "A chunk is also emitted when this long has passed since the last one and new text is waiting; "
              "with vLLM, text arrives chunk_tokens tokens at a time, so a slower answer gets a chunk per "
              "chunk_tokens tokens rather than per interval. The generate step polls the engine every half of this "
              "(10-100 ms; a key holding only bulk-lane requests: 0.5 s): how soon completions and dead letters leave.",
              "200", GROUP_STREAMING, "NUMBER", default=200, minimum=1),
)

PARAMETERS_BY_NAME: dict[str, Parameter] = {p.name: p for p in PARAMETERS}


# Beam's own worker options that the console's form shows beside the template's parameters. Beam parses them (they
# are not StreamingLLMOptions'); the launch fills them in when a launch leaves them unset
# (pipeline.config.launch_checks).
DEFAULT_DISK_SIZE_GB = 200
# How many work items a worker runs at once when the launch does not say (Dataflow's own default depends on the job,
# pipeline.config.launch_checks); the runtime client keeps a call thread for each (pipeline.worker.runtime_client).
DEFAULT_HARNESS_THREADS = 12
WORKER_OPTIONS: tuple[Parameter, ...] = (
    Parameter("sdk_container_image", "Worker image",
              "The container image the workers run. Empty: the worker image built from the same commit as this "
              "template's launcher (built together), which the launcher knows.",
              "us-central1-docker.pkg.dev/my-project/dataflow/streaming-llm-worker:0123456789ab", GROUP_WORKERS,
              regex=r"^\S+$"),
    Parameter("disk_size_gb", "Worker disk size (GB)",
              "Each worker's boot disk: the worker image unpacks to about 20 GB while it is pulled, and the weights "
              "come on top (2 bytes a parameter, up to twice). Empty: "
              f"{DEFAULT_DISK_SIZE_GB}.", "500", GROUP_WORKERS, "NUMBER", minimum=30, maximum=65536),
    Parameter("number_of_worker_harness_threads", "Work items a worker runs at once",
              "How many bundles and timer firings each worker runs at once (Dataflow's threads per worker). None "
              "of them waits for room: while a worker holds max_in_flight + worker_queue requests its reader pulls "
              "nothing and gives its thread back, leaving the rest of the backlog in Pub/Sub. "
              f"Empty: {DEFAULT_HARNESS_THREADS}.", "16",
              GROUP_WORKERS, "NUMBER", minimum=2, maximum=1000),
)


WORKER_OPTIONS_BY_NAME: dict[str, Parameter] = {p.name: p for p in WORKER_OPTIONS}


def default(name: str) -> Any:
    """A parameter's default, for the components whose settings mirror it (the one place defaults are written)."""
    return PARAMETERS_BY_NAME[name].default
