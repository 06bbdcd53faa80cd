"""No-code stream enrichment: a system prompt, a prompt template and a response schema for every request.

Set as template parameters, these turn a stream of raw records from any
producer (support tickets, reviews, log lines) into structured completions
without code: the template wraps each record in the prompt, prepends the
system prompt, and constrains the answer to the schema. They are applied when
a message is parsed, before validation, so every limit holds for the request
as it will be sent, and the completion records what was sent.
"""

from __future__ import annotations

import copy
import json
import string
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from pipeline.contract.request_parsing import RequestError
from pipeline.contract.structured_output import ResponseFormatError, checked_schema, schema_response_format

TEXT_FIELD = "text"


def template_fields(template: str) -> tuple[str, ...]:
    """The placeholders of a prompt template; only plain ``{name}`` ones (``{{`` and ``}}`` escape a brace)."""
    fields = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"prompt_template is not a valid template: {exc}") from None
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if not name.isidentifier() or spec or conversion:
            raise ValueError(f"prompt_template placeholder {{{name}{'!' + conversion if conversion else ''}"
                             f"{':' + spec if spec else ''}}} is not allowed; use plain names such as {{text}}")
        fields.append(name)
    if not fields:
        raise ValueError("prompt_template has no placeholder; use {text} for the message text, or metadata names")
    return tuple(fields)


@dataclass(frozen=True)
class RequestDefaults:
    """Template-level settings applied to each parsed message (all optional)."""

    system_prompt: str | None = None
    prompt_template: str | None = None
    response_schema: str | None = None  # a JSON Schema, as JSON text
    prompt_format: str = "chat"

    def __post_init__(self) -> None:
        """Parses and checks the settings once, at launch: a bad template or schema raises ValueError here."""
        _ = self._fields, self._response_format

    @cached_property
    def _fields(self) -> tuple[str, ...]:
        return template_fields(self.prompt_template) if self.prompt_template else ()

    @cached_property
    def _response_format(self) -> dict[str, Any] | None:
        if not self.response_schema:
            return None
        try:
            return schema_response_format(checked_schema(json.loads(self.response_schema), "response_schema"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"response_schema is not valid JSON: {exc.msg}") from None
        except ResponseFormatError as exc:
            raise ValueError(str(exc)) from None

    def apply(self, fields: dict[str, Any], is_text: bool) -> dict[str, Any]:
        """The message's fields with the defaults applied; raises RequestError when the template cannot be filled."""
        fields = dict(fields)
        if self.prompt_template and (is_text or fields.get("messages") is None):
            values: dict[str, Any] = {}
            metadata = fields.get("metadata")
            if isinstance(metadata, dict) and not is_text:
                values.update(metadata)
            if isinstance(fields.get("prompt"), str):
                values[TEXT_FIELD] = fields["prompt"]
            fields["prompt"] = self._render(values)
        if self._response_format is not None and fields.get("response_format") is None:
            fields["response_format"] = copy.deepcopy(self._response_format)
        if self.system_prompt:
            self._add_system_prompt(fields)
        return fields

    def _render(self, values: Mapping[str, Any]) -> str:
        template = self.prompt_template
        assert template is not None, "rendered only with a prompt_template"
        missing = [name for name in self._fields if name not in values]
        if missing:
            available = ", ".join(sorted(values)) or "none"
            raise RequestError(f"prompt_template needs {', '.join('{' + m + '}' for m in missing)}, which this "
                               f"message does not have (it has: {available}); plain text fills {{text}}, "
                               "a JSON request fills the others from its 'metadata'")
        return template.format_map(
            {k: v if isinstance(v, str) else json.dumps(v, ensure_ascii=False) for k, v in values.items()})

    def _add_system_prompt(self, fields: dict[str, Any]) -> None:
        messages = fields.get("messages")
        if isinstance(messages, list):
            if not any(isinstance(m, dict) and m.get("role") == "system" for m in messages):
                fields["messages"] = [{"role": "system", "content": self.system_prompt}, *messages]
        elif isinstance(fields.get("prompt"), str):
            if self.prompt_format == "chat":
                fields["messages"] = [{"role": "system", "content": self.system_prompt},
                                      {"role": "user", "content": fields.pop("prompt")}]
            else:
                fields["prompt"] = f"{self.system_prompt}\n\n{fields['prompt']}"
