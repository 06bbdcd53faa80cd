"""How the stateful steps write their state cells, so that an update can always read them.

A Dataflow update hands the replacement job the old job's state as the old code
wrote it ("Update an existing pipeline"). A cell this code cannot read must not
raise: its work item would be retried for ever and wedge its key. So every cell
that holds requests or their bookkeeping as records (the generate step's entries,
progress and ids, the batcher's buffer and counters) is a JSON object with a
version ``"v"`` (cells written before versions existed have none, and are
version 1 of their kind), and its reader goes through :func:`read_cell`, which
says what is wrong in a :class:`StateFormatError`. The step then turns what it
cannot read into a dead letter with the raw text (or, for bookkeeping that
holds no request, a logged error and the ``undecodable_state_entries``
counter) and goes on.

The generate step's two timer cells (``poll_at_ms``, ``wait_ms``) are the one
exception: single integers under Beam's standard ``VarIntCoder``
(``beam:coder:varint:v1``, whose bytes Beam's model fixes for every SDK), and
versioned by their name, which says the unit. A change of meaning takes a new
cell name, and the old cell is read once and cleared; the coder of a cell is not
changed, since Dataflow compares the coders of the old and new job when it
checks an update.
"""

from __future__ import annotations

import json
from typing import Any


class StateFormatError(ValueError):
    """A state cell this code cannot read (written by another version of it, or damaged)."""


def write_cell(fields: dict[str, Any], version: int) -> str:
    return json.dumps({**fields, "v": version}, separators=(",", ":"))


def read_cell(text: Any, versions: tuple[int, ...], required: dict[str, tuple[type, ...]]) -> dict[str, Any]:
    """The cell's fields, checked: a JSON object of a known version whose ``required`` fields have their types."""
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, TypeError) as exc:
        raise StateFormatError(f"not JSON: {exc}") from None
    return check_cell(data, versions, required)


def check_cell(data: Any, versions: tuple[int, ...], required: dict[str, tuple[type, ...]]) -> dict[str, Any]:
    """:func:`read_cell` for a cell already parsed (a reader that must look at it first, for an older format)."""
    if not isinstance(data, dict):
        raise StateFormatError(f"not an object: {type(data).__name__}")
    version = data.get("v", 1)
    if version not in versions:
        raise StateFormatError(f"state version {version!r}; this code reads {', '.join(map(str, versions))}")
    for name, types in required.items():
        value = data.get(name)
        if name not in data or not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise StateFormatError(f"field {name!r} missing or of the wrong type")
    return data
