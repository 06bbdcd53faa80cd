"""Hostile Pub/Sub messages: hypothesis strategies for the fuzz tests, and a seeded corpus for the e2e run.

Both draw from the same families: arbitrary bytes; JSON-shaped requests whose
every field may hold any JSON value; literals that ``json.loads`` turns into
trouble (deep nesting, NaN/Infinity, numbers too large for a double or with
thousands of digits, lone-surrogate escapes, NULs); very long strings; text
that starts like JSON; odd attribute maps (long or empty ids, unknown content
types).
"""

from __future__ import annotations

import json
import random
from typing import Any

from hypothesis import strategies as st

FIELDS = ("id", "prompt", "messages", "max_tokens", "min_tokens", "temperature", "top_p", "stop", "metadata",
          "deadline_ms", "adapter")
TROUBLE_LITERALS = ("NaN", "Infinity", "-Infinity", "1e999", "-1e400", "9" * 5000, "1" * 4301,
                    '"\\ud800"', '"\\udfff tail"', '"a\\u0000b"', "[" * 3000 + "]" * 3000,
                    '{"a":' * 2000 + "1" + "}" * 2000, "[" * 40 + "]" * 40, "true", "null", "[]", "{}", '""')
TOO_LONG_ID = "x" * 600
ODD_TEXT = ("\ud800", "\udfff", "\x00", "\u202e", "\ufeff", "🦙" * 3, "\n\r\t", "[INST]", "{name}", " " * 5)

_text = st.one_of(st.text(max_size=40), st.sampled_from(ODD_TEXT),
                  st.builds(lambda s, n: s * n, st.sampled_from(("a", "é", "🦙", "\x00")),
                            st.integers(1, 60_000)))
_numbers = st.one_of(st.integers(), st.integers(-10**400, 10**400), st.floats(allow_nan=True, allow_infinity=True))
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), _numbers, _text),
    lambda children: st.one_of(st.lists(children, max_size=4),
                               st.dictionaries(st.one_of(st.sampled_from(FIELDS), st.text(max_size=8)),
                                               children, max_size=4)),
    max_leaves=12)


def _valid_field(name: str) -> st.SearchStrategy[Any]:
    return {
        "id": st.one_of(st.text(min_size=1, max_size=20), st.integers(0, 10**6)),
        "prompt": st.text(min_size=1, max_size=80),
        "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(("system", "user", "assistant")),
                                                    "content": st.text(max_size=40)}), min_size=1, max_size=3),
        "max_tokens": st.integers(1, 64),
        "min_tokens": st.integers(0, 64),
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0.01, 1),
        "stop": st.lists(st.text(min_size=1, max_size=5), max_size=3),
        "metadata": st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
        "deadline_ms": st.integers(1, 10**6),
        "adapter": st.one_of(st.sampled_from(("support", "extract")), st.text(min_size=1, max_size=300)),
    }[name]


@st.composite
def json_requests(draw: st.DrawFn) -> bytes:
    """A request-shaped JSON object: each field valid, absent, or any JSON value; maybe a trouble literal spliced in."""
    fields = {}
    for name in FIELDS:
        choice = draw(st.sampled_from(("absent", "valid", "valid", "any")))
        if choice == "valid":
            fields[name] = draw(_valid_field(name))
        elif choice == "any":
            fields[name] = draw(json_values)
    try:
        text = json.dumps(fields, allow_nan=True)  # NaN/Infinity literals and \ud800 escapes as json emits them
    except ValueError:  # an integer json cannot print (over 4300 digits)
        text = "{}"
    if draw(st.booleans()):
        field, literal = draw(st.sampled_from(FIELDS)), draw(st.sampled_from(TROUBLE_LITERALS))
        text = text[:-1] + ("," if len(text) > 2 else "") + f'"{field}": {literal}}}'
    return text.encode("utf-8", "surrogatepass")


attributes = st.one_of(
    st.just({}),
    st.dictionaries(st.sampled_from(("id", "content_type", "source", "")),
                    st.one_of(st.text(max_size=30), st.just("x" * 2000),
                              st.sampled_from(("text/plain", "application/json", "image/png", ""))),
                    max_size=3))

payloads = st.one_of(
    st.binary(max_size=200),
    json_requests(),
    st.sampled_from(TROUBLE_LITERALS).map(str.encode),
    st.text(max_size=200).map(lambda s: s.encode("utf-8")),
    st.sampled_from(("[INST] hi [/INST]", "{name} is here", "[1, 2]", "{")).map(str.encode),
)


def hostile_corpus(seed: int, size: int) -> list[tuple[bytes, dict[str, str]]]:
    """A seeded, reproducible corpus of the same families, for runs that cannot host hypothesis.

    The only payload id it writes is one too long to accept (:data:`TOO_LONG_ID`).
    """
    rng = random.Random(seed)

    def literal() -> str:
        return rng.choice(TROUBLE_LITERALS)

    def odd_text() -> str:
        return rng.choice(ODD_TEXT) * rng.randint(1, 3)

    makers = [
        lambda: bytes(rng.randrange(256) for _ in range(rng.randint(1, 64))),
        lambda: literal().encode(),
        lambda: ('{"prompt": "hi", "%s": %s}' % (rng.choice(FIELDS[3:]), literal())).encode(),
        lambda: ('{"prompt": %s}' % literal()).encode(),
        lambda: ('{"messages": [{"role": "user", "content": %s}]}' % literal()).encode(),
        lambda: json.dumps({"prompt": odd_text()}).encode("utf-8", "surrogatepass"),
        lambda: json.dumps({rng.choice(FIELDS[1:]): rng.choice([[], {}, True, -1, 1e308, "x" * 70_000])}).encode(),
        lambda: json.dumps({"id": TOO_LONG_ID, "prompt": "hi"}).encode(),
        lambda: ("{" + '"a":{' * 50 + "}" * 51).encode(),
    ]
    return [(rng.choice(makers)(), {}) for _ in range(size)]


def carries_too_long_id(payload: bytes) -> bool:
    """Whether a corpus payload names its own id, one too long to accept: it is refused under no id."""
    return f'"id": "{TOO_LONG_ID}"'.encode() in payload
