"""``make tail``: watch a running job's answers arrive, README step 7's second half.

Pulls from the subscriptions ``make setup`` creates for it on the job's output topics (``<topic>-tail`` on the
chunks, completions and dead-letter topics, kept 10 minutes; an application's and ops.redrive's ``-sub`` copies
are left alone) and prints each record as it comes: a chunk's text under its request id, a completion's summary
(tokens, time to first token, the structured answer if any), a dead letter's stage and reason. What is printed
is acknowledged; a subscription that does not exist (an output the job does not have) is left out, saying so, and
one you may not read stops it with the roles to ask for. The chunks' subscription delivers each request's chunks in
order (make setup makes it with message ordering; one made before is named).
The three are read at once (streaming pull), so a chunk is printed as it arrives. Runs until interrupted, or
``--until N`` completions and dead letters have arrived, or ``--seconds`` have passed. Pub/Sub keeps no order
across topics, so a request's last chunks may come after its completion: on reaching ``--until`` it goes on
printing until the streams have been quiet for a moment (``SETTLE_QUIET_S``, at most ``SETTLE_MAX_S``), and it
stops only once every record it was handed has been printed and acknowledged.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ops.settings import DeployError, Settings, output_subscription

# Which output each subscription carries, by the setting of its topic.
OUTPUTS = (("CHUNKS_TOPIC", "chunk"), ("COMPLETIONS_TOPIC", "completion"), ("DEAD_LETTER_TOPIC", "dead letter"))
SETTLE_QUIET_S = 1.0  # after --until: stop once nothing has arrived for this long ...
SETTLE_MAX_S = 5.0  # ... or this long has passed, whichever is first (a busy job is never quiet)


def line_for(kind: str, data: bytes) -> tuple[str, bool]:
    """What to print for one record, and whether it ends its request (a completion or a dead letter)."""
    try:
        record: Any = json.loads(data)
    except ValueError:
        return f"[{kind}] {data[:200]!r}", kind != "chunk"
    if not isinstance(record, dict):
        return f"[{kind}] {record!r}", kind != "chunk"
    request = record.get("id")
    if kind == "chunk":
        return f"{request} #{record.get('seq')}: {record.get('text', '')}", False
    if kind == "completion":
        usage = record.get("usage") or {}
        answer = record.get("output_json")
        first = record.get("time_to_first_token_ms")
        return (f"{request} done: {usage.get('completion_tokens')} tokens, first token "
                f"{'?' if first is None else f'{first / 1000:.2f} s'}, {record.get('finish_reason')}"
                + (f"; answer {json.dumps(answer)}" if answer is not None else
                   f"; {record.get('output_error')}" if record.get("output_error") else "")), True
    return f"{request} dead letter ({record.get('stage')}): {record.get('reason')}", True


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.tail", description=__doc__.split("\n\n")[0])
    parser.add_argument("--until", type=int, default=None, help="stop after this many completions and dead letters")
    parser.add_argument("--seconds", type=float, default=None, help="stop after this long")
    args = parser.parse_args(argv)
    settings = Settings(dict(os.environ if environ is None else environ))
    try:
        settings.require("PROJECT")
        topics = [(settings.pubsub_path(name), kind) for name, kind in OUTPUTS]
        outputs = [(output_subscription(topic, "tail"), kind) for topic, kind in topics if topic]
    except DeployError as exc:
        print(f"make tail: {exc}", file=sys.stderr)
        return 2
    import google.cloud.pubsub_v1 as pubsub_v1
    from google.api_core import exceptions

    subscriber = pubsub_v1.SubscriberClient()
    watching = []
    for subscription, kind in outputs:
        try:
            found = subscriber.get_subscription(subscription=subscription)
        except exceptions.NotFound:
            print(f"(no {subscription}: its {kind}s are not shown; make setup creates it)", flush=True)
            continue
        except exceptions.PermissionDenied:
            print(f"make tail: {not_allowed(subscription)}", file=sys.stderr, flush=True)
            subscriber.close()
            return 2
        if kind == "chunk" and not found.enable_message_ordering:
            print(f"(a request's chunks may print out of order: {subscription} was made without message ordering, "
                  "by a make setup before it ordered them; make setup makes it again with ordering)", flush=True)
        watching.append((subscription, kind))
    ended = threading.Semaphore(0)
    lock = threading.Lock()  # one line at a time from the three streams
    last_arrival = [time.monotonic()]

    def shown(kind: str) -> Callable[[Any], None]:
        def callback(message: Any) -> None:
            text, ends = line_for(kind, message.data)
            with lock:
                print(text, flush=True)
                last_arrival[0] = time.monotonic()
            message.ack()
            if ends:
                ended.release()
        return callback

    # Waiting for the callbacks on shutdown: none acknowledges on a channel already closed.
    streams = [subscriber.subscribe(subscription, callback=shown(kind), await_callbacks_on_shutdown=True)
               for subscription, kind in watching]
    print(f"Watching {', '.join(s for s, _ in watching) or 'nothing'} (Ctrl-C to stop)", flush=True)
    deadline = None if args.seconds is None else time.monotonic() + args.seconds
    try:
        count = 0
        while streams and (args.until is None or count < args.until):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            if ended.acquire(timeout=1.0 if left is None else min(left, 1.0)):
                count += 1
        if streams and args.until is not None and count >= args.until:
            settle(last_arrival, lock, deadline)
    except KeyboardInterrupt:
        pass
    finally:
        for stream in streams:
            stream.cancel()
        for stream, (subscription, _) in zip(streams, watching, strict=True):
            try:
                stream.result(timeout=30)
            except exceptions.PermissionDenied:
                print(f"make tail: {not_allowed(subscription)}", file=sys.stderr)
            except Exception as exc:  # noqa: BLE001 - say why a stream ended early, then close the rest
                print(f"make tail: {subscription} stopped: {exc}", file=sys.stderr)
        subscriber.close()
    return 0


def not_allowed(subscription: str) -> str:
    """One sentence for a refusal: what reading a subscription takes (Pub/Sub's access control page)."""
    return (f"Pub/Sub refused to let you read {subscription}: ask for Pub/Sub Subscriber (roles/pubsub.subscriber) and "
            "Pub/Sub Viewer (roles/pubsub.viewer) on it, or on the project (docs/operations.md#roles).")


def settle(last_arrival: list[float], lock: threading.Lock, deadline: float | None) -> None:
    """Go on printing what still arrives until a quiet moment, the settle bound or the deadline."""
    end = time.monotonic() + SETTLE_MAX_S
    if deadline is not None:
        end = min(end, deadline)
    while True:
        now = time.monotonic()
        with lock:
            quiet_since = last_arrival[0]
        if now >= end or now - quiet_since >= SETTLE_QUIET_S:
            return
        time.sleep(min(0.1, end - now))


if __name__ == "__main__":
    sys.exit(main())
