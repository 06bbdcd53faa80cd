"""``make publish``: send prompts to a running job's input topic from the terminal, README step 7's first half.

One prompt (``PROMPT='...'``) or a file of them (``PROMPTS=file``: one request a line, a JSON object as the
contract takes it, or plain text, which becomes ``{"prompt": line}``). A request without an ``id`` gets one, so
that its chunks, completion or dead letter can be found again (``make tail`` prints it). Each message is
published to ``INPUT_TOPIC`` (derived from ``PROJECT``) and confirmed by Pub/Sub before its id is printed.
Messages are sent as they are written: the job validates them, and what it refuses comes back as a dead letter.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from ops.settings import DeployError, Settings


def requests_from(prompt: str | None, path: str | None) -> list[tuple[str, bytes]]:
    """(id, message data) for each prompt: ``prompt`` itself, or each non-empty line of the file at ``path``."""
    lines: Iterable[str]
    if path:
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise DeployError(f"PROMPTS={path}: cannot be read ({exc})") from None
    elif prompt:
        lines = [prompt]  # one request, read as a line of a file is (a newline in it stays in the prompt)
    else:
        raise DeployError("Set PROMPT='...' (one prompt) or PROMPTS=file (one request a line)")
    found = []
    for line in (line for line in lines if line.strip()):
        try:
            request = json.loads(line) if line.lstrip().startswith("{") else {"prompt": line}
        except ValueError:
            request = None  # sent as it is: the job's dead letter says what is wrong with it
        if isinstance(request, dict):
            request.setdefault("id", f"cli-{uuid.uuid4().hex[:12]}")
            found.append((str(request["id"]), json.dumps(request, ensure_ascii=False).encode("utf-8")))
        else:
            found.append(("(as written)", line.encode("utf-8")))
    if not found:
        raise DeployError(f"PROMPTS={path}: no request in it" if path else "PROMPT is blank")
    return found


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.publish", description=__doc__.split("\n\n")[0])
    environment = dict(os.environ if environ is None else environ)
    parser.add_argument("--prompt", default=environment.get("PROMPT") or None,
                        help="one prompt (or one JSON request); default: $PROMPT")
    parser.add_argument("--prompts", default=environment.get("PROMPTS") or None,
                        help="a file of requests, one a line (JSON or plain text); default: $PROMPTS")
    args = parser.parse_args(argv)
    settings = Settings(environment)
    try:
        settings.require("PROJECT")
        topic = settings.pubsub_path("INPUT_TOPIC")
        if not topic:
            raise DeployError("Set INPUT_TOPIC (or PROJECT, which it is derived from)")
        messages = requests_from(args.prompt, args.prompts)
    except DeployError as exc:
        print(f"make publish: {exc}", file=sys.stderr)
        return 2
    import google.cloud.pubsub_v1 as pubsub_v1

    publisher = pubsub_v1.PublisherClient()
    futures = [(request_id, publisher.publish(topic, data)) for request_id, data in messages]
    failed = 0
    for request_id, future in futures:
        try:
            future.result(timeout=60)
            print(f"published {request_id} to {topic}", flush=True)
        except Exception as exc:  # noqa: BLE001 - reported per message, the rest still confirmed
            failed += 1
            print(f"make publish: {request_id} was not published: {exc}", file=sys.stderr, flush=True)
    if not failed:
        print("Watch the answers: make tail", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
