"""The fields a request may carry, declared once: what parsing allows, what each engine applies and sends, what
lineage records, and what docs/contract.md's table of them says (``make metadata`` writes it from here).

vLLM declares each of its request fields once, with its bounds, and maps all of them in one place
(``to_sampling_params`` in vllm/entrypoints/openai/protocol.py). This table does the same for the template: a
sampling field with ``bounds`` is validated from them (:mod:`pipeline.contract.request_parsing`), sent to vLLM
under its name (:mod:`pipeline.engines.vllm_engine`) and recorded in a completion's lineage where its engine
applied it (:mod:`pipeline.serving.lineage`); the rest have a check of their own in parsing, and the table
states what they mean, what an unset one means and how each engine applies them. Adding a sampling field is one
entry here and one field of :class:`~pipeline.contract.messages.InferenceRequest` (docs/architecture.md, "A
request field"); a new field leaves every stored fingerprint as it was, by construction (an entry's
``first_stored`` is false unless set: :data:`FINGERPRINTED_WHEN_UNSET`).
"""

from __future__ import annotations

from dataclasses import dataclass

ENGINE_VLLM, ENGINE_TRANSFORMERS = "vllm", "transformers"
BOTH = frozenset({ENGINE_VLLM, ENGINE_TRANSFORMERS})
VLLM_ONLY = frozenset({ENGINE_VLLM})


@dataclass(frozen=True)
class RequestField:
    """One field of a request's JSON object.

    ``bounds``: a number's [low, high] (``low_open``: low itself refused), validated as such; None: the field has
    its own check in parsing. ``default``: what an unset field means. ``engines``: those that apply it (another
    serves the request without it, or refuses it where its answer could not be trusted: ``response_format``); vLLM
    takes every ``to_server`` field as sent, the transformers engine only what its code maps, so a new field of
    both engines is code there too (``tests/test_lineage.py`` names the test of each it applies); and
    ``applied``: how each does. ``to_server``: sent to vLLM's OpenAI server in the body under its own name, as the
    request gave it. ``lineage``: recorded in the completion's ``lineage.sampling`` where its engine applied it.
    ``first_stored``: a field of the first stored state, which fingerprints hash even when it is unset; never set
    it on a field added since (:meth:`~pipeline.contract.messages.InferenceRequest.fingerprint`: every fingerprint
    stored before the field came must stay the one its request computes). ``refused_elsewhere``: an engine not in
    ``engines`` dead-letters a request that sets it (its answer could not be trusted), rather than serving it
    without."""

    name: str
    type: str  # as docs/contract.md shows it
    doc: str
    engines: frozenset[str]  # no default: the transformers engine applies a field only where its code does
    bounds: tuple[float, float] | None = None
    low_open: bool = False
    default: str = ""
    applied: str = ""
    to_server: bool = False
    lineage: bool = False
    first_stored: bool = False
    refused_elsewhere: bool = False

    def __post_init__(self) -> None:
        if self.bounds is not None and not self.bounds[0] < self.bounds[1]:
            raise ValueError(f"{self.name}: bounds must be (low, high) with low < high, got {self.bounds}")
        if not self.engines <= BOTH:
            raise ValueError(f"{self.name}: unknown engines {sorted(self.engines - BOTH)}")

    def bounds_text(self) -> str:
        if self.bounds is None:
            return ""
        return f"{'(' if self.low_open else '['}{self.bounds[0]:g}, {self.bounds[1]:g}]"


REQUEST_FIELDS: tuple[RequestField, ...] = (
    RequestField("id", "string", "The request's id, up to 512 bytes: its answers carry it, and a request delivered "
                 "again with the same id is served once.", engines=BOTH,
                 default="the `id_attribute` attribute, else the message id", applied="names the answers; not sent",
                 first_stored=True),
    RequestField("prompt", "string", "The prompt, as text; exactly one of `prompt` and `messages`.",
                 engines=BOTH, applied="vLLM: the completions API's prompt, or the chat API's one user message "
                 "with `prompt_format=chat`; transformers: the same text, through the chat template with chat",
                 first_stored=True),
    RequestField("messages", "list", "Chat messages, each an object of a `role` (`system`, `user` or "
                 "`assistant`) and its `content` (a string), sent through the model's chat template.",
                 engines=BOTH, applied="vLLM: the chat API's messages; transformers: the tokenizer's chat template",
                 first_stored=True),
    RequestField("max_tokens", "integer", "The most tokens the answer may have, below the model's context.",
                 engines=BOTH, default="`default_max_tokens`",
                 applied="vLLM: sent as is; transformers: the row's length", to_server=True, lineage=True,
                 first_stored=True),
    RequestField("min_tokens", "integer", "No end token and no stop string before this many tokens (0 to "
                 "`max_tokens`; not with `response_format`).", engines=BOTH, default="0",
                 applied="vLLM: sent as is; transformers: the end tokens masked until then", to_server=True,
                 lineage=True),
    RequestField("temperature", "number", "Sampling temperature; 0 is greedy.", engines=BOTH, bounds=(0.0, 2.0),
                 default="vLLM: the model's generation config, else 1; transformers: 1",
                 applied="vLLM: sent as is; transformers: each row's own", to_server=True, lineage=True,
                 first_stored=True),
    RequestField("top_p", "number", "Nucleus sampling: the smallest set of tokens whose probability reaches it.",
                 engines=BOTH, bounds=(0.0, 1.0), low_open=True,
                 default="vLLM: the model's generation config, else 1; transformers: 1",
                 applied="vLLM: sent as is; transformers: each row's own", to_server=True, lineage=True,
                 first_stored=True),
    RequestField("presence_penalty", "number", "OpenAI's presence penalty: positive values favour tokens not yet "
                 "in the answer.", engines=VLLM_ONLY, bounds=(-2.0, 2.0), default="0", applied="vLLM: sent as is",
                 to_server=True, lineage=True, first_stored=True),
    RequestField("frequency_penalty", "number", "OpenAI's frequency penalty: positive values penalise tokens by "
                 "how often they appeared.", engines=VLLM_ONLY, bounds=(-2.0, 2.0), default="0",
                 applied="vLLM: sent as is", to_server=True, lineage=True, first_stored=True),
    RequestField("repetition_penalty", "number", "vLLM's repetition penalty: above 1 discourages tokens already "
                 "in the prompt or the answer, below 1 encourages them.", engines=VLLM_ONLY, bounds=(0.0, 2.0),
                 low_open=True, default="the model's generation config, else 1", applied="vLLM: sent as is",
                 to_server=True, lineage=True),
    RequestField("stop", "string or list", "Up to 8 strings, of up to 256 characters each, that end the answer "
                 "(not included in it).", engines=BOTH, default="none",
                 applied="vLLM: sent as a list; transformers: the answer cut at the first", lineage=True,
                 first_stored=True),
    RequestField("seed", "integer", "A 64-bit seed: the same request samples the same answer.", engines=VLLM_ONLY,
                 default="one drawn from the id, so a retried stream samples as the first did",
                 applied="vLLM: sent, its own or the drawn one", lineage=True, first_stored=True),
    RequestField("response_format", "object", "OpenAI's `response_format` (`json_object` or `json_schema`): the "
                 "answer is JSON of that shape.", engines=VLLM_ONLY, default="free text",
                 applied="vLLM: sent as is; transformers: refused (a dead letter)", to_server=True, lineage=True,
                 first_stored=True, refused_elsewhere=True),
    RequestField("adapter", "string", "A LoRA adapter the job serves (`lora_adapters`, or a folder of "
                 "`lora_adapter_root`).", engines=VLLM_ONLY, default="the model itself",
                 applied="vLLM: the request's model name; transformers: refused (a dead letter)",
                 refused_elsewhere=True),
    RequestField("deadline_ms", "integer", "The request must finish within this many milliseconds of its receipt "
                 "(1 to a week), or become a dead letter.", engines=BOTH, default="none",
                 applied="the generate step and the engine end it", first_stored=True),
    RequestField("metadata", "object", "Up to 64 KB of JSON, passed through to the completion as is.",
                 engines=BOTH, default="{}", applied="passed through; not sent", first_stored=True),
)

FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in REQUEST_FIELDS)
# The numbers validated from their bounds alone, in the table's order.
BOUNDED_FIELDS: tuple[RequestField, ...] = tuple(f for f in REQUEST_FIELDS if f.bounds is not None)


# The fields the first stored state had, which a fingerprint hashes even when unset (RequestField.first_stored).
FINGERPRINTED_WHEN_UNSET: frozenset[str] = frozenset(f.name for f in REQUEST_FIELDS if f.first_stored)

# The fields vLLM's server is sent under their own names, as the request gave them.
SENT_TO_SERVER: tuple[str, ...] = tuple(f.name for f in REQUEST_FIELDS if f.to_server)


def refused_by(engine: str) -> tuple[str, ...]:
    """The fields ``engine`` dead-letters a request for setting (``RequestField.refused_elsewhere``)."""
    return tuple(f.name for f in REQUEST_FIELDS if f.refused_elsewhere and engine not in f.engines)


def recorded_in_lineage(engine: str) -> tuple[str, ...]:
    """The fields a completion's lineage records as applied by ``engine`` (what it ignores, it does not record)."""
    return tuple(f.name for f in REQUEST_FIELDS if f.lineage and engine in f.engines)

